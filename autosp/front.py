"""``autosp.compile``: the front door. One line turns a single-device model into an SP model.

    model = autosp.compile(model)
    loss = model(input_ids=ids, labels=ids).loss   # every rank passes the same full batch
    loss.backward()                                # grads == one process's grads

Its arguments become typed values (:mod:`autosp.decisions`, :mod:`autosp.options`) that the
transform consumes as they are (:func:`autosp.transform.api.build`). The keywords of earlier
releases (``strategy=``, ``zero_stage=``, ``compiler=``, ...) still work, with a
``DeprecationWarning`` that names the new spelling.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from autosp.decisions import Decisions, MeshChoice
from autosp.errors import AutospError
from autosp.options import Auto, Runtime, Zero, parse_bytes
from autosp.planner.plan import Plan

# the keywords of earlier releases -> the option group that holds them now
_OLD = {"strategy": "plan", "layout": "plan", "checkpoint": "plan", "mlp_chunks": "plan", "loss_chunks": "plan",
        "sp_size": "mesh", "group": "mesh",
        "zero_stage": "zero", "bucket_mb": "zero", "zero_shard": "zero",
        "compiler": "runtime", "overlap": "runtime", "gather_outputs": "runtime", "reduce_grads": "runtime"}


def compile(model: nn.Module, plan: Any = "auto", *, mesh: DeviceMesh | dist.ProcessGroup | int | None = None,
            memory_limit: float | str | None = None, zero: Zero | int | None = None,
            runtime: Runtime | None = None, **deprecated: Any) -> nn.Module:  # noqa: A001 - mirrors torch.compile
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
            the path of one (``autosp plan --out``): applied as planned, refused when made for
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
        **deprecated: the keywords of earlier releases (``strategy``, ``layout``, ``checkpoint``,
            ``mlp_chunks``, ``loss_chunks``, ``sp_size``, ``group``, ``zero_stage``, ``bucket_mb``,
            ``zero_shard``, ``compiler``, ``overlap``, ``gather_outputs``, ``reduce_grads``); each
            warns once with its new spelling.

    Returns:
        A :class:`autosp.SequenceParallel` module wrapping ``model`` (``.module``), with
        ``.report()``, ``.optimizer(cls, **kw)`` and ``.no_sync()``; or ``model`` itself when
        ``torch.distributed`` is not initialised.
    """
    if deprecated:
        plan, mesh, zero, runtime = _translate(deprecated, plan, mesh, zero, runtime)
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

    if isinstance(plan, str) and plan != "auto" and (plan.endswith(".json") or os.path.exists(plan)):
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
        return build(model, Decisions(), mesh=mesh, zero=zero, runtime=runtime, provider=plan)
    if isinstance(plan, str) or (isinstance(plan, (list, tuple)) and plan and all(isinstance(x, str) for x in plan)):
        plan = Decisions.of(strategy=plan if isinstance(plan, str) else list(plan))   # one per layer
    if not isinstance(plan, Decisions):
        raise AutospError(f"plan must be 'auto', autosp.Auto(...), a strategy name, autosp.Decisions, a Plan or the "
                          f"path of a plan JSON, not {type(plan).__name__}")
    return build(model, plan, mesh=mesh, zero=zero, runtime=runtime)


def _planned(model: nn.Module, auto: Auto, mesh: Any, limit: float | None, zero: Zero, runtime: Runtime,
             fallback: bool) -> nn.Module:
    """The planner runs at the first call, for that batch (:mod:`autosp.autoplan`); until then the
    default choice ("auto" per attention op) is configured, and kept where a default budget fails."""
    from autosp.autoplan import AutoPlanner
    from autosp.transform.api import build  # noqa: PLC0415 - torch-heavy, loaded on use

    provider = AutoPlanner(fallback=fallback, memory_limit=limit, checkpoints=auto.checkpoints,
                           overlap=runtime.overlap, mlp_chunks=auto.mlp_chunk_choices,
                           loss_chunks=auto.loss_chunk_choices, zero_stage=zero.stage,
                           offloads=auto.offload_choices, host_optimizers=auto.host_optimizer_choices)
    fixed = Decisions.of(checkpoint=auto.checkpoint or "none", mlp_chunks=auto.mlp_chunks or 1,
                         mesh=MeshChoice(loss_chunks=auto.loss_chunks or 1, host_optimizer=bool(auto.host_optimizer)),
                         offload=bool(auto.offload))
    return build(model, fixed, mesh=mesh, zero=zero, runtime=runtime, provider=provider)


def _translate(old: dict[str, Any], plan: Any, mesh: Any, zero: Any, runtime: Any) -> tuple[Any, Any, Any, Any]:
    """The keywords of earlier releases in the typed options, with one warning naming the new spelling."""
    unknown = sorted(set(old) - set(_OLD))
    if unknown:
        raise AutospError(f"autosp.compile() got unknown keyword(s) {', '.join(unknown)}; its options are plan, mesh, "
                          "memory_limit, zero and runtime (see help(autosp.compile))")
    clash = sorted({_OLD[k] for k in old} & {name for name, v in (("mesh", mesh), ("zero", zero),
                                                                    ("runtime", runtime)) if v is not None})
    if clash:
        raise AutospError(f"give {', '.join(clash)} in the new spelling or the old keywords, not both")
    new: list[str] = []
    strategy = old.get("strategy", "auto")
    fixed = {k: old[k] for k in ("checkpoint", "mlp_chunks", "loss_chunks", "layout") if k in old}
    if "strategy" in old or fixed:
        if plan != "auto" and "strategy" in old and strategy != "auto":
            raise AutospError("strategy= and plan= both choose the strategy: pass plan= alone")
        if plan != "auto":
            fixed.pop("layout", None)          # a plan sets the layout (as before: the caller's was ignored)
            if fixed:
                raise AutospError(f"{', '.join(fixed)} with a saved plan: the plan holds these decisions; "
                                  "re-plan, or give plan=autosp.Decisions.of(...)")
        elif strategy == "auto":
            lists = [k for k in ("checkpoint", "mlp_chunks") if k in fixed and not isinstance(fixed[k], (str, int))]
            if lists:
                raise AutospError(f"per-layer {', '.join(lists)} fix every layer: give the strategy too, "
                                  "plan=autosp.Decisions.of(strategy=..., ...)")
            fixed.pop("layout", None)          # the planner chooses the layout
            auto = {k: v for k, v in fixed.items() if not (k == "checkpoint" and v == "none")
                    and not (k in ("mlp_chunks", "loss_chunks") and v == 1)}
            plan = Auto(**auto) if auto else "auto"
            new.append(f"plan=autosp.Auto({', '.join(f'{k}={v!r}' for k, v in auto.items())})")
        else:
            mesh_choice = MeshChoice(layout=fixed.pop("layout", None), loss_chunks=fixed.pop("loss_chunks", 1))
            plan = Decisions.of(strategy=strategy, mesh=mesh_choice, **fixed)
            new.append("plan=autosp.Decisions.of(strategy=..., checkpoint=..., mlp_chunks=..., layout=..., "
                       "loss_chunks=...)" if fixed or "layout" in old or "loss_chunks" in old
                       else f"plan={strategy!r}")
    if "sp_size" in old or "group" in old:
        if "sp_size" in old and "group" in old:
            raise AutospError("give sp_size or group, not both (mesh= takes either)")
        if mesh is not None:
            raise AutospError("give a mesh, or sp_size / group, not both (the mesh's 'sp' dimension is the SP group)")
        mesh = old.get("group", old.get("sp_size"))
        new.append("mesh=<group or SP degree>")
    zero_kw = {k.replace("zero_", ""): old[k] for k in ("zero_stage", "bucket_mb", "zero_shard") if k in old}
    if zero_kw:
        zero = Zero(**zero_kw)
        new.append(f"zero=autosp.Zero({', '.join(f'{k}={v!r}' for k, v in zero_kw.items())})")
    run_kw = {k: old[k] for k in ("compiler", "overlap", "gather_outputs", "reduce_grads") if k in old}
    if run_kw:
        runtime = Runtime(**run_kw)
        new.append(f"runtime=autosp.Runtime({', '.join(f'{k}={v!r}' for k, v in run_kw.items())})")
    warnings.warn(f"autosp.compile({', '.join(f'{k}=' for k in old)}) is the old spelling; use "
                  f"{', '.join(new)}", DeprecationWarning, stacklevel=3)
    return plan, mesh, zero, runtime


__all__ = ["compile"]
