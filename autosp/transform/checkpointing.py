"""Activation checkpointing applied inside the sharded graph, per layer, as planned.

Modes (the planner's, see :mod:`autosp.costmodel.memory`):
  none       autograd keeps what it keeps
  selective  recompute the cheap ops of a layer in backward; keep the outputs of its
             matmuls, attention kernels and collectives (never communicate twice)
  full       keep only the layer's inputs; recompute its whole forward in backward
             (the collectives too: the recompute runs in the same order on every rank)

How, with the eager compiler: the sharded graph is split at transformer-layer boundaries
(each node knows its module from Dynamo's ``nn_module_stack``), and each checkpointed
layer's piece runs under ``torch.utils.checkpoint`` (non-reentrant; ``selective`` with a
policy of torch's selective-checkpoint contexts). Through AOTAutograd (``aot_eager``,
``inductor``): each node of a checkpointed layer is tagged with a recompute policy and
its layer's checkpoint id (``node.meta["recompute"]``, ``["ac_graph_id"]``, the tags
``torch.utils.checkpoint`` leaves under torch.compile); AOTAutograd copies them onto the
aten ops each node becomes, and its partitioner saves or recomputes accordingly. Under
``full`` a layer's output is kept (as the region's output is under torch.utils.checkpoint),
and with a tiled MLP (:mod:`autosp.transform.tiled_mlp`) the MLP block is a region of its
own where ``LayerChoice.keep_mlp_input`` says so. The user never wraps layers and nothing in torch is replaced process-wide.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from autosp.errors import AutospError

MODES = ("none", "selective", "full")
# aten ops whose outputs selective checkpointing keeps: expensive to recompute.
_KEEP = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_dot_product_flash_attention_for_cpu",
         "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
         "_scaled_dot_product_cudnn_attention", "scaled_dot_product_attention"}


def check_modes(modes: str | list[str]) -> None:
    for m in [modes] if isinstance(modes, str) else modes:
        if m not in MODES:
            raise AutospError(f"unknown checkpointing '{m}'; use one of {', '.join(MODES)}")


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    name = op._schema.name.split("::")[-1] if hasattr(op, "_schema") else ""
    namespace = op._schema.name.split("::")[0] if hasattr(op, "_schema") else ""
    if namespace == "autosp" or name in _KEEP:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _layer_of(node: fx.Node, layer_paths: list[str]) -> int | None:
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        for i, name in enumerate(layer_paths):
            if path == name or path.endswith("." + name):
                return i
    return None


def _partitions(gm: fx.GraphModule, layer_paths: list[str]) -> dict[fx.Node, int]:
    """Per node: 2 x layer + 1 inside a layer, an even number between layers. Nodes the sharding
    pass inserted (no module stack) stay with the node before them."""
    part: dict[fx.Node, int] = {}
    current, outside = 0, 0
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output", "get_attr"):
            continue
        layer = _layer_of(n, layer_paths) if n.meta.get("nn_module_stack") else None
        if layer is not None:
            current = 2 * layer + 1                    # odd partitions: layers
        elif n.meta.get("nn_module_stack"):
            if current % 2:                            # left a layer: the next outside piece
                outside = current + 1
            current = outside
        part[n] = current
    return part


def tag_for_recompute(gm: fx.GraphModule, layer_paths: list[str], mode_of: Callable[[int], str]) -> int:
    """Tag the nodes of each checkpointed layer for AOTAutograd's partitioner; returns how many.

    ``full``: every node of the layer is recomputed in backward (only what enters it is saved).
    ``selective``: the outputs of matmuls, attention and autosp's collectives are saved, the rest
    recomputed."""
    tagged = 0
    part = _partitions(gm, layer_paths)
    for n, p in part.items():
        mode = mode_of(p // 2) if p % 2 else "none"
        # call_method nodes too: a ``.transpose()`` or ``.reshape()`` left untagged would be where
        # the partitioner cuts, saving the projections it feeds instead of the layer's input.
        if mode == "none" or n.op not in ("call_function", "call_method") or "recompute" in n.meta:
            continue                # (already tagged: a tiled chunk, see tiled_mlp.py)
        if _random(n.target):       # a recomputed draw would need the RNG state replayed: kept instead
            policy = CheckpointPolicy.MUST_SAVE
        elif mode == "full" and any(part.get(u, p) != p for u in n.users):
            # The layer's output (read by the next layer, the final norm, the head): kept, as
            # torch.utils.checkpoint keeps the output of the region it wraps. Recomputed, it
            # would drag the whole layer's forward (and its activations) into the backward of
            # whatever reads it first.
            policy = CheckpointPolicy.MUST_SAVE
        elif mode == "full":
            policy = CheckpointPolicy.MUST_RECOMPUTE
        else:
            policy = CheckpointPolicy.MUST_SAVE if _expensive(n.target) else CheckpointPolicy.PREFER_RECOMPUTE
        n.meta["recompute"] = policy
        # A tiled MLP's part of a fully checkpointed layer is a region of its own (tiled_mlp.py):
        # the boundary between the two (the attention block's output) is kept.
        n.meta["ac_graph_id"] = 2 * (p // 2) + (1 if mode == "full" and n.meta.get("autosp_second_part") else 0)
        tagged += 1
    return tagged


def _random(target: Any) -> bool:
    name = getattr(target, "__name__", "") or str(target)
    return any(word in name for word in ("dropout", "rand", "bernoulli", "normal_", "uniform_"))


def _expensive(target: Any) -> bool:
    """A Dynamo-graph call whose output selective checkpointing keeps."""
    name = getattr(target, "__name__", "") or str(target)
    module = getattr(target, "__module__", "") or ""
    return name in _KEEP or module.startswith("autosp") or "autosp" in str(target)


def apply_checkpointing(gm: fx.GraphModule, layer_paths: list[str], mode_of: Callable[[int], str]) -> fx.GraphModule:
    """``gm`` with each layer whose ``mode_of(layer index)`` is not ``none`` run under checkpoint.

    ``layer_paths`` are the qualified names of the model's transformer layers, in order."""
    part = _partitions(gm, layer_paths)
    layers_here = sorted({p // 2 for p in part.values() if p % 2})
    if not any(mode_of(i) != "none" for i in layers_here):
        return gm
    split = split_module(gm, None, lambda n: part[n], keep_original_order=True)
    for n in split.graph.nodes:
        if n.op == "call_module" and n.target.startswith("submod_"):
            p = int(n.target.split("_")[1])
            if p % 2 and mode_of(p // 2) != "none":
                setattr(split, n.target, Checkpointed(getattr(split, n.target), mode_of(p // 2)))
    return split


class Checkpointed(torch.nn.Module):
    """One layer's piece of the graph, run under activation checkpointing."""

    def __init__(self, layer: torch.nn.Module, mode: str):
        super().__init__()
        self.layer, self.mode = layer, mode

    def forward(self, *args: Any) -> Any:
        if self.mode == "full":
            return checkpoint(self.layer, *args, use_reentrant=False)
        return checkpoint(self.layer, *args, use_reentrant=False,
                          context_fn=functools.partial(create_selective_checkpoint_contexts, _policy))
