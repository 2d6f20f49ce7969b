"""Capture one training step (forward + backward) as an :class:`OpGraph`, on fake tensors.

How:
  1. build the model on the ``meta`` device (:mod:`autosp.graph.build`; no weights), keeping
     only a few of its repeated blocks when the family lets us rebuild it
     shallower (Hugging Face configs): identical layers are costed once;
  2. replace every parameter and buffer by a *fake* CPU tensor of the same
     shape and dtype, and make the sequence dim of the inputs symbolic (``S``);
  3. trace ``loss = model(...); grads = autograd.grad(loss, params)`` with
     ``make_fx``: one joint aten graph, forward then backward, whose shapes are
     expressions in ``S``;
  4. attribute every node to a block (forward hooks mark where each block's ops
     start and end; backward ops inherit the block of the forward op with the
     same autograd sequence number) and fingerprint blocks structurally.

Planning a 405B model at 128k tokens therefore allocates nothing but a vector
of token ids.
"""

from __future__ import annotations

import hashlib
import os
import traceback
from typing import Any

import networkx as nx
import sympy
import torch
import torch.nn as nn

from autosp.errors import AutospError
from autosp.graph.build import Built, build, count_params, fsdp_hooks_off
from autosp.graph.catalog import ModelSource
from autosp.graph.hf_compat import (attention_window, broadcast_kv_as_gqa, eager_experts_as_grouped,
                                    experts_as_compiled, pad_value_head_dim, polar_as_view, traced_as_exported,
                                    unpacked_positions)
from autosp.graph.inputs import InputSpec, parse_dtype, parse_input_spec
from autosp.graph.mixers import mark_gathered
from autosp.graph.opgraph import S, AttentionOp, LayerClass, OpGraph, OpNode, evaluate
from autosp.graph.ops import OpKind, attention_operands, classify, is_causal_call, is_masked_call, op_flops, prod
from autosp.graph.written_attention import fill_score_costs, find_written, roles, written_op

DEFAULT_LM_INPUTS = "input_ids:int64[B,S],labels:int64[B,S]"

# constant_pad_nd's fake kernel guards on concrete sizes, which would pin the symbolic
# sequence length (HF shifts labels with F.pad); its decomposition keeps it symbolic.
# baddbmm's (BLOOM's ALiBi scores) fake kernel takes no symbolic sizes; as bmm, mul and add it does.
_DECOMPOSITIONS = torch._decomp.get_decompositions([torch.ops.aten.constant_pad_nd, torch.ops.aten.baddbmm])


def capture(model: str | nn.Module | ModelSource, *, seq_len: int, batch_size: int = 1,
            dtype: str | torch.dtype = "bfloat16", inputs: str | None = None,
            max_layers: int | None = 2) -> OpGraph:
    """Trace one forward+backward step of ``model`` at ``[batch_size, seq_len]`` on fake tensors.

    ``model`` is a catalogue name, a config path, ``package.module:factory``, or a module.
    ``max_layers`` bounds how many repeated blocks of a Hugging Face model are traced
    (``None`` traces all); the rest are represented by their layer class.
    """
    if not isinstance(seq_len, int) or seq_len <= 0:
        raise AutospError(f"sequence length must be a positive integer, got {seq_len!r}; pass e.g. --seq-len 8192")
    if not isinstance(batch_size, int) or batch_size <= 0:
        raise AutospError(f"batch size must be a positive integer, got {batch_size!r}; pass e.g. --batch-size 1")
    torch_dtype = parse_dtype(dtype)
    with torch.enable_grad():          # a training step, whatever the caller's grad mode (eval loops)
        return _capture(model, seq_len, batch_size, torch_dtype, inputs, max_layers)


def _capture(model: Any, seq_len: int, batch_size: int, torch_dtype: torch.dtype, inputs: str | None,
             max_layers: int | None) -> OpGraph:
    built = build(model, torch_dtype, seq_len, max_layers)
    specs = parse_input_spec(inputs) if inputs else parse_input_spec(DEFAULT_LM_INPUTS)
    graph = _trace(built, specs, batch_size, seq_len, torch_dtype)
    if not graph.attention_nodes() and built.module.training:
        # Attention dropout sends SDPA off its fused kernel into ops that hide the attention;
        # the transform still shards it (each rank draws its own masks): plan it without dropout.
        built.module.eval()
        try:
            retry = _trace(built, specs, batch_size, seq_len, torch_dtype)
        finally:
            built.module.train()
        if retry.attention_nodes():
            retry.attention_dropout = True
            retry.notes.append("attention dropout hides the fused attention op while tracing; planned in "
                               "eval mode (without dropout)")
            return retry
    return graph


# --------------------------------------------------------------------------------------------
# tracing


def _trace(built: Built, specs: list[InputSpec], batch_size: int, seq_len: int,
           dtype: torch.dtype) -> OpGraph:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
    import torch.fx.traceback as fx_traceback

    module = built.module
    shape_env = ShapeEnv()
    fake_mode = FakeTensorMode(shape_env=shape_env)

    # Fake parameters and buffers on the CPU device (so SDPA takes the fused flash kernel,
    # as in a real run), one fake tensor per storage so tied weights stay tied.
    fakes: dict[int, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    with fake_mode:
        for name, p in list(module.named_parameters(remove_duplicate=False)) + \
                list(module.named_buffers(remove_duplicate=False)):
            if id(p) not in fakes:
                t = torch.empty(p.shape, dtype=p.dtype)
                if isinstance(p, nn.Parameter) and p.requires_grad:
                    t.requires_grad_(True)
                fakes[id(p)] = t
            state[name] = fakes[id(p)]
    params = [t for t in fakes.values() if t.requires_grad]

    # One symbol for the sequence length, shared by every input (a separate symbol per
    # input would be unified with guards that can collapse it into a constant).
    first = next(sp for sp in specs if sp.seq_dim is not None)
    seed = fake_mode.from_tensor(
        torch.zeros(first.shape(batch_size, seq_len), dtype=first.dtype),
        symbolic_context=StatelessSymbolicContext(
            dynamic_sizes=[DimDynamic.DYNAMIC if d == "S" else DimDynamic.STATIC for d in first.dims]))
    sym_s = seed.shape[first.seq_dim]
    seq_syms = {sym_s.node.expr}
    kwargs: dict[str, torch.Tensor] = {}
    with fake_mode:
        for spec in specs:
            shape = [sym_s if d == "S" else x for d, x in zip(spec.dims, spec.shape(batch_size, seq_len))]
            kwargs[spec.name] = seed if spec is first else torch.zeros(shape, dtype=spec.dtype)
    if built.is_hf:
        kwargs["use_cache"] = False

    # Marks are the last node traced so far (node identity survives later dead-code
    # elimination, positions do not).
    marks: dict[int, list[Any]] = {}
    boundary: list[Any] = []

    def last_node() -> Any:
        mode = get_proxy_mode()
        return next(reversed(mode.tracer.graph.nodes)) if mode is not None else None

    def enter(i: int) -> None:
        marks.setdefault(i, []).append(last_node())

    hooks = []   # hooks return None: a returned value would replace the block's input/output
    for i, block in enumerate(built.blocks):
        hooks.append(block.register_forward_pre_hook(lambda m, a, i=i: enter(i)))
        hooks.append(block.register_forward_hook(lambda m, a, o, i=i: enter(i)))
        for name, child in block.named_children():      # where a block's MLP runs (tiled MLPs are costed)
            hooks.append(child.register_forward_pre_hook(lambda m, a, k=(i, name): enter(k)))
            hooks.append(child.register_forward_hook(lambda m, a, o, k=(i, name): enter(k)))

    def step(params_in: list[torch.Tensor], kw: dict[str, torch.Tensor]):
        by_id = {id(p): q for p, q in zip(params, params_in)}
        call_state = {n: by_id.get(id(t), t) for n, t in state.items()}
        out = torch.func.functional_call(module, call_state, args=(), kwargs=kw, strict=False)
        loss = _loss_of(out)
        boundary.append(last_node())
        _tag_backward_with_forward_seq_nr(loss)
        grads = torch.autograd.grad(loss, params_in, allow_unused=True)
        return loss, [g for g in grads if g is not None]

    try:
        with fake_mode, fx_traceback.preserve_node_meta(), unpacked_positions(built.is_hf), broadcast_kv_as_gqa(), \
                pad_value_head_dim() as value_dims, polar_as_view(), experts_as_compiled(built.is_hf), \
                eager_experts_as_grouped(module), fsdp_hooks_off(module), traced_as_exported():
            gm = make_fx(step, tracing_mode="real", decomposition_table=_DECOMPOSITIONS)(params, kwargs)
    except AutospError:
        raise
    except Exception as e:  # noqa: BLE001 - turned into a one-line error naming where
        raise AutospError(_explain_trace_failure(built.name, e)) from e
    finally:
        for h in hooks:
            h.remove()

    seq_exprs = {shape_env.replace(s) for s in seq_syms}
    if not any(isinstance(s, sympy.Symbol) for s in seq_exprs):
        raise AutospError(f"model '{built.name}' turns the sequence length into a constant while tracing "
                          "(e.g. int(x.shape[1]) or a Python branch on it); keep sequence sizes as tensor shapes")
    canon = {s: S for s in seq_exprs | seq_syms if isinstance(s, sympy.Symbol)}
    return _to_opgraph(built, gm, shape_env, canon, marks, boundary[0], batch_size, seq_len, dtype, len(params),
                       value_dims)


def _position(node: Any, index: dict) -> int:
    """Position just after ``node`` in the final graph (walking back over erased nodes)."""
    while node is not None and node not in index:
        node = node._prev if node._prev is not node else None
    return index[node] + 1 if node is not None else 0


def _tag_backward_with_forward_seq_nr(loss: torch.Tensor) -> None:
    """Make every backward op traced for an autograd node carry that node's sequence number.

    The tracer stamps ``node.meta["seq_nr"]`` from ``fx_traceback``'s current grad_fn;
    the hooks set it while each autograd node runs, so backward ops map to the forward
    op (hence the block) they differentiate.
    """
    import torch.fx.traceback as fx_traceback

    seen, stack = set(), [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        nr = fn._sequence_nr()
        fn.register_prehook(lambda grads, nr=nr: fx_traceback.set_grad_fn_seq_nr(nr))
        fn.register_hook(lambda gi, go: fx_traceback.reset_grad_fn_seq_nr())
        stack.extend(f for f, _ in fn.next_functions)


def _loss_of(out: Any) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    if loss is None:
        loss = out[0] if isinstance(out, (tuple, list)) else out
        loss = getattr(loss, "logits", loss)
    if not isinstance(loss, torch.Tensor):
        raise AutospError(f"the model returned {type(out).__name__}; return a loss tensor, logits, or an object with .loss")
    return loss if loss.numel() == 1 else loss.float().mean()


def _explain_trace_failure(name: str, e: Exception) -> str:
    where = "unknown location"
    for frame in reversed(traceback.extract_tb(e.__traceback__)):
        f = frame.filename
        if os.sep + "torch" + os.sep not in f and os.sep + "autosp" + os.sep not in f:
            where = f"{f}:{frame.lineno} in {frame.name}"
            break
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return (f"model '{name}' cannot be captured as one graph: {type(e).__name__}: {msg[:200]} "
            f"(at {where}); remove data-dependent Python control flow there (e.g. .item(), if tensor:)")


# --------------------------------------------------------------------------------------------
# from the fx graph to the OpGraph


def _expr(x: Any, shape_env: Any, canon: dict) -> Any:
    if isinstance(x, torch.SymInt):
        return sympy.sympify(shape_env.replace(x.node.expr)).xreplace(canon)
    return int(x)


def _tensor_vals(val: Any) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [v for v in val if isinstance(v, torch.Tensor)]
    return []


def _to_opgraph(built: Built, gm: torch.fx.GraphModule, shape_env: Any, canon: dict,
                marks: dict[int, list[Any]], boundary_node: Any, batch_size: int, seq_len: int,
                dtype: torch.dtype, n_params: int, value_dims: list[Any] | None = None) -> OpGraph:
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    spans = {b: (_position(m[0], index), _position(m[-1], index)) for b, m in marks.items()
             if len(m) == 2 and isinstance(b, int)}
    # the children of a block called once: (block, child name) -> span
    child_spans = {k: (_position(m[0], index), _position(m[-1], index)) for k, m in marks.items()
                   if len(m) == 2 and isinstance(k, tuple)}

    def fwd_region(i: int) -> str | None:
        return next((name for (_, name), (lo, hi) in child_spans.items() if lo <= i < hi), None)
    boundary = _position(boundary_node, index)

    def fwd_block(i: int) -> int | None:
        for b, (lo, hi) in spans.items():
            if lo <= i < hi:
                return b
        return None

    config = getattr(built.module, "config", None)
    windows = [attention_window(b, config) if built.is_hf else 0 for b in built.blocks]
    seq_nr_block: dict[int, int | None] = {}
    seq_nr_region: dict[int, str | None] = {}
    for i, n in enumerate(nodes[:boundary]):
        nr = n.meta.get("seq_nr")
        if nr is not None and n.op == "call_function":
            seq_nr_block.setdefault(nr, fwd_block(i))
            seq_nr_region.setdefault(nr, fwd_region(i))

    g = nx.DiGraph()
    storage_best: dict[Any, tuple[Any, str]] = {}
    shapes_of: dict[Any, list] = {}
    role = roles(find_written(nodes, boundary))      # attention the model writes itself
    learned = set([n for n in nodes if n.op == "placeholder"][:n_params])     # what the parameters reach
    for n in nodes:
        if any(a in learned for a in n.all_input_nodes):
            learned.add(n)
    fused_calls = 0
    for i, n in enumerate(nodes):
        tvals = _tensor_vals(n.meta.get("val"))
        shapes = [tuple(_expr(d, shape_env, canon) for d in t.shape) for t in tvals]
        shapes_of[n] = shapes
        if n.op != "call_function":
            continue
        phase = "fwd" if i < boundary else "bwd"
        layer = fwd_block(i) if phase == "fwd" else seq_nr_block.get(n.meta.get("seq_nr"))
        region = fwd_region(i) if phase == "fwd" else seq_nr_region.get(n.meta.get("seq_nr"))
        kind = OpKind.VIEW if role.get(n, ("",))[0] == "inside" else \
            OpKind.ATTENTION if n in role else classify(n.target)
        arg_shapes = [(shapes_of.get(a) or [None])[0] if isinstance(a, torch.fx.Node) else None for a in n.args]
        out_bytes = sum(prod(s) * t.element_size() for s, t in zip(shapes, tvals))
        in_bytes = 0
        for a in n.all_input_nodes:
            for s, t in zip(shapes_of.get(a, []), _tensor_vals(a.meta.get("val"))):
                in_bytes += prod(s) * t.element_size()
        is_view = kind == OpKind.VIEW
        attention, flops = None, op_flops(n.target, n.args, n.kwargs, shapes, arg_shapes)
        if n in role and kind == OpKind.ATTENTION:
            attention, flops, out_bytes = written_op(role[n], shapes_of, out_bytes,
                                                      windows[layer] if layer is not None else 0)
        elif kind == OpKind.ATTENTION:
            q, k = attention_operands(n.target, arg_shapes)
            masked = is_masked_call(n.target, n.args, n.kwargs)
            v_dim = 0
            if phase == "fwd":          # the forward's fused calls, in the order SDPA was called
                v_dim = value_dims[fused_calls] if value_dims and fused_calls < len(value_dims) else 0
                fused_calls += 1
            # A causal LM's explicit mask (a sliding window; padding at run time) is causal too.
            attention = AttentionOp(batch=prod(q[:-3]), heads=q[-3], kv_heads=k[-3], q_len=q[-2], kv_len=k[-2],
                                    head_dim=q[-1], v_head_dim=v_dim, causal=is_causal_call(n.target, n.args, n.kwargs)
                                    or (masked and built.is_hf), masked=masked,
                                    window=windows[layer] if layer is not None and masked else 0)
        g.add_node(n.name, op=OpNode(
            name=n.name, target=str(n.target), kind=kind, phase=phase, layer=layer, shapes=shapes,
            dtypes=[str(t.dtype).replace("torch.", "") for t in tvals],
            seq_dims=[[d for d, e in enumerate(s) if _has_seq(e)] for s in shapes],
            flops=flops, bytes_read=0 if is_view else in_bytes, bytes_written=0 if is_view else out_bytes,
            attention=attention, index=i, region=region if layer is not None else None,
            replicated=phase == "fwd" and n not in learned and any(map(_has_seq, shapes[0] if shapes else ()))))
        for a in n.all_input_nodes:
            if a.name in g:
                g.add_edge(a.name, n.name)
        # Saved for backward: a forward activation (holds S) read by a backward op. The S x S
        # tensors of attention written by hand are the strategy's to cost (score_saved).
        if phase == "fwd" and len(tvals) == 1 and any(_has_seq(e) for e in shapes[0]) \
                and any(index[u] >= boundary for u in n.users) \
                and not (n in role and sum(map(_has_seq, shapes[0])) >= 2):
            key = _storage_key(tvals[0], n.name)
            size = prod(shapes[0]) * tvals[0].element_size()
            prev = storage_best.get(key)
            if prev is None or evaluate(size, seq_len) > evaluate(prev[0], seq_len):
                storage_best[key] = (size, n.name)
    for size, name in storage_best.values():
        g.nodes[name]["op"].bytes_saved = size
    fill_score_costs(g, role, nodes, boundary, shapes_of, seq_len)

    classes = _layer_classes(built, g)
    return OpGraph(graph=g, model_name=built.name, batch_size=batch_size, seq_len=seq_len,
                   dtype=str(dtype).replace("torch.", ""), layer_classes=classes,
                   total_params=built.total_params, captured_layers=len(built.blocks), notes=built.notes,
                   mixers=mark_gathered(g, nodes[:boundary], shapes_of))


def _has_seq(e: Any) -> bool:
    return isinstance(e, sympy.Basic) and S in e.free_symbols


def _storage_key(t: torch.Tensor, fallback: str) -> Any:
    try:
        from torch.multiprocessing.reductions import StorageWeakRef
        return StorageWeakRef(t.untyped_storage())
    except Exception:  # noqa: BLE001 - a tensor without storage is its own key
        return fallback


def _layer_classes(built: Built, g: nx.DiGraph) -> dict[str, LayerClass]:
    prints: dict[int, str] = {}
    for b in range(len(built.blocks)):
        h = hashlib.sha1()
        for _, data in g.nodes(data=True):
            a: OpNode = data["op"]
            if a.layer == b:
                h.update(f"{a.phase}|{a.target}|{a.shapes}|{a.dtypes};".encode())
        prints[b] = h.hexdigest()[:12]
    classes: dict[str, LayerClass] = {}
    key_to_fp = {}
    for b, key in enumerate(built.captured_keys):
        key_to_fp.setdefault(key, prints[b])
    for b in range(len(built.blocks)):
        fp = prints[b]
        lc = classes.setdefault(fp, LayerClass(fp, type(built.blocks[b]).__name__, 0, [],
                                               count_params(built.blocks[b])))
        lc.captured.append(b)
    if len(built.full_keys) == len(built.blocks):
        for fp, lc in classes.items():          # traced at full depth: count what we saw
            lc.count = len(lc.captured)
    else:                                       # shallow trace: each full layer joins its key's class
        for key in built.full_keys:
            classes[key_to_fp[key]].count += 1
    return {fp: lc for fp, lc in classes.items() if lc.count > 0}
