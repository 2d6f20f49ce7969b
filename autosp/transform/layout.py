"""Token layout: which tokens each rank holds, and moving tensors between layouts.

Contiguous layout: with P ranks and a (padded) sequence of S tokens, rank r
holds tokens ``[r*S/P, (r+1)*S/P)``. A sequence dim may be *flattened* with
leading dims (``[B*S, V]`` logits in a loss): its size is ``c * S`` and the
token index is the inner one, so it is viewed as ``[c, S]`` before slicing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from autosp.transform.collectives import all_gather


def slice_seq(x: Tensor, dim: int, full_len: int, rank: int, world: int) -> Tensor:
    """This rank's tokens of a replicated tensor whose ``dim`` holds ``c * full_len`` entries."""
    size = x.shape[dim]
    c = size // full_len
    n = full_len // world
    if c == 1:
        return x.narrow(dim, rank * n, n)
    shape = list(x.shape)
    y = x.reshape(shape[:dim] + [c, full_len] + shape[dim + 1:]).narrow(dim + 1, rank * n, n)
    return y.reshape(shape[:dim] + [c * n] + shape[dim + 1:])


def gather_seq(x: Tensor, dim: int, full_len: int, world: int, group_name: str) -> Tensor:
    """Inverse of :func:`slice_seq`: every rank gets the full tensor (autograd: own slice back)."""
    local_len = full_len // world
    size = x.shape[dim]
    c = size // local_len
    if c == 1:
        return all_gather(x, dim, group_name)
    shape = list(x.shape)
    y = all_gather(x.reshape(shape[:dim] + [c, local_len] + shape[dim + 1:]), dim + 1, group_name)
    return y.reshape(shape[:dim] + [-1] + shape[dim + 1:])
