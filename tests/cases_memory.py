"""Memory cases: what checkpointing, tiling, ring attention, written attention and offload
hold per rank, measured against one process.

Run on every rank of a gloo pool (``dist_harness``); :mod:`dist_cases` is their index."""

from __future__ import annotations

import copy
from typing import Any

import torch

import autosp

from dist_models import _batch, _full, _loss, _rel, build, compile_options, train_compare


def loss_tiling_memory(seq_len: int = 1024, vocab: int = 8192) -> dict[str, Any]:
    """Per-rank step peak (allocator's view) of a Llama with a large vocabulary, with the LM head
    and loss whole and in 8 chunks; the two losses against one process."""
    import transformers

    from autosp.tools.memory_probe import step_peak

    out: dict[str, Any] = {}
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, seq_len), generator=g)
    single = ref(input_ids=ids, labels=ids, use_cache=False).loss.item()
    for chunks in (1, 8):
        torch._dynamo.reset()
        sp = autosp.compile(copy.deepcopy(ref), plan=autosp.Decisions.of(strategy="ulysses", mesh=autosp.MeshChoice(loss_chunks=chunks)))
        sp(input_ids=ids, labels=ids).loss.backward()                      # compile outside the probe
        loss, peak = step_peak(sp, lambda: sp(input_ids=ids, labels=ids).loss)
        out[chunks] = {"peak": peak, "loss_err": abs(loss.item() - single) / single,
                       "tiled": sum(r.tiled_losses for r in sp.state.reports)}
    return out


def ring_memory(seq_lens: tuple[int, ...] = (512, 1024), degrees: tuple[int, ...] = (2, 4)) -> dict[str, int]:
    """Peak bytes allocated by ring attention forward+backward on one rank, per (P, S)."""
    import torch.distributed as dist
    from autosp.strategies.layout import all_chunks
    from autosp.tools.memory_probe import PeakBytes
    from autosp.strategies.ring_kernel import ring_backward, ring_forward

    groups = {p: dist.new_group(list(range(p))) for p in degrees}   # every rank creates every group
    out: dict[str, int] = {}
    for p in degrees:
        if dist.get_rank() >= p:
            continue
        pg = groups[p]
        for s in seq_lens:
            g = torch.Generator().manual_seed(s)
            q, k, v = (torch.randn(1, h, s // p, 32, generator=g) for h in (8, 2, 2))
            chunks = all_chunks("contiguous", p)
            with PeakBytes() as mem:
                o, lse = ring_forward(q, k, v, None, chunks, True, 32 ** -0.5, pg)
                ring_backward(torch.ones_like(o), q, k, v, o, lse, None, chunks, True, 32 ** -0.5, pg)
            out[f"{p}x{s}"] = mem.peak
        dist.barrier(group=pg)
    dist.barrier()
    return out


def checkpoint_memory(seq_len: int = 1024, strategy: str = "ulysses", compiler: str = "eager",
                      modes: tuple = ("none", "selective", "full")) -> dict[str, Any]:
    """Peak step memory (allocator view) of tiny Llama per memory decision (a checkpointing mode,
    or (mode, MLP chunks, loss chunks)), its losses, and the cost model's prediction of the peak."""
    import torch.distributed as dist

    from autosp.costmodel.predict import step_peak
    from autosp.costmodel.profile import load_profile
    from autosp.graph import capture
    from autosp.tools.validation import measure_step, tiny_model

    graph = capture(tiny_model(), seq_len=seq_len, dtype="float32")
    out = {}
    for mode in modes:
        ck, mlp, lc, *keep = (mode, 1, 1) if isinstance(mode, str) else mode
        keep_input = keep[0] if keep else True         # (a fourth field: the tiled MLP's input kept under full)
        torch._dynamo.reset()
        sp = autosp.compile(tiny_model(), **compile_options(strategy, checkpoint=ck, mlp_chunks=mlp, loss_chunks=lc,
                                                            keep_mlp_input=keep_input,
                                                            runtime=autosp.Runtime(compiler=compiler)))
        m = measure_step(sp, seq_len, repeats=0)
        predicted = step_peak(graph, load_profile("cpu-gloo"), sp=dist.get_world_size(), strategy=strategy,
                              seq_len=seq_len, checkpoint=ck, mlp_chunks=mlp, loss_chunks=lc, keep_mlp_input=keep_input)
        out[mode if isinstance(mode, str) else "/".join(map(str, mode))] = {
            "peak": m["peak"], "loss": m["loss"], "predicted": predicted,
            "tiled_mlps": sum(r.tiled_mlps for r in sp.state.reports)}
    return out


def allgather_kv_schedule(**kw: Any) -> dict[str, Any]:
    """``train_compare`` under ``allgather_kv:overlap``, with the order of the overlapped kernel's
    steps recorded on this rank: when each collective starts and is waited for, and which
    blocks (the own K/V chunks, or another rank's) attend in between; and the timeline the
    overlap bench reads: per wait, when its collectives were issued and when the wait began."""
    from autosp.strategies import allgather_kv_kernel as kernel
    from autosp.strategies import collectives

    events: list[str] = []
    saved = {n: getattr(kernel, n) for n in ("attend_forward", "attend_backward", "_gather_start",
                                             "_reduce_scatter_start", "wait_all")}

    def logged(name: str, label: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            events.append(label(*args) if callable(label) else label)
            return saved[name](*args, **kwargs)
        return run

    own = lambda q_chunks, kv_chunks: "own" if q_chunks == kv_chunks else "other"  # noqa: E731
    kernel.attend_forward = logged("attend_forward", lambda q, k, v, qc, kc, *_: "fwd " + own(qc, kc))
    kernel.attend_backward = logged("attend_backward", lambda d, q, k, v, o, l, qc, kc, *_: "bwd " + own(qc, kc))
    kernel._gather_start = logged("_gather_start", "gather starts")
    kernel._reduce_scatter_start = logged("_reduce_scatter_start", "reduce-scatter starts")
    kernel.wait_all = logged("wait_all", lambda works, kind, group, *_: f"wait {kind}")
    collectives.TIMELINE = timeline = []
    try:
        out = train_compare(strategy="allgather_kv:overlap", **kw)
    finally:
        for n, f in saved.items():
            setattr(kernel, n, f)
        collectives.TIMELINE = None
    out["events"] = events
    out["timeline"] = [(waited - issued, done - waited) for issued, waited, done in timeline]
    return out


def ulysses_schedule(**kw: Any) -> dict[str, Any]:
    """``train_compare`` under a pipelined Ulysses with the timeline on: per SP exchange, in the
    order they completed, (when it was issued, when it was waited for) relative to the step's
    first issue; and the model's layer count."""
    from autosp.strategies import collectives

    collectives.TIMELINE = timeline = []
    try:
        out = train_compare(**kw)
    finally:
        collectives.TIMELINE = None
    out["timeline"] = [(issued, waited) for issued, waited, _ in timeline]
    return out


def written_attention_memory(kinds: tuple[str, ...] = ("handwritten", "gemma2", "bloom"), seq_len: int = 512,
                             strategies: tuple[str, ...] = ("ulysses", "allgather_kv"),
                             cases: tuple[tuple[str, str], ...] = ()) -> dict[str, Any]:
    """Per model with attention written by hand and per strategy: the probe's step peak (allocator
    view, through AOTAutograd) against the planner's prediction, whose S x S scores the region's
    attention op carries (score_saved / score_live per score entry, from the captured graph)."""
    import torch.distributed as dist

    from autosp.costmodel.predict import predict, step_peak
    from autosp.costmodel.profile import load_profile
    from autosp.graph import capture
    from autosp.tools.memory_probe import step_peak as probe_peak

    world, out = dist.get_world_size(), {}
    ids = torch.randint(0, 128, (1, seq_len), generator=torch.Generator().manual_seed(0))
    for kind in dict.fromkeys(k for k, _ in cases) if cases else kinds:
        graph = capture(build(kind), seq_len=seq_len, dtype="float32")
        attention = graph.first_attention()
        for strategy in [s for k, s in cases if k == kind] if cases else strategies:
            torch._dynamo.reset()
            sp = autosp.compile(build(kind), plan=strategy, runtime=autosp.Runtime(compiler="aot_eager"))
            _loss(sp, kind, ids, ids).backward()                          # compile outside the probe
            for p in sp.parameters():
                p.grad = None
            loss, peak = probe_peak(sp, lambda: _loss(sp, kind, ids, ids))
            predicted = step_peak(graph, load_profile("cpu-gloo"), sp=world, strategy=strategy, seq_len=seq_len)
            scores = predict(graph, load_profile("cpu-gloo"), sp=world, strategy=strategy, seq_len=seq_len)
            out[f"{kind}/{strategy}"] = {
                "peak": peak, "predicted": predicted, "strategies": sp.state.strategies,
                "score_saved": attention.score_saved, "written": attention.written,
                "attention_saved": sum(scores.attention_saved.values())}
    return out


def offload_step(seq_len: int = 256, steps: int = 3, compilers: tuple[str, ...] = ("aot_eager", "inductor"),
                 zero_stage: int | None = 3, strategy: str = "ulysses", mlp_chunks: int = 2,
                 loss_chunks: int = 2, keep_mlp_input: tuple[bool, ...] = (True, False),
                 host_optimizer: bool = True) -> dict[str, Any]:
    """Full checkpointing + offload + ZeRO ``zero_stage`` + tiled MLP and loss (+ the optimizer stepped
    in host memory: ``model.optimizer(AdamW)``) on a 1 x world mesh,
    per compiler (with ``keep_mlp_input``, one per compiler) against one process over ``steps`` AdamW steps (loss, every gradient, the
    parameters after), the report, and the last step's order of copies and all-to-alls: ``O`` an
    offload, ``R`` a reload issued, ``W`` its wait, ``a`` an all-to-all, ``|`` the backward begins."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autosp.decisions import MeshChoice
    from autosp.strategies import collectives
    from autosp.tools.validation import tiny_model
    from autosp.transform import offload as off

    ref = tiny_model()
    out: dict[str, Any] = {}
    marks = {"all_to_all": "a", off.OFFLOAD_KIND: "O", off.RELOAD_KIND: "R", off.WAIT_KIND: "W"}
    for compiler, keep in zip(compilers, keep_mlp_input):
        torch._dynamo.reset()
        one, model = copy.deepcopy(ref), copy.deepcopy(ref)
        mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "sp"))
        decisions = autosp.Decisions.of(strategy=strategy, checkpoint="full", mlp_chunks=mlp_chunks, offload=True,
                                        keep_mlp_input=keep,
                                        mesh=MeshChoice(loss_chunks=loss_chunks, host_optimizer=host_optimizer))
        sp = autosp.compile(model, plan=decisions, mesh=mesh, zero=zero_stage, runtime=autosp.Runtime(compiler=compiler))
        opt, opt_one = sp.optimizer(torch.optim.AdamW, lr=1e-3), torch.optim.AdamW(one.parameters(), lr=1e-3)
        row: dict[str, Any] = {"loss_err": 0.0, "grad_err": 0.0}
        events: list[str] = []
        saved = collectives.tally, off.tally

        def tally(kind, group, *sent):
            events.append(marks.get(kind, ""))
            return saved[0](kind, group, *sent)

        for step in range(steps):
            ids, labels = _batch(step, 1, seq_len, True)
            events.clear()
            collectives.tally = off.tally = tally
            try:
                loss = sp(input_ids=ids, labels=labels).loss
                events.append("|")
                loss.backward()
            finally:
                collectives.tally, off.tally = saved
            ref_loss = one(input_ids=ids, labels=labels).loss
            ref_loss.backward()
            row["loss_err"] = max(row["loss_err"], abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
            for p, q in zip(model.parameters(), one.parameters()):
                row["grad_err"] = max(row["grad_err"], _rel(_full(p.grad), q.grad))
            opt.step(), opt_one.step()
            opt.zero_grad(set_to_none=True), opt_one.zero_grad(set_to_none=True)
        flat = lambda m: torch.cat([_full(p.detach()).flatten() for p in m.parameters()])  # noqa: E731
        row["param_err"] = _rel(flat(model), flat(one))
        row["report"] = sp.report().as_dict()
        row["offloaded"] = sum(r.offloaded for r in sp.state.reports)
        row["events"] = "".join(events)
        row["optimizer"] = _where_optimizer_stepped(opt, model)
        out[compiler] = row
    return out


def _where_optimizer_stepped(opt: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, Any]:
    """What the optimizer holds and where: its type, whether it stepped on the host, the last step's
    copies, and per parameter its host master's shape and storage against the parameter's local part."""
    from autosp.transform.host_optimizer import HostOptimizer, _local

    if not isinstance(opt, HostOptimizer):
        return {"type": type(opt).__name__}
    params = list(model.parameters())
    locals_ = [_local(p) for p in params]
    return {"type": type(opt).__name__, "on_host": opt.on_host, "copies": dict(opt.copies),
            "local_numel": sum(t.numel() for t in locals_),
            "master_numel": sum(m.numel() for m in opt.masters),
            "shapes_match": all(m.shape == t.shape for m, t in zip(opt.masters, locals_)),
            "masters_apart": all(m.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
                                 for m, t in zip(opt.masters, locals_)),
            # the states the wrapped AdamW made, keyed by the masters (none by the model's parameters)
            "states_on_masters": sum(1 for k in opt.inner.state if any(k is m for m in opt.masters)),
            "states_on_params": sum(1 for k in opt.inner.state if any(k is p for p in params)),
            "state_numel": sum(v.numel() for st in opt.inner.state.values() for k, v in st.items() if k != "step"),
            "full_numel": sum(p.numel() for p in params)}


def offload_memory(seq_len: int = 2048, strategy: str = "ulysses") -> dict[str, Any]:
    """Device and host peaks (memory probe) of one step of tiny Llama with full checkpointing,
    through aot_eager, next to what the memory model predicts for each: the MLP whole, with and
    without offload ("kept", "offload"), and offloaded with the MLP and loss in 8 chunks, the MLP
    recomputed with its layer ("offload_tiled", one hidden state kept per layer)."""
    import torch.distributed as dist

    from autosp.costmodel.memory import layer_saved
    from autosp.costmodel.predict import step_peak as predicted_peak
    from autosp.costmodel.profile import load_profile
    from autosp.graph import capture
    from autosp.tools.memory_probe import step_memory
    from autosp.tools.validation import tiny_model

    graph = capture(tiny_model(), seq_len=seq_len, dtype="float32")
    out: dict[str, Any] = {}
    runs = {"kept": (False, 1, 1), "offload": (True, 1, 1), "offload_tiled": (True, 8, 8)}
    for name, (offload, chunks, loss_chunks) in runs.items():
        torch._dynamo.reset()
        mem = dict(checkpoint="full", mlp_chunks=chunks, offload=offload, keep_mlp_input=chunks == 1)
        decisions = autosp.Decisions.of(strategy=strategy, **mem, mesh=autosp.MeshChoice(loss_chunks=loss_chunks))
        sp = autosp.compile(tiny_model(), plan=decisions, runtime=autosp.Runtime(compiler="aot_eager"))
        ids, labels = _batch(0, 1, seq_len, False)
        sp(input_ids=ids, labels=labels).loss.backward()        # compile first: the probe sees a steady step
        _, probe = step_memory(sp, lambda: sp(input_ids=ids, labels=labels).loss)
        out[name] = {
            "peak": probe.peak, "host_peak": probe.host_peak,
            "predicted": predicted_peak(graph, load_profile("cpu-gloo"), sp=dist.get_world_size(), strategy=strategy,
                                        seq_len=seq_len, loss_chunks=loss_chunks, **mem),
            "offloaded_bytes": sp.report().as_dict()["collectives"].get("host_offload", {}).get("bytes", 0),
            "kept_per_layer": next(iter(layer_saved(graph, seq_len / dist.get_world_size(), "full", chunks,
                                                    chunks == 1).values())),
            "mlp_chunks": sorted({c for r in sp.state.reports for c in r.mlp_chunks.values()})}
    out["layers"] = sum(lc.count for lc in graph.layer_classes.values())
    return out
