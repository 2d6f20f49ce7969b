"""Ring attention: K/V blocks travel around the SP group, partial results merge by log-sum-exp.

No head constraint and never the full K/V on one rank: per-rank memory is
``O(S/P)`` (see :mod:`autosp.strategies.ring_kernel` for the schedule). Each
hop's transfer runs while the rank attends to the block it holds.

Two specs, one runtime: ``ring`` runs on whatever token layout the model uses
(contiguous by default: the last rank does most of the causal work), and
``zigzag_ring`` asks for the zigzag layout, which balances causal work.
"""

from __future__ import annotations

import math

import torch.distributed as dist
from torch import Tensor

from autosp.errors import AutospError
from autosp.strategies.base import AttentionCost, AttentionShape, SPMesh, Strategy, register
from autosp.strategies.ring_costs import blockwise_kernel_calls, ring_transfers, ring_workspace
from autosp.strategies.collectives import resolve_group
from autosp.strategies.layout import kernel_chunks
from autosp.strategies.region import score_bytes
from autosp.strategies.ring_kernel import ring_attention
from autosp.strategies.ring_region import ring_region


def no_dropout(strategy: str, dropout_p: float) -> None:
    if dropout_p:
        raise AutospError(f"strategy '{strategy}' does not support attention dropout ({dropout_p}); set it to 0")


def block_mask(attn_mask: Tensor | None, query: Tensor, heads: tuple[int, int] | None = None) -> Tensor | None:
    """SDPA's mask as ``[B|1, H|1, S|1, S]`` over global token order, for blockwise kernels
    (``heads``: the ``(first, count)`` of the heads this rank attends with, when a mask has one per head)."""
    if attn_mask is None:
        return None
    m = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)) if attn_mask.dim() < 4 else attn_mask
    if heads is not None and m.shape[1] > 1:
        m = m.narrow(1, heads[0], heads[1])
    return m


def softmax_scale(q: Tensor, scale: float | None) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])


def ring_attention_sp(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                      dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                      enable_gqa: bool = False, *, group_name: str, layout: str = "contiguous") -> Tensor:
    no_dropout("ring", dropout_p)
    world = dist.get_world_size(resolve_group(group_name))
    out, _ = ring_attention(query, key, value, block_mask(attn_mask, query), kernel_chunks(layout, world), is_causal,
                            softmax_scale(query, scale), group_name)
    return out


def blockwise_illegal(name: str, shape: AttentionShape) -> str | None:
    """Blockwise kernels here take masks (block by block) but not dropout; and the fused kernels they
    run per block take one head dim for queries, keys and values."""
    if shape.dropout:
        return (f"has attention dropout, which strategy '{name}' does not support; use ulysses for this layer "
                "or set attention dropout to 0")
    if shape.v_head_dim and shape.v_head_dim != shape.head_dim:
        return (f"has values of head dim {shape.v_head_dim} against {shape.head_dim} for queries and keys "
                f"(multi-head latent attention), which the per-block kernels of '{name}' do not take; use ulysses")
    return None


@register
class Ring(Strategy):
    family = "ring"
    auto_rank = 1
    attention_fn = staticmethod(ring_attention_sp)
    region_fn = staticmethod(ring_region)

    @classmethod
    def variants(cls, mesh: SPMesh, shape: AttentionShape) -> list[Strategy]:
        # Under zigzag the planner writes the same runtime as zigzag_ring.
        return [cls()] if mesh.degree > 1 and mesh.layout == "contiguous" else []

    def illegal(self, shape: AttentionShape, mesh: SPMesh) -> str | None:
        if shape.written and shape.unsplit:
            return (f"is attention written by hand that {shape.unsplit}, so {self.spec} cannot split its softmax "
                    "over key blocks; use 'ulysses'" + ("" if shape.positional else " or 'allgather_kv'"))
        return blockwise_illegal(self.spec, shape)

    def cost(self, shape: AttentionShape, mesh: SPMesh) -> AttentionCost:
        p = mesh.degree
        kv_block = 2 * shape.bytes(shape.kv_heads, shape.seq_len / p)
        _, scores, moved = score_bytes(shape, p, blockwise=True)     # attention written by hand
        return AttentionCost(kernels=blockwise_kernel_calls(shape, mesh, shape.batch * shape.heads, p),
                             transfers=ring_transfers(kv_block, p, mesh.crosses_nodes, shape.elem_bytes),
                             workspace_bytes=ring_workspace(shape, mesh) + scores,
                             saved_bytes=shape.bytes(shape.heads, shape.seq_len / p),     # the output's copy
                             copy_bytes=moved)


@register
class ZigzagRing(Ring):
    family = "zigzag_ring"
    layout = "zigzag"
    auto_rank = None

    @classmethod
    def variants(cls, mesh: SPMesh, shape: AttentionShape) -> list[Strategy]:
        return [cls()] if mesh.degree > 1 and mesh.layout == "zigzag" else []

    def illegal(self, shape: AttentionShape, mesh: SPMesh) -> str | None:
        if mesh.layout != "zigzag":
            return "needs the zigzag token layout (layout='zigzag'; the layout is one global choice)"
        return super().illegal(shape, mesh)
