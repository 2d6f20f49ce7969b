"""Tiled feed-forward: a layer's MLP run over chunks of this rank's tokens, recomputed per chunk.

Under SP the attention's activations shrink with the SP degree, but a layer's MLP still
makes ``tokens x intermediate`` tensors (gate, up, their activation and product, and
their gradients): at 688 intermediate features per 256 hidden they are the largest
activations of a Llama layer, and under checkpointing they are the recompute transient
that sets the step's peak. An MLP is token-local (each token's output depends on that
token alone), so it can run ``k`` token slices at a time: each chunk's intermediates are
made, reduced to the chunk's output and freed; backward recomputes them chunk by chunk.
Exact: every token sees the same ops; only the weight gradients' sums run in another order.

After the sharding pass, each child module of a transformer layer is a candidate region
(its nodes in the graph, by ``nn_module_stack``). A region is tiled when it is token-wise
by construction: only linear layers and pointwise ops, no sizes read or passed (a ``view``
to a shape would not survive chunking), one sequence-sharded tensor in, one out, at least
two matmuls (the intermediates lie between them). Attention, mixture-of-experts routing and norms are left alone.

The region becomes a submodule called once per chunk (``tensor_split`` in, ``cat`` out).
How each call recomputes (the input is cut by :func:`token_split`): with the eager compiler the submodule runs under
``torch.utils.checkpoint``; through AOTAutograd each call node carries the recompute tags
``torch.utils.checkpoint`` leaves under torch.compile (``MUST_RECOMPUTE`` and a checkpoint
id per chunk, or the layer's id when the whole layer is checkpointed), which AOTAutograd
copies onto every aten op of the call; its partitioner then saves only the chunk's input
and reorders the backward as the autograd engine would, so each chunk is recomputed just
before its own backward.
"""

from __future__ import annotations

import operator
import re
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from autosp.transform.graph_pass import finish_pass

# Token-wise by construction: linear layers and elementwise math (HF's activations among them).
_LINEAR = {torch._C._nn.linear, F.linear}
_POINTWISE_FUNCTIONS = {F.silu, F.gelu, F.relu, F.tanh, F.sigmoid, F.mish, F.softplus, F.leaky_relu, F.elu,
                        torch.tanh, torch.sigmoid, torch.relu, torch.pow, torch.mul, torch.add, torch.sub,
                        torch.exp, torch.erf, torch.sqrt, torch.rsqrt, torch._C._nn.gelu, torch._C._nn.silu,
                        operator.mul, operator.add, operator.sub, operator.truediv, operator.neg, operator.pow}
_POINTWISE_METHODS = {"to", "float", "half", "bfloat16", "type_as", "mul", "add", "sub", "div", "pow", "tanh",
                      "sigmoid", "exp", "neg", "relu"}
# Checkpoint ids of tiled chunks: far above any layer index, one per chunk.
_CHUNK_ID_BASE = 1 << 20


def _path(p: str) -> str:
    return re.sub(r"^L\['self'\]\.?", "", str(p))


def _child_of_layer(node: fx.Node, layer_paths: list[str]) -> tuple[int, str] | None:
    """(layer index, path of the layer's child module) a node runs inside, or None."""
    stack = [_path(p) for p, _ in (node.meta.get("nn_module_stack") or {}).values()]
    for i, p in enumerate(stack[:-1]):
        for li, name in enumerate(layer_paths):
            if p == name or p.endswith("." + name):
                return li, stack[i + 1]
    return None


def _token_wise(n: fx.Node) -> bool:
    if n.op == "call_function":
        ok = n.target in _LINEAR or n.target in _POINTWISE_FUNCTIONS
    elif n.op == "call_method":
        ok = n.target in _POINTWISE_METHODS
    else:
        return False
    # Sizes read or passed would be those of the whole shard, not of a chunk.
    return ok and not any(isinstance(a.meta.get("example_value"), (torch.SymInt, int)) for a in n.all_input_nodes)


def _regions(gm: fx.GraphModule, layer_paths: list[str]) -> list[tuple[int, list[fx.Node]]]:
    """Per layer child module, its nodes in graph order (only modules whose nodes are contiguous)."""
    groups: dict[str, tuple[int, list[fx.Node]]] = {}
    order: dict[fx.Node, int] = {}
    for i, n in enumerate(gm.graph.nodes):
        order[n] = i
        if n.op not in ("call_function", "call_method"):
            continue
        where = _child_of_layer(n, layer_paths)
        if where is not None:
            groups.setdefault(where[1], (where[0], []))[1].append(n)
    out = []
    for layer, nodes in groups.values():
        if order[nodes[-1]] - order[nodes[0]] + 1 == len(nodes):
            out.append((layer, nodes))
    return out


def _without_param_gathers(nodes: list[fx.Node]) -> list[fx.Node]:
    """The region without ZeRO 3's parameter gathers (read where the MLP reads its weights): they
    move before it, so the chunks read the gathered weights as they read any weight."""
    gather = torch.ops.autosp.gather_shards.default if hasattr(torch.ops.autosp, "gather_shards") else None
    moved = [n for n in nodes if n.target is gather or (n.target is operator.getitem and
                                                        getattr(n.args[0], "target", None) is gather)]
    if not moved:
        return nodes
    rest = [n for n in nodes if n not in set(moved)]
    for n in moved:                 # they read only the parameters' shards (placeholders)
        rest[0].prepend(n)
    return rest


def _tileable(nodes: list[fx.Node]) -> tuple[fx.Node, fx.Node, int] | None:
    """(the sequence-sharded input, the output, the sequence dim) of a region that may run in chunks."""
    inside = set(nodes)
    # Two matmuls at least: an MLP's intermediates lie between them (one linear layer alone has
    # nothing inside to free, and tiling it would only recompute it).
    if not all(_token_wise(n) for n in nodes) or sum(n.target in _LINEAR for n in nodes) < 2:
        return None
    outside_in = {a for n in nodes for a in n.all_input_nodes if a not in inside}
    seq_in = [a for a in outside_in if a.meta.get("autosp_seq")]
    if len(seq_in) != 1:
        return None
    # Everything else that enters must be static-shaped: weights and biases, nothing with tokens.
    if not all(_static(a) for a in outside_in - set(seq_in)):
        return None
    outs = [n for n in nodes if any(u not in inside for u in n.users)]
    x = seq_in[0]
    if len(outs) != 1 or len(x.meta["autosp_seq"]) != 1 or outs[0].meta.get("autosp_seq") != x.meta["autosp_seq"]:
        return None
    return x, outs[0], x.meta["autosp_seq"][0]


def _static(a: fx.Node) -> bool:
    v = a.meta.get("example_value")
    return isinstance(v, torch.Tensor) and not any(isinstance(d, torch.SymInt) for d in v.shape)


def _extract(gm: fx.GraphModule, nodes: list[fx.Node], x: fx.Node, out: fx.Node) -> tuple[fx.GraphModule, list]:
    """The region as its own GraphModule: (module, its external inputs, x first)."""
    inside = set(nodes)
    ext = [x] + list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside and a is not x))
    g = fx.Graph()
    env = {a: g.placeholder(f"in_{i}") for i, a in enumerate(ext)}
    for n in nodes:
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(env[out])
    return fx.GraphModule(gm, g), ext


def token_split(x: torch.Tensor, chunks: int, dim: int) -> tuple[torch.Tensor, ...]:
    """``x`` in exactly ``chunks`` slices along ``dim`` (some empty when it holds fewer tokens).

    ``split`` with sizes, not ``tensor_split``: the backward of a split is one ``cat`` of the
    chunks' gradients, where each slice of a ``tensor_split`` would scatter its gradient into a
    zero tensor the size of the whole shard."""
    n = x.shape[dim]
    return torch.split(x, [(n * (c + 1)) // chunks - (n * c) // chunks for c in range(chunks)], dim)


class CheckpointedChunk(torch.nn.Module):
    """One chunk's call of a tiled region, its intermediates recomputed in backward (eager)."""

    def __init__(self, region: torch.nn.Module):
        super().__init__()
        self.region = region

    def forward(self, *args: Any) -> Any:
        return checkpoint(self.region, *args, use_reentrant=False)


def _mark_second_part(gm: fx.GraphModule, first: fx.Node, split: fx.Node, layer: int, layer_paths: list[str]) -> None:
    """Mark the layer's nodes from its MLP block on (the norm before the MLP, if any, then the
    MLP and the residual after it) as the layer's second part: under full checkpointing it is its
    own recompute region (:func:`autosp.transform.checkpointing.tag_for_recompute`), so the MLP
    chunks are recomputed from the block's saved input without the attention's recompute alive."""
    nodes = list(gm.graph.nodes)
    at = nodes.index(split)
    before = [n for n in nodes[:at] if n.op in ("call_function", "call_method") and n.meta.get("nn_module_stack")]
    start = split
    if before:
        where = _child_of_layer(before[-1], layer_paths)
        run = [n for n in before if _child_of_layer(n, layer_paths) == where]
        # a norm (no matmul) right before the MLP belongs to the MLP's part
        if where is not None and where[0] == layer and not any(n.target in _LINEAR for n in run):
            start = run[0]
    for n in nodes[nodes.index(start):]:
        where = _child_of_layer(n, layer_paths) if n.meta.get("nn_module_stack") else (layer, "")
        stack = [_path(p) for p, _ in (n.meta.get("nn_module_stack") or {}).values()]
        in_layer = where is not None and where[0] == layer or any(
            p == layer_paths[layer] or p.endswith("." + layer_paths[layer]) for p in stack)
        if not in_layer:
            break
        n.meta["autosp_second_part"] = True


def tile_mlps(gm: fx.GraphModule, chunks: int | Callable[[int], int], layer_paths: list[str], *, aot: bool,
              mode_of: Callable[[int], str] = lambda i: "none", own_region: Callable[[int], bool] = lambda i: True,
              record: dict[int, int] | None = None) -> int:
    """Run every tileable layer child of ``gm`` over ``chunks`` token slices (or ``chunks(layer)``
    for each layer); returns how many were tiled.

    ``aot``: tag the chunk calls for AOTAutograd's partitioner (else wrap them in checkpoint);
    ``mode_of(layer)``: the layer's checkpointing (under ``full`` the chunks share its id);
    ``own_region(layer)``: under ``full``, the MLP block (from the norm before it) recomputes as a
    region of its own, its input kept, else with the whole layer from the layer's input;
    ``record``: filled with layer index -> chunks, for the report."""
    chunks_of = chunks if callable(chunks) else (lambda layer: chunks)
    tiled = 0
    for layer, nodes in _regions(gm, layer_paths):
        chunks = chunks_of(layer)
        nodes = _without_param_gathers(nodes) if chunks > 1 else nodes
        found = _tileable(nodes) if chunks > 1 else None
        if found is None:
            continue
        x, out, dim = found
        region, ext = _extract(gm, nodes, x, out)
        name = f"autosp_tiled_{tiled}"
        gm.add_submodule(name, region if aot else CheckpointedChunk(region))
        meta = {k: v for k, v in nodes[0].meta.items() if k in ("nn_module_stack", "stack_trace", "source_fn_stack")}
        with gm.graph.inserting_before(nodes[0]):
            parts = gm.graph.call_function(token_split, (x, chunks, dim))
            parts.meta.update(meta)
            outs = []
            for c in range(chunks):
                xc = gm.graph.call_function(operator.getitem, (parts, c))
                call = gm.graph.call_module(name, (xc, *ext[1:]))
                xc.meta.update(meta)
                call.meta.update(meta)
                if aot:
                    call.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                    full = mode_of(layer) == "full"
                    call.meta["ac_graph_id"] = 2 * layer + int(own_region(layer)) if full else \
                        _CHUNK_ID_BASE + tiled * chunks + c
                outs.append(call)
            joined = gm.graph.call_function(torch.cat, (outs,), {"dim": dim})
            joined.meta.update(meta)
            joined.meta["autosp_seq"] = out.meta["autosp_seq"]
            if aot and mode_of(layer) != "full":
                # Kept (one hidden state): else recomputing the residual stream after the MLP
                # (selective checkpointing, or the partitioner's own choice) recomputes every
                # chunk at once at the start of the layer's backward, all their intermediates
                # alive together. Full checkpointing keeps the layer's output instead.
                joined.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                joined.meta["ac_graph_id"] = _CHUNK_ID_BASE + tiled * chunks + chunks
        out.replace_all_uses_with(joined)
        if mode_of(layer) == "full" and own_region(layer):
            _mark_second_part(gm, nodes[0], parts, layer, layer_paths)
        if record is not None:
            record[layer] = chunks
        for n in reversed(nodes):
            gm.graph.erase_node(n)
        tiled += 1
    return finish_pass(gm, tiled)
