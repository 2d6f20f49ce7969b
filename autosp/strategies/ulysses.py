"""Ulysses: all-to-all sequence <-> heads around the single-device kernel.

Every rank sends its tokens of H/P heads to each other rank, so each gets *all*
tokens of H/P heads, runs the unmodified SDPA kernel (any mask), and an
all-to-all sends the output back to sequence sharding. Backward is the inverse
all-to-alls (autograd of :func:`autosp.strategies.collectives.all_to_all`).

KV heads: split like the query heads when P divides Hkv; repeated P/Hkv times
when Hkv divides P (rank j then holds KV head ``j*Hkv/P``, the one its query
heads read; autograd sums the copies' gradients); else expanded to H.

Chunked (``ulysses:cK``, K head groups): the heads are cut into K groups that go
through the all-to-alls and the kernel one after another, pipelined: group g+1's
Q, K, V are in flight while group g attends, and group g's output travels back
while group g+1 attends. The first group's exchanges start where the graph makes
each of Q, K and V (:func:`issue_first_group`, placed by the sharding pass): V's
after its projection moves while RoPE runs on Q and K, Q's while K's RoPE runs. The
backward mirrors it (see the issue/complete ops in :mod:`autosp.strategies.collectives`):
the last group's output gradient moves alone, each earlier group's while the group after
it runs its attention backward (group g's output is completed after group g+1's attention,
which orders the backward so), and each group's dQ, dK, dV while the group before it runs
its attention backward. Exact for every K: each head's attention is
the same kernel call on the same tokens; only when the bytes move changes. Needs
K*P to divide the query heads; KV heads are repeated until each group has its own.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from autosp.errors import AutospError
from autosp.strategies.base import AttentionCost, AttentionShape, KernelCall, SPMesh, Strategy, Transfer, register
from autosp.strategies.collectives import all_to_all, all_to_all_complete, all_to_all_issue, resolve_group
from autosp.strategies.layout import to_natural_order, to_rank_order
from autosp.strategies.region import full_sizes, score_bytes, slice_atom


def kv_repeat(n_heads: int, n_kv: int, world: int, chunks: int = 1) -> int:
    """How many times Ulysses repeats each KV head before its all-to-all: the fewest copies
    that ``chunks`` head groups x ``world`` ranks divide (each rank then holds the KV heads its
    query heads read), at most one per query head."""
    for r in range(1, n_heads // n_kv + 1):
        if (n_kv * r) % (world * chunks) == 0 and n_heads % (n_kv * r) == 0:
            return r
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


def v_ratio(shape: AttentionShape) -> float:
    """The values' head dim over the queries' (below 1 under multi-head latent attention)."""
    return (shape.v_head_dim or shape.head_dim) / shape.head_dim if shape.head_dim else 1.0


def all_to_all_transfers(shape: AttentionShape, group: int, tokens: float, inter: bool,
                         chunks: int = 1) -> list[Transfer]:
    """Q, K, V in and the output back, forward; their gradients, backward. In ``chunks`` head
    groups: each group's share, pipelined against the groups' kernels (``pipeline``), the
    forward's Q, K and V each issued where the graph makes it (``lead``)."""
    q_bytes = shape.bytes(shape.heads, tokens) / chunks
    kv_bytes = shape.bytes(shape.kv_heads * kv_repeat(shape.heads, shape.kv_heads, group, chunks), tokens) / chunks
    r = v_ratio(shape)
    if chunks == 1 and r != 1.0:
        # multi-head latent attention: V and the output (and their gradients) at the values' head dim
        return [Transfer("all_to_all", group, nbytes, phase, 1, inter)
                for phase in ("fwd", "bwd") for nbytes in (q_bytes, q_bytes * r, kv_bytes, kv_bytes * r)]
    if chunks == 1:
        return [Transfer("all_to_all", group, nbytes, phase, 2, inter)
                for phase in ("fwd", "bwd") for nbytes in (q_bytes, kv_bytes)]
    fwd = [Transfer("all_to_all", group, nbytes, "fwd", 1, inter, pipeline=chunks, lead=lead)
           for nbytes, lead in ((q_bytes, "q"), (kv_bytes, "k"), (kv_bytes, "v"), (q_bytes, ""))]
    # backward, group after group: its output gradient in, its dQ, dK, dV back
    bwd = [Transfer("all_to_all", group, q_bytes, "bwd", 2, inter, pipeline=chunks),
           Transfer("all_to_all", group, kv_bytes, "bwd", 2, inter, pipeline=chunks)]
    return fwd + bwd


def seq_to_heads(q: Tensor, k: Tensor, v: Tensor, group_name: str) -> tuple[Tensor, Tensor, Tensor]:
    world = dist.get_world_size(resolve_group(group_name))
    rep = kv_repeat(q.shape[-3], k.shape[-3], world)
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    hd, sd = q.dim() - 3, q.dim() - 2
    return tuple(all_to_all(t.contiguous(), hd, sd, group_name) for t in (q, k, v))  # type: ignore[return-value]


def heads_to_seq(out: Tensor, group_name: str) -> Tensor:
    return all_to_all(out.contiguous(), out.dim() - 2, out.dim() - 3, group_name)


def _local_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, first_head: int, n_heads: int,
                     world: int, layout: str, dropout_p: float, is_causal: bool, scale: float | None,
                     enable_gqa: bool) -> Tensor:
    """The unmodified kernel on heads ``first_head ..`` (of ``n_heads``) over all tokens."""
    reorder = layout != "contiguous" and (is_causal or attn_mask is not None)
    if reorder:          # all tokens arrived in rank order; the kernel's causal mask needs token order
        q, k, v = (to_natural_order(t, t.dim() - 2, layout, world) for t in (q, k, v))
    if attn_mask is not None and attn_mask.dim() >= 3 and attn_mask.shape[-3] == n_heads and n_heads > 1:
        attn_mask = attn_mask.narrow(-3, first_head, q.shape[-3])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                         scale=scale, enable_gqa=bool(enable_gqa and q.shape[-3] != k.shape[-3]))
    return to_rank_order(out, out.dim() - 2, layout, world) if reorder else out


def issue_first_group(x: Tensor, *, n_heads: int, group_name: str, chunks: int, **_: Any) -> Tensor:
    """Start the first head group's all-to-all of one of q, k, v (``x``, ``[..., H, S, D]``) where
    the graph makes it; returns the receive buffer :func:`ulysses_attention` completes
    (``first=``). KV heads are repeated as the attention function repeats them (it repeats them
    again for the later groups: a copy, cheaper than holding the repeated tensor across the
    prologue)."""
    world = dist.get_world_size(resolve_group(group_name))
    rep = kv_repeat(n_heads, x.shape[-3], world, chunks)
    if rep > 1:
        x = x.repeat_interleave(rep, dim=-3)
    hd = x.dim() - 3
    return all_to_all_issue(x.chunk(chunks, dim=hd)[0].contiguous(), hd, group_name)


def ulysses_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                      dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                      enable_gqa: bool = False, *, group_name: str, layout: str = "contiguous",
                      chunks: int = 1, first: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
    pg = resolve_group(group_name)
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    n_heads = query.shape[-3]
    args = (world, layout, dropout_p, is_causal, scale, enable_gqa)
    if chunks == 1:
        q, k, v = seq_to_heads(query, key, value, group_name)
        out = _local_attention(q, k, v, attn_mask, rank * (n_heads // world), n_heads, *args)
        return heads_to_seq(out, group_name)
    rep = kv_repeat(n_heads, key.shape[-3], world, chunks)
    if rep > 1:
        key, value = key.repeat_interleave(rep, dim=-3), value.repeat_interleave(rep, dim=-3)
    hd, sd = query.dim() - 3, query.dim() - 2
    groups = [t.chunk(chunks, dim=hd) for t in (query, key, value)]
    per_group = n_heads // chunks

    def issue(g: int) -> list[Tensor]:
        return [all_to_all_issue(t[g].contiguous(), hd, group_name) for t in groups]

    # the first group's exchanges already started where q, k, v were made (issue_first_group)
    in_flight, outs, sending = (list(first) if first is not None else issue(0)), [], None
    for g in range(chunks):
        arrived = in_flight
        if g + 1 < chunks:
            in_flight = issue(g + 1)            # moves while group g attends
        q, k, v = (all_to_all_complete(r, sd, group_name) for r in arrived)
        out = _local_attention(q, k, v, attn_mask, g * per_group + rank * (per_group // world), n_heads, *args)
        # Group g-1's output moved while group g attended; completing it here, before group g's
        # output is issued, orders the backward (which runs the later node first): group g's
        # output gradient is issued and waited for, then group g-1's is issued and moves while
        # group g's attention backward runs. Completed at the end instead, every group's output
        # gradient would start at once and the first wait would share the link with all of them.
        if sending is not None:
            outs.append(all_to_all_complete(sending, hd, group_name))
        sending = all_to_all_issue(out.contiguous(), sd, group_name)     # moves while group g+1 attends
    outs.append(all_to_all_complete(sending, hd, group_name))
    return torch.cat(outs, dim=hd)


def ulysses_region(query: Tensor, key: Tensor, value: Tensor, *extras: Any, region: Any, group_name: str,
                   layout: str = "contiguous", **_: Any) -> Tensor:
    pg = resolve_group(group_name)
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    full = full_sizes(query, value, world)
    q, k, v = seq_to_heads(query, key, value, group_name)
    q, k, v = (to_natural_order(t, 2, layout, world) for t in (q, k, v))   # the masks are in token order
    h = full["h"] // world
    mine = [slice_atom(x, a, "h", full, lambda t, d: t.narrow(d, rank * h, h))
            for x, a in zip(extras, region.autosp_region.extras)]
    out = region(q, k, v, *mine)
    return heads_to_seq(to_rank_order(out, 2, layout, world).contiguous(), group_name)


CHUNK_CHOICES = (1, 2, 4, 8)      # head groups the planner may pipeline Ulysses in


@register
class Ulysses(Strategy):
    family = "ulysses"
    example = "ulysses[:cK]"
    auto_rank = 0
    attention_fn = staticmethod(ulysses_attention)
    region_fn = staticmethod(ulysses_region)

    def __init__(self, chunks: int = 1):
        self.chunks = chunks

    @property
    def spec(self) -> str:
        return self.family if self.chunks == 1 else f"{self.family}:c{self.chunks}"

    @classmethod
    def parse(cls, spec: str) -> Strategy:
        if spec == cls.family:
            return cls()
        tail = spec.split(":", 1)[1] if ":" in spec else ""
        if not (tail[:1].lower() == "c" and tail[1:].isdigit() and int(tail[1:]) >= 1):
            raise AutospError(f"bad strategy '{spec}'; write 'ulysses', or 'ulysses:cK' for K head groups "
                              f"pipelined (e.g. ulysses:c4)")
        return cls(int(tail[1:]))

    @classmethod
    def variants(cls, mesh: SPMesh, shape: AttentionShape) -> list[Strategy]:
        if mesh.degree <= 1:
            return []
        return [cls(k) for k in (CHUNK_CHOICES if mesh.overlap else (1,))]

    def illegal(self, shape: AttentionShape, mesh: SPMesh) -> str | None:
        reason = heads_illegal(shape.heads, shape.kv_heads, mesh.degree)
        if not reason and shape.written and self.chunks > 1:
            return (f"is attention written by hand, whose heads {self.spec} cannot pipeline (it pipelines "
                    "SDPA calls); use plain 'ulysses'")
        if not reason and self.chunks > 1 and shape.v_head_dim and shape.v_head_dim != shape.head_dim:
            # measured: not exact on DeepSeek-V3's MLA (2 ranks, 2 groups: the first loss 4.8325 against
            # 4.8222, parameters NaN after 3 AdamW steps), cause not found yet
            return (f"has values of head dim {shape.v_head_dim} against {shape.head_dim} for queries and keys "
                    f"(multi-head latent attention), whose heads {self.spec} does not pipeline yet; use plain 'ulysses'")
        if reason or self.chunks == 1:
            return reason
        k, p = self.chunks, mesh.degree
        if shape.heads % (k * p):
            return (f"has {shape.heads} query heads, which {k} head groups x SP degree {p} do not divide; use "
                    f"fewer groups (ulysses:cK with K x {p} dividing {shape.heads}) or plain 'ulysses'")
        return None

    def cost(self, shape: AttentionShape, mesh: SPMesh) -> AttentionCost:
        p, k = mesh.degree, self.chunks
        s_loc = shape.seq_len / p
        # On a non-contiguous layout the gathered q, k, v go into token order for a causal (or
        # masked) kernel and its output back into rank order: copies beside the originals, which
        # buy nothing (Ulysses' kernel sees every token on any layout).
        reorder = mesh.layout != "contiguous" and (shape.causal or shape.masked)
        q = shape.bytes(shape.heads, s_loc)
        kv = shape.bytes(shape.kv_heads * kv_repeat(shape.heads, shape.kv_heads, p, k), s_loc)
        copies = (q + 2 * kv) if reorder else 0.0
        scores_saved, scores_live, scores_moved = score_bytes(shape, p)
        return AttentionCost(
            # an explicit mask (a window, padding) makes the fused kernel compute every block
            # (q k^T at the queries' head dim, p v at the values': their mean gives the FLOPs)
            kernels=[[KernelCall(shape.batch * shape.heads / p / k, shape.seq_len, shape.seq_len,
                                 shape.head_dim * (1 + v_ratio(shape)) / 2, shape.causal and not shape.masked, k)]],
            transfers=all_to_all_transfers(shape, p, s_loc, mesh.crosses_nodes, k),
            # unpipelined, one all-to-all's receive buffer beside its result (the send buffer is
            # freed first); pipelined, send and receive buffers of about three groups (the group
            # attending, the next one's inputs, the last output) stay in flight
            workspace_bytes=copies + (q if k == 1 else 2 * q * min(1.0, 3 / k)) + scores_live,
            # the output all-to-all's result is a new tensor, which the output projection saves
            saved_bytes=q * v_ratio(shape) + scores_saved,
            copy_bytes=(2 * (copies + q) if reorder else 0.0) + scores_moved)

    def setup(self, group: Any) -> dict[str, Any]:
        return {"group_name": group.group_name, "chunks": self.chunks}

    def early_issue(self, shape: AttentionShape) -> tuple[Any, dict[str, Any]] | None:
        return (issue_first_group, {"n_heads": shape.heads}) if self.chunks > 1 else None

    def grid(self, mesh: SPMesh) -> tuple[int, int]:
        return (mesh.degree, 1)

    @property
    def overlap(self) -> str:
        return "none" if self.chunks == 1 else f"{self.chunks} head groups pipelined"

    def without_overlap(self) -> Strategy:
        return Ulysses()
