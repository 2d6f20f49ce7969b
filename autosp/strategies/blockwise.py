"""Exact attention over blocks of keys, merged by log-sum-exp: the core of ring and
all-gather-KV attention.

Tokens are cut into equal *chunks* with global ids (chunk ``c`` holds tokens
``[c*L, (c+1)*L)``). A rank's queries and a block of keys/values are each a list
of chunk ids, so one routine serves every token layout (contiguous, zigzag,
the permuted chunks of a Ulysses x ring hybrid). Under a causal mask, query
chunk ``a`` sees key chunk ``b`` fully when ``b < a``, causally when ``b == a``,
and not at all when ``b > a``: no ``S x S`` mask is ever built.

Per (query chunk, key chunk) pair the fused kernel returns ``(out, lse)``;
partial results merge in fp32:

    lse = logaddexp(lse_1, lse_2)
    out = out_1 * exp(lse_1 - lse) + out_2 * exp(lse_2 - lse)

Backward calls the kernel's backward per pair with the *merged* ``out`` and
``lse``: that gives each pair's exact share of dQ, dK, dV.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from autosp.errors import AutospError


def _expand_kv(x: Tensor, n_heads: int) -> Tensor:
    rep = n_heads // x.shape[1]
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def _reduce_kv(dx: Tensor, n_kv: int) -> Tensor:
    b, h, l, d = dx.shape
    return dx if h == n_kv else dx.view(b, n_kv, h // n_kv, l, d).sum(2)


def kernel_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Fused attention returning ``(out, lse)``; k/v already have q's head count."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse
    if q.device.type == "cuda":
        if q.dtype not in (torch.bfloat16, torch.float16):
            raise AutospError(f"ring / all-gather-KV attention on CUDA uses the flash kernel, which takes bf16 or "
                              f"fp16, not {q.dtype}; train in bf16 or use strategy='ulysses'")
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return res[0], res[1]
    raise AutospError(f"blockwise attention has no kernel for device '{q.device.type}'; use strategy='ulysses'")


def kernel_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                    scale: float) -> tuple[Tensor, Tensor, Tensor]:
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    # Dense (not varlen) flash kernel, no dropout: no cumulative lengths, RNG state unused.
    seed = torch.zeros(2, dtype=torch.uint64, device=q.device)
    offset = torch.zeros((), dtype=torch.uint64, device=q.device)
    res = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, q.shape[-2], k.shape[-2], 0.0, causal, seed, offset, scale=scale)
    return res[0], res[1], res[2]


def chunk_pairs(q_chunks: list[int], kv_chunks: list[int], causal: bool) -> list[tuple[int, int, bool]]:
    """(query chunk index, key chunk index, causal within the pair) for every visible pair."""
    pairs = []
    for i, a in enumerate(q_chunks):
        for j, b in enumerate(kv_chunks):
            if not causal or b < a:
                pairs.append((i, j, False))
            elif b == a:
                pairs.append((i, j, True))
    return pairs


def acc_dtype(x: Tensor) -> torch.dtype:
    """Merging happens in fp32 (fp64 for fp64 inputs, whose kernels return fp64 lse)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def new_accumulator(q: Tensor) -> tuple[Tensor, Tensor]:
    out = torch.zeros(q.shape, dtype=acc_dtype(q), device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc_dtype(q), device=q.device)
    return out, lse


def attend_forward(q: Tensor, k: Tensor, v: Tensor, q_chunks: list[int], kv_chunks: list[int], causal: bool,
                   scale: float, acc: tuple[Tensor, Tensor]) -> None:
    """Merge the attention of ``q`` over this key block into the running ``acc`` (in place)."""
    acc_out, acc_lse = acc
    n_heads = q.shape[1]
    qs, acc_o, acc_l = q.chunk(len(q_chunks), 2), acc_out.chunk(len(q_chunks), 2), acc_lse.chunk(len(q_chunks), 2)
    ks, vs = k.chunk(len(kv_chunks), 2), v.chunk(len(kv_chunks), 2)
    for i, j, c in chunk_pairs(q_chunks, kv_chunks, causal):
        o, lse = kernel_forward(qs[i], _expand_kv(ks[j], n_heads), _expand_kv(vs[j], n_heads), c, scale)
        new = torch.logaddexp(acc_l[i], lse)
        acc_o[i].mul_(torch.exp(acc_l[i] - new).unsqueeze(-1)).add_(o.to(acc_o[i].dtype) * torch.exp(lse - new).unsqueeze(-1))
        acc_l[i].copy_(new)


def attend_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, q_chunks: list[int],
                    kv_chunks: list[int], causal: bool, scale: float,
                    dq: Tensor, dk: Tensor, dv: Tensor) -> None:
    """Accumulate this key block's share of dQ (into ``dq``) and its dK, dV (into ``dk``, ``dv``)."""
    n_heads, n_kv = q.shape[1], k.shape[1]
    nq, nk = len(q_chunks), len(kv_chunks)
    qs, dos, outs, lses, dqs = (t.chunk(nq, 2) for t in (q, dout, out, lse, dq))
    ks, vs, dks, dvs = (t.chunk(nk, 2) for t in (k, v, dk, dv))
    for i, j, c in chunk_pairs(q_chunks, kv_chunks, causal):
        gq, gk, gv = kernel_backward(dos[i].contiguous(), qs[i], _expand_kv(ks[j], n_heads),
                                     _expand_kv(vs[j], n_heads), outs[i].contiguous(), lses[i].contiguous(),
                                     c, scale)
        dqs[i].add_(gq)
        dks[j].add_(_reduce_kv(gk, n_kv))
        dvs[j].add_(_reduce_kv(gv, n_kv))


# ------------------------------------------------------------------ the local op with autograd

@torch.library.custom_op("autosp::chunked_attention", mutates_args=())
def chunked_attention(q: Tensor, k: Tensor, v: Tensor, q_chunks: list[int], kv_chunks: list[int],
                      causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Attention of local queries over gathered keys/values, both described by chunk ids."""
    acc = new_accumulator(q)
    attend_forward(q, k, v, q_chunks, kv_chunks, causal, scale, acc)
    return acc[0].to(q.dtype), acc[1]


def register_blockwise(op: Any, names: tuple[str, ...], backward_op: Any) -> None:
    """Fake kernels and autograd of a blockwise attention op ``(q, k, v, *rest) -> (out, lse)``
    whose backward is the custom op ``backward_op(dout, q, k, v, out, lse, *rest) -> (dq, dk, dv)``.

    Both directions are opaque custom ops, so AOTAutograd traces through them (their
    collectives never enter a graph); fakes are contiguous, as the real kernels return."""
    def fake(q: Tensor, *rest: Any) -> tuple[Tensor, Tensor]:
        return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=acc_dtype(q))

    def setup(ctx, inputs, output) -> None:
        for name, value in zip(names, inputs[3:]):
            setattr(ctx, name, value)
        ctx.save_for_backward(*inputs[:3], output[0], output[1])

    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        grads = backward_op(dout.contiguous(), q, k, v, out, lse, *(getattr(ctx, n) for n in names))
        return (*grads, *([None] * len(names)))

    def fake_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, *rest: Any) -> tuple[Tensor, Tensor, Tensor]:
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    op.register_fake(fake)
    backward_op.register_fake(fake_backward)
    op.register_autograd(backward, setup_context=setup)


@torch.library.custom_op("autosp::chunked_attention_backward", mutates_args=())
def chunked_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                               q_chunks: list[int], kv_chunks: list[int], causal: bool,
                               scale: float) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = (torch.zeros(t.shape, dtype=acc_dtype(t), device=t.device) for t in (q, k, v))
    attend_backward(dout.to(q.dtype), q, k, v, out, lse, q_chunks, kv_chunks, causal, scale, dq, dk, dv)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


register_blockwise(chunked_attention, ("q_chunks", "kv_chunks", "causal", "scale"), chunked_attention_backward)
