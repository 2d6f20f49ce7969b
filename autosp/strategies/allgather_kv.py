"""All-gather-KV: every rank gathers the whole K and V, its local queries attend blockwise.

Forward all-gathers K and V (Hkv heads, so cheap under GQA); backward
reduce-scatters dK and dV (every rank's queries read every block). Memory:
the full K/V on every rank during the op.

Two specs: ``allgather_kv`` blocks on each collective; ``allgather_kv:overlap`` moves
them beside the rank's own block of attention (:mod:`autosp.strategies.allgather_kv_kernel`).
The planner chooses between them by the profile's measured concurrency.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import Tensor

from autosp.errors import AutospError
from autosp.strategies.allgather_kv_kernel import allgather_kv_attention as overlapped_attention
from autosp.strategies.base import AttentionCost, AttentionShape, SPMesh, Strategy, Transfer, register
from autosp.strategies.blockwise import chunked_attention
from autosp.strategies.collectives import all_gather_rs, resolve_group
from autosp.strategies.layout import kernel_chunks, n_chunks, rank_chunks, slice_seq, to_natural_order
from autosp.strategies.region import full_sizes, score_bytes, slice_atom
from autosp.strategies.ring import block_mask, blockwise_illegal, no_dropout, softmax_scale
from autosp.strategies.ring_costs import blockwise_kernel_calls


def allgather_kv_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                           dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                           enable_gqa: bool = False, *, group_name: str, layout: str = "contiguous",
                           overlap: bool = False) -> Tensor:
    no_dropout("allgather_kv", dropout_p)
    pg = resolve_group(group_name)
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    if overlap:
        out, *_ = overlapped_attention(query, key, value, block_mask(attn_mask, query), kernel_chunks(layout, world),
                                       is_causal, softmax_scale(query, scale), group_name)
        return out
    seq = key.dim() - 2
    k, v = all_gather_rs(key.contiguous(), seq, group_name), all_gather_rs(value.contiguous(), seq, group_name)
    out, _ = chunked_attention(query, k, v, block_mask(attn_mask, query), kernel_chunks(layout, world, rank),
                               kernel_chunks(layout, world), is_causal, softmax_scale(query, scale))
    return out


def allgather_kv_region(query: Tensor, key: Tensor, value: Tensor, *extras: Any, region: Any, group_name: str,
                        layout: str = "contiguous", **_: Any) -> Tensor:
    pg = resolve_group(group_name)
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    full = full_sizes(query, value, world)
    k, v = (to_natural_order(all_gather_rs(t.contiguous(), 2, group_name), 2, layout, world) for t in (key, value))
    mine = [slice_atom(x, a, "sq", full, lambda t, d: slice_seq(t, d, full["sq"], rank, world, layout))
            for x, a in zip(extras, region.autosp_region.extras)]
    return region(query, k, v, *mine)


def own_share(shape: AttentionShape, mesh: SPMesh) -> float:
    """The share of the busiest rank's attention work that its own K/V chunks make: what the
    overlapped form computes beside each collective. A causal diagonal pair is half a block."""
    n = n_chunks(mesh.layout, mesh.degree)
    work = []
    for r in range(mesh.degree):
        mine = rank_chunks(mesh.layout, r, mesh.degree)
        m = len(mine)
        if shape.causal:
            # chunk a sees the a chunks before it and half its own; among its own m chunks
            # each pair once and each diagonal half: m^2 / 2 (closed forms: the planner asks
            # this for thousands of ranks)
            work.append((sum(a + 0.5 for a in mine), m * m / 2))
        else:
            work.append((float(m * n), float(m * m)))
    total, own = max(work)
    return own / total


@register
class AllGatherKV(Strategy):
    family = "allgather_kv"
    example = "allgather_kv[:overlap]"
    attention_fn = staticmethod(allgather_kv_attention)
    region_fn = staticmethod(allgather_kv_region)

    def __init__(self, overlapped: bool = False):
        self.overlapped = overlapped

    @property
    def spec(self) -> str:
        return f"{self.family}:overlap" if self.overlapped else self.family

    @classmethod
    def parse(cls, spec: str) -> Strategy:
        if spec not in (cls.family, f"{cls.family}:overlap"):
            raise AutospError(f"bad strategy '{spec}'; write 'allgather_kv', or 'allgather_kv:overlap' for its "
                              "collectives beside the local block's attention")
        return cls(spec.endswith(":overlap"))

    @classmethod
    def variants(cls, mesh: SPMesh, shape: AttentionShape) -> list[Strategy]:
        if mesh.degree <= 1:
            return []
        return [cls(), cls(True)] if mesh.overlap else [cls()]

    def illegal(self, shape: AttentionShape, mesh: SPMesh) -> str | None:
        if shape.written and (shape.positional or self.overlapped):
            why = "reads token positions inside it" if shape.positional else "runs blockwise under :overlap"
            return (f"is attention written by hand that {why}, which needs every query row on one rank; "
                    "use 'ulysses'" + ("" if shape.positional else " or plain 'allgather_kv'"))
        return blockwise_illegal(self.spec, shape)

    def cost(self, shape: AttentionShape, mesh: SPMesh) -> AttentionCost:
        p = mesh.degree
        s_loc = shape.seq_len / p
        shard = shape.bytes(shape.kv_heads, s_loc)
        inter = mesh.crosses_nodes
        beside = own_share(shape, mesh) if self.overlapped else 0.0
        scores_saved, scores_live, scores_moved = score_bytes(shape, p)
        return AttentionCost(
            kernels=blockwise_kernel_calls(shape, mesh, shape.batch * shape.heads, p),
            transfers=[Transfer("all_gather", p, shard, "fwd", 2, inter, beside=beside),
                       Transfer("reduce_scatter", p, shard * p, "bwd", 2, inter, beside=beside)],
            workspace_bytes=2 * shard * p + 2 * shape.bytes(shape.heads, s_loc) + scores_live,
            # the output's copy, and the whole K and V the op keeps for its backward (both forms)
            saved_bytes=shape.bytes(shape.heads, s_loc) + 2 * shard * (p - 1) + scores_saved,
            copy_bytes=scores_moved)

    def setup(self, group: Any) -> dict[str, Any]:
        return {"group_name": group.group_name, "overlap": self.overlapped}

    @property
    def overlap(self) -> str:
        return "K/V gather and dK/dV reduce beside the own block" if self.overlapped else "none"

    def without_overlap(self) -> Strategy:
        return AllGatherKV()
