"""Planning cases: memory budgets, saved plans, the first call's planner, plans per batch
length, packed documents and the balanced layout.

Run on every rank of a gloo pool (``dist_harness``); :mod:`dist_cases` is their index."""

from __future__ import annotations

import copy
from typing import Any

import torch

import autosp
from autosp.errors import AutospError
from autosp.strategies.blockwise import BLOCK_TALLY

from dist_models import _batch, _loss, _rel, build, train_compare


def memory_budget_refused(seq_len: int = 256, limit: float = 2 ** 20) -> dict[str, Any]:
    """autosp.compile(model, memory_limit=...) with a budget no plan meets: every rank raises one
    AutospError at its first call, and no step runs without the budget."""
    model = build("llama")
    sp = autosp.compile(model, memory_limit=limit)
    ids, labels = _batch(0, 1, seq_len, False)
    try:
        _loss(sp, "llama", ids, labels).backward()
    except AutospError as e:
        return {"error": str(e), "graphs": len(sp.state.reports),
                "grads": sum(p.grad is not None for p in model.parameters())}
    return {"error": "", "graphs": len(sp.state.reports), "grads": sum(p.grad is not None for p in model.parameters())}


def memory_budget_compare(seq_len: int = 256) -> dict[str, Any]:
    """autosp.compile(model, memory_limit=...) between the predicted peaks without and with full
    checkpointing (MLPs untiled): the planner must checkpoint or tile, the transform apply what it
    chose, and training stay exact."""
    import torch.distributed as dist

    from autosp.graph import capture
    from autosp.planner.problem import Problem
    from autosp.planner.search import plan

    from autosp.transform.backend import default_compiler

    world = dist.get_world_size()
    graph = capture(build("llama"), seq_len=seq_len, batch_size=2, dtype="float32")
    peak = {k: plan(Problem.of(graph=graph, seq_len=seq_len, batch_size=2, world_size=world, profile="cpu-gloo",
                               sp_degrees=(world,), checkpoints=(k,), mlp_chunks=(1,), compiler=default_compiler(),
                               memory_limit=float("inf"))).predicted.peak_bytes
            for k in ("none", "full")}
    limit = (peak["none"] + peak["full"]) / 2
    import os
    import tempfile

    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp()        # plan afresh, not from a cached plan
    out = train_compare("llama", seq_len=seq_len, steps=1, plan=None, memory_limit=limit)
    out["peaks"], out["limit"] = peak, limit
    return out


def costmodel_measure(seq_len: int = 1024, strategies: tuple[str, ...] = ("ulysses", "zigzag_ring")) -> list:
    """Measured step time and peak step memory of tiny Llama under autosp (see autosp.tools.validation)."""
    from autosp.tools.validation import measured_sp

    return measured_sp([seq_len], list(strategies), repeats=2)


def plan_apply(tmp: str, seq_len: int = 32) -> dict[str, Any]:
    """A saved plan (mixed strategies) applied with plan=: exact, and refused when it does not match."""
    import torch.distributed as dist

    from dataclasses import replace

    from autosp.decisions import LayerChoice, MeshChoice
    from autosp.planner.plan import LayerPlan, Plan, Predicted

    world = dist.get_world_size()
    plan = Plan(model="reference", fingerprint="x", seq_len=seq_len, batch_size=2, dtype="float32",
                world_size=world, devices_per_node=world, dp_degree=1, mesh=MeshChoice(world, "zigzag", loss_chunks=2),
                layers=[LayerPlan("Block", "", 1, LayerChoice("ulysses"), ulysses_degree=world),
                        LayerPlan("Block", "", 1, LayerChoice("zigzag_ring"), ring_degree=world)],
                predicted=Predicted.from_dict({}), profile="cpu-gloo", memory_limit_bytes=1e12, memory_margin=0.0)
    path = f"{tmp}/plan-{dist.get_rank()}.json"
    plan.save(path)
    out = train_compare("reference", seq_len=seq_len, steps=1, strategy="auto", plan=path)
    wrong = replace(Plan.load(path), world_size=world * 2)
    try:
        autosp.compile(build("reference"), plan=wrong)
        out["wrong_world"] = ""
    except AutospError as e:
        out["wrong_world"] = str(e)
    sp = autosp.compile(build("reference"), plan=path)
    ids, labels = _batch(0, 1, seq_len * 2, False)
    try:
        sp(ids, labels=labels)
        out["wrong_len"] = ""
    except AutospError as e:
        out["wrong_len"] = str(e)
    return out


def auto_plan_compare(kind: str = "llama", cache_dir: str = "", **cfg: Any) -> dict[str, Any]:
    """plan="auto": the ILP plans on the first call (cpu-gloo profile); still exact; cached."""
    import os

    os.environ["XDG_CACHE_HOME"] = cache_dir
    out = train_compare(kind, seq_len=64, steps=2, plan="auto", **cfg)
    files = os.listdir(os.path.join(cache_dir, "autosp", "plans"))
    out["cached"] = files
    # the compiler the plan's memory was costed for: the one the wrapper runs (Inductor fuses)
    out["plan_compiler"] = autosp.Plan.load(os.path.join(cache_dir, "autosp", "plans", files[0])).predicted.compiler
    return out


def _plan_by_length(module: Any, batch: int, seq_len: int, group: Any, documents: tuple = ()) -> Any:
    """A planner of one's own: Ulysses up to 128 tokens, zigzag ring beyond (so buckets switch plans)."""
    import torch.distributed as dist

    from autosp.decisions import LayerChoice, MeshChoice
    from autosp.planner.plan import LayerPlan, Plan, Predicted

    world = dist.get_world_size(group)
    strategy, layout = ("ulysses", "contiguous") if seq_len <= 128 else ("zigzag_ring", "zigzag")
    return Plan(model="llama", fingerprint="x", seq_len=seq_len, batch_size=batch, dtype="float32", world_size=world,
                devices_per_node=world, dp_degree=1, mesh=MeshChoice(world, layout),
                layers=[LayerPlan("LlamaDecoderLayer", "", 2, LayerChoice(strategy))],
                predicted=Predicted.from_dict({}), profile="cpu-gloo", memory_limit_bytes=1e12, memory_margin=0.0)


def varying_lengths(lengths: tuple[int, ...] = (64, 100, 200, 64, 300, 96), planner: str = "auto",
                    kind: str = "llama", compiler: str | None = None) -> dict[str, Any]:
    """One model trained over batches whose length and documents change every step (the last one
    packed with short documents), against one process at every step: per step the loss and worst
    gradient error, what ran (strategy per op, padded length, tokens per rank), and how many buckets
    were planned and decisions compiled. ``planner``: "auto" (the ILP) or "by_length" (switches)."""
    ref = build(kind)
    model = copy.deepcopy(ref)
    sp = autosp.compile(model, plan="auto" if planner == "auto" else _plan_by_length,
                        runtime=autosp.Runtime(compiler=compiler))
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt_sp = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out: dict[str, Any] = {"steps": []}
    for step, seq_len in enumerate(lengths):
        ids, labels = _batch(step, 2, seq_len, uneven=False)
        extra = {}
        if step == len(lengths) - 1:                 # short documents only: positions restart every 8 tokens
            extra["position_ids"] = (torch.arange(seq_len) % 8).expand(2, seq_len).clone()
        loss_ref = _loss(ref, kind, ids, labels, **extra)
        loss_ref.backward()
        loss = _loss(sp, kind, ids, labels, **extra)
        loss.backward()
        worst = max(_rel(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
        rep = sp.report().as_dict()
        out["steps"].append({"seq_len": seq_len, "grad_err": worst,
                             "loss_err": abs(loss.item() - loss_ref.item()) / abs(loss_ref.item()), "strategies": [a["strategy"] for a in rep["attention"]],
                             "padded_len": rep["padded_len"],
                             "tokens_per_rank": [a["tokens_per_rank"] for a in rep["attention"]],
                             "plans": rep["plans"], "variants": rep["compiled_variants"],
                             "plan_len": sp.plan.seq_len if sp.plan is not None else None})
        for opt in (opt_ref, opt_sp):
            opt.step()
            opt.zero_grad()
    return out


# Document lengths of a packed stream, one row per step: long and short mixes, a length (70) that the
# balanced layout's 4 chunks per rank do not divide (padded), and a row of short documents only.
PACKED_STREAM = ((40, 8, 16), (4, 4, 56), (64,), (8,) * 8, (30, 30, 10), (16, 48))


def balanced_stream(strategy: str = "ring", docs: tuple = PACKED_STREAM, layout: str = "balanced",
                    compiler: str | None = None) -> dict[str, Any]:
    """Packed batches whose documents change every step under one layout, against one process at
    every step: loss and worst gradient error, the chunks this rank's slice held (read from the
    balanced deal as the step ran), the (query, key) pairs its attention kernels attended (counted
    as they ran), and how many graphs were compiled over the stream."""
    import torch._dynamo.utils as dynamo_utils
    import torch.distributed as dist

    from autosp.strategies import layout as lay

    ref = build("llama")
    model = copy.deepcopy(ref)
    sp = autosp.compile(model, plan=autosp.Decisions.of(strategy=strategy, mesh=autosp.MeshChoice(layout=layout)),
                        runtime=autosp.Runtime(compiler=compiler))
    opt_ref, opt_sp = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, model))
    frames = dynamo_utils.counters["stats"]["unique_graphs"]
    out: dict[str, Any] = {"steps": []}
    for step, lengths in enumerate(docs):
        seq_len = sum(lengths)
        ids, labels = _batch(step, 2, seq_len, uneven=False)
        pos = torch.cat([torch.arange(n) for n in lengths]).expand(2, seq_len).clone()
        loss_ref = _loss(ref, "llama", ids, labels, position_ids=pos)
        loss_ref.backward()
        before = BLOCK_TALLY["query_keys"]
        loss = _loss(sp, "llama", ids, labels, position_ids=pos)
        attended = BLOCK_TALLY["query_keys"] - before       # forward only: the backward does not count
        loss.backward()
        rep = sp.report().as_dict()
        world = rep["sp_degree"]
        out["steps"].append({
            "seq_len": seq_len, "padded_len": rep["padded_len"], "compiler": rep["compiler"],
            "loss_err": abs(loss.item() - loss_ref.item()) / abs(loss_ref.item()),
            "grad_err": max(_rel(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())),
            "chunks": lay.rank_chunks(layout, dist.get_rank(), world) if layout == "balanced" else None,
            "attended": attended, "strategies": [a["strategy"] for a in rep["attention"]]})
        for opt in (opt_ref, opt_sp):
            opt.step()
            opt.zero_grad()
    out["graphs"] = dynamo_utils.counters["stats"]["unique_graphs"] - frames
    return out


def planning_failure(seq_len: int = 32) -> dict[str, Any]:
    """The first call's planner failing (made to fail here the way a capture it cannot trace does):
    with the default budget it warns, naming the command that shows why, and runs the default
    choice (exact against one process); with a memory budget given, every rank fails in one line
    and nothing runs without the budget."""
    import warnings
    from unittest import mock

    from autosp.autoplan import AutoPlanner

    def failing(self, *args, **kw):         # before the plan cache, which may hold this problem's plan
        raise RuntimeError("the capture turned the sequence length into a constant")

    ref = build("llama")
    model = copy.deepcopy(ref)
    ids, labels = _batch(0, 1, seq_len, False)
    out: dict[str, Any] = {}
    with mock.patch.object(AutoPlanner, "plan", failing):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = _loss(autosp.compile(model), "llama", ids, labels)
        loss.backward()
        loss_ref = _loss(ref, "llama", ids, labels)
        loss_ref.backward()
        out["warnings"] = [str(w.message) for w in caught if "could not plan" in str(w.message)]
        out["loss_err"] = abs(loss.item() - loss_ref.item()) / loss_ref.item()
        out["grad_err"] = max(_rel(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
        limited = build("llama")
        sp = autosp.compile(limited, memory_limit=2 ** 30)
        try:
            _loss(sp, "llama", ids, labels).backward()
            out["error"] = ""
        except AutospError as e:
            out["error"] = str(e)
    out["grads"] = sum(p.grad is not None for p in limited.parameters())
    return out
