"""Token layout: which tokens each rank holds, and moving tensors between layouts.

The (padded) sequence of S tokens is cut into equal chunks:
  contiguous  P chunks, rank r holds chunk r
  zigzag      2P chunks, rank r holds chunks r and 2P-1-r (balances causal work:
              every rank gets one early and one late chunk)
Each rank's tokens are its chunks concatenated in that order. A sequence dim may
be *flattened* with leading dims (``[B*S, V]`` logits in a loss): its size is
``c * S`` and the token index is the inner one, so it is viewed as ``[c, S]``.

  balanced    4P chunks, dealt per batch so that every rank gets about the same
              causal work *within documents* (packed sequences: a token sees only its
              own document, so a rank holding a long document's tail would otherwise do
              most of the work). Set by the wrapper from the position ids before each
              step (:func:`set_balanced`); without documents it is two zigzag rounds.

The layout is one global choice: every sequence-sharded tensor (ids, labels,
positions, masks, activations) follows it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from autosp.decisions import LAYOUTS          # one definition: the decisions carry the layout
from autosp.errors import AutospError
from autosp.strategies.collectives import all_gather

PLANNED_LAYOUTS = ("contiguous", "zigzag")      # balanced depends on each batch's documents
BALANCED_CHUNKS = 4                             # chunks per rank under the balanced layout

# SP degree -> chunk ids per rank for the current batch (one SP group per process).
_BALANCED: dict[int, list[list[int]]] = {}


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise AutospError(f"unknown layout '{layout}'; use one of {', '.join(LAYOUTS)}")
    return layout


def rank_chunks(layout: str, rank: int, world: int) -> list[int]:
    if layout == "zigzag":
        return [rank, 2 * world - 1 - rank]
    if layout == "balanced":
        dealt = _BALANCED.get(world)
        if dealt is not None:
            return dealt[rank]
        return [rank, 2 * world - 1 - rank, 2 * world + rank, 4 * world - 1 - rank]
    return [rank]


def token_work(positions: Tensor) -> Tensor:
    """Keys each token attends to under a causal mask within documents: its position in its
    document + 1 (positions restart at 0 where a packed document starts)."""
    return positions.to(torch.float64) + 1


def deal_balanced(positions: Tensor, world: int) -> list[list[int]]:
    """Deal the ``BALANCED_CHUNKS x world`` chunks of ``positions [B, S]`` to ranks, equal counts,
    heaviest chunk first to the least-loaded rank with room (longest-processing-time greedy)."""
    n = BALANCED_CHUNKS * world
    work = token_work(positions).reshape(positions.shape[0], n, -1).sum((0, 2)).tolist()
    loads, dealt = [0.0] * world, [[] for _ in range(world)]
    for c in sorted(range(n), key=lambda c: (-work[c], c)):
        r = min((r for r in range(world) if len(dealt[r]) < BALANCED_CHUNKS), key=lambda r: (loads[r], r))
        dealt[r].append(c)
        loads[r] += work[c]
    return [sorted(d) for d in dealt]


def set_balanced(dealt: list[list[int]] | None, world: int) -> None:
    """The balanced layout's chunks per rank for the next step (None: the default pattern)."""
    if dealt is None:
        _BALANCED.pop(world, None)
    else:
        _BALANCED[world] = dealt


def work_per_rank(positions: Tensor, layout: str, world: int) -> list[float]:
    """Causal-within-document attention work (query-key pairs) each rank's tokens carry."""
    n = n_chunks(layout, world)
    work = token_work(positions.cpu()).reshape(positions.shape[0], n, -1).sum((0, 2))
    return [float(work[rank_chunks(layout, r, world)].sum()) for r in range(world)]


def all_chunks(layout: str, world: int) -> list[int]:
    """Chunk ids of ranks 0..P-1, concatenated: the order an all-gather produces."""
    return [c for r in range(world) for c in rank_chunks(layout, r, world)]


def n_chunks(layout: str, world: int) -> int:
    return {"zigzag": 2 * world, "balanced": BALANCED_CHUNKS * world}.get(layout, world)


# ------------------------------------------------------------------ tensors


def _as_tokens(x: Tensor, dim: int, full_len: int) -> tuple[Tensor, list[int], int]:
    shape = list(x.shape)
    c = shape[dim] // full_len
    return x.reshape(shape[:dim] + [c, shape[dim] // c] + shape[dim + 1:]), shape, c


def slice_seq(x: Tensor, dim: int, full_len: int, rank: int, world: int, layout: str = "contiguous") -> Tensor:
    """This rank's tokens of a replicated tensor whose ``dim`` holds ``c * full_len`` entries."""
    y, shape, c = _as_tokens(x, dim, full_len)
    n = full_len // n_chunks(layout, world)
    parts = [y.narrow(dim + 1, k * n, n) for k in rank_chunks(layout, rank, world)]
    y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim + 1)
    return y.reshape(shape[:dim] + [c * y.shape[dim + 1]] + shape[dim + 1:])


def to_natural_order(x: Tensor, dim: int, layout: str, world: int) -> Tensor:
    """Reorder a tensor whose ``dim`` holds all ranks' tokens in rank order into token order."""
    if layout == "contiguous":
        return x
    order = all_chunks(layout, world)
    parts = x.chunk(len(order), dim=dim)
    return torch.cat([parts[order.index(k)] for k in range(len(order))], dim=dim)


def to_rank_order(x: Tensor, dim: int, layout: str, world: int) -> Tensor:
    """Inverse of :func:`to_natural_order`."""
    if layout == "contiguous":
        return x
    parts = x.chunk(n_chunks(layout, world), dim=dim)
    return torch.cat([parts[k] for k in all_chunks(layout, world)], dim=dim)


def gather_seq(x: Tensor, dim: int, full_len: int, world: int, group_name: str,
               layout: str = "contiguous") -> Tensor:
    """Inverse of :func:`slice_seq`: every rank gets the full tensor (autograd: own slice back)."""
    c = x.shape[dim] * world // full_len
    shape = list(x.shape)
    y = x.reshape(shape[:dim] + [c, shape[dim] // c] + shape[dim + 1:])
    y = to_natural_order(all_gather(y, dim + 1, group_name), dim + 1, layout, world)
    return y.reshape(shape[:dim] + [-1] + shape[dim + 1:])
