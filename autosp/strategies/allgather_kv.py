"""All-gather-KV: every rank gathers the whole K and V, its local queries attend blockwise.

Forward all-gathers K and V (Hkv heads, so cheap under GQA); backward
reduce-scatters dK and dV (every rank's queries read every block). Memory:
the full K/V on every rank during the op.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from autosp.strategies.base import (AttentionCost, AttentionShape, SPMesh, Strategy, Transfer,
                                    blockwise_kernel_calls, register)
from autosp.strategies.blockwise import chunked_attention
from autosp.strategies.collectives import all_gather_rs, resolve_group
from autosp.strategies.layout import all_chunks, rank_chunks
from autosp.strategies.ring import block_mask, dropout_illegal, no_dropout, softmax_scale


def allgather_kv_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                           dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                           enable_gqa: bool = False, *, group_name: str, layout: str = "contiguous") -> Tensor:
    no_dropout("allgather_kv", dropout_p)
    pg = resolve_group(group_name)
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    seq = key.dim() - 2
    k, v = all_gather_rs(key.contiguous(), seq, group_name), all_gather_rs(value.contiguous(), seq, group_name)
    out, _ = chunked_attention(query, k, v, block_mask(attn_mask, query), rank_chunks(layout, rank, world),
                               all_chunks(layout, world), is_causal, softmax_scale(query, scale))
    return out


@register
class AllGatherKV(Strategy):
    family = "allgather_kv"
    attention_fn = staticmethod(allgather_kv_attention)

    def illegal(self, shape: AttentionShape, mesh: SPMesh) -> str | None:
        return dropout_illegal(self.spec, shape)

    def cost(self, shape: AttentionShape, mesh: SPMesh) -> AttentionCost:
        p = mesh.degree
        s_loc = shape.seq_len / p
        shard = shape.bytes(shape.kv_heads, s_loc)
        inter = mesh.crosses_nodes
        return AttentionCost(
            kernels=blockwise_kernel_calls(shape, mesh, shape.batch * shape.heads, p),
            transfers=[Transfer("all_gather", p, shard, "fwd", 2, inter),
                       Transfer("reduce_scatter", p, shard * p, "bwd", 2, inter)],
            workspace_bytes=2 * shard * p + 2 * shape.bytes(shape.heads, s_loc))
