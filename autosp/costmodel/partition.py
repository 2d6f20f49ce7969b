"""How SP partitions a sequence and heads: pure arithmetic shared by the cost model,
the planner and the transform (which imports it; the cost model imports no transform).

Token layouts cut the (padded) sequence of S tokens into equal chunks:
  contiguous  P chunks, rank r holds chunk r
  zigzag      2P chunks, rank r holds chunks r and 2P-1-r (balances causal work)
"""

from __future__ import annotations

import sympy

# The symbolic sequence length every captured size is an expression in.
S = sympy.Symbol("S", integer=True, positive=True)

LAYOUTS = ("contiguous", "zigzag")


def rank_chunks(layout: str, rank: int, world: int) -> list[int]:
    if layout == "zigzag":
        return [rank, 2 * world - 1 - rank]
    return [rank]


def all_chunks(layout: str, world: int) -> list[int]:
    """Chunk ids of ranks 0..P-1, concatenated: the order an all-gather produces."""
    return [c for r in range(world) for c in rank_chunks(layout, r, world)]


def n_chunks(layout: str, world: int) -> int:
    return 2 * world if layout == "zigzag" else world


def ulysses_kv_repeat(n_heads: int, n_kv: int, world: int) -> int:
    """How many times Ulysses repeats each KV head before its all-to-all."""
    if n_kv % world == 0:
        return 1
    if world % n_kv == 0:
        return world // n_kv
    return n_heads // n_kv
