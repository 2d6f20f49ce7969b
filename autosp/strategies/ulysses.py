"""Ulysses: all-to-all sequence <-> heads around the single-device kernel.

Every rank sends its tokens of H/P heads to each other rank, so each gets *all*
tokens of H/P heads, runs the unmodified SDPA kernel (any mask), and an
all-to-all sends the output back to sequence sharding. Backward is the inverse
all-to-alls (autograd of :func:`autosp.strategies.collectives.all_to_all`).

KV heads: split like the query heads when P divides Hkv; repeated P/Hkv times
when Hkv divides P (rank j then holds KV head ``j*Hkv/P``, the one its query
heads read; autograd sums the copies' gradients); else expanded to H.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from autosp.strategies.base import AttentionCost, AttentionShape, KernelCall, SPMesh, Strategy, Transfer, register
from autosp.strategies.collectives import all_to_all, resolve_group
from autosp.strategies.layout import to_natural_order, to_rank_order


def kv_repeat(n_heads: int, n_kv: int, world: int) -> int:
    """How many times Ulysses repeats each KV head before its all-to-all."""
    if n_kv % world == 0:
        return 1
    if world % n_kv == 0:
        return world // n_kv
    return n_heads // n_kv


def heads_illegal(n_heads: int, n_kv: int, world: int, what: str = "SP degree") -> str | None:
    if n_heads % world:
        divisors = [d for d in range(2, n_heads + 1) if n_heads % d == 0]
        return (f"has {n_heads} query heads, which {what} {world} does not divide, so Ulysses cannot split "
                f"them; use an SP degree in {divisors}, strategy='ring' (no head constraint) or "
                f"'hybrid:UxR' with U dividing {n_heads}")
    if n_kv and n_heads % n_kv:
        return f"has {n_heads} query heads and {n_kv} KV heads; query heads must be a multiple of KV heads"
    return None


def all_to_all_transfers(shape: AttentionShape, group: int, tokens: float, inter: bool) -> list[Transfer]:
    """Q, K, V in and the output back, forward; their gradients, backward."""
    q_bytes = shape.bytes(shape.heads, tokens)
    kv_bytes = shape.bytes(shape.kv_heads * kv_repeat(shape.heads, shape.kv_heads, group), tokens)
    return [Transfer("all_to_all", group, nbytes, phase, 2, inter)
            for phase in ("fwd", "bwd") for nbytes in (q_bytes, kv_bytes)]


def seq_to_heads(q: Tensor, k: Tensor, v: Tensor, group_name: str) -> tuple[Tensor, Tensor, Tensor]:
    world = dist.get_world_size(resolve_group(group_name))
    rep = kv_repeat(q.shape[-3], k.shape[-3], world)
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    hd, sd = q.dim() - 3, q.dim() - 2
    return tuple(all_to_all(t.contiguous(), hd, sd, group_name) for t in (q, k, v))  # type: ignore[return-value]


def heads_to_seq(out: Tensor, group_name: str) -> Tensor:
    return all_to_all(out.contiguous(), out.dim() - 2, out.dim() - 3, group_name)


def ulysses_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                      dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                      enable_gqa: bool = False, *, group_name: str, layout: str = "contiguous") -> Tensor:
    pg = resolve_group(group_name)
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    n_heads = query.shape[-3]
    q, k, v = seq_to_heads(query, key, value, group_name)
    reorder = layout != "contiguous" and (is_causal or attn_mask is not None)
    if reorder:          # all tokens arrived in rank order; the kernel's causal mask needs token order
        q, k, v = (to_natural_order(t, t.dim() - 2, layout, world) for t in (q, k, v))
    if attn_mask is not None and attn_mask.dim() >= 3 and attn_mask.shape[-3] == n_heads and n_heads > 1:
        per = n_heads // world
        attn_mask = attn_mask.narrow(-3, rank * per, per)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                         scale=scale, enable_gqa=bool(enable_gqa and q.shape[-3] != k.shape[-3]))
    if reorder:
        out = to_rank_order(out, out.dim() - 2, layout, world)
    return heads_to_seq(out, group_name)


@register
class Ulysses(Strategy):
    family = "ulysses"
    auto_rank = 0
    attention_fn = staticmethod(ulysses_attention)

    def illegal(self, shape: AttentionShape, mesh: SPMesh) -> str | None:
        return heads_illegal(shape.heads, shape.kv_heads, mesh.degree)

    def cost(self, shape: AttentionShape, mesh: SPMesh) -> AttentionCost:
        p = mesh.degree
        s_loc = shape.seq_len / p
        return AttentionCost(
            # an explicit mask (a window, padding) makes the fused kernel compute every block
            kernels=[[KernelCall(shape.batch * shape.heads / p, shape.seq_len, shape.seq_len, shape.head_dim,
                                 shape.causal and not shape.masked)]],
            transfers=all_to_all_transfers(shape, p, s_loc, mesh.crosses_nodes),
            workspace_bytes=2 * shape.bytes(shape.heads, s_loc))          # all-to-all send and receive

    def grid(self, mesh: SPMesh) -> tuple[int, int]:
        return (mesh.degree, 1)
