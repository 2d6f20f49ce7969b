"""A strategy added from the tests, as a user would add one: this module and nothing else.

All-gather-KV whose backward *all-reduces* dK/dV and keeps this rank's slice, instead
of reduce-scattering them: slower, same numbers. Importing the module registers it;
compile, the cost model, the planner and the reports find it through the registry.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from autosp.strategies import AttentionCost, AttentionShape, SPMesh, Strategy, Transfer, register
from autosp.strategies.ring_costs import blockwise_kernel_calls
from autosp.strategies.blockwise import chunked_attention
from autosp.strategies.collectives import all_gather, all_reduce_sum, group_size, resolve_group
from autosp.strategies.layout import all_chunks, rank_chunks
from autosp.strategies.ring import block_mask, blockwise_illegal, no_dropout, softmax_scale

FAMILY = "toy_allgather_ar"


@torch.library.custom_op("autosp_test::gather_then_all_reduce", mutates_args=())
def gather_then_all_reduce(x: Tensor, dim: int, group_name: str) -> Tensor:
    return all_gather(x, dim, group_name)


@gather_then_all_reduce.register_fake
def _(x: Tensor, dim: int, group_name: str) -> Tensor:
    shape = list(x.shape)
    shape[dim] *= group_size(group_name)
    return x.new_empty(shape)


def _setup(ctx, inputs, output) -> None:
    _, ctx.dim, ctx.group_name = inputs


def _backward(ctx, grad: Tensor):
    pg = resolve_group(ctx.group_name)
    total = all_reduce_sum(grad.contiguous(), ctx.group_name)     # a custom op: traceable by AOTAutograd
    n = grad.shape[ctx.dim] // dist.get_world_size(pg)
    return total.narrow(ctx.dim, dist.get_rank(pg) * n, n), None, None


gather_then_all_reduce.register_autograd(_backward, setup_context=_setup)


def toy_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                  enable_gqa: bool = False, *, group_name: str, layout: str = "contiguous") -> Tensor:
    no_dropout(FAMILY, dropout_p)
    pg = resolve_group(group_name)
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    seq = key.dim() - 2
    k = gather_then_all_reduce(key.contiguous(), seq, group_name)
    v = gather_then_all_reduce(value.contiguous(), seq, group_name)
    out, _ = chunked_attention(query, k, v, block_mask(attn_mask, query), rank_chunks(layout, rank, world),
                               all_chunks(layout, world), is_causal, softmax_scale(query, scale))
    return out


@register
class ToyAllGatherAllReduce(Strategy):
    family = FAMILY
    attention_fn = staticmethod(toy_attention)

    def illegal(self, shape: AttentionShape, mesh: SPMesh) -> str | None:
        return blockwise_illegal(self.spec, shape)

    def cost(self, shape: AttentionShape, mesh: SPMesh) -> AttentionCost:
        p = mesh.degree
        shard = shape.bytes(shape.kv_heads, shape.seq_len / p)
        return AttentionCost(
            kernels=blockwise_kernel_calls(shape, mesh, shape.batch * shape.heads, p),
            transfers=[Transfer("all_gather", p, shard, "fwd", 2, mesh.crosses_nodes),
                       Transfer("all_reduce", p, shard * p, "bwd", 2, mesh.crosses_nodes)],
            workspace_bytes=2 * shard * p)
