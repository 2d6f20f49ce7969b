"""Ring attention for attention the model writes itself: its score function, block by block.

A region whose softmax reads nothing but its own scores (``z = f(q, k, masks, biases)``, any
elementwise ``f``: scale, soft-capping, ALiBi, an additive or ``masked_fill`` mask) runs as ring
attention: K/V blocks travel the ring as in :mod:`autosp.strategies.ring_kernel`, and per block

    z_b = f(q, k_b, extras[:, cols of b])         the model's own ops, on this block's keys
    out, lse  merged by log-sum-exp (fp32)        exactly the softmax over all keys

Backward recomputes ``z_b`` with autograd on and pulls ``dS = P * (dP - rowsum(dO * O))`` through
it to dQ and dK (``f``'s derivative is the model's own, whatever ``f`` is); dV is ``P^T dO``. No
``S x S`` tensor is ever whole: the scores live one ``[S/P, S/P]`` block at a time, where
Ulysses and all-gather-KV hold ``S x S / P`` per rank.

The op is opaque to AOTAutograd (a custom op, like the ring's), so it names its score function by
a key: :func:`register_scores` keeps them (process state, listed in docs/concepts.md).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from autosp.strategies.blockwise import acc_dtype, new_accumulator
from autosp.strategies.collectives import resolve_group, wait_all
from autosp.strategies.layout import kernel_chunks, resolve_chunks, slice_seq
from autosp.strategies.region import Atoms, full_sizes, slice_atom
from autosp.strategies.ring_kernel import _exchange, chunks_of

# key -> (score function (q, k, v, *extras) -> scores, each extra's atoms): what the ops run
_SCORES: dict[str, tuple[Callable[..., Tensor], list[Atoms | None]]] = {}


def register_scores(score: Callable[..., Tensor], atoms: list[Atoms | None]) -> str:
    """Keep a region's score function for the ring op; returns its key."""
    key = f"region{len(_SCORES)}"
    _SCORES[key] = (score, atoms)
    return key


def _columns(extras: list[Tensor], atoms: list[Atoms | None], ids: list[int], chunk: int,
             full: dict[str, int]) -> list[Tensor]:
    """Each extra's key columns of the chunks ``ids`` (chunk ``c``: keys ``c*chunk ..``)."""
    def cut(t: Tensor, d: int) -> Tensor:
        parts = [t.narrow(d, c * chunk, chunk) for c in ids]
        return parts[0] if len(parts) == 1 else torch.cat(parts, d)
    return [slice_atom(x, a, "sk", full, cut) for x, a in zip(extras, atoms)]


def _scores(key: str, q: Tensor, k: Tensor, v: Tensor, extras: list[Tensor]) -> Tensor:
    score, _ = _SCORES[key]
    return score(q, k, v, *extras).to(acc_dtype(q))


def _sizes(q: Tensor, v: Tensor, world: int) -> dict[str, int]:
    """Atom sizes of the extras as the op holds them: this rank's query rows, every key."""
    return {**full_sizes(q, v, world), "sq": q.shape[2]}


@contextlib.contextmanager
def _autograd_on() -> Iterator[None]:
    """Autograd inside a custom op's kernel, which may run below it (AOTAutograd's compiled
    backward excludes the autograd keys, and enable_grad alone would then record nothing)."""
    keys = torch._C._dispatch_tls_local_exclude_set()
    for k in (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.ADInplaceOrView):
        keys = keys.remove(k)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), keys), torch.enable_grad():
        yield


def region_ring_forward(q: Tensor, k: Tensor, v: Tensor, extras: list[Tensor], chunks: list[int], key: str,
                        pg: dist.ProcessGroup, sink: int = -1) -> tuple[Tensor, Tensor]:
    p, r = dist.get_world_size(pg), dist.get_rank(pg)
    atoms, full = _SCORES[key][1], _sizes(q, v, p)
    chunks = resolve_chunks(chunks)
    chunk = k.shape[2] * p // len(chunks)
    acc_o, acc_l = new_accumulator(q)
    cur = [k.contiguous(), v.contiguous()]
    for step in range(p):
        src = (r - step) % p
        if step < p - 1:
            nxt, reqs = _exchange(pg, cur)
        z = _scores(key, q, cur[0], cur[1], _columns(extras, atoms, chunks_of(chunks, src, p), chunk, full))
        lse = torch.logsumexp(z, -1)
        seen = lse > float("-inf")                       # rows this block shows some key
        prob = torch.exp(z - lse.masked_fill(~seen, 0.0).unsqueeze(-1))
        o = torch.matmul(prob, cur[1].to(prob.dtype))
        new = torch.logaddexp(acc_l, lse)
        shown = new > float("-inf")
        w_old = torch.where(shown, torch.exp(acc_l - new), 0.0)
        w_new = torch.where(shown, torch.exp(lse - new), 0.0)
        acc_o = acc_o * w_old.unsqueeze(-1) + o * w_new.unsqueeze(-1)
        acc_l = new
        if step < p - 1:
            wait_all(reqs, "send_recv", pg.group_name)
            cur = nxt
    if sink >= 0:             # the sink joins each row's softmax once, after every key block
        new = torch.logaddexp(acc_l, torch.logsumexp(extras[sink].to(acc_l.dtype), -1).expand_as(acc_l))
        acc_o = acc_o * torch.where(acc_l > float("-inf"), torch.exp(acc_l - new), 0.0).unsqueeze(-1)
        acc_l = new
    return acc_o.to(q.dtype), acc_l


def region_ring_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                         extras: list[Tensor], chunks: list[int], key: str, pg: dist.ProcessGroup,
                         sink: int = -1, learned: list[int] | None = None
                         ) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """dQ, dK, dV, and the gradients of the extras ``learned`` (indices): a learned bias's through
    the score function, block by block; the sink's ``-p_sink * rowsum(dO * O)``."""
    p, r = dist.get_world_size(pg), dist.get_rank(pg)
    atoms, full = _SCORES[key][1], _sizes(q, v, p)
    chunks = resolve_chunks(chunks)
    chunk = k.shape[2] * p // len(chunks)
    dt = acc_dtype(q)
    do, o = dout.to(dt), out.to(dt)
    rowsum = (do * o).sum(-1, keepdim=True)
    lse = lse.masked_fill(lse == float("-inf"), 0.0).unsqueeze(-1)
    dq = torch.zeros(q.shape, dtype=dt, device=q.device)
    cur = [k.contiguous(), v.contiguous()]
    dkv = [torch.zeros(k.shape, dtype=dt, device=k.device), torch.zeros(v.shape, dtype=dt, device=v.device)]
    # a learned bias: a leaf whose gradient the blocks' score functions accumulate (columns cut from it)
    learned = [i for i in (learned or []) if i != sink]
    leaves = {i: extras[i].detach().requires_grad_() for i in learned}
    dx = {i: torch.zeros_like(extras[i]) for i in learned}
    scored = [leaves.get(i, x) for i, x in enumerate(extras)]
    for step in range(p):
        src = (r - step) % p
        if step < p - 1:
            nxt, reqs = _exchange(pg, cur)
        with _autograd_on():           # the model's own derivative of its score function
            cols = _columns(scored, atoms, chunks_of(chunks, src, p), chunk, full)
            qg, kg = q.detach().requires_grad_(), cur[0].detach().requires_grad_()
            z = _scores(key, qg, kg, cur[1], cols)
            prob = torch.exp(z.detach() - lse)
            dp = torch.matmul(do, cur[1].to(dt).transpose(-2, -1))
            gq, gk, *gx = torch.autograd.grad(z, (qg, kg, *leaves.values()), prob * (dp - rowsum),
                                              allow_unused=True)
        for i, g in zip(leaves, gx):
            if g is not None:
                dx[i] += g
        dq += gq
        dkv[0] += gk
        dkv[1] += torch.matmul(prob.transpose(-2, -1), do)
        dkv, dreqs = _exchange(pg, dkv)           # the accumulators travel with their block
        wait_all(dreqs, "send_recv", pg.group_name)
        if step < p - 1:
            wait_all(reqs, "send_recv", pg.group_name)
            cur = nxt
    dxs = [dx[i] for i in learned]
    if sink >= 0:             # d sink = -p_sink * rowsum, summed where the sink was broadcast
        s = extras[sink]
        ds = -torch.exp(s.to(dt) - lse) * rowsum
        dxs.insert(sorted(learned + [sink]).index(sink), ds.sum_to_size(s.shape).to(s.dtype))
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), dxs


@torch.library.custom_op("autosp::ring_region", mutates_args=())
def ring_region_op(q: Tensor, k: Tensor, v: Tensor, extras: list[Tensor], chunks: list[int], key: str,
                   group_name: str, sink: int) -> tuple[Tensor, Tensor]:
    return region_ring_forward(q, k, v, extras, chunks, key, resolve_group(group_name), sink)


@torch.library.custom_op("autosp::ring_region_backward", mutates_args=())
def ring_region_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                            extras: list[Tensor], chunks: list[int], key: str, group_name: str, sink: int,
                            learned: list[int]) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    return region_ring_backward(dout, q, k, v, out, lse, extras, chunks, key, resolve_group(group_name), sink,
                                learned)


@ring_region_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, *rest: Any) -> tuple[Tensor, Tensor]:
    return q.new_empty(q.shape[:-1] + v.shape[-1:]), q.new_empty(q.shape[:-1], dtype=acc_dtype(q))


@ring_region_backward_op.register_fake
def _(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, extras: list[Tensor],
      chunks: list[int], key: str, group_name: str, sink: int, learned: list[int]
      ) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), \
        [extras[i].new_empty(extras[i].shape) for i in sorted(set(learned) | ({sink} - {-1}))]


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, extras, ctx.chunks, ctx.key, ctx.group_name, ctx.sink = inputs
    ctx.n_extras = len(extras)
    # the extras whose gradient is wanted (a learned bias, the sink): the backward makes only theirs
    ctx.learned = [i for i, e in enumerate(extras) if e.requires_grad]
    ctx.save_for_backward(q, k, v, output[0], output[1], *extras)


def _backward(ctx: Any, dout: Tensor, dlse: Tensor) -> tuple:
    q, k, v, out, lse, *extras = ctx.saved_tensors
    wanted = sorted(set(ctx.learned) | ({ctx.sink} - {-1}))
    dq, dk, dv, dxs = ring_region_backward_op(dout.contiguous(), q, k, v, out, lse, list(extras), ctx.chunks,
                                              ctx.key, ctx.group_name, ctx.sink, ctx.learned)
    grads = dict(zip(wanted, dxs))
    return dq, dk, dv, [grads.get(i) for i in range(ctx.n_extras)], None, None, None, None


ring_region_op.register_autograd(_backward, setup_context=_setup)


def ring_region(query: Tensor, key: Tensor, value: Tensor, *extras: Any, region: Any, group_name: str,
                layout: str = "contiguous", **_: Any) -> Tensor:
    """The runtime of ``ring`` and ``zigzag_ring`` for a region: its masks and biases keep this
    rank's query rows here; the op cuts their key columns block by block."""
    pg = resolve_group(group_name)
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    info = region.autosp_region
    full = full_sizes(query, value, world)
    # masks and biases keep this rank's rows; scalars (a scale Dynamo kept symbolic; sizes the scores
    # never read) travel as 0-d tensors, the op taking tensors only
    mine = [slice_atom(x, a, "sq", full, lambda t, d: slice_seq(t, d, full["sq"], rank, world, layout))
            if isinstance(x, Tensor) else torch.scalar_tensor(x if isinstance(x, (int, float)) else x, device=query.device)
            for x, a in zip(extras, info.extras)]
    out, _ = ring_region_op(query, key, value, mine, kernel_chunks(layout, world), info.score_key, group_name,
                            info.sink)
    return out
