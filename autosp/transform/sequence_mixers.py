"""Layers that mix tokens other than by attention: found in the graph, run on the whole sequence.

Linear-attention and state-space hybrids (Qwen3-Next's gated DeltaNet, Mamba-2 in Bamba, Jamba,
Granite 4.0-H, MiniMax's lightning attention) mix tokens with a short causal convolution and a
scan or recurrence over the sequence. On a sequence split over ranks each of those needs what
the ranks before it hold (a halo of the last k-1 tokens, the state entering its first token).

Kinds of sequence mixer autosp runs (the ``kind`` of :class:`MixerRun`):

  gathered   the layer's module (a child of a numbered block with no attention op, that runs a
             convolution, a pad, a cumulative op or a slice along the sequence) runs on the whole
             sequence on every rank: its sharded inputs are all-gathered where they enter it
             (:func:`autosp.strategies.layout.gather_seq`), its output is sliced back to this
             rank's tokens where a sharded op reads it. Backward, the gradient of each gathered
             input is summed over the group before each rank keeps its tokens' part
             (:func:`autosp.transform.replicated.sum_grad`): every rank back-propagates only
             through its own tokens' outputs, so the parts add up to the whole gradient, and the
             layer's parameters get partial gradients like every sharded layer's. Exact for any
             mixer; its compute and activations are those of one device (not divided by SP), its
             traffic an all-gather of its input and an all-reduce of that input's gradient.

Not built: mixers sharded on the sequence (a conv halo, a scan whose state passes rank to rank).

An op along the sharded sequence outside such a module (in the block itself) is refused:
:func:`name_the_mixer` says which layer, of which type, what kind of token mixing it met, and
what runs instead.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch

import torch.fx as fx

from autosp.errors import AutospError

CONVOLUTIONS = {"conv1d", "conv2d", "conv3d", "convolution", "conv_transpose1d"}
SCANS = {"cumsum", "cumprod", "logcumsumexp", "cummax", "cummin"}
_SPLITS = {"split", "chunk", "tensor_split", "unbind", "narrow"}
GATHERED = "gathered"

# what an op along the sequence is, in the words of the layers that run it
_KINDS = [
    (CONVOLUTIONS, "runs a convolution along the sequence (a short causal conv1d, as Mamba-2 and gated "
                   "DeltaNet layers run before their scan)"),
    ({"pad"}, "pads the sequence (what a causal convolution does before it)"),
    (SCANS,
     "runs a cumulative op along the sequence (a scan or recurrence)"),
    (_SPLITS, "cuts the sequence into chunks (a chunked scan)"),
    ({"getitem"}, "slices the sequence (a causal convolution's trim, or a scan stepping through tokens)"),
]


def _path(raw: str) -> str:
    """``L['self'].model.layers[0].mixer`` -> ``model.layers.0.mixer``."""
    raw = re.sub(r"^L\['self'\]\.?", "", raw)
    return re.sub(r"\[(\d+)\]", r".\1", raw)


def _block_and_child(n: fx.Node) -> tuple[tuple[str, str], tuple[str, str] | None] | None:
    """((path, type) of the numbered block ``n`` runs in, that of its child ``n`` runs in or None
    where ``n`` is the block's own op), or None outside every numbered block."""
    stack = [(_path(p), getattr(t, "__name__", str(t))) for p, t in (n.meta.get("nn_module_stack") or {}).values()]
    for i, (p, _) in enumerate(stack):
        if re.search(r"\.\d+$", p):
            return stack[i], stack[i + 1] if i + 1 < len(stack) else None
    return None


def mixer_of(n: fx.Node) -> tuple[str, str] | None:
    """(path, type name) of the block's child module ``n`` runs in (the block itself where ``n``
    is its own op), or None outside a numbered block."""
    found = _block_and_child(n)
    return None if found is None else found[1] or found[0]


@dataclass
class MixerRun:
    """How one sequence mixer ran (read by the report and the tests)."""

    layer: str              # its module path, e.g. model.layers.0.linear_attn
    type: str               # its module class
    kind: str               # GATHERED
    ops: int                # graph ops it runs
    trigger: str            # the first op that mixes along the sequence, and where


def block_child(n: fx.Node) -> tuple[str, str] | None:
    """(path, type) of the child module of a numbered block that ``n`` runs in; None where ``n``
    runs in the block itself or outside every block."""
    found = _block_and_child(n)
    return None if found is None else found[1]


def _along(n: fx.Node, seq_dims: Callable[[Any], tuple[int, ...]]) -> bool:
    """Whether ``n`` mixes entries along a sequence dim of its first input (symbolic dims: this
    runs before placement, on the traced shapes)."""
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    src = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
    v = src.meta.get("example_value") if src is not None else None
    if not isinstance(v, torch.Tensor):
        return False
    dims, ndim = set(seq_dims(v)), v.dim()
    if not dims:
        return False
    if name in CONVOLUTIONS:
        return bool(dims & set(range(2, ndim)))
    if name == "pad":
        pads = n.args[1] if len(n.args) > 1 else n.kwargs.get("pad", ())
        return bool(dims & {ndim - 1 - i // 2 for i, p in enumerate(pads) if not (isinstance(p, int) and p == 0)})
    if name in SCANS or name in _SPLITS:
        dim = n.kwargs.get("dim", n.args[2 if name in ("split", "chunk", "tensor_split") else 1]
                           if len(n.args) > (2 if name in ("split", "chunk", "tensor_split") else 1) else 0)
        return isinstance(dim, int) and dim % ndim in dims
    if name == "getitem":
        idx = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
        if any(i is Ellipsis or i is None for i in idx):
            return False     # rare in mixers; the pass's own check reads these
        return any(d < len(idx) and not (isinstance(idx[d], slice) and idx[d] == slice(None)) for d in dims)
    return False


def gathered_mixers(graph: fx.Graph, seq_dims: Callable[[Any], tuple[int, ...]],
                    attention_modules: set[str], token_local: set[str]) -> tuple[dict[fx.Node, str], list[MixerRun]]:
    """The ops of every sequence mixer this graph runs gathered (node -> its module path), and one
    :class:`MixerRun` per mixer. A mixer is a child of a numbered block holding no attention op and
    no token-local (expert) module, in which some op works along the sequence."""
    by_child: dict[tuple[str, str], list[fx.Node]] = {}
    for n in graph.nodes:
        if n.op in ("call_function", "call_method") and (child := block_child(n)) is not None:
            by_child.setdefault(child, []).append(n)
    nodes: dict[fx.Node, str] = {}
    runs: list[MixerRun] = []
    for (path, kind), ops in by_child.items():
        if any(a == path or a.startswith(path + ".") for a in attention_modules | token_local):
            continue
        trigger = next((n for n in ops if _along(n, seq_dims)), None)
        if trigger is None:
            continue
        nodes.update((n, path) for n in ops)
        name = trigger.target if isinstance(trigger.target, str) else getattr(trigger.target, "__name__", "?")
        runs.append(MixerRun(path, kind, GATHERED, len(ops), f"{name} at {_model_line(trigger) or trigger.name}"))
    return nodes, runs


def name_the_mixer(n: fx.Node, error: AutospError, op: str, where: str, attention_modules: set[str]) -> AutospError:
    """``error`` (the pass's refusal of ``op`` at ``n``) said of the layer it met, where ``n`` runs
    inside a block's module that has no attention op, or is a token-mixing op in the block's own
    forward (which holds the attention call, as a hand-written block does); else ``error`` as it is."""
    mixer = mixer_of(n)
    what = next((w for ops, w in _KINDS if op in ops), None)
    in_block = block_child(n) is None and what is not None and op != "getitem"
    if mixer is None or (not in_block and any(a == mixer[0] or a.startswith(mixer[0] + ".")
                                              for a in attention_modules)):
        return error
    what = what or f"runs {op} along the sequence"
    where = _model_line(n) or where
    path, kind = mixer
    return AutospError(
        f"layer {path} ({kind}) mixes tokens in a way autosp cannot shard: it {what} ({op} at {where}). "
        "autosp shards softmax attention on a split sequence and runs a layer's other token mixing (a "
        "convolution, a scan) on the gathered sequence when it sits in a submodule of the layer with no "
        "attention in it; move that code into such a submodule, or train this model without SP (DP or "
        "ZeRO over the ranks, a mesh with SP 1)")


def _model_line(n: fx.Node) -> str:
    """The innermost line of the stack outside torch itself: the model's, not ``F.pad``'s."""
    st = n.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in st.strip().splitlines()
             if ln.strip().startswith("File") and f"{os.sep}torch{os.sep}" not in ln]
    return lines[-1] if lines else ""


def module_paths(nodes: Any) -> set[str]:
    """The modules the attention ops among ``nodes`` run in."""
    return {m[0] for n in nodes if (m := mixer_of(n)) is not None}
