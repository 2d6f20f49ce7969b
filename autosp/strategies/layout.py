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
              A compiled graph traces its ops once, so under this layout every op that
              depends on the deal is a custom op that reads it when it runs: the kernels get
              :func:`kernel_chunks` markers, the slices and reorders are ``autosp::balanced_*``.

The layout is one global choice: every sequence-sharded tensor (ids, labels,
positions, masks, activations) follows it.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from autosp.decisions import LAYOUTS          # one definition: the decisions carry the layout
from autosp.errors import AutospError
from autosp.strategies.collectives import all_gather

PLANNED_LAYOUTS = ("contiguous", "zigzag")      # balanced depends on each batch's documents:
BALANCED_CHUNKS = 4                             # chunks per rank under the balanced layout

# SP degree -> chunk ids per rank for the current batch (one SP group per process).
_BALANCED: dict[int, list[list[int]]] = {}


def planned_layouts(documents: tuple[int, ...] = ()) -> tuple[str, ...]:
    """The layouts the planner weighs: balanced too where it knows the batch's documents."""
    return PLANNED_LAYOUTS + ("balanced",) if documents else PLANNED_LAYOUTS


@functools.lru_cache(maxsize=64)
def dealt_for(documents: tuple[int, ...], world: int) -> list[list[int]]:
    """The balanced deal of a row packing ``documents`` (what the wrapper deals for such a batch)."""
    return deal_balanced(torch.cat([torch.arange(n) for n in documents]).unsqueeze(0), world)


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise AutospError(f"unknown layout '{layout}'; use one of {', '.join(LAYOUTS)}")
    return layout


# A kernel argument that stands for the balanced deal of the step being run: [RUN_TIME, world]
# (every rank's chunks, rank order) or [RUN_TIME, world, rank] (one rank's).
RUN_TIME = -1


def kernel_chunks(layout: str, world: int, rank: int | None = None) -> list[int]:
    """Chunk ids to pass a blockwise kernel: the ids, or under the balanced layout a marker the
    kernel resolves (:func:`resolve_chunks`) each time it runs, since a compiled graph would
    otherwise keep the first batch's deal as a constant."""
    if layout == "balanced":
        return [RUN_TIME, world] if rank is None else [RUN_TIME, world, rank]
    return all_chunks(layout, world) if rank is None else rank_chunks(layout, rank, world)


def resolve_chunks(chunks: list[int]) -> list[int]:
    """The chunk ids a :func:`kernel_chunks` argument stands for now."""
    if not chunks or chunks[0] != RUN_TIME:
        return list(chunks)
    world = chunks[1]
    return all_chunks("balanced", world) if len(chunks) == 2 else rank_chunks("balanced", chunks[2], world)


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
    if layout == "balanced":
        return balanced_slice(x, dim, full_len, rank, world)
    return _slice_chunks(x, dim, full_len, rank_chunks(layout, rank, world), n_chunks(layout, world))


def _slice_chunks(x: Tensor, dim: int, full_len: int, chunks: list[int], count: int) -> Tensor:
    """Chunks ``chunks`` (of ``count`` equal ones) of each token row, concatenated in that order."""
    y, shape, c = _as_tokens(x, dim, full_len)
    n = full_len // count
    parts = [y.narrow(dim + 1, k * n, n) for k in chunks]
    y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim + 1)
    return y.reshape(shape[:dim] + [c * y.shape[dim + 1]] + shape[dim + 1:])


def to_natural_order(x: Tensor, dim: int, layout: str, world: int) -> Tensor:
    """Reorder a tensor whose ``dim`` holds all ranks' tokens in rank order into token order."""
    if layout == "contiguous":
        return x
    if layout == "balanced":
        return balanced_reorder(x, dim, world, True)
    return _reorder(x, dim, all_chunks(layout, world), True)


def _reorder(x: Tensor, dim: int, order: list[int], to_natural: bool) -> Tensor:
    """``x``'s chunks along ``dim`` from rank order (``order``: chunk ids) to token order, or back."""
    parts = x.chunk(len(order), dim=dim)
    if to_natural:
        return torch.cat([parts[order.index(k)] for k in range(len(order))], dim=dim)
    return torch.cat([parts[k] for k in order], dim=dim)


def to_rank_order(x: Tensor, dim: int, layout: str, world: int) -> Tensor:
    """Inverse of :func:`to_natural_order`."""
    if layout == "contiguous":
        return x
    if layout == "balanced":
        return balanced_reorder(x, dim, world, False)
    return _reorder(x, dim, all_chunks(layout, world), False)


def gather_seq(x: Tensor, dim: int, full_len: int, world: int, group_name: str,
               layout: str = "contiguous") -> Tensor:
    """Inverse of :func:`slice_seq`: every rank gets the full tensor (autograd: own slice back)."""
    c = x.shape[dim] * world // full_len
    shape = list(x.shape)
    y = x.reshape(shape[:dim] + [c, shape[dim] // c] + shape[dim + 1:])
    y = to_natural_order(all_gather(y, dim + 1, group_name), dim + 1, layout, world)
    return y.reshape(shape[:dim] + [-1] + shape[dim + 1:])


# ------------------------------------------------------------------ the balanced deal, read at run time
# Custom ops: a compiled graph calls them as they are, so each call reads this step's deal.

@torch.library.custom_op("autosp::balanced_slice", mutates_args=())
def balanced_slice(x: Tensor, dim: int, full_len: int, rank: int, world: int) -> Tensor:
    """:func:`slice_seq` under the balanced layout, with the deal of the step being run."""
    return _slice_chunks(x, dim, full_len, rank_chunks("balanced", rank, world), n_chunks("balanced", world))


@balanced_slice.register_fake
def _(x: Tensor, dim: int, full_len: int, rank: int, world: int) -> Tensor:
    shape = list(x.shape)
    shape[dim] = shape[dim] // world
    return x.new_empty(shape)


@torch.library.custom_op("autosp::balanced_unslice", mutates_args=())
def balanced_unslice(x: Tensor, dim: int, full_len: int, rank: int, world: int) -> Tensor:
    """The gradient of :func:`balanced_slice`: ``x`` at this rank's chunks, zeros elsewhere."""
    shape = list(x.shape)
    shape[dim] = shape[dim] * world
    full = x.new_zeros(shape)
    y, _, c = _as_tokens(full, dim, full_len)
    n = full_len // n_chunks("balanced", world)
    mine = x.reshape(shape[:dim] + [c, -1] + shape[dim + 1:])
    for i, k in enumerate(rank_chunks("balanced", rank, world)):
        y.narrow(dim + 1, k * n, n).copy_(mine.narrow(dim + 1, i * n, n))
    return full


@balanced_unslice.register_fake
def _(x: Tensor, dim: int, full_len: int, rank: int, world: int) -> Tensor:
    shape = list(x.shape)
    shape[dim] = shape[dim] * world
    return x.new_empty(shape)


def _slice_setup(ctx, inputs, output) -> None:
    _, ctx.dim, ctx.full_len, ctx.rank, ctx.world = inputs


balanced_slice.register_autograd(
    lambda ctx, g: (balanced_unslice(g.contiguous(), ctx.dim, ctx.full_len, ctx.rank, ctx.world),
                    None, None, None, None), setup_context=_slice_setup)
balanced_unslice.register_autograd(
    lambda ctx, g: (balanced_slice(g, ctx.dim, ctx.full_len, ctx.rank, ctx.world), None, None, None, None),
    setup_context=_slice_setup)


@torch.library.custom_op("autosp::balanced_reorder", mutates_args=())
def balanced_reorder(x: Tensor, dim: int, world: int, to_natural: bool) -> Tensor:
    """:func:`to_natural_order` (or back) under the balanced layout, with the step's deal."""
    return _reorder(x, dim, all_chunks("balanced", world), to_natural)


@balanced_reorder.register_fake
def _(x: Tensor, dim: int, world: int, to_natural: bool) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _reorder_setup(ctx, inputs, output) -> None:
    _, ctx.dim, ctx.world, ctx.to_natural = inputs


balanced_reorder.register_autograd(
    lambda ctx, g: (balanced_reorder(g, ctx.dim, ctx.world, not ctx.to_natural), None, None, None),
    setup_context=_reorder_setup)
