"""Refusals that name the sequence mixer: a layer that mixes tokens other than by attention.

Linear-attention and state-space hybrids (Qwen3-Next's gated DeltaNet, Mamba-2 in Bamba, Jamba,
Granite 4.0-H, MiniMax's lightning attention) mix tokens with a short causal convolution and a
scan or recurrence over the sequence. On a sequence split over ranks each of those needs what
the ranks before it hold (a halo of the last k-1 tokens, the state entering its first token),
which autosp does not exchange yet. The sharding pass refuses the first op that works along the
sharded sequence; inside such a layer that op is a detail (a slice, a pad, a cumulative sum), so
:func:`name_the_mixer` says what the user can act on: which layer, of which type, what kind of
token mixing it met, and what runs instead.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch.fx as fx

from autosp.errors import AutospError

CONVOLUTIONS = {"conv1d", "conv2d", "conv3d", "convolution", "conv_transpose1d"}

# what an op along the sequence is, in the words of the layers that run it
_KINDS = [
    (CONVOLUTIONS, "runs a convolution along the sequence (a short causal conv1d, as Mamba-2 and gated "
                   "DeltaNet layers run before their scan)"),
    ({"pad"}, "pads the sequence (what a causal convolution does before it)"),
    ({"cumsum", "cumprod", "logcumsumexp", "cummax", "cummin"},
     "runs a cumulative op along the sequence (a scan or recurrence)"),
    ({"split", "chunk", "tensor_split", "unbind", "narrow"}, "cuts the sequence into chunks (a chunked scan)"),
    ({"getitem"}, "slices the sequence (a causal convolution's trim, or a scan stepping through tokens)"),
]


def _path(raw: str) -> str:
    """``L['self'].model.layers[0].mixer`` -> ``model.layers.0.mixer``."""
    raw = re.sub(r"^L\['self'\]\.?", "", raw)
    return re.sub(r"\[(\d+)\]", r".\1", raw)


def mixer_of(n: fx.Node) -> tuple[str, str] | None:
    """(path, type name) of the block's child module ``n`` runs in (the block itself where ``n``
    is its own op), or None outside a numbered block."""
    stack = [(_path(p), getattr(t, "__name__", str(t))) for p, t in (n.meta.get("nn_module_stack") or {}).values()]
    for i, (p, _) in enumerate(stack):
        if re.search(r"\.\d+$", p):
            return stack[i + 1] if i + 1 < len(stack) else stack[i]
    return None


def name_the_mixer(n: fx.Node, error: AutospError, op: str, where: str, attention_modules: set[str]) -> AutospError:
    """``error`` (the pass's refusal of ``op`` at ``n``) said of the layer it met, where ``n`` runs
    inside a block's module that has no attention op; else ``error`` as it is."""
    mixer = mixer_of(n)
    if mixer is None or any(a == mixer[0] or a.startswith(mixer[0] + ".") for a in attention_modules):
        return error
    what = next((w for ops, w in _KINDS if op in ops), f"runs {op} along the sequence")
    where = _model_line(n) or where
    path, kind = mixer
    return AutospError(
        f"layer {path} ({kind}) mixes tokens in a way autosp cannot shard yet: it {what} ({op} at {where}). "
        "autosp shards softmax attention (SDPA or written out) on a split sequence, not the convolutions and "
        "scans of linear-attention or state-space layers; train this model without SP (DP or ZeRO over the "
        "ranks, a mesh with SP 1)")


def _model_line(n: fx.Node) -> str:
    """The innermost line of the stack outside torch itself: the model's, not ``F.pad``'s."""
    st = n.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in st.strip().splitlines()
             if ln.strip().startswith("File") and f"{os.sep}torch{os.sep}" not in ln]
    return lines[-1] if lines else ""


def module_paths(nodes: Any) -> set[str]:
    """The modules the attention ops among ``nodes`` run in."""
    return {m[0] for n in nodes if (m := mixer_of(n)) is not None}
