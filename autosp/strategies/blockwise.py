"""Exact attention over blocks of keys, merged by log-sum-exp: the core of ring and
all-gather-KV attention.

Tokens are cut into equal *chunks* with global ids (chunk ``c`` holds tokens
``[c*L, (c+1)*L)``). A rank's queries and a block of keys/values are each a list
of chunk ids, so one routine serves every token layout (contiguous, zigzag,
the permuted chunks of a Ulysses x ring hybrid). Under a causal mask, query
chunk ``a`` sees key chunk ``b`` fully when ``b < a``, causally when ``b == a``,
and not at all when ``b > a``: no ``S x S`` mask is ever built.

An explicit mask (``[B|1, H|1, S|1, S]``, boolean or additive, over global token
order, as the model built it) is cut the same way: each (query chunk, key chunk)
pair reads its mask block, and a block that masks everything is skipped, so a
sliding window or packed documents cost only the blocks they see (under a mask,
chunks are cut into tiles of at most ``MASK_TILE`` tokens, so a window shorter than
a rank's chunk still hides whole tiles). A block that
masks nothing runs unmasked. Rows a block masks entirely get ``lse = -inf`` there
(the kernel reports 0), so they add nothing when merged.

Per (query chunk, key chunk) pair the fused kernel returns ``(out, lse)``;
partial results merge in fp32:

    lse = logaddexp(lse_1, lse_2)
    out = out_1 * exp(lse_1 - lse) + out_2 * exp(lse_2 - lse)

Backward calls the kernel's backward per pair with the *merged* ``out`` and
``lse``: that gives each pair's exact share of dQ, dK, dV.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from autosp.errors import AutospError
from autosp.strategies.layout import resolve_chunks


def _expand_kv(x: Tensor, n_heads: int) -> Tensor:
    rep = n_heads // x.shape[1]
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def _reduce_kv(dx: Tensor, n_kv: int) -> Tensor:
    b, h, l, d = dx.shape
    return dx if h == n_kv else dx.view(b, n_kv, h // n_kv, l, d).sum(2)


# Forward kernel calls made ("computed"), (query, key) chunk pairs a mask hid entirely
# ("skipped"), and the (query, key) pairs the forward kernels attended summed over the batch
# ("query_keys": this rank's attention work as it ran), since start (read by reports and tests).
BLOCK_TALLY: Counter = Counter()


def _shown(bias: Tensor | None, causal: bool, q: Tensor) -> int:
    """(query, key) pairs one forward kernel call attends, summed over the batch (not heads)."""
    length, keys = q.shape[2], q.shape[2]
    if bias is None:
        return q.shape[0] * (length * (length + 1) // 2 if causal else length * keys)
    shown = bias > float("-inf")
    if causal:
        shown = shown & torch.ones(length, keys, dtype=torch.bool, device=bias.device).tril()
    per_head = shown.shape[1] if shown.dim() == 4 else 1
    rows = q.shape[0] if shown.dim() < 4 or shown.shape[0] == 1 else 1
    return int(shown.sum()) * rows // per_head


def kernel_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
                   bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Fused attention returning ``(out, lse)``; k/v already have q's head count; ``bias`` additive."""
    BLOCK_TALLY["computed"] += 1
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias,
                                                                              scale=scale)
        return out, lse
    if q.device.type == "cuda":
        if bias is not None or q.dtype not in (torch.bfloat16, torch.float16):
            return _math_forward(q, k, v, causal, scale, bias)     # the flash kernel takes no mask, no fp32
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return res[0], res[1]
    raise AutospError(f"blockwise attention has no kernel for device '{q.device.type}'; use strategy='ulysses'")


def kernel_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                    scale: float, bias: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)
    if bias is not None or q.dtype not in (torch.bfloat16, torch.float16):
        return _math_backward(dout, q, k, v, out, lse, causal, scale, bias)
    # Dense (not varlen) flash kernel, no dropout: no cumulative lengths, RNG state unused.
    seed = torch.zeros(2, dtype=torch.uint64, device=q.device)
    offset = torch.zeros((), dtype=torch.uint64, device=q.device)
    res = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, q.shape[-2], k.shape[-2], 0.0, causal, seed, offset, scale=scale)
    return res[0], res[1], res[2]


def _acc(x: Tensor) -> Tensor:
    return x.to(acc_dtype(x))


def _scores(q: Tensor, k: Tensor, causal: bool, scale: float, bias: Tensor | None) -> Tensor:
    s = torch.matmul(_acc(q), _acc(k).transpose(-2, -1)) * scale
    if bias is not None:
        s = s + _acc(bias)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _math_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
                  bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """One tile in fp32 (fp64 for fp64) matmuls, for what no fused CUDA kernel returns an lse for (a masked tile,
    fp32): tiles are at most MASK_TILE tokens, so the scores stay small."""
    s = _scores(q, k, causal, scale, bias)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0.0).unsqueeze(-1))   # rows that see nothing: 0
    return torch.matmul(p, _acc(v)).to(q.dtype), lse


def _math_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                   scale: float, bias: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """The tile's share of dQ, dK, dV from the merged ``out`` and ``lse`` (the fused kernels' math)."""
    p = torch.exp(_scores(q, k, causal, scale, bias) - _acc(lse).unsqueeze(-1))
    do = _acc(dout)
    dv = torch.matmul(p.transpose(-2, -1), do)
    dp = torch.matmul(do, _acc(v).transpose(-2, -1))
    ds = p * (dp - (do * _acc(out)).sum(-1, keepdim=True))
    dq = torch.matmul(ds, _acc(k)) * scale
    dk = torch.matmul(ds.transpose(-2, -1), _acc(q)) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


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


Pair = tuple[int, int, bool, "Tensor | None", "Tensor | None"]

# Under a mask, chunks are cut into tiles of at most this many tokens, so a window or a short
# document hides whole tiles even when a rank's chunk is longer than the window.
MASK_TILE = 1024


def tiles_per_chunk(chunk_len: float) -> int:
    """Under a mask, how many tiles a chunk is cut into: halved until at most MASK_TILE tokens."""
    m = 1
    while chunk_len / m > MASK_TILE and chunk_len % (2 * m) == 0:
        m *= 2
    return m


def tiles(chunks: list[int], chunk_len: int, masked: bool) -> tuple[list[int], int]:
    """The chunk ids and length the kernels work on: the chunks themselves, or under a mask
    their tiles (chunk ``c`` of ``m`` tiles holds tiles ``c*m .. c*m+m-1``: still global ids)."""
    m = tiles_per_chunk(chunk_len) if masked else 1
    return [c * m + t for c in chunks for t in range(m)], chunk_len // m


def visible_pairs(q_chunks: list[int], kv_chunks: list[int], causal: bool, mask: Tensor | None, chunk_len: int,
                  dtype: torch.dtype) -> list[Pair]:
    """:func:`chunk_pairs` with, per pair, the additive mask block (None: sees everything) and the
    rows it sees (None: all of them); pairs whose mask block hides everything are left out."""
    pairs: list[Pair] = []
    if mask is None:
        return [(i, j, c, None, None) for i, j, c in chunk_pairs(q_chunks, kv_chunks, causal)]
    if mask.shape[-1] % chunk_len:
        raise AutospError(f"the attention mask covers {mask.shape[-1]} keys, not whole chunks of {chunk_len} "
                          "tokens; build it over the full (padded) sequence")
    status = _block_status(mask, q_chunks, chunk_len)
    for i, j, c in chunk_pairs(q_chunks, kv_chunks, causal):
        a, b = q_chunks[i], kv_chunks[j]
        seen = int(status[i][b])
        if seen == _HIDDEN:
            continue
        if seen == _SHOWN:
            pairs.append((i, j, c, None, None))
            continue
        rows = mask if mask.shape[-2] == 1 else mask.narrow(-2, a * chunk_len, chunk_len)
        block = rows.narrow(-1, b * chunk_len, chunk_len)
        if block.dtype == torch.bool:
            zero, hide = (torch.full((), x, dtype=dtype, device=block.device) for x in (0.0, float("-inf")))
            bias, visible = torch.where(block, zero, hide), block
        else:
            bias, visible = block.to(dtype), block > float("-inf")
        rows_seen = visible.any(-1)
        pairs.append((i, j, c, bias, None if bool(rows_seen.all()) else rows_seen))
    return pairs


_HIDDEN, _PARTIAL, _SHOWN = 0, 1, 2
# Per mask tensor (by identity, held weakly) and version: the status of every key block for a
# rank's query blocks. Every layer of a step shares one mask, and backward reads what forward
# read: the S x S mask is scanned once per step, not per layer and direction.
_STATUS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _block_status(mask: Tensor, q_chunks: list[int], chunk_len: int) -> list[Tensor]:
    """Per query block, ``[S / chunk_len]`` statuses over all key blocks: hidden, partial or shown."""
    key = (mask._version, tuple(q_chunks), chunk_len)
    per_mask = _STATUS.setdefault(mask, {})
    if key not in per_mask:
        m = mask
        for d in range(m.dim() - 2):               # broadcast dims (stride 0) hold one value
            if m.stride(d) == 0:
                m = m.narrow(d, 0, 1)
        n_k = m.shape[-1] // chunk_len
        out = []
        for a in q_chunks:
            rows = m if m.shape[-2] == 1 else m.narrow(-2, a * chunk_len, chunk_len)
            blocks = rows.unflatten(-1, (n_k, chunk_len))
            dims = tuple(d for d in range(blocks.dim()) if d != blocks.dim() - 2)
            if blocks.dtype == torch.bool:           # a byte view: one pass each for any and all
                u = blocks.view(torch.uint8)
                some, every = u.amax(dim=dims) > 0, u.amin(dim=dims) > 0
            else:
                some = (blocks > float("-inf")).flatten(0, -3).any(0).any(-1) if blocks.shape[-2] else None
                every = (blocks == 0).flatten(0, -3).all(0).all(-1)
            out.append(some.to(torch.int8) + every.to(torch.int8))
        if len(per_mask) > 64:
            per_mask.clear()
        per_mask[key] = out
    return per_mask[key]


def acc_dtype(x: Tensor) -> torch.dtype:
    """Merging happens in fp32 (fp64 for fp64 inputs, whose kernels return fp64 lse)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def new_accumulator(q: Tensor) -> tuple[Tensor, Tensor]:
    out = torch.zeros(q.shape, dtype=acc_dtype(q), device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc_dtype(q), device=q.device)
    return out, lse


def attend_forward(q: Tensor, k: Tensor, v: Tensor, q_chunks: list[int], kv_chunks: list[int], causal: bool,
                   scale: float, acc: tuple[Tensor, Tensor], mask: Tensor | None = None) -> None:
    """Merge the attention of ``q`` over this key block into the running ``acc`` (in place)."""
    acc_out, acc_lse = acc
    n_heads = q.shape[1]
    length = q.shape[2] // len(q_chunks)
    q_chunks, length = tiles(q_chunks, length, mask is not None)
    kv_chunks, _ = tiles(kv_chunks, k.shape[2] // len(kv_chunks), mask is not None)
    qs, acc_o, acc_l = q.chunk(len(q_chunks), 2), acc_out.chunk(len(q_chunks), 2), acc_lse.chunk(len(q_chunks), 2)
    ks, vs = k.chunk(len(kv_chunks), 2), v.chunk(len(kv_chunks), 2)
    pairs = visible_pairs(q_chunks, kv_chunks, causal, mask, length, q.dtype)
    BLOCK_TALLY["skipped"] += len(chunk_pairs(q_chunks, kv_chunks, causal)) - len(pairs)
    for i, j, c, bias, rows_seen in pairs:
        BLOCK_TALLY["query_keys"] += _shown(bias, c, qs[i])
        o, lse = kernel_forward(qs[i], _expand_kv(ks[j], n_heads), _expand_kv(vs[j], n_heads), c, scale, bias)
        if rows_seen is None:
            new = torch.logaddexp(acc_l[i], lse)
            w_old, w_new = torch.exp(acc_l[i] - new), torch.exp(lse - new)
        else:   # rows this block hides: lse -inf; rows no block has shown yet stay -inf with weight 0
            lse = lse.to(acc_l[i].dtype).masked_fill(~rows_seen, float("-inf"))
            o = o.masked_fill(~rows_seen.unsqueeze(-1), 0.0)        # some kernels leave NaN there
            new = torch.logaddexp(acc_l[i], lse)
            shown = new > float("-inf")
            w_old = torch.where(shown, torch.exp(acc_l[i] - new), 0.0)
            w_new = torch.where(shown, torch.exp(lse - new), 0.0)
        acc_o[i].mul_(w_old.unsqueeze(-1)).add_(o.to(acc_o[i].dtype) * w_new.unsqueeze(-1))
        acc_l[i].copy_(new)


def attend_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, q_chunks: list[int],
                    kv_chunks: list[int], causal: bool, scale: float,
                    dq: Tensor, dk: Tensor, dv: Tensor, mask: Tensor | None = None) -> None:
    """Accumulate this key block's share of dQ (into ``dq``) and its dK, dV (into ``dk``, ``dv``)."""
    n_heads, n_kv = q.shape[1], k.shape[1]
    length = q.shape[2] // len(q_chunks)
    q_chunks, length = tiles(q_chunks, length, mask is not None)
    kv_chunks, _ = tiles(kv_chunks, k.shape[2] // len(kv_chunks), mask is not None)
    nq, nk = len(q_chunks), len(kv_chunks)
    if mask is not None:        # rows no key is shown to: the kernel's own convention, lse 0 and out 0
        lse = lse.masked_fill(lse == float("-inf"), 0.0)
    qs, dos, outs, lses, dqs = (t.chunk(nq, 2) for t in (q, dout, out, lse, dq))
    ks, vs, dks, dvs = (t.chunk(nk, 2) for t in (k, v, dk, dv))
    for i, j, c, bias, _ in visible_pairs(q_chunks, kv_chunks, causal, mask, length, q.dtype):
        gq, gk, gv = kernel_backward(dos[i].contiguous(), qs[i], _expand_kv(ks[j], n_heads),
                                     _expand_kv(vs[j], n_heads), outs[i].contiguous(), lses[i].contiguous(),
                                     c, scale, bias)
        dqs[i].add_(gq)
        dks[j].add_(_reduce_kv(gk, n_kv))
        dvs[j].add_(_reduce_kv(gv, n_kv))


# ------------------------------------------------------------------ the local op with autograd

@torch.library.custom_op("autosp::chunked_attention", mutates_args=())
def chunked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, q_chunks: list[int],
                      kv_chunks: list[int], causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Attention of local queries over gathered keys/values, both described by chunk ids; ``mask``
    (or None) over global token order."""
    acc = new_accumulator(q)
    attend_forward(q, k, v, resolve_chunks(q_chunks), resolve_chunks(kv_chunks), causal, scale, acc, mask)
    return acc[0].to(q.dtype), acc[1]


def register_blockwise(op: Any, names: tuple[str, ...], backward_op: Any) -> None:
    """Fake kernels and autograd of a blockwise attention op ``(q, k, v, mask, *rest) -> (out, lse)``
    whose backward is the custom op ``backward_op(dout, q, k, v, out, lse, mask, *rest) -> (dq, dk, dv)``.

    Both directions are opaque custom ops, so AOTAutograd traces through them (their
    collectives never enter a graph); fakes are contiguous, as the real kernels return."""
    def fake(q: Tensor, *rest: Any) -> tuple[Tensor, Tensor]:
        return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=acc_dtype(q))

    def setup(ctx, inputs, output) -> None:
        for name, value in zip(names, inputs[4:]):
            setattr(ctx, name, value)
        ctx.save_for_backward(*inputs[:3], output[0], output[1], inputs[3])

    def backward(ctx, dout, dlse):
        q, k, v, out, lse, mask = ctx.saved_tensors
        grads = backward_op(dout.contiguous(), q, k, v, out, lse, mask, *(getattr(ctx, n) for n in names))
        return (*grads, None, *([None] * len(names)))

    def fake_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, *rest: Any) -> tuple[Tensor, Tensor, Tensor]:
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    op.register_fake(fake)
    backward_op.register_fake(fake_backward)
    op.register_autograd(backward, setup_context=setup)


@torch.library.custom_op("autosp::chunked_attention_backward", mutates_args=())
def chunked_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                               mask: Tensor | None, q_chunks: list[int], kv_chunks: list[int], causal: bool,
                               scale: float) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = (torch.zeros(t.shape, dtype=acc_dtype(t), device=t.device) for t in (q, k, v))
    attend_backward(dout.to(q.dtype), q, k, v, out, lse, resolve_chunks(q_chunks), resolve_chunks(kv_chunks),
                    causal, scale, dq, dk, dv, mask)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


register_blockwise(chunked_attention, ("q_chunks", "kv_chunks", "causal", "scale"), chunked_attention_backward)
