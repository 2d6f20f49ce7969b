"""Op classification and FLOP counts for aten ops of a captured training graph.

FLOPs are counted for the tensor-core work only: matmuls and attention. One
multiply-add is 2 FLOPs. Pointwise, norm and loss ops are costed by the bytes
they move (see :mod:`autosp.graph.opgraph`).

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
_MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addbmm", "dot", "mv",
               "_grouped_mm", "grouped_mm", "grouped_mm_fallback"}    # experts: [T, K] x [E, K, N]
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


# Lowest priority first: a name in two sets takes the later kind.
_KIND_OF = {name: kind for kind, ops in ((OpKind.CREATION, _CREATION_OPS), (OpKind.REDUCTION, _REDUCTION_OPS),
                                         (OpKind.EMBEDDING, _EMBEDDING_OPS), (OpKind.LOSS, _LOSS_OPS),
                                         (OpKind.NORM, _NORM_OPS), (OpKind.VIEW, _VIEW_OPS | {"getitem"}),
                                         (OpKind.MATMUL, _MATMUL_OPS)) for name in ops}


def classify(target: Any) -> OpKind:
    name = op_name(target)
    if "scaled_dot_product" in name or "flash_attention" in name or "efficient_attention" in name:
        return OpKind.ATTENTION
    if "c10d" in str(target) or "autosp." in str(target):
        return OpKind.COLLECTIVE
    return _KIND_OF.get(name, OpKind.POINTWISE)


def prod(xs: Sequence[Any]) -> Any:
    """Product of sizes (ints or symbolic expressions)."""
    out = 1
    for x in xs:
        out = out * x
    return out


def attention_flops(q_shape: Sequence[Any], k_shape: Sequence[Any], causal: bool, backward: bool) -> Any:
    """FLOPs of one attention call; shapes are ``[..., heads, len, head_dim]``."""
    *batch, lq, d = q_shape
    lk = k_shape[-2]
    fwd = 4 * prod(batch) * lq * lk * d
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
        elif "grouped_mm" in name:           # each routed token row meets one expert's [K, N]
            a, b = arg_shapes[0], arg_shapes[1]
            return 0 if a is None or b is None else 2 * a[0] * a[-1] * b[-1]
        else:
            return 0
        if a is None or b is None:
            return 0
        # [..., M, K] @ [..., K, N] -> 2*M*N*K per batch element.
        return 2 * prod(out_shapes[0]) * a[-1]
    if kind == OpKind.ATTENTION:
        backward = name.endswith("_backward")
        q, k = attention_operands(target, arg_shapes)
        return attention_flops(q, k, is_causal_call(target, args, kwargs), backward)
    return 0


def attention_operands(target: Any, arg_shapes: Sequence[Any]) -> tuple[Any, Any]:
    """Shapes of (q, k) of an attention call; backward calls take ``grad_out`` first."""
    if op_name(target).endswith("_backward"):
        return arg_shapes[1], arg_shapes[2]
    return arg_shapes[0], arg_shapes[1]


def is_causal_call(target: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    return bool(kwargs.get("is_causal", _is_causal(args, op_name(target).endswith("_backward"))))


def is_masked_call(target: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """An explicit mask is passed (keyword ``attn_mask`` on every fused kernel; 4th positional
    argument of ``scaled_dot_product_attention`` itself)."""
    if kwargs.get("attn_mask") is not None:
        return True
    return op_name(target) == "scaled_dot_product_attention" and len(args) > 3 and args[3] is not None


def _is_causal(args: Sequence[Any], backward: bool) -> bool:
    # Positional layout of the CPU flash kernel and its backward:
    #   fwd(query, key, value, dropout_p, is_causal, ...)
    #   bwd(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, ...)
    pos = 7 if backward else 4
    if len(args) > pos and isinstance(args[pos], bool):
        return args[pos]
    return False
