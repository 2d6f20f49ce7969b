"""Human- and machine-readable summaries of a captured graph (``autosp inspect``)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from autosp.graph import OpGraph
from autosp.planner.plan import Plan, RunnerUp


def human(n: float, unit: str = "") -> str:
    """1234567 -> '1.23 M'; bytes use binary prefixes."""
    if unit == "B":
        for p in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
            if abs(n) < 1024 or p == "PiB":
                return f"{n:.0f} {p}" if p == "B" else f"{n:.2f} {p}"
            n /= 1024
    for p in ("", "K", "M", "G", "T", "P", "E"):
        if abs(n) < 1000 or p == "E":
            return f"{n:.3g}{(' ' + p) if p else ''}{unit}"
        n /= 1000
    return str(n)


def inspect_dict(g: OpGraph) -> dict[str, Any]:
    """The JSON document of ``autosp inspect --json``."""
    rows = g.layer_rows()
    return {
        "model": g.model_name,
        "batch_size": g.batch_size,
        "seq_len": g.seq_len,
        "dtype": g.dtype,
        "captured_layers": g.captured_layers,
        "layer_classes": rows,
        "totals": g.totals(),
        "notes": g.notes,
    }


def inspect_table(g: OpGraph):  # -> rich.table.Table
    from rich.table import Table

    t = Table(title=f"{g.model_name}: batch {g.batch_size} x {g.seq_len} tokens, {g.dtype}, "
                    f"one training step (forward + backward)")
    for col in ("layer class", "count", "params/layer", "fwd FLOPs/layer", "bwd FLOPs/layer",
                "act. saved/layer"):
        t.add_column(col, justify="left" if col == "layer class" else "right")
    for r in g.layer_rows():
        t.add_row(f"{r['layer_class']} [{r['fingerprint']}]" if r["fingerprint"] != "-" else r["layer_class"],
                  str(r["count"]), human(r["params_per_layer"]), human(r["fwd_flops_per_layer"]),
                  human(r["bwd_flops_per_layer"]), human(r["act_bytes_per_layer"], "B"))
    tot = g.totals()
    t.add_section()
    t.add_row("total", "", human(tot["params"]), human(tot["fwd_flops"]), human(tot["bwd_flops"]),
              human(tot["act_bytes"], "B"))
    return t


def layer_choices(alternative: RunnerUp) -> str:
    """Every layer class's strategy and checkpointing of a plan summary, in one cell."""
    mesh = alternative.mesh
    loss = f"; loss in {mesh.loss_chunks} chunks" if mesh.loss_chunks > 1 else ""
    return "; ".join(f"{x.module_type}: {c.strategy}, ckpt {c.checkpoint}"
                     + (f", MLP in {c.mlp_chunks} chunks" if c.mlp_chunks > 1 else "")
                     + (" recomputed with the layer" if c.mlp_with_layer else "")
                     + (", offloaded" if c.offload else "")
                     for x in alternative.layers for c in (x.choice,)) + loss \
        + ("; optimizer on the host" if mesh.host_optimizer else "")


def plan_table(plan: Plan) -> list:  # -> list of rich renderables
    """The chosen plan, why, and the runner-ups side by side."""
    from rich.table import Table

    pr, mesh = plan.predicted, plan.mesh
    head = Table(title=f"{plan.model}: {plan.seq_len} tokens on {plan.world_size} devices "
                       f"({plan.devices_per_node}/node, profile {plan.profile}, ZeRO {mesh.zero_stage}"
                       f"{f' sharded per {mesh.zero_shard} ranks, HSDP' if mesh.zero_shard else ''})")
    head.add_column("decision")
    head.add_column("value", justify="right")
    head.add_row("SP x TP x DP", f"{mesh.sp_degree} x {mesh.tp_degree} x {plan.dp_degree}")
    if mesh.tp_degree > 1:
        head.add_row("  TP", "each block's attention and MLP linear pairs split inside a node (autosp.compile "
                             "with this plan builds the ('dp', 'sp', 'tp') mesh)")
    head.add_row("token layout", mesh.layout)
    for layer in plan.layers:
        c = layer.choice
        head.add_row(f"{layer.module_type} x{layer.count}",
                     f"{c.strategy} (Ulysses {layer.ulysses_degree} x ring {layer.ring_degree}), "
                     f"checkpoint {c.checkpoint}, "
                     + (f"MLP in {c.mlp_chunks} token chunks"
                        + ("" if c.mlp_region_of_its_own or c.checkpoint != "full" else " recomputed with the layer")
                        + ", " if c.mlp_chunks > 1 else "")
                     + ("saved tensors offloaded to host, " if c.offload else "")
                     + f"overlap {layer.overlap}, exposed comm {layer.exposed_comm_s:.3f} s")
    head.add_row("LM head + loss", f"in {mesh.loss_chunks} token chunks" if mesh.loss_chunks > 1 else "whole")
    if mesh.host_optimizer:
        head.add_row("optimizer", f"states in host memory, stepped there ({human(pr.host_optimizer_bytes, 'B')}, "
                                  f"step and copies {pr.host_optimizer_step_s:.3f} s)")
    if pr.saved_by:
        head.add_row("  what each saves", ", ".join(f"{k} {human(v, 'B')}" for k, v in pr.saved_by))
    head.add_section()
    copies = f", exposed host copies {pr.exposed_copy_s:.3f}" if pr.host_bytes else ""
    rest = pr.exposed_comm_s - pr.exposed_tp_s - pr.exposed_sp_s
    head.add_row("step time", f"{pr.total_s:.3f} s (compute {pr.compute_s:.3f}, exposed comm "
                              f"{pr.exposed_comm_s:.3f}{copies})")
    head.add_row("  exposed comm by axis", (f"TP {pr.exposed_tp_s:.3f} s, " if mesh.tp_degree > 1 else "")
                 + f"SP attention {pr.exposed_sp_s:.3f} s, gradients and ZeRO gathers {rest:.3f} s")
    kept = f", {plan.memory_margin:.0%} kept free" if plan.memory_margin else ""
    runtime = pr.runtime_reserved_bytes
    held = (f" (the device's {human(plan.memory_limit_bytes + runtime, 'B')} less {human(runtime, 'B')} the CUDA "
            f"context and NCCL hold)") if runtime else ""
    head.add_row("peak memory / device", f"{human(pr.peak_bytes, 'B')} of {human(plan.memory_limit_bytes, 'B')}"
                                         f"{held}{kept}")
    head.add_row("  breakdown", ", ".join(f"{k} {human(v, 'B')}" for k, v in asdict(pr.memory).items()
                                          if k != "peak"))
    # its memory differs: Inductor never writes a bf16 model's fp32 copies
    head.add_row("  costed for", f"the step compiled by {pr.compiler} (--compiler)")
    head.add_row("  peaks in", pr.bound_by.phase)
    if pr.host_bytes:
        budget = f" of {human(pr.bound_by.host_budget, 'B')} it may take" if pr.bound_by.host_budget else ""
        states = pr.host_optimizer_bytes
        parts = f" (checkpoints {human(pr.host_bytes - states, 'B')}, optimizer {human(states, 'B')})" \
            if states else ""
        head.add_row("host memory / device", f"{human(pr.host_bytes, 'B')} offloaded{parts}{budget} (the node's host "
                                             f"memory is shared by its {min(plan.world_size, plan.devices_per_node)} "
                                             f"ranks)")
    for t in pr.largest_live[:4]:
        where = f"layer {t.layer}" if t.layer is not None else "outside the layers"
        op = t.target.removeprefix("aten.").removesuffix(".default")
        head.add_row(f"  largest untiled: {op}", f"{human(t.bytes, 'B')} ({t.phase}, {where}, "
                                                          f"[{', '.join(map(str, t.shape))}])")
    head.add_row("tokens/s per device, MFU", f"{pr.tokens_per_s_per_device:.0f}, {pr.mfu:.1%}")
    if plan.solver:
        head.add_row("solver", f"{plan.solver.status} in {plan.solver.solve_s:.2f} s "
                               f"({plan.solver.variables} variables, {plan.solver.solves} solves)")
    alts = Table(title="runner-ups (from the solver)")
    for col in ("SP x TP", "layout", "layers", "step (s)", "vs chosen", "peak memory"):
        alts.add_column(col, justify="left" if col == "layers" else "right")
    for a in plan.alternatives:
        alts.add_row(f"{a.mesh.sp_degree} x {a.mesh.tp_degree}", a.mesh.layout, layer_choices(a), f"{a.total_s:.3f}",
                     f"{a.total_s / pr.total_s:.2f}x", human(a.peak_bytes, "B"))
    return [head, alts]
