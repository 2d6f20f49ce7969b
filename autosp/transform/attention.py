"""Attention strategies that replace ``scaled_dot_product_attention`` under SP.

Ulysses (all-to-all sequence <-> heads):
  inputs  q [B, H, S/P, D], k/v [B, Hkv, S/P, D]   (this rank's tokens, all heads)
  a2a     q [B, H/P, S, D], k/v [B, Hkv/P, S, D]   (all tokens, this rank's heads)
  SDPA    exactly the single-device kernel on those heads
  a2a     out [B, H, S/P, D]

Grouped KV heads: when P divides Hkv the KV heads split like the query heads.
When Hkv divides P each KV head is repeated P/Hkv times first, so rank j gets
KV head ``j*Hkv/P``, the one its query heads ``[j*H/P, (j+1)*H/P)`` read
(autograd sums the repeated copies' gradients back). Otherwise KV heads are
expanded to H. A mask with one row per head is cut to this rank's heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from autosp.errors import AutospError
from autosp.transform.collectives import all_to_all, resolve_group


def ulysses_kv_repeat(n_heads: int, n_kv: int, world: int) -> int:
    """How many times each KV head is repeated before the all-to-all."""
    if n_kv % world == 0:
        return 1
    if world % n_kv == 0:
        return world // n_kv
    return n_heads // n_kv


def check_ulysses_heads(n_heads: int, n_kv: int, world: int, where: str) -> None:
    if n_heads % world:
        divisors = [d for d in range(2, n_heads + 1) if n_heads % d == 0]
        raise AutospError(
            f"{where} has {n_heads} query heads, which SP degree {world} does not divide, so Ulysses cannot "
            f"split them; use an SP degree in {divisors} or ring attention (no head constraint)")
    if n_kv and n_heads % n_kv:
        raise AutospError(f"{where} has {n_heads} query heads and {n_kv} KV heads; query heads must be a "
                          "multiple of KV heads")


def ulysses_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                      dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                      enable_gqa: bool = False, *, group_name: str) -> Tensor:
    """Drop-in for ``F.scaled_dot_product_attention`` on sequence-sharded ``[B, H, S/P, D]``."""
    pg = resolve_group(group_name)
    world, rank = torch.distributed.get_world_size(pg), torch.distributed.get_rank(pg)
    n_heads, n_kv = query.shape[-3], key.shape[-3]
    rep = ulysses_kv_repeat(n_heads, n_kv, world)
    if rep > 1:
        key = key.repeat_interleave(rep, dim=-3)
        value = value.repeat_interleave(rep, dim=-3)
    head_dim, seq_dim = query.dim() - 3, query.dim() - 2
    q = all_to_all(query.contiguous(), head_dim, seq_dim, group_name)
    k = all_to_all(key.contiguous(), head_dim, seq_dim, group_name)
    v = all_to_all(value.contiguous(), head_dim, seq_dim, group_name)
    if attn_mask is not None and attn_mask.dim() >= 3 and attn_mask.shape[-3] == n_heads and n_heads > 1:
        per = n_heads // world
        attn_mask = attn_mask.narrow(-3, rank * per, per)
    gqa = enable_gqa and q.shape[-3] != k.shape[-3]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                         is_causal=is_causal, scale=scale, enable_gqa=gqa)
    return all_to_all(out.contiguous(), seq_dim, head_dim, group_name)
