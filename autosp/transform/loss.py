"""Losses and reductions over sequence-sharded tensors, made global.

A mean over tokens is ``global sum / global count``: right when ranks hold
different numbers of ignored (-100) labels, where a mean of per-rank means
is not. Sums travel through :func:`all_reduce_sum`, whose backward is the
identity (see :mod:`autosp.strategies.collectives`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from autosp.strategies.collectives import all_reduce_sum
from autosp.transform.observe import observed


@torch.library.custom_op("autosp::all_reduce_count", mutates_args=())
def all_reduce_count(count: Tensor, group_name: str) -> Tensor:
    """``all_reduce_sum`` of this rank's labelled tokens, which it keeps for ``report()``: what each
    rank's loss covered, counted as the graph runs."""
    observed(group_name).loss_tokens = count.detach().clone()
    return all_reduce_sum(count, group_name)


@all_reduce_count.register_fake
def _(count: Tensor, group_name: str) -> Tensor:
    return torch.empty_like(count)


def sharded_cross_entropy(input: Tensor, target: Tensor, weight: Tensor | None = None,
                          size_average=None, ignore_index: int = -100, reduce=None,  # noqa: ANN001
                          reduction: str = "mean", label_smoothing: float = 0.0, *,
                          group_name: str) -> Tensor:
    """``F.cross_entropy`` whose input and target hold this rank's tokens; returns the global loss."""
    if reduction == "none":
        return F.cross_entropy(input, target, weight, ignore_index=ignore_index, reduction="none",
                               label_smoothing=label_smoothing)
    local = F.cross_entropy(input, target, weight, ignore_index=ignore_index, reduction="sum",
                            label_smoothing=label_smoothing)
    total = all_reduce_sum(local, group_name)
    if reduction == "sum":
        return total
    valid = target != ignore_index
    if weight is None:
        count = valid.sum().to(total.dtype)
    else:
        count = (weight[target.clamp(min=0)] * valid).sum().to(total.dtype)
    return total / all_reduce_count(count.detach(), group_name)


def global_sum(x: Tensor, *, group_name: str) -> Tensor:
    """Sum of all elements over all ranks' shards."""
    return all_reduce_sum(x.sum(), group_name)


def global_mean(x: Tensor, *, group_name: str) -> Tensor:
    """Mean over all ranks' elements (shards are equal in size)."""
    n = all_reduce_sum(torch.tensor(float(x.numel()), dtype=x.dtype, device=x.device), group_name)
    return all_reduce_sum(x.sum(), group_name) / n


def token_total(x: Tensor, *, group_name: str, shards: int = 1) -> Tensor:
    """A statistic of this rank's tokens made global: a sum or a histogram over them adds up
    over ranks; a mean over equal shards is the mean of the ranks' means (``shards`` = P)."""
    total = all_reduce_sum(x, group_name)
    return total / shards if shards != 1 else total

