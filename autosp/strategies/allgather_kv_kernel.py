"""All-gather-KV with its collectives beside the local block's attention.

Forward, on rank ``r`` of ``P``: start gathering K and V (asynchronous), attend the
local queries to the rank's *own* K/V chunks while they move, wait, then attend to
the other ranks' chunks and merge by log-sum-exp (fp32)::

    issue gather(K), gather(V)  |  attend(q, K_r, V_r)
    wait                        |
                                   attend(q, K_j, V_j) for j != r

Backward runs the other ranks' blocks first, so their dK/dV can start reducing
(a reduce-scatter over the rank axis, this rank's slot zero) while the own block's
backward computes; the own block's dK/dV is added after the wait::

    dK_j, dV_j for j != r       |
    issue reduce_scatter(dK, dV)|  dQ, dK_r, dV_r of the own block
    wait; dK = reduced + dK_r   |

The gathered K/V are returned stacked by rank (``[P, B, H, S/P, D]``, one buffer the
gather writes into) and saved for the backward, as the unpipelined form saves them.
The work beside each collective is the own block's share of the rank's attention:
under a causal mask on contiguous rank ``r``, 1/2 of ``r + 1/2`` blocks; under
zigzag, 2 of ``2P`` (see :meth:`AllGatherKV.cost`).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import Tensor

from autosp.strategies.blockwise import acc_dtype, attend_backward, attend_forward, new_accumulator
from autosp.strategies.collectives import group_size, resolve_group, tally, wait_all
from autosp.strategies.ring_kernel import chunks_of


def _gather_start(x: Tensor, pg: dist.ProcessGroup) -> tuple[Tensor, object]:
    """Start gathering ``x`` from every rank into one ``[P, *x.shape]`` buffer."""
    p = dist.get_world_size(pg)
    stacked = torch.empty((p, *x.shape), dtype=x.dtype, device=x.device)
    tally("all_gather", pg.group_name, x)
    work = dist.all_gather(list(stacked.unbind(0)), x.contiguous(), group=pg, async_op=True)
    return stacked, work


def _reduce_scatter_start(stacked: Tensor, pg: dist.ProcessGroup) -> tuple[Tensor, object]:
    """Start summing ``stacked`` ``[P, ...]`` over the group; returns (buffer, work) where
    ``buffer`` holds this rank's sum once the work is done."""
    tally("reduce_scatter", pg.group_name, stacked)
    if dist.get_backend(pg) == "nccl":
        out = torch.empty_like(stacked[0])
        return out, dist.reduce_scatter_tensor(out, stacked.contiguous(), group=pg, async_op=True)
    # gloo has no reduce-scatter: all-reduce in place, keep this rank's slot
    work = dist.all_reduce(stacked, group=pg, async_op=True)
    return stacked[dist.get_rank(pg)], work


def allgather_kv_forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, all_chunks: list[int],
                         causal: bool, scale: float, pg: dist.ProcessGroup) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    p, r = dist.get_world_size(pg), dist.get_rank(pg)
    own = chunks_of(all_chunks, r, p)
    issued = time.perf_counter()
    ks, k_work = _gather_start(k, pg)
    vs, v_work = _gather_start(v, pg)
    acc = new_accumulator(q)
    attend_forward(q, k, v, own, own, causal, scale, acc, mask)           # while K/V move
    wait_all([k_work, v_work], "all_gather", pg.group_name, issued)
    for j in range(p):
        if j != r:
            attend_forward(q, ks[j], vs[j], own, chunks_of(all_chunks, j, p), causal, scale, acc, mask)
    return acc[0].to(q.dtype), acc[1], ks, vs


def allgather_kv_backward(dout: Tensor, q: Tensor, ks: Tensor, vs: Tensor, out: Tensor, lse: Tensor,
                          mask: Tensor | None, all_chunks: list[int], causal: bool, scale: float,
                          pg: dist.ProcessGroup) -> tuple[Tensor, Tensor, Tensor]:
    p, r = dist.get_world_size(pg), dist.get_rank(pg)
    own = chunks_of(all_chunks, r, p)
    dout = dout.to(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc_dtype(q), device=q.device)
    dks = torch.zeros(ks.shape, dtype=acc_dtype(ks), device=ks.device)
    dvs = torch.zeros(vs.shape, dtype=acc_dtype(vs), device=vs.device)
    for j in range(p):
        if j != r:
            attend_backward(dout, q, ks[j], vs[j], out, lse, own, chunks_of(all_chunks, j, p), causal, scale,
                            dq, dks[j], dvs[j], mask)
    # in the tensors' own dtype, as the unpipelined form reduces them
    issued = time.perf_counter()
    dk_sum, k_work = _reduce_scatter_start(dks.to(ks.dtype), pg)
    dv_sum, v_work = _reduce_scatter_start(dvs.to(vs.dtype), pg)
    dk_own, dv_own = torch.zeros_like(dks[r]), torch.zeros_like(dvs[r])
    attend_backward(dout, q, ks[r], vs[r], out, lse, own, own, causal, scale, dq, dk_own, dv_own, mask)
    wait_all([k_work, v_work], "reduce_scatter", pg.group_name, issued)
    return dq.to(q.dtype), (dk_sum + dk_own).to(ks.dtype), (dv_sum + dv_own).to(vs.dtype)


@torch.library.custom_op("autosp::allgather_kv_attention", mutates_args=())
def allgather_kv_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, all_chunks: list[int],
                           causal: bool, scale: float, group_name: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out, lse, gathered K, gathered V); ``all_chunks``: the chunk ids held by ranks 0..P-1,
    concatenated (equal counts); ``mask`` (or None) over global token order."""
    return allgather_kv_forward(q, k, v, mask, all_chunks, causal, scale, resolve_group(group_name))


@allgather_kv_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, all_chunks: list[int], causal: bool, scale: float,
      group_name: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    p = group_size(group_name)
    return (q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=acc_dtype(q)),
            k.new_empty((p, *k.shape)), v.new_empty((p, *v.shape)))


@torch.library.custom_op("autosp::allgather_kv_attention_backward", mutates_args=())
def allgather_kv_attention_backward(dout: Tensor, q: Tensor, ks: Tensor, vs: Tensor, out: Tensor, lse: Tensor,
                                    mask: Tensor | None, all_chunks: list[int], causal: bool, scale: float,
                                    group_name: str) -> tuple[Tensor, Tensor, Tensor]:
    return allgather_kv_backward(dout, q, ks, vs, out, lse, mask, all_chunks, causal, scale,
                                 resolve_group(group_name))


@allgather_kv_attention_backward.register_fake
def _(dout: Tensor, q: Tensor, ks: Tensor, vs: Tensor, *rest) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), ks.new_empty(ks.shape[1:]), vs.new_empty(vs.shape[1:])


def _setup(ctx, inputs, output) -> None:
    q, _, _, mask, ctx.all_chunks, ctx.causal, ctx.scale, ctx.group_name = inputs
    out, lse, ks, vs = output
    ctx.save_for_backward(q, ks, vs, out, lse, mask)


def _backward(ctx, dout, dlse, dks, dvs):
    # (dlse, dks, dvs: the extra outputs exist to be saved; nothing downstream reads them)
    q, ks, vs, out, lse, mask = ctx.saved_tensors
    dq, dk, dv = allgather_kv_attention_backward(dout.contiguous(), q, ks, vs, out, lse, mask, ctx.all_chunks,
                                                 ctx.causal, ctx.scale, ctx.group_name)
    return dq, dk, dv, None, None, None, None, None


allgather_kv_attention.register_autograd(_backward, setup_context=_setup)
