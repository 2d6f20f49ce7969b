"""Attention strategies that replace ``scaled_dot_product_attention`` under SP.

All take this rank's tokens ``q [B, H, S/P, D]``, ``k, v [B, Hkv, S/P, D]`` (in
the token layout, see :mod:`autosp.transform.layout`) and return this rank's
output ``[B, H, S/P, D]``, exactly what single-device SDPA gives for those tokens.

ulysses       all-to-all sequence<->heads: every rank gets all tokens of H/P heads,
              runs the single-device kernel, all-to-all back. KV heads: split like
              the query heads when P divides Hkv; repeated P/Hkv times when Hkv
              divides P (rank j then holds KV head ``j*Hkv/P``, the one its query
              heads read; autograd sums the copies' gradients); else expanded to H.
ring          K/V blocks circulate (:mod:`autosp.transform.ring`); no head constraint.
allgather_kv  K/V all-gathered, local queries attend the whole sequence blockwise;
              backward reduce-scatters dK/dV.
hybrid u x r  Ulysses inside groups of u consecutive ranks (a node), ring across
              the r groups; needs only u | H.
"""

from __future__ import annotations

import math

import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from autosp.costmodel.partition import ulysses_kv_repeat
from autosp.errors import AutospError
from autosp.transform.blockwise import chunked_attention
from autosp.transform.collectives import all_gather_rs, all_to_all, resolve_group
from autosp.transform.layout import all_chunks, rank_chunks, to_natural_order, to_rank_order
from autosp.transform.ring import ring_attention

STRATEGIES = ("ulysses", "ring", "zigzag_ring", "allgather_kv", "hybrid")


def check_ulysses_heads(n_heads: int, n_kv: int, world: int, where: str) -> None:
    if n_heads % world:
        divisors = [d for d in range(2, n_heads + 1) if n_heads % d == 0]
        raise AutospError(
            f"{where} has {n_heads} query heads, which SP degree {world} does not divide, so Ulysses cannot "
            f"split them; use an SP degree in {divisors}, strategy='ring' (no head constraint) or "
            f"'hybrid:UxR' with U dividing {n_heads}")
    if n_kv and n_heads % n_kv:
        raise AutospError(f"{where} has {n_heads} query heads and {n_kv} KV heads; query heads must be a "
                          "multiple of KV heads")


def _scale(q: Tensor, scale: float | None) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])


def _seq_to_heads(q: Tensor, k: Tensor, v: Tensor, group_name: str) -> tuple[Tensor, Tensor, Tensor]:
    world = dist.get_world_size(resolve_group(group_name))
    rep = ulysses_kv_repeat(q.shape[-3], k.shape[-3], world)
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    hd, sd = q.dim() - 3, q.dim() - 2
    return tuple(all_to_all(t.contiguous(), hd, sd, group_name) for t in (q, k, v))  # type: ignore[return-value]


def _heads_to_seq(out: Tensor, group_name: str) -> Tensor:
    return all_to_all(out.contiguous(), out.dim() - 2, out.dim() - 3, group_name)


def _no_mask(strategy: str, attn_mask: Tensor | None, dropout_p: float) -> None:
    if attn_mask is not None:
        raise AutospError(f"strategy '{strategy}' does not take an explicit attention mask; use 'ulysses' for "
                          "masked attention (or pass no padding mask)")
    if dropout_p:
        raise AutospError(f"strategy '{strategy}' does not support attention dropout ({dropout_p}); set it to 0")


def ulysses_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                      dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                      enable_gqa: bool = False, *, group_name: str, layout: str = "contiguous") -> Tensor:
    pg = resolve_group(group_name)
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    n_heads = query.shape[-3]
    q, k, v = _seq_to_heads(query, key, value, group_name)
    reorder = layout != "contiguous" and (is_causal or attn_mask is not None)
    if reorder:          # all tokens arrived in rank order; the kernel's causal mask needs token order
        q, k, v = (to_natural_order(t, t.dim() - 2, layout, world) for t in (q, k, v))
    if attn_mask is not None and attn_mask.dim() >= 3 and attn_mask.shape[-3] == n_heads and n_heads > 1:
        per = n_heads // world
        attn_mask = attn_mask.narrow(-3, rank * per, per)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                         scale=scale, enable_gqa=enable_gqa and q.shape[-3] != k.shape[-3])
    if reorder:
        out = to_rank_order(out, out.dim() - 2, layout, world)
    return _heads_to_seq(out, group_name)


def ring_attention_sp(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                      dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                      enable_gqa: bool = False, *, group_name: str, layout: str = "contiguous") -> Tensor:
    _no_mask("ring", attn_mask, dropout_p)
    world = dist.get_world_size(resolve_group(group_name))
    out, _ = ring_attention(query, key, value, all_chunks(layout, world), is_causal, _scale(query, scale),
                            group_name)
    return out


def allgather_kv_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                           dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                           enable_gqa: bool = False, *, group_name: str, layout: str = "contiguous") -> Tensor:
    _no_mask("allgather_kv", attn_mask, dropout_p)
    pg = resolve_group(group_name)
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    seq = key.dim() - 2
    k, v = all_gather_rs(key.contiguous(), seq, group_name), all_gather_rs(value.contiguous(), seq, group_name)
    out, _ = chunked_attention(query, k, v, rank_chunks(layout, rank, world), all_chunks(layout, world),
                               is_causal, _scale(query, scale))
    return out


def hybrid_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                     dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                     enable_gqa: bool = False, *, group_name: str, ulysses_group: str, ring_group: str,
                     layout: str = "contiguous") -> Tensor:
    _no_mask("hybrid", attn_mask, dropout_p)
    world = dist.get_world_size(resolve_group(group_name))
    u = dist.get_world_size(resolve_group(ulysses_group))
    r = world // u
    q, k, v = _seq_to_heads(query, key, value, ulysses_group)
    # Ring rank g holds the tokens of SP ranks g*u .. g*u+u-1, in that order.
    chunks = [c for g in range(r) for j in range(u) for c in rank_chunks(layout, g * u + j, world)]
    out, _ = ring_attention(q, k, v, chunks, is_causal, _scale(query, scale), ring_group)
    return _heads_to_seq(out, ulysses_group)
