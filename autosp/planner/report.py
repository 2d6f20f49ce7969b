"""Human- and machine-readable summaries of a captured graph (``autosp inspect``)."""

from __future__ import annotations

from typing import Any

from autosp.planner.opgraph import OpGraph


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
