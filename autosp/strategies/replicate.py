"""Replicate: no SP, the single-device kernel on the whole sequence (SP degree 1 only)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from autosp.strategies.base import AttentionCost, AttentionShape, KernelCall, SPMesh, Strategy, register


def replicated_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                         dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                         enable_gqa: bool = False, *, layout: str = "contiguous") -> Tensor:
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


@register
class Replicate(Strategy):
    family = "replicate"
    auto_rank = -1                  # legal only at degree 1, where it is the obvious choice
    attention_fn = staticmethod(replicated_attention)

    @classmethod
    def variants(cls, mesh: SPMesh, shape: AttentionShape) -> list[Strategy]:
        return [cls()] if mesh.degree == 1 else []

    def illegal(self, shape: AttentionShape, mesh: SPMesh) -> str | None:
        if mesh.degree > 1:
            return (f"runs attention unsharded, which SP degree {mesh.degree} cannot: every rank holds only "
                    "its tokens; pick an SP strategy")
        return None

    def cost(self, shape: AttentionShape, mesh: SPMesh) -> AttentionCost:
        call = KernelCall(shape.batch * shape.heads, shape.seq_len, shape.seq_len, shape.head_dim, shape.causal)
        return AttentionCost(kernels=[[call]], transfers=[], workspace_bytes=0.0)

    def setup(self, group: object) -> dict:
        return {}

    def grid(self, mesh: SPMesh) -> tuple[int, int]:
        return (1, 1)
