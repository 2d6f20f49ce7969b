"""``autosp plan --html report.html``: the plan with plots, one self-contained file.

Plots (matplotlib, embedded as PNG): the step-time breakdown of the chosen plan
and the runner-ups, the memory breakdown against the device limit, and every
alternative on a time/memory chart.
"""

from __future__ import annotations

import base64
import html
import io
from dataclasses import asdict

from autosp.planner.plan import Plan, RunnerUp
from autosp.planner.report import human, layer_choices


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def _label(a: RunnerUp) -> str:
    choices = " | ".join(f"{x.choice.strategy} ck:{x.choice.checkpoint[:3]}" for x in a.layers)
    return f"SP{a.mesh.sp_degree}{f' TP{a.mesh.tp_degree}' if a.mesh.tp_degree > 1 else ''} {a.mesh.layout[:3]} {choices}"


def figures(plan: Plan) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = plan.summary()
    rows = [chosen, *plan.alternatives]
    out = []

    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.45 * len(rows)))
    names = [("* " if i == 0 else "") + _label(r) for i, r in enumerate(rows)]
    ax.barh(names, [r.compute_s for r in rows], label="compute")
    ax.barh(names, [r.exposed_comm_s for r in rows], left=[r.compute_s for r in rows],
            label="exposed communication")
    ax.invert_yaxis()
    ax.set_xlabel("predicted step time (s)")
    ax.legend(loc="lower right")
    out.append(("Step time: chosen plan (*) and runner-ups", _png(fig)))
    plt.close(fig)

    mem = asdict(plan.predicted.memory)
    fig, ax = plt.subplots(figsize=(8, 1.8))
    left = 0.0
    for k in ("parameters", "optimizer", "gradients", "activations", "workspace"):
        v = mem.get(k, 0.0) / 2 ** 30
        ax.barh(["peak"], [v], left=[left], label=k)
        left += v
    ax.axvline(plan.memory_limit_bytes / 2 ** 30, color="red", linestyle="--", label="limit")
    ax.set_xlabel("GiB per device")
    ax.legend(ncol=3, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.45))
    out.append(("Memory per device against the limit", _png(fig)))
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter([r.peak_bytes / 2 ** 30 for r in rows[1:]], [r.total_s for r in rows[1:]], label="runner-ups")
    ax.scatter([chosen.peak_bytes / 2 ** 30], [chosen.total_s], marker="*", s=200, label="chosen")
    ax.axvline(plan.memory_limit_bytes / 2 ** 30, color="red", linestyle="--", label="memory limit")
    ax.set_xlabel("peak memory per device (GiB)")
    ax.set_ylabel("predicted step time (s)")
    ax.legend()
    out.append(("Alternatives: time against memory", _png(fig)))
    plt.close(fig)
    return out


def write_html(plan: Plan, path: str) -> None:
    pr = plan.predicted
    rows = "".join(f"<tr><td>{html.escape(layer.module_type)} x{layer.count}</td><td>{layer.choice.strategy}</td>"
                   f"<td>{layer.ulysses_degree} x {layer.ring_degree}</td>"
                   f"<td>{layer.choice.checkpoint}</td></tr>" for layer in plan.layers)
    alt_rows = "".join(f"<tr><td>{a.mesh.sp_degree}</td><td>{a.mesh.layout}</td><td>{html.escape(layer_choices(a))}</td>"
                       f"<td>{a.total_s:.3f}</td><td>{human(a.peak_bytes, 'B')}</td></tr>"
                       for a in plan.alternatives)
    imgs = "".join(f"<h3>{html.escape(t)}</h3><img src='data:image/png;base64,{b}'/>" for t, b in figures(plan))
    doc = f"""<!doctype html><html><head><meta charset="utf-8"><title>autosp plan: {html.escape(plan.model)}</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:2em auto}}td,th{{padding:.2em .8em}}</style></head><body>
<h1>{html.escape(plan.model)}: {plan.seq_len} tokens on {plan.world_size} devices</h1>
<p>Profile <b>{html.escape(plan.profile)}</b>, {plan.devices_per_node} devices per node, ZeRO stage {plan.mesh.zero_stage}.
SP x TP x DP = <b>{plan.mesh.sp_degree} x {plan.mesh.tp_degree} x {plan.dp_degree}</b>, token layout <b>{plan.mesh.layout}</b>.</p>
<table border=1><tr><th>layers</th><th>attention</th><th>Ulysses x ring</th><th>checkpointing</th></tr>{rows}</table>
<p>Predicted step {pr.total_s:.3f} s (compute {pr.compute_s:.3f} s, exposed communication
{pr.exposed_comm_s:.3f} s), peak {human(pr.peak_bytes, 'B')} of {human(plan.memory_limit_bytes, 'B')},
{pr.tokens_per_s_per_device:.0f} tokens/s per device, MFU {pr.mfu:.1%}.</p>
<h3>Runner-ups (from the solver)</h3>
<table border=1><tr><th>SP</th><th>layout</th><th>layers</th><th>step (s)</th><th>peak</th></tr>{alt_rows}</table>
{imgs}</body></html>"""
    with open(path, "w") as f:
        f.write(doc)
