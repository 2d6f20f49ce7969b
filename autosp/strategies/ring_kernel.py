"""Ring attention: K/V blocks travel around the SP ring; never the full K/V, never an S x S mask.

Forward, on ring rank ``r`` of ``P``: at step ``s`` the rank holds the K/V
block of rank ``(r - s) mod P``; it starts sending that block to ``r+1`` and
receiving the next from ``r-1`` (``batch_isend_irecv``), attends its queries to
the block it holds while the transfer runs, and merges by log-sum-exp (fp32).

Backward rotates K/V the same way; dQ accumulates locally, while each block's
dK/dV accumulator travels *with* the block: after ``P`` hops it arrives back at
the block's owner holding every rank's contribution.

Per-rank memory: the local queries, two K/V blocks and one dK/dV accumulator:
``O(S/P)``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from autosp.strategies.blockwise import (acc_dtype, attend_backward, attend_forward, new_accumulator,
                                        register_blockwise)
from autosp.strategies.collectives import resolve_group, tally, wait_all
from autosp.strategies.layout import resolve_chunks


def _exchange(pg: dist.ProcessGroup, tensors: list[Tensor]) -> tuple[list[Tensor], list]:
    """Start sending ``tensors`` to the next ring rank and receiving as many from the previous."""
    p, r = dist.get_world_size(pg), dist.get_rank(pg)
    nxt, prv = dist.get_global_rank(pg, (r + 1) % p), dist.get_global_rank(pg, (r - 1) % p)
    recv = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
    tally("send_recv", pg.group_name, *tensors)
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, pg) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, prv, pg) for t in recv]
    return recv, dist.batch_isend_irecv(ops)


def chunks_of(all_chunks: list[int], rank: int, world: int) -> list[int]:
    """Ring rank ``rank``'s chunk ids (``all_chunks`` may be a balanced deal's run-time marker)."""
    all_chunks = resolve_chunks(all_chunks)
    per = len(all_chunks) // world
    return all_chunks[rank * per:(rank + 1) * per]


def ring_forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, all_chunks: list[int], causal: bool,
                 scale: float, pg: dist.ProcessGroup) -> tuple[Tensor, Tensor]:
    p, r = dist.get_world_size(pg), dist.get_rank(pg)
    q_chunks = chunks_of(all_chunks, r, p)
    acc = new_accumulator(q)
    cur = [k.contiguous(), v.contiguous()]
    for step in range(p):
        src = (r - step) % p
        if step < p - 1:
            nxt, reqs = _exchange(pg, cur)
        attend_forward(q, cur[0], cur[1], q_chunks, chunks_of(all_chunks, src, p), causal, scale, acc, mask)
        if step < p - 1:
            wait_all(reqs, "send_recv", pg.group_name)
            cur = nxt
    return acc[0].to(q.dtype), acc[1]


@torch.library.custom_op("autosp::ring_attention", mutates_args=())
def ring_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, all_chunks: list[int], causal: bool,
                   scale: float, group_name: str) -> tuple[Tensor, Tensor]:
    """``all_chunks``: the chunk ids held by ring ranks 0..P-1, concatenated (equal counts); ``mask``
    (or None): every rank's copy over global token order (it never travels)."""
    return ring_forward(q, k, v, mask, all_chunks, causal, scale, resolve_group(group_name))


@torch.library.custom_op("autosp::ring_attention_backward", mutates_args=())
def ring_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                            mask: Tensor | None, all_chunks: list[int], causal: bool, scale: float,
                            group_name: str) -> tuple[Tensor, Tensor, Tensor]:
    return ring_backward(dout, q, k, v, out, lse, mask, all_chunks, causal, scale, resolve_group(group_name))


def ring_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, mask: Tensor | None,
                  all_chunks: list[int], causal: bool, scale: float,
                  pg: dist.ProcessGroup) -> tuple[Tensor, Tensor, Tensor]:
    p, r = dist.get_world_size(pg), dist.get_rank(pg)
    q_chunks = chunks_of(all_chunks, r, p)
    dout = dout.to(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc_dtype(q), device=q.device)
    cur = [k.contiguous(), v.contiguous()]
    dkv = [torch.zeros(k.shape, dtype=acc_dtype(k), device=k.device),
           torch.zeros(v.shape, dtype=acc_dtype(v), device=v.device)]
    for step in range(p):
        src = (r - step) % p
        if step < p - 1:
            nxt, reqs = _exchange(pg, cur)
        attend_backward(dout, q, cur[0], cur[1], out, lse, q_chunks, chunks_of(all_chunks, src, p),
                        causal, scale, dq, dkv[0], dkv[1], mask)
        # The accumulator follows its block; after P hops it is home with every contribution.
        dkv, dreqs = _exchange(pg, dkv)
        wait_all(dreqs, "send_recv", pg.group_name)
        if step < p - 1:
            wait_all(reqs, "send_recv", pg.group_name)
            cur = nxt
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


register_blockwise(ring_attention, ("all_chunks", "causal", "scale", "group_name"), ring_attention_backward)
