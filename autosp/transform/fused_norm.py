"""RMSNorm as one op that saves its low-precision input, where a layer's recompute holds it.

Why: Hugging Face's RMSNorm (Llama, Mistral, Qwen, ...) upcasts to fp32 and normalises in
pointwise ops, so eager autograd saves the fp32 copy of the input (two hidden states in bf16
terms) and the normalised bf16 tensor (one more) for each norm. Where a fully checkpointed layer
recomputes its tiled MLP with the rest of the layer (``LayerChoice.keep_mlp_input=False``), the
rest's recomputed tensors stay alive through the MLP chunks' backward as eager autograd saves
them (:func:`autosp.costmodel.phases.own_bytes`): at millions of tokens the two norms' copies are
five hidden states per rank, the largest part of that phase. One op ``autosp::rms_norm`` saves
the input as it is and the fp32 reciprocal RMS (one number per token); its backward recomputes
the rest (pointwise, memory-bound).

The forward runs the same ops in the same order as the module it replaces, so its output is the
same bits; the backward writes out what autograd would do for those ops
(:func:`rms_norm_backward`). :func:`fuse_rms_norms` rewrites the Dynamo graph: a chain
``x.to(fp32); pow(2); mean(-1, keepdim); + eps; rsqrt; x32 * r; .to(dtype); weight *`` becomes
one call; anything else (Gemma's ``1 + weight``, a norm over another dim) is left as written.
"""

from __future__ import annotations

import operator
from typing import Callable

import torch
import torch.fx as fx
from torch import Tensor

from autosp.transform.graph_pass import finish_pass


# Rows per block inside the op: the fp32 transients of one block at a time (1 / 8 of the tokens'),
# so neither direction holds more than the unfused ops would; each row's result is the same bits.
BLOCKS = 8


def _rows(t: Tensor) -> list[Tensor]:
    flat = t.reshape(-1, t.shape[-1])
    return list(flat.split(max(1, -(-flat.shape[0] // BLOCKS))))


def _forward_block(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    x32 = x.to(torch.float32)
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (x32 * r).to(x.dtype), r


def _forward(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    y = x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))
    r = x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)
    for xb, yb, rb in zip(_rows(x), _rows(y), _rows(r)):
        yb[:], rb[:] = _forward_block(xb, weight, eps)
    return y, r


def _fake_forward(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return _forward_block(x, weight, eps)


@torch.library.custom_op("autosp::rms_norm", mutates_args=())
def rms_norm_op(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` computed in fp32, the fp32 reciprocal RMS)."""
    return _forward(x, weight, eps)


rms_norm_op.register_fake(_fake_forward)


def _backward_block(dy: Tensor, x: Tensor, weight: Tensor, r: Tensor) -> tuple[Tensor, Tensor]:
    # autograd's formulas for the forward's ops (x32 * r: both factors; rsqrt: -r^3 / 2; mean: / D;
    # pow(2): 2 x32), in place where it can
    x32 = x.to(torch.float32)
    dweight = (dy * (x32 * r).to(x.dtype)).to(torch.float32).sum(0)
    dn = (dy * weight).to(torch.float32)
    coef = (dn * x32).sum(-1, keepdim=True).mul_(r.pow(3)).mul_(-1.0 / x32.shape[-1])
    return dn.mul_(r).addcmul_(x32, coef).to(x.dtype), dweight


def _backward(dy: Tensor, x: Tensor, weight: Tensor, r: Tensor) -> tuple[Tensor, Tensor]:
    """Block by block (see BLOCKS); the weight's gradient summed over blocks in fp32."""
    dx = torch.empty_like(x)
    dweight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    for dyb, xb, rb, dxb in zip(_rows(dy), _rows(x), _rows(r), _rows(dx)):
        dxb[:], dwb = _backward_block(dyb, xb, weight, rb)
        dweight += dwb
    return dx, dweight.to(weight.dtype)


def _fake_backward(dy: Tensor, x: Tensor, weight: Tensor, r: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(weight)


@torch.library.custom_op("autosp::rms_norm_backward", mutates_args=())
def rms_norm_backward(dy: Tensor, x: Tensor, weight: Tensor, r: Tensor) -> tuple[Tensor, Tensor]:
    """(gradient of the input, of the weight) from the saved input and reciprocal RMS."""
    return _backward(dy, x, weight, r)


rms_norm_backward.register_fake(_fake_backward)


def _setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _grad(ctx, dy: Tensor, _dr: Tensor):  # type: ignore[no-untyped-def]
    x, weight, r = ctx.saved_tensors
    dx, dweight = torch.ops.autosp.rms_norm_backward(dy, x, weight, r)
    return dx, dweight, None


rms_norm_op.register_autograd(_grad, setup_context=_setup)


def fused_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """What the rewritten graph calls (an FX target is a plain function)."""
    return torch.ops.autosp.rms_norm(x, weight, eps)[0]


# ------------------------------------------------------------------------------ the graph rewrite

def _call(n: fx.Node, method: str | None = None, fn: object = None) -> bool:
    if method is not None:
        return n.op == "call_method" and n.target == method
    return n.op == "call_function" and n.target is fn


def _value(a: object) -> object:
    return a.meta.get("example_value") if isinstance(a, fx.Node) else a


def _only_user(n: fx.Node) -> fx.Node | None:
    return next(iter(n.users)) if len(n.users) == 1 else None


def match_rms_norm(r: fx.Node) -> tuple[fx.Node, fx.Node, float | fx.Node, list[fx.Node], fx.Node] | None:
    """From an ``rsqrt`` node: (input x, weight, eps, the chain's nodes, its output) where the
    chain is exactly an RMSNorm as Hugging Face writes it, else None."""
    if not _call(r, fn=torch.rsqrt):
        return None
    add = r.args[0]
    # eps: a constant, or a graph input where Dynamo lifted the float (dynamic shapes)
    if not (isinstance(add, fx.Node) and _call(add, fn=operator.add) and isinstance(add.args[1], (float, fx.Node))
            and not isinstance(_value(add.args[1]), Tensor)):
        return None
    mean = add.args[0]
    if not (isinstance(mean, fx.Node) and _call(mean, "mean") and tuple(mean.args[1:]) == (-1,)
            and mean.kwargs == {"keepdim": True}):
        return None
    pow_ = mean.args[0]
    if not (isinstance(pow_, fx.Node) and _call(pow_, "pow") and pow_.args[1] == 2):
        return None
    up = pow_.args[0]
    if not (isinstance(up, fx.Node) and _call(up, "to") and up.args[1:] == (torch.float32,) and not up.kwargs):
        return None
    mul = _only_user(r)
    if mul is None or not _call(mul, fn=operator.mul) or set(mul.args) != {up, r} or set(up.users) != {pow_, mul}:
        return None
    down = _only_user(mul)
    if down is None or not _call(down, "to") or len(down.args) != 2 or down.kwargs:
        return None
    x = up.args[0]
    value = _value(x)
    if not isinstance(x, fx.Node) or not isinstance(value, Tensor) or down.args[1] != value.dtype:
        return None
    out = _only_user(down)
    if out is None or not _call(out, fn=operator.mul) or out.args[1] is not down \
            or not isinstance(out.args[0], fx.Node):
        return None
    if any(_only_user(n) is None for n in (pow_, mean, add)):
        return None
    return x, out.args[0], add.args[1], [up, pow_, mean, add, r, mul, down, out], out


def fuse_rms_norms(gm: fx.GraphModule, where: Callable[[fx.Node], bool] = lambda n: True) -> int:
    """Replace every RMSNorm chain whose output node ``where`` accepts by one
    :func:`fused_rms_norm` call (keeping the output's metadata: its module, its layer's
    checkpointing); returns how many were replaced."""
    fused = 0
    for r in list(gm.graph.nodes):
        found = match_rms_norm(r)
        if found is None or not where(found[4]):
            continue
        x, weight, eps, chain, out = found
        with gm.graph.inserting_before(out):
            call = gm.graph.call_function(fused_rms_norm, (x, weight, eps))
        call.meta.update(out.meta)
        out.replace_all_uses_with(call)
        for n in reversed(chain):
            gm.graph.erase_node(n)
        fused += 1
    return finish_pass(gm, fused)


def fuse_layer_norms(gm: fx.GraphModule, layer_paths: list[str], fused: Callable[[int], bool]) -> dict[int, int]:
    """:func:`fuse_rms_norms` inside the layers ``fused(layer)`` names; returns layer -> norms fused."""
    from autosp.transform.tiled_mlp import _child_of_layer

    counts: dict[int, int] = {}

    def where(out: fx.Node) -> bool:
        found = _child_of_layer(out, layer_paths)
        if found is None or not fused(found[0]):
            return False
        counts[found[0]] = counts.get(found[0], 0) + 1
        return True

    fuse_rms_norms(gm, where)
    return counts
