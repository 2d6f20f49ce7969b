"""What autosp did to a model: ``sp.report()``.

Per attention op of the graphs the last step ran (before any step: of every graph compiled): the
strategy that runs it, the token layout, the heads it sees and the 2-D grid (Ulysses x ring) it
uses, the heads and tokens each rank holds inside attention and outside it, and the checkpointing
of its layer. Per step (since the last forward began): the collectives issued on the model's
groups, by kind, with the bytes this rank sent and the seconds its compute waited on them (counted
at run time, see :data:`autosp.strategies.collectives.TALLY`), and the padding added to the batch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from autosp.strategies import SPMesh, resolve
from autosp.strategies.collectives import TALLY
from autosp.strategies.layout import work_per_rank
from autosp.transform.observe import observed
from autosp.transform.offload import HOST


@dataclass
class AttentionRow:
    index: int
    strategy: str
    layout: str
    heads: int
    kv_heads: int
    ulysses_degree: int
    ring_degree: int
    heads_per_rank: int            # inside attention
    tokens_per_rank: int           # at its output (its queries), observed as the last step ran (0: none yet)
    checkpoint: str
    overlap: str = "none"          # how its collectives overlap its compute (the strategy says)
    mlp_chunks: int = 1            # token chunks its layer's MLP ran in (1: untiled)
    # fully checkpointed and tiled: its MLP recomputed with the whole layer from the layer's input
    # (eager graphs always; compiled, LayerChoice.keep_mlp_input=False), else as a region of its own
    mlp_with_layer: bool = False
    fused_norms: int = 0           # its layer's RMSNorms run as one op each (transform/fused_norm.py)


@dataclass
class SPReport:
    sp_degree: int
    seq_len: int                   # of the last batch, as given
    padded_len: int                # after padding to the layout's multiple
    compiled_graphs: int
    compiler: str = ""             # what ran each sharded graph (inductor, aot_eager, eager)
    dp_degree: int = 1             # rows of the mesh, each with its own batch
    zero_stage: int | None = None  # None: gradients summed over the SP group inside the graphs
    grad_buckets: int = 0          # buckets autosp's gradient reduction all-reduces (zero_stage 0, 1)
    param_gathers: int = 0         # ZeRO 3: parameter all-gathers per forward, one per unit of blocks
    param_prefetched: int = 0      # of which started while the unit before computes (overlap=True)
    attention: list[AttentionRow] = field(default_factory=list)
    # kind -> calls, bytes sent, seconds this rank's compute waited on them (exposed)
    collectives: dict[str, dict[str, float]] = field(default_factory=dict)
    # causal-within-document query-key pairs each rank's tokens carry (the layout's balance)
    work_per_rank: list[float] = field(default_factory=list)
    plans: int = 0                 # batch-shape buckets planned so far (plan="auto")
    compiled_variants: int = 1     # distinct decisions compiled so far (one compiled model each)
    # labelled tokens this rank's loss covered in the last step, counted as its graph ran (None: no
    # loss was made global over the model's group, e.g. a model that returns logits only)
    loss_tokens: int | None = None
    # tensor parallelism: the group's size, the linear layers it split (column, row) and left whole,
    # and the collectives its group issued in the last step (kind -> calls, bytes, blocked seconds)
    tp_degree: int = 1
    tp: dict[str, Any] = field(default_factory=dict)
    tp_collectives: dict[str, dict[str, float]] = field(default_factory=dict)
    # layers that mix tokens without attention (linear attention, state-space scans): how each ran
    # (transform/sequence_mixers.py: layer, type, kind, ops, the op that made it a mixer)
    mixers: list[dict[str, Any]] = field(default_factory=list)

    @property
    def work_balance(self) -> float:
        """Busiest rank's attention work over the mean (1.0 = even)."""
        w = self.work_per_rank
        return max(w) / (sum(w) / len(w)) if w and sum(w) else 1.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "work_balance": self.work_balance}

    def __rich__(self) -> Any:
        from rich.table import Table

        units = f"{self.param_gathers} parameter gathers per forward, {self.param_prefetched} prefetched" \
            if self.zero_stage == 3 else \
            f"{self.grad_buckets} gradient buckets"
        dp = f", DP degree {self.dp_degree}, ZeRO stage {self.zero_stage} ({units})" \
            if self.zero_stage is not None else ""
        tp = (f", TP degree {self.tp_degree} ({len(self.tp.get('column', ()))} column- and "
              f"{len(self.tp.get('row', ()))} row-parallel linear layers)") if self.tp_degree > 1 else ""
        t = Table(title=f"autosp: SP degree {self.sp_degree}{tp}{dp}, {self.seq_len} tokens (padded to "
                        f"{self.padded_len}), {self.compiled_graphs} graphs compiled by {self.compiler}, attention work busiest / "
                        f"mean rank {self.work_balance:.2f}")
        for col in ("attention op", "strategy", "layout", "heads / KV", "Ulysses x ring", "heads per rank",
                    "tokens per rank", "checkpoint", "MLP chunks", "overlap"):
            t.add_column(col, justify="right")
        for r in self.attention:
            t.add_row(str(r.index), r.strategy, r.layout, f"{r.heads} / {r.kv_heads}",
                      f"{r.ulysses_degree} x {r.ring_degree}", str(r.heads_per_rank), str(r.tokens_per_rank),
                      r.checkpoint, str(r.mlp_chunks), r.overlap)
        for m in self.mixers:
            t.add_row(m["layer"], f"{m['kind']} ({m['type']})", "", "", "", "", str(self.padded_len), "", "", "")
        t.add_section()
        for kind, c in sorted(self.collectives.items()):
            t.add_row(kind, f"{c['calls']} calls", f"{c['bytes'] / 2**20:.2f} MiB sent",
                      f"{c.get('blocked_s', 0.0) * 1e3:.1f} ms waited", "", "", "", "", "", "")
        return t

    def __str__(self) -> str:
        from rich.console import Console

        console = Console(width=120, record=True)
        with console.capture() as cap:
            console.print(self)
        return cap.get()


def report_of(sp: Any) -> SPReport:
    """The report of ``sp`` (a :class:`autosp.transform.sequence_parallel.SequenceParallel`): what its
    variant running now compiled, and what its graphs observed in the last step."""
    step = getattr(sp, "_step", {"seq_len": 0, "padded_len": 0, "tally": {}})
    decisions = sp.config.decisions
    layout = decisions.mesh.layout
    mesh = SPMesh(sp.sp_degree, layout)
    tiled = {layer: k for r in sp.state.reports for layer, k in r.mlp_chunks.items()}
    fused = {layer: k for r in sp.state.reports for layer, k in r.fused_norms.items()}
    rows = []
    seen = observed(sp.group.group_name).attention_tokens
    for i, (spec, (heads, kv)) in enumerate(zip(sp.state.strategies, sp.state.heads)):
        if seen and i not in seen:
            continue        # a graph that did not run in the last step (another length bucket's)
        strat = resolve(spec)
        u, r = strat.grid(mesh)
        choice = decisions.layer(i)
        nested = choice.checkpoint == "full" and tiled.get(i, 1) > 1 and (
            sp.config.compiler == "eager" or not choice.mlp_region_of_its_own)
        rows.append(AttentionRow(
            index=i, strategy=spec, layout=layout, heads=heads, kv_heads=kv, ulysses_degree=u,
            ring_degree=r, heads_per_rank=heads // u,
            tokens_per_rank=seen.get(i, 0),    # observed as it ran
            checkpoint=choice.checkpoint, mlp_chunks=tiled.get(i, 1), mlp_with_layer=nested, overlap=strat.overlap,
            fused_norms=fused.get(i, 0)))
    groups = {v for kw in sp.strategy_setups.values() for v in kw.values()} | {sp.group.group_name}
    if sp.mesh is not None:
        groups.add(sp.mesh.whole.group_name)
    groups.update(sp.param_groups)
    groups.add(HOST)                      # offload's copies to and from host memory
    counts = _issued(step, groups)
    tp_group = sp.mesh.tp if sp.mesh is not None else None
    tp_counts = _issued(step, {tp_group.group_name}) if tp_group is not None else {}
    tp_report = getattr(sp, "tp_report", None)
    return SPReport(sp_degree=sp.sp_degree, dp_degree=sp.mesh.dp_degree if sp.mesh else 1,
                    zero_stage=sp.zero_stage,
                    grad_buckets=len(sp.reducer.buckets) if sp.reducer else 0,
                    param_gathers=sum(r.param_gathers for r in sp.state.reports),
                    param_prefetched=sum(r.param_prefetched for r in sp.state.reports),
                    seq_len=step["seq_len"], padded_len=step["padded_len"],
                    compiled_graphs=len(sp.state.reports), compiler=sp.config.compiler,
                    attention=rows, collectives=counts,
                    work_per_rank=work_per_rank(step["positions"], layout, sp.sp_degree)
                    if "positions" in step else [],
                    plans=len(sp._plans), compiled_variants=max(len(sp._variants), 1),
                    loss_tokens=_loss_tokens(observed(sp._loss_group_name).loss_tokens),
                    tp_degree=tp_report.degree if tp_report else 1,
                    tp=tp_report.as_dict() if tp_report and tp_report.degree > 1 else {}, tp_collectives=tp_counts,
                    mixers=[asdict(m) for r in sp.state.reports for m in r.mixers])


def _issued(step: dict, groups: set[str]) -> dict[str, dict[str, float]]:
    """Per kind, the collectives ``groups`` issued since the step began: calls, bytes, blocked seconds."""
    counts: dict[str, dict[str, float]] = {}
    for (group, kind), (calls, sent, waited) in TALLY.items():
        before = step["tally"].get((group, kind), (0, 0, 0.0))
        if group in groups and calls > before[0]:
            c = counts.setdefault(kind, {"calls": 0, "bytes": 0, "blocked_s": 0.0})
            c["calls"] += calls - before[0]
            c["bytes"] += sent - before[1]
            c["blocked_s"] += waited - before[2]
    return counts


def _loss_tokens(count: torch.Tensor | None) -> int | None:
    return None if count is None else int(count.item())
