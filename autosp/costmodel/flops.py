"""Op classification and FLOP counts for aten ops of a captured training graph.

FLOPs are counted for the tensor-core work only: matmuls and attention. One
multiply-add is 2 FLOPs. Pointwise, norm and loss ops are costed by the bytes
they move (see :mod:`autosp.planner.opgraph`).

Attention convention (written down because peers differ):
  forward  = 4 * B * H * Lq * Lk * D      (QK^T and PV, 2 FLOPs per MAC)
  backward = 2 * forward                  (dQ, dK, dV, dP: four matmuls)
  causal   = half of both, because the kernels skip the masked upper triangle.
torch's flop_counter counts 0 for the CPU flash kernel, hence our own count.
"""

from __future__ import annotations

import enum
from typing import Any, Sequence


class OpKind(str, enum.Enum):
    MATMUL = "matmul"
    ATTENTION = "attention"
    NORM = "norm"
    POINTWISE = "pointwise"
    REDUCTION = "reduction"
    EMBEDDING = "embedding"
    LOSS = "loss"
    VIEW = "view"
    COLLECTIVE = "collective"
    CREATION = "creation"
    OTHER = "other"


_VIEW_OPS = {
    "view", "_unsafe_view", "t", "transpose", "permute", "unsqueeze", "squeeze", "expand",
    "slice", "select", "alias", "detach", "as_strided", "split", "split_with_sizes",
    "unbind", "chunk", "reshape", "narrow", "sym_size", "sym_numel", "sym_stride",
    "lift_fresh_copy", "unflatten", "flatten", "view_as", "expand_as", "diagonal",
}
_MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addbmm", "dot", "mv"}
_NORM_OPS = {"native_layer_norm", "native_layer_norm_backward", "rms_norm", "_fused_rms_norm",
             "_fused_rms_norm_backward", "layer_norm", "native_group_norm", "native_group_norm_backward",
             "native_batch_norm", "native_batch_norm_backward"}
_LOSS_OPS = {"nll_loss_forward", "nll_loss_backward", "nll_loss", "nll_loss2d_forward",
             "nll_loss2d_backward", "_log_softmax", "_log_softmax_backward_data", "cross_entropy_loss"}
_EMBEDDING_OPS = {"embedding", "embedding_dense_backward", "embedding_backward"}
_REDUCTION_OPS = {"sum", "mean", "amax", "amin", "max", "min", "var", "std", "norm", "logsumexp",
                  "_softmax", "_softmax_backward_data", "cumsum", "prod", "argmax", "argmin"}
_CREATION_OPS = {"arange", "zeros", "ones", "full", "empty", "zeros_like", "ones_like", "full_like",
                 "empty_like", "scalar_tensor", "empty_strided", "new_zeros", "new_ones", "new_empty",
                 "new_full", "randn", "rand", "tensor"}


def op_name(target: Any) -> str:
    """``aten.mm.default`` -> ``mm``; python callables keep their ``__name__``."""
    name = getattr(target, "__name__", str(target))
    if hasattr(target, "_schema"):            # OpOverload
        name = target._schema.name.split("::")[-1]
    return name.split(".")[0]


def classify(target: Any) -> OpKind:
    text = str(target)
    name = op_name(target)
    if "scaled_dot_product" in name or "flash_attention" in name or "efficient_attention" in name:
        return OpKind.ATTENTION
    if "c10d" in text or "autosp." in text:
        return OpKind.COLLECTIVE
    if name in _MATMUL_OPS:
        return OpKind.MATMUL
    if name in _VIEW_OPS:
        return OpKind.VIEW
    if name in _NORM_OPS:
        return OpKind.NORM
    if name in _LOSS_OPS:
        return OpKind.LOSS
    if name in _EMBEDDING_OPS:
        return OpKind.EMBEDDING
    if name in _REDUCTION_OPS:
        return OpKind.REDUCTION
    if name in _CREATION_OPS:
        return OpKind.CREATION
    if name in ("getitem",):
        return OpKind.VIEW
    return OpKind.POINTWISE


def _prod(xs: Sequence[Any]) -> Any:
    out = 1
    for x in xs:
        out = out * x
    return out


def attention_flops(q_shape: Sequence[Any], k_shape: Sequence[Any], causal: bool, backward: bool) -> Any:
    """FLOPs of one attention call; shapes are ``[..., heads, len, head_dim]``."""
    *batch, lq, d = q_shape
    lk = k_shape[-2]
    fwd = 4 * _prod(batch) * lq * lk * d
    if causal:
        fwd = fwd / 2
    return 2 * fwd if backward else fwd


def op_flops(target: Any, args: Sequence[Any], kwargs: dict[str, Any],
             out_shapes: Sequence[Sequence[Any]], arg_shapes: Sequence[Sequence[Any] | None]) -> Any:
    """FLOPs of one aten call. ``arg_shapes[i]`` is the shape of tensor arg ``i`` (or None)."""
    name = op_name(target)
    kind = classify(target)
    if kind == OpKind.MATMUL:
        if name in ("mm", "bmm", "matmul"):
            a, b = arg_shapes[0], arg_shapes[1]
        elif name in ("addmm", "baddbmm", "addbmm"):
            a, b = arg_shapes[1], arg_shapes[2]
        else:
            return 0
        if a is None or b is None:
            return 0
        # [..., M, K] @ [..., K, N] -> 2*M*N*K per batch element.
        return 2 * _prod(out_shapes[0]) * a[-1]
    if kind == OpKind.ATTENTION:
        backward = name.endswith("_backward")
        # Forward: (q, k, v, ...); backward: (grad_out, q, k, v, ...).
        q, k = (arg_shapes[1], arg_shapes[2]) if backward else (arg_shapes[0], arg_shapes[1])
        causal = kwargs.get("is_causal", _is_causal(args, backward))
        return attention_flops(q, k, bool(causal), backward)
    return 0


def _is_causal(args: Sequence[Any], backward: bool) -> bool:
    # Positional layout of the CPU flash kernel and its backward:
    #   fwd(query, key, value, dropout_p, is_causal, ...)
    #   bwd(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, ...)
    pos = 7 if backward else 4
    if len(args) > pos and isinstance(args[pos], bool):
        return args[pos]
    return False
