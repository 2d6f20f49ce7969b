"""``autosp.compile``: the front door. One line turns a single-device model into an SP model.

    model = autosp.compile(model)
    loss = model(input_ids=ids, labels=ids).loss   # every rank passes the same full batch
    loss.backward()                                # grads == one process's grads

Its arguments become typed values (:mod:`autosp.decisions`, :mod:`autosp.options`, a planner
at the first call: :class:`autosp.autoplan.AutoPlanner`) that the transform consumes as they are
(:func:`autosp.transform.api.build`).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import replace
from typing import Any

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from autosp.decisions import Decisions, MeshChoice
from autosp.errors import AutospError
from autosp.options import Auto, Runtime, Zero, parse_bytes
from autosp.planner.plan import Plan

# keywords users may reach for, and where each lives (refused in one line naming the spelling)
_ELSEWHERE = {"strategy": "plan='ulysses' (or plan=autosp.Decisions.of(strategy=...))",
              "layout": "plan=autosp.Decisions.of(..., mesh=autosp.MeshChoice(layout=...))",
              "checkpoint": "plan=autosp.Auto(checkpoint=...) or autosp.Decisions.of(checkpoint=...)",
              "mlp_chunks": "plan=autosp.Auto(mlp_chunks=...) or autosp.Decisions.of(mlp_chunks=...)",
              "loss_chunks": "plan=autosp.Auto(loss_chunks=...)",
              "sp_size": "mesh=<SP degree>", "group": "mesh=<process group>",
              "zero_stage": "zero=<stage> or zero=autosp.Zero(stage=...)", "bucket_mb": "zero=autosp.Zero(bucket_mb=...)",
              "zero_shard": "zero=autosp.Zero(shard=...)", "compiler": "runtime=autosp.Runtime(compiler=...)",
              "overlap": "runtime=autosp.Runtime(overlap=...)",
              "gather_outputs": "runtime=autosp.Runtime(gather_outputs=...)",
              "reduce_grads": "runtime=autosp.Runtime(reduce_grads=...)"}


def compile(model: nn.Module, plan: Any = "auto", *, mesh: DeviceMesh | dist.ProcessGroup | int | None = None,
            memory_limit: float | str | None = None, zero: Zero | int | None = None,
            runtime: Runtime | None = None, **unknown: Any) -> nn.Module:  # noqa: A001 - mirrors torch.compile
    """Wrap ``model`` for sequence-parallel training; it plans and compiles at its first call.

    Every rank passes the same full batch; each computes its share of the tokens, the loss it
    returns is the global one, and after ``backward()`` its gradients are those of one process on
    that batch. Without an initialised process group the model is returned as it is (with a
    warning), so one script runs alone or under ``torchrun``.

    Args:
        model: the single-device model (a Hugging Face causal LM, or any module calling
            ``F.scaled_dot_product_attention``).
        plan: ``"auto"`` (default): the ILP plans for the first batch's shape within
            ``memory_limit``: per layer class the attention strategy, checkpointing and MLP chunks,
            and the token layout and loss chunks. ``autosp.Auto(checkpoint=..., mlp_chunks=...,
            loss_chunks=...)``: the same with those fixed. A strategy name (``"ulysses"``,
            ``"ring"``, ``"zigzag_ring"``, ``"allgather_kv"``, ``"hybrid:UxR"``, a registered one):
            that strategy on every layer, nothing else changed; a list of names: one per attention
            layer. ``autosp.Decisions.of(strategy=..., checkpoint=..., mlp_chunks=..., layout=...,
            loss_chunks=...)``: every decision fixed
            (one value for all layers or a list with one per layer). A :class:`autosp.Plan` or
            its path (an ``os.PathLike``, or a string ending in ``.json``; ``autosp plan --out``):
            applied as planned, refused when made for
            another model, world size or sequence length. A callable ``(module, batch_size, seq_len,
            group, documents=()) -> Plan`` (e.g. :class:`autosp.autoplan.AutoPlanner` with a profile
            of one's own) plans at the first call.
        mesh: ``None``: SP over the whole world. A ``DeviceMesh`` with dimensions ``("dp", "sp")``:
            SP inside each ``"sp"`` row, data parallel across (each row passes its own batch). An
            int k: SP groups of k consecutive ranks, data parallel across. A ``ProcessGroup``: SP
            over that group.
        memory_limit: bytes per device the plan must fit (a number, or a size such as ``"40GiB"``);
            a limit no plan meets raises ``AutospError`` on every rank, saying what would fit.
            Default: the device's capacity (on CPU the available RAM shared by this machine's
            ranks); only the default falls back to the default strategy, with a warning, where
            planning fails.
        zero: ZeRO run by autosp over the whole mesh: :class:`autosp.Zero` (stage, gradient bucket
            size, sharding group) or a stage number 0-3. Default: none (gradients summed over each
            SP group inside the graphs).
        runtime: :class:`autosp.Runtime`: the graph compiler, overlap of collectives with compute,
            whether outputs are gathered, who reduces gradients.

        **unknown: refused in one line; a keyword that lives in an option group (``strategy``,
            ``zero_stage``, ``compiler``, ...) is named with its spelling there.

    Returns:
        A :class:`autosp.SequenceParallel` module wrapping ``model`` (``.module``), with
        ``.report()``, ``.optimizer(cls, **kw)`` and ``.no_sync()``; or ``model`` itself when
        ``torch.distributed`` is not initialised.
    """
    if unknown:
        where = "; ".join(f"{k}: {_ELSEWHERE[k]}" for k in unknown if k in _ELSEWHERE)
        raise AutospError(f"autosp.compile() takes no {', '.join(f'{k}=' for k in unknown)}; its options are plan, "
                          f"mesh, memory_limit, zero and runtime" + (f" ({where})" if where else
                                                                     " (see help(autosp.compile))"))
    limit = parse_bytes(memory_limit)
    zero = zero if isinstance(zero, Zero) else Zero(stage=zero)
    runtime = runtime if runtime is not None else Runtime()
    if not isinstance(zero, Zero) or not isinstance(runtime, Runtime):
        raise AutospError("zero= takes autosp.Zero(...) or a stage number, runtime= takes autosp.Runtime(...)")
    sp = _wrap(model, plan, mesh, limit, zero, runtime)
    if sp is model:
        warnings.warn("torch.distributed is not initialised: autosp runs the model on this device alone "
                      "(SP degree 1); launch with torchrun to split the sequence", stacklevel=2)
    return sp


def _wrap(model: nn.Module, plan: Any, mesh: Any, limit: float | None, zero: Zero, runtime: Runtime) -> nn.Module:
    from autosp.transform.api import build  # noqa: PLC0415 - torch-heavy, loaded on use

    # a saved plan: a path object, or a name that says it is one (never a strategy that happens to
    # share its name with a file in the working directory)
    if isinstance(plan, os.PathLike) or (isinstance(plan, str) and plan.endswith(".json")):
        plan = Plan.load(plan)
    if plan == "auto" or isinstance(plan, Auto):
        return _planned(model, Auto() if plan == "auto" else plan, mesh, limit, zero, runtime,
                        fallback=plan == "auto" and limit is None)
    if limit is not None:
        raise AutospError("memory_limit is a budget for the planner: use it with plan='auto' (the default) or "
                          "autosp.Auto(...), not with a named strategy, fixed decisions or a saved plan")
    if isinstance(plan, Plan):
        return build(model, Decisions(), mesh=mesh, zero=zero, runtime=runtime, plan=plan)
    if callable(plan) and not isinstance(plan, Decisions):     # a planner of one's own, e.g. AutoPlanner(profile=...)
        from autosp.autoplan import AutoPlanner
        from autosp.transform.backend import check_compiler, default_compiler

        if isinstance(plan, AutoPlanner) and plan.compiler is None:       # it plans for what will run the step
            plan = replace(plan, compiler=check_compiler(runtime.compiler or default_compiler()))
        return build(model, Decisions(), mesh=mesh, zero=zero, runtime=runtime, provider=plan, may_step_on_host=True)
    if isinstance(plan, str) or (isinstance(plan, (list, tuple)) and plan and all(isinstance(x, str) for x in plan)):
        plan = Decisions.of(strategy=plan if isinstance(plan, str) else list(plan))   # one per layer
    if not isinstance(plan, Decisions):
        raise AutospError(f"plan must be 'auto', autosp.Auto(...), a strategy name, autosp.Decisions, a Plan or the "
                          f"path of a plan JSON, not {type(plan).__name__}")
    return build(model, plan, mesh=mesh, zero=zero, runtime=runtime)


def _planned(model: nn.Module, auto: Auto, mesh: Any, limit: float | None, zero: Zero, runtime: Runtime,
             fallback: bool) -> nn.Module:
    """The planner runs at the first call of each batch shape (:mod:`autosp.autoplan`), for the
    compiler and ZeRO stage that will run the step; until then the default choice ("auto" per
    attention op) is configured, and kept where a default budget fails."""
    from autosp.autoplan import AutoPlanner
    from autosp.transform.api import build  # noqa: PLC0415 - torch-heavy, loaded on use
    from autosp.transform.backend import check_compiler, default_compiler

    compiler = check_compiler(runtime.compiler if runtime.compiler is not None else default_compiler())
    provider = AutoPlanner(auto=auto, memory_limit=limit, fallback=fallback, overlap=runtime.overlap,
                           zero_stage=zero.stage, compiler=compiler)
    fixed = Decisions.of(checkpoint=auto.checkpoint or "none", mlp_chunks=auto.mlp_chunks or 1,
                         mesh=MeshChoice(loss_chunks=auto.loss_chunks or 1, host_optimizer=bool(auto.host_optimizer)),
                         offload=bool(auto.offload))
    return build(model, fixed, mesh=mesh, zero=zero, runtime=replace(runtime, compiler=compiler), provider=provider,
                 may_step_on_host=True in auto.host_optimizer_choices)


__all__ = ["compile"]
