"""Ulysses x ring hybrid (``hybrid:UxR``): Ulysses inside groups of U consecutive ranks
(a node), ring attention across the R groups. Needs only U | H.

The SP group of P = U x R ranks is a 2-D grid: rank ``g*U + j`` is Ulysses rank j
of group g and ring rank g of column j. After the Ulysses all-to-all a rank holds
the tokens of its whole group for H/U heads; ring attention then passes those
(larger) K/V blocks across groups, so ring rank g's tokens are the chunks of SP
ranks ``g*U .. g*U+U-1`` in that order.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import Tensor

from autosp.errors import AutospError
from autosp.strategies.base import AttentionCost, AttentionShape, SPMesh, Strategy, register
from autosp.strategies.ring_costs import blockwise_kernel_calls, ring_transfers, ring_workspace
from autosp.strategies.collectives import resolve_group
from autosp.strategies.layout import kernel_chunks
from autosp.strategies.ring import block_mask, blockwise_illegal, no_dropout, softmax_scale
from autosp.strategies.ring_kernel import ring_attention
from autosp.strategies.ulysses import all_to_all_transfers, heads_illegal, heads_to_seq, kv_repeat, seq_to_heads


def hybrid_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                     dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                     enable_gqa: bool = False, *, group_name: str, ulysses_group: str, ring_group: str,
                     layout: str = "contiguous") -> Tensor:
    no_dropout("hybrid", dropout_p)
    world = dist.get_world_size(resolve_group(group_name))
    u_group = resolve_group(ulysses_group)
    u = dist.get_world_size(u_group)
    per = query.shape[1] // u          # this Ulysses rank attends with heads [j*per, (j+1)*per)
    q, k, v = seq_to_heads(query, key, value, ulysses_group)
    chunks = kernel_chunks(layout, world)     # SP ranks in order: ring rank g holds ranks g*u .. g*u+u-1
    mask = block_mask(attn_mask, query, (dist.get_rank(u_group) * per, per))
    out, _ = ring_attention(q, k, v, mask, chunks, is_causal, softmax_scale(query, scale), ring_group)
    return heads_to_seq(out, ulysses_group)


@register
class Hybrid(Strategy):
    family = "hybrid"
    example = "hybrid:UxR"
    attention_fn = staticmethod(hybrid_attention)

    def __init__(self, ulysses: int, ring: int):
        self.ulysses, self.ring = ulysses, ring

    @property
    def spec(self) -> str:
        return f"hybrid:{self.ulysses}x{self.ring}"

    @classmethod
    def parse(cls, spec: str) -> Strategy:
        try:
            u, r = (int(x) for x in spec.split(":", 1)[1].lower().split("x"))
        except (ValueError, IndexError):
            raise AutospError(f"bad hybrid strategy '{spec}'; write hybrid:UxR, e.g. hybrid:2x2") from None
        if u < 1 or r < 1:
            raise AutospError(f"bad hybrid strategy '{spec}'; U and R must be positive")
        return cls(u, r)

    @classmethod
    def variants(cls, mesh: SPMesh, shape: AttentionShape) -> list[Strategy]:
        p = mesh.degree        # Ulysses inside a node: U <= devices per node
        return [cls(u, p // u) for u in range(2, p) if p % u == 0 and u <= mesh.devices_per_node]

    def _size_mismatch(self, degree: int) -> str | None:
        if self.ulysses * self.ring != degree:
            return (f"'{self.spec}' needs U x R = {self.ulysses * self.ring} ranks but the SP group has {degree}; "
                    f"pick U x R = {degree}")
        return None

    def illegal(self, shape: AttentionShape, mesh: SPMesh) -> str | None:
        return (self._size_mismatch(mesh.degree)
                or heads_illegal(shape.heads, shape.kv_heads, self.ulysses, "the hybrid's Ulysses degree")
                or blockwise_illegal(self.spec, shape))

    def cost(self, shape: AttentionShape, mesh: SPMesh) -> AttentionCost:
        u, r = self.ulysses, self.ring
        s_loc = shape.seq_len / mesh.degree
        kv_bytes = shape.bytes(shape.kv_heads * kv_repeat(shape.heads, shape.kv_heads, u), s_loc)
        # After the all-to-all a rank holds u x its tokens of 1/u of the heads: K/V blocks of 2 x kv_bytes.
        return AttentionCost(
            kernels=blockwise_kernel_calls(shape, mesh, shape.batch * shape.heads / u, r),
            transfers=all_to_all_transfers(shape, u, s_loc, False)
            + ring_transfers(2 * kv_bytes, r, mesh.crosses_nodes, shape.elem_bytes),
            workspace_bytes=ring_workspace(shape, mesh),
            saved_bytes=shape.bytes(shape.heads, s_loc))       # the output all-to-all's result

    def setup(self, group: Any) -> dict[str, Any]:
        """Create the Ulysses (consecutive ranks) and ring groups; every rank creates every group."""
        mismatch = self._size_mismatch(dist.get_world_size(group))
        if mismatch:
            raise AutospError(mismatch)
        u, r = self.ulysses, self.ring
        ranks = dist.get_process_group_ranks(group)
        me = dist.get_rank(group)
        out: dict[str, Any] = {"group_name": group.group_name}
        for g in range(r):
            pg = dist.new_group([ranks[g * u + j] for j in range(u)])
            if me // u == g:
                out["ulysses_group"] = pg.group_name
        for j in range(u):
            pg = dist.new_group([ranks[g * u + j] for g in range(r)])
            if me % u == j:
                out["ring_group"] = pg.group_name
        return out

    def grid(self, mesh: SPMesh) -> tuple[int, int]:
        return (self.ulysses, self.ring)
