"""What the runtimes of attention the model writes itself share (:mod:`autosp.transform.attention_region`).

A region runs as the model wrote it, on other shapes: its views take their sizes from the
tensors it gets (the region's atoms), and its masks and biases are sliced here along the atom the
strategy splits.

  Ulysses        all-to-all q, k, v from this rank's tokens of every head to every token of
                 H/P heads; the region runs on them (any score function: soft-capping, ALiBi,
                 masks made inside it); the output goes back. Extras keep this rank's heads.
  all-gather-KV  K and V gathered whole (their gradients reduce-scattered back); the region runs
                 with this rank's query rows against every key, which holds for any score function
                 that reads no position inside the region. Extras keep this rank's query rows.

  ring           K/V blocks around the ring, the region's score ops per block, the softmax merged
                 by log-sum-exp (:mod:`autosp.strategies.ring_region`). Extras keep this rank's
                 query rows, and the op cuts their key columns block by block.

The runtimes live with their strategies: ``ulysses_region``, ``allgather_kv_region``,
``ring_region``; the hybrid has none (:meth:`autosp.strategies.base.Strategy.refuses`).
"""

from __future__ import annotations

from typing import Any, Callable

from torch import Tensor


Atoms = tuple[tuple[str, ...], ...]


def score_bytes(shape: Any, degree: int, blockwise: bool = False) -> tuple[float, float, float]:
    """(saved for the backward, workspace, moved per forward) of a region's S x S tensors per rank:
    both strategies hold ``B*H*S*S/P`` score entries (H/P heads of every row, or every head of
    S/P rows). The workspace is what the region holds at its peak beyond what it saves (those are
    counted with the layer's saved activations). ``blockwise`` (ring): a block at a time, none saved."""
    if not shape.written:
        return 0.0, 0.0, 0.0
    entries = shape.batch * shape.heads * shape.seq_len * shape.seq_len / degree
    if blockwise:     # ring: one [S/P, S/P] block of scores at a time, recomputed in the backward
        # beside the region's own tensors, the blockwise backward's fp32 P, dP, dS and rescaled scores
        block = entries / degree
        return 0.0, (shape.score_live + 16) * block, shape.score_traffic * entries
    return (shape.score_saved * entries, (shape.score_live - shape.score_saved) * entries,
            shape.score_traffic * entries)


def full_sizes(q: Tensor, v: Tensor, world: int) -> dict[str, int]:
    """The atoms' single-device sizes, from this rank's sequence-sharded q and v."""
    return {"b": q.shape[0], "h": q.shape[1], "sq": q.shape[2] * world, "sk": q.shape[2] * world,
            "d": q.shape[3], "dv": v.shape[3]}


def slice_atom(x: Any, atoms: Atoms | None, atom: str, full: dict[str, int],
               cut: Callable[[Tensor, int], Tensor]) -> Any:
    """``x`` (an extra of the region, single-device sizes) cut along ``atom`` wherever a dim holds it."""
    if atoms is None or not isinstance(x, Tensor):
        return x
    for dim, group in enumerate(atoms):
        if atom not in group:
            continue
        shape = list(x.shape)
        y = x.reshape(shape[:dim] + [full[a] for a in group] + shape[dim + 1:])
        y = cut(y, dim + group.index(atom))
        x = y.reshape(shape[:dim] + [-1] + shape[dim + 1:])
    return x
