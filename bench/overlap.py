"""SP collectives overlapped with attention, measured against their blocking forms.

    python bench/overlap.py [--ranks 2 4] [--seq-len 16384] [--repeats 15] [--chunks 1 2 4] [--specs ...]
                            [--save F.json]

Ulysses' all-to-alls pipelined in K head groups, all-gather-KV's gather and reduce-scatter beside
the own block (``allgather_kv:overlap``); ``SPEC@zigzag`` runs a spec on the zigzag layout.

The benches' tiny Llama (hidden 256, 8 heads, 4 KV heads, 2 layers, fp32, random weights), batch 1,
on N gloo ranks with one thread each. For each configuration: the median step time, and the
*exposed communication* per step: the seconds the compute thread spent blocked in the strategy's
collectives (waiting for an in-flight transfer, or inside a blocking one), counted at run time
(``sp.report()``'s ``blocked_s``) on every rank: of the rank that waited most, and of the one that
waited least (the busiest, whose waits lie on the step's critical path). Blocked time includes
waiting for a slower peer: under the contiguous layout all-gather-KV's last rank does the most
causal work and the others wait for it (the zigzag rows balance it). Ratios are against the same
strategy's blocking form. Next to them: the cost model's prediction of both (profile ``cpu-gloo``,
with its measured concurrency slowdowns), and the planner's choice within each family. Losses of
all configurations must agree (the same model and batch), checked before printing.

A second table splits every form's waits with the SP collectives' timeline
(``autosp.strategies.collectives.TIMELINE``): the part a rank spent before the last rank had
issued the exchange (its peers' lag: load imbalance and scheduling on shared cores, which no
schedule hides) and the part after (the transfer still in flight, which overlap can hide). The
transfer is predicted by the cost model with, of its sync skew, only the part after the last rank
issued (where ranks share cores a rank that has its data computes again and slows a peer still
receiving) and without the compute slowdown (the quantity the timeline's transfer measures),
twice: with the shipped profile's collective tables and skew, and with tables of the step's own
collectives timed alone and the skew measured in the same processes right after the steps
(:func:`time_alone`), which takes this machine's drift (20-50% between runs) out of the
comparison and leaves the overlap formulas' error. The tables are timed right after a barrier, as
``autosp profile`` times them; a third prediction takes them timed after the ranks idled 100 ms,
the other end of the range ``bench/exchange_in_step.py`` finds a step's exchanges in (at 2 ranks
the step's lie between the two).

A third table splits the transfer waits into the forward's exchanges and the backward's, measured
and predicted with the tables timed now, to show which phase a prediction's error lies in.

Ratios and errors carry a 90% interval ``[5%-95%]``: the timed rounds resampled with replacement
(a round holds one step of every configuration, so a configuration and its blocking form stay
paired and the drift between rounds stays out of their ratio); the planner's choice carries the
share of resamples in which it is within 5% of the fastest. ``--save F.json`` keeps every step's
measurements (and every exchange's timeline) and the predictions.

The ranks run with glibc told to keep the memory it frees (``--allocator keep``, the default:
``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_`` set for the spawned
ranks), as CUDA's caching allocator keeps its blocks. With glibc's default the backward hands
large blocks back to the OS and every step's receive buffers are faulted in afresh, page by
page, inside the transfer: 2 MiB received into a fresh tensor took 1.45 ms against 0.73 ms into
a reused one (512 minor faults a call), which the collective tables, timed into reused buffers,
do not hold. ``--allocator default`` measures that.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
from typing import Callable

from autosp.costmodel.profile import load_profile
from autosp.tools.launch import interleaved_times, spawn_gloo


def measure(seq_len: int, specs: list[str], repeats: int, sizes: list[tuple[str, int, int]]
            ) -> tuple[list[dict], dict[tuple[str, int], float], dict]:
    """Every configuration compiled and warmed up first, then timed in interleaved rounds (one step of
    each per round), so that drift on a shared machine (and the first configuration's slower
    warm-up of the allocator) falls on all of them alike. Then each of ``sizes``' collectives alone,
    in the same processes (:func:`time_alone`), and the sync skew with its transfer part
    (:func:`autosp.costmodel.sync_skew.measure_sync_skew`, as ``autosp profile`` measures it)."""
    import torch
    import torch.distributed as dist

    import autosp
    from autosp.costmodel.sync_skew import measure_sync_skew
    from autosp.strategies import collectives
    from autosp.tools.validation import tiny_model

    torch.set_num_threads(1)
    ids = torch.randint(0, 2048, (1, seq_len), generator=torch.Generator().manual_seed(0))
    models, waited, losses, calls = {}, {s: [] for s in specs}, {}, {}
    split = {s: [] for s in specs}      # per step, per rank: (peers' lag, transfer) in the SP collectives
    lines = {s: [] for s in specs}      # per step, per rank: (issued, waited from, done) of each exchange
    for spec in specs:
        torch._dynamo.reset()
        strategy, _, layout = spec.partition("@")
        models[spec] = autosp.compile(tiny_model(), plan=autosp.Decisions.of(strategy=strategy, mesh=autosp.MeshChoice(layout=layout or None)))

    def step(spec: str) -> None:
        sp = models[spec]
        collectives.TIMELINE = []
        loss = sp(input_ids=ids, labels=ids).loss
        loss.backward()
        for p in sp.parameters():
            p.grad = None
        losses[spec] = loss.item()
        issued = sp.report().collectives          # read before another model's step adds to the tally
        mine = sum(c.get("blocked_s", 0.0) for kind, c in issued.items()
                   if kind not in ("all_reduce", "grad_all_reduce"))
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        waited[spec].append(every)
        timelines = [None] * dist.get_world_size()
        dist.all_gather_object(timelines, collectives.TIMELINE)
        collectives.TIMELINE = None
        split[spec].append(collectives.split_waits(timelines))
        lines[spec].append(timelines)
        calls[spec] = issued.get("all_to_all", {}).get("calls", 0)

    times = interleaved_times(specs, step, repeats, dist.barrier)
    waited = {spec: w[-repeats:] for spec, w in waited.items()}     # the timed steps'
    split = {spec: w[-repeats:] for spec, w in split.items()}
    # per step: the rank that waited most, and the one that waited least (the busiest: its waits
    # lie on the step's critical path; a less loaded rank's include waiting for it)
    rows = [dict(spec=spec, time=statistics.median(times[spec]),
                 exposed=statistics.median(max(w) for w in waited[spec]),
                 critical=statistics.median(min(w) for w in waited[spec]),
                 loss=losses[spec], calls=calls[spec], split=_split_medians(split[spec]),
                 rounds=dict(time=times[spec], critical=[min(w) for w in waited[spec]],
                             transfer=[sum(r[1] for r in ranks) / len(ranks) for ranks in split[spec]],
                             timelines=lines[spec][-repeats:]))
            for spec in specs]
    alone = {regime: time_alone(sizes, repeats=31, idle=idle) for regime, idle in (("barrier", 0.0), ("idle", 0.1))}
    world = dist.get_world_size()
    return rows, alone, measure_sync_skew(torch.device("cpu"), lambda: None, [(world, None)], repeats=7)


def time_alone(sizes: list[tuple[str, int, int]], repeats: int, idle: float = 0.0) -> dict[tuple[str, int], float]:
    """Seconds of each (collective, group, per-rank bytes) alone, issued as the strategies' ops
    issue it (a fresh output each call; gloo's reduce-scatter is an all-reduce), the ranks
    starting together after a barrier (and ``idle`` seconds of sleep after it). Per call the
    least-waiting rank's time (the last to arrive waits for the transfer only), median over
    calls: the table the step's transfers would have if profiled now, on this machine as loaded
    as the steps found it."""
    import time

    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    calls: dict[tuple[str, int], Callable[[], None]] = {}
    for name, group, nbytes in sizes:
        if group != world:
            raise ValueError(f"a {name} over {group} of {world} ranks: the bench times whole-world collectives")
        x = torch.randn(max(world, nbytes // 4 // world * world))
        if name == "all_to_all":
            fn = lambda x=x: dist.all_to_all_single(torch.empty_like(x), x)  # noqa: E731
        elif name == "all_gather":
            fn = lambda x=x: dist.all_gather([torch.empty_like(x) for _ in range(world)], x)  # noqa: E731
        elif name in ("reduce_scatter", "all_reduce"):
            fn = lambda x=x: dist.all_reduce(x)  # noqa: E731
        else:
            raise ValueError(f"no timing for a {name} here")
        calls[(name, nbytes)] = fn

    def timed(fn: Callable[[], None]) -> float:
        dist.barrier()
        time.sleep(idle)
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    for fn in calls.values():                       # the first call of each warms up
        timed(fn)
    # in rounds of one call of each size, so that the machine's drift while they are timed (which
    # moved one size's median by a third between runs when each was timed in a block) falls on all
    mine: dict[tuple[str, int], list[float]] = {key: [] for key in calls}
    for _ in range(repeats):
        for key, fn in calls.items():
            mine[key].append(timed(fn))
    every = [None] * world
    dist.all_gather_object(every, mine)
    return {key: statistics.median(min(r[key][i] for r in every) for i in range(repeats)) for key in mine}


def _split_medians(steps: list[list[tuple[float, float]]]) -> dict[str, tuple[float, float]]:
    """Medians over steps of (peers' lag, transfer) in the SP collectives: of the most- and the
    least-waiting rank, and the mean over ranks."""
    def pick(which: Callable) -> tuple[float, float]:
        chosen = [which(ranks) for ranks in steps]
        return (statistics.median(c[0] for c in chosen), statistics.median(c[1] for c in chosen))

    def mean(ranks: list[tuple[float, float]]) -> tuple[float, float]:
        return (sum(r[0] for r in ranks) / len(ranks), sum(r[1] for r in ranks) / len(ranks))

    return {"most": pick(lambda ranks: max(ranks, key=sum)), "least": pick(lambda ranks: min(ranks, key=sum)),
            "mean": pick(mean)}


def transfer_sizes(graph, world: int, seq_len: int, specs: list[str]) -> list[tuple[str, int, int]]:
    """(collective, group, per-rank bytes) of every transfer the specs' attention issues."""
    from autosp.costmodel.predict import attention_shape
    from autosp.strategies import SPMesh, required_layout, resolve

    shape = attention_shape(graph.attention_nodes("fwd")[0], seq_len)
    out = set()
    for spec in specs:
        strategy, _, layout = spec.partition("@")
        strat = resolve(strategy)
        mesh = SPMesh(world, layout or required_layout([strat]) or "contiguous", world)
        out |= {(t.collective, t.group, int(t.nbytes)) for t in strat.cost(shape, mesh).transfers}
    return sorted(out)


def with_tables(prof, world: int, alone: dict[tuple[str, int], float], skew: dict):
    """``prof`` with its collectives over ``world`` ranks timed now (:func:`time_alone`), the part
    of the sync skew measured now that lies after the last rank issued (``skew``), and no compute
    slowdown: what it predicts is the transfers' waits alone, the quantity the timeline's
    "transfer" measures."""
    data = copy.deepcopy(prof.data)
    for (name, nbytes), seconds in alone.items():
        rows = data["collectives"][name]["intra"].setdefault(str(world), [])
        if rows and "now" not in rows[0]:
            rows.clear()
        rows.append({"bytes": nbytes, "seconds": seconds, "now": True})
    for rows in (data["collectives"][n]["intra"][str(world)] for n in {n for n, _ in alone}):
        rows.sort(key=lambda r: r["bytes"])
    data["sync_skew"] = {"seconds": dict(skew.get("transfer_seconds", {}))}
    data.setdefault("concurrency", {})["compute_slowdown"] = 1.0
    return dataclasses.replace(prof, data=data)


def predicted(graph, world: int, seq_len: int, specs: list[str], alone: dict[str, dict[tuple[str, int], float]],
              skew: dict) -> tuple[dict[str, tuple[float, ...]], dict[str, str]]:
    """Per spec: (step, exposed, transfer waits with the shipped tables, with the tables timed in
    the run after a barrier, with them timed after 100 ms idle, and the backward's share of the
    in-run-barrier prediction); and the planner's choice within each family."""
    from autosp.costmodel.predict import predict
    from autosp.costmodel.profile import load_profile
    from autosp.planner.problem import Problem
    from autosp.planner.search import plan

    prof = load_profile("cpu-gloo")
    # The transfers' waits alone: of the sync skew only its transfer part (the timeline counts the
    # peers' lag apart) and no compute slowdown beside a transfer (the overlapped forms' "exposed"
    # counts the compute they slow down, which no wait shows).
    shipped = dataclasses.replace(prof, data=copy.deepcopy(prof.data))
    shipped.data["sync_skew"] = {"seconds": dict(prof.data.get("sync_skew", {}).get("transfer_seconds", {}))}
    shipped.data.setdefault("concurrency", {})["compute_slowdown"] = 1.0
    now = {regime: with_tables(prof, world, tables, skew) for regime, tables in alone.items()}
    out = {}
    for spec in specs:
        strategy, _, layout = spec.partition("@")
        kw = dict(sp=world, strategy=strategy, layout=layout or None, seq_len=seq_len,
                  devices_per_node=world)       # every rank on this machine
        p = predict(graph, prof, **kw)
        p_now = predict(graph, now["barrier"], **kw)
        out[spec] = (p.total_s, p.attention_exposed_s, predict(graph, shipped, **kw).attention_exposed_s,
                     p_now.attention_exposed_s, predict(graph, now["idle"], **kw).attention_exposed_s,
                     p_now.attention_exposed_bwd_s)
    chosen = {}
    for family in ("ulysses", "allgather_kv"):
        best = plan(Problem.of(graph=graph, seq_len=seq_len, world_size=world, profile=prof, sp_degrees=(world,),
                               checkpoints=("none",), strategies=(family,), memory_limit=float("inf"),
                               devices_per_node=world))
        chosen[family] = best.layers[0].choice.strategy
    return out, chosen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=15,
                    help="timed rounds; fewer than about 10 leave the 90%% intervals wide")
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--specs", nargs="+", default=["zigzag_ring", "allgather_kv", "allgather_kv:overlap",
                                                    "allgather_kv@zigzag", "allgather_kv:overlap@zigzag"],
                    help="strategies measured besides ulysses:cK (SPEC@zigzag: on the zigzag layout)")
    ap.add_argument("--allocator", choices=["keep", "default"], default="keep",
                    help="keep: glibc keeps freed memory (as a caching allocator does); default: glibc's own")
    ap.add_argument("--save", metavar="JSON", help="write every step's measurements and the predictions here")
    args = ap.parse_args()
    saved = {}
    if args.allocator == "keep":            # read by glibc when each spawned rank starts
        os.environ.update(KEEP_FREED_MEMORY)
    print(f"tiny Llama, S = {args.seq_len}, one thread per rank, median of {args.repeats} steps; exposed = "
          "seconds the most-waiting rank's compute waited on SP collectives per step; ratios against the "
          f"same strategy's blocking form (ulysses, allgather_kv on the same layout); allocator: {args.allocator}")
    print("| ranks | strategy | step (s) | exposed, most-waiting rank (s) | / blocking | exposed, least-waiting "
          "rank (s) | / blocking | step / blocking | predicted step (s) | predicted exposed (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for world in args.ranks:
        specs = [("ulysses" if k == 1 else f"ulysses:c{k}") for k in args.chunks if 8 % (k * world) == 0]
        specs += args.specs
        graph = tiny_graph(args.seq_len)
        sizes = transfer_sizes(graph, world, args.seq_len, specs)
        rows, alone, skew = spawn_gloo(measure, world, threads=1, seq_len=args.seq_len, specs=specs,
                                       repeats=args.repeats, sizes=sizes)
        losses = {round(r["loss"], 4) for r in rows}
        assert len(losses) == 1, f"configurations disagree on the loss: {rows}"
        pred, chosen = predicted(graph, world, args.seq_len, specs, alone, skew)
        saved[world] = dict(rows=rows, predicted=pred, chosen=chosen, skew=skew,
                            alone={regime: [[*key, t] for key, t in tables.items()] for regime, tables in alone.items()})
        if args.save:                       # after every world size, so that a later failure loses nothing
            with open(args.save, "w") as f:
                json.dump(saved, f, indent=1)
        by_spec = {r["spec"]: r for r in rows}
        for r in rows:
            pt, pe, *_ = pred[r["spec"]]
            base = by_spec.get(blocking_form(r["spec"]), r)
            print(f"| {world} | {r['spec']} | {r['time']:.3f} | {r['exposed']:.3f} | "
                  f"{ratio(r['exposed'], base['exposed'])} | {r['critical']:.3f} | {ratio(r['critical'], base['critical'])} "
                  f"{paired(r, base, 'critical')} | {r['time'] / base['time']:.2f}x {paired(r, base, 'time')} "
                  f"| {pt:.3f} | {pe:.3f} |")
        shipped = load_profile("cpu-gloo")
        print(f"\n{world} ranks, the step's collectives alone now (ms) against the shipped table: " + ", ".join(
            f"{name} {nbytes / 2**20:.1f} MiB {t * 1e3:.2f} vs {shipped.collective_time(name, world, nbytes) * 1e3:.2f}"
            for (name, nbytes), t in sorted(alone["barrier"].items())))
        print(f"{world} ranks, the same after 100 ms idle (ms): " + ", ".join(
            f"{name} {nbytes / 2**20:.1f} MiB {t * 1e3:.2f}" for (name, nbytes), t in sorted(alone["idle"].items())))
        print(f"{world} ranks, sync skew now (ms): {skew['seconds'][str(world)] * 1e3:.2f}, of it after the last rank "
              f"issued {skew.get('transfer_seconds', {}).get(str(world), 0.0) * 1e3:.2f}; shipped "
              f"{shipped.sync_skew(world) * 1e3:.2f}, {shipped.sync_skew(world, transfer_only=True) * 1e3:.2f}")
        print("\n| ranks | strategy | most-waiting rank: peers' lag / transfer (s) | least-waiting rank: peers' lag "
              "/ transfer (s) | transfer, mean over ranks (s) | / blocking | predicted transfer, shipped tables (s) "
              "| error | predicted transfer, tables timed now (s) | error | the same, tables timed after 100 ms idle (s) "
              "| error |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            (ml, mt), (ll, lt), (_, mean) = r["split"]["most"], r["split"]["least"], r["split"]["mean"]
            base = by_spec.get(blocking_form(r["spec"]), r)["split"]["mean"][1]
            _, _, p_shipped, p_now, p_idle, _ = pred[r["spec"]]
            print(f"| {world} | {r['spec']} | {ml:.3f} / {mt:.3f} | {ll:.3f} / {lt:.3f} | {mean:.3f} | "
                  f"{ratio(mean, base)} | {p_shipped:.3f} | {error(p_shipped, mean)} | {p_now:.3f} | {error(p_now, mean)} "
                  f"{error_interval(p_now, r)} | {p_idle:.3f} | {error(p_idle, mean)} |")
        print("\n| ranks | strategy | transfer, forward: measured / predicted (s) | error | backward: measured / "
              "predicted (s) | error |\n|---|---|---|---|---|---|")
        for r in rows:                      # where the prediction errs: the tables timed now, phase by phase
            _, _, _, p_now, _, p_bwd = pred[r["spec"]]
            fwd, bwd = phase_transfers(r["rounds"]["timelines"])
            print(f"| {world} | {r['spec']} | {fwd:.4f} / {p_now - p_bwd:.4f} | {error(p_now - p_bwd, fwd)} | "
                  f"{bwd:.4f} / {p_bwd:.4f} | {error(p_bwd, bwd)} |")
        print()
        for family, pick in chosen.items():
            measured = [r for r in rows if r["spec"].split("@")[0].split(":")[0] == family and "@" not in r["spec"]]
            if not measured:
                continue
            best = min(measured, key=lambda r: r["time"])
            if not any(r["spec"] == pick for r in measured):
                print(f"| {world} | planner's choice: {pick} | not measured (add it to --specs) | | | | | | | |")
                continue
            lo, hi, within = choice_interval(measured, pick)
            print(f"| {world} | planner's choice: {pick} | measured best: {best['spec']} "
                  f"({pred_gap(rows, pick, best):+.1%} step vs the best, 90% interval {lo:+.1%} to {hi:+.1%}; "
                  f"within 5% in {within:.0%} of resampled rounds) | | | | | | | |")


KEEP_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": "4294967296",     # no block of up to 4 GiB mmapped apart
                     "MALLOC_TRIM_THRESHOLD_": "68719476736",    # free memory never returned to the OS
                     "MALLOC_TOP_PAD_": "268435456"}             # the heap grown 256 MiB at a time


def tiny_graph(seq_len: int):
    from autosp.graph import capture
    from autosp.tools.validation import tiny_model

    return capture(tiny_model(), seq_len=seq_len, batch_size=1, dtype="float32")


def phase_transfers(steps: list[list[list[tuple[float, float, float]]]]) -> tuple[float, float]:
    """Medians over steps of the transfer waits (mean over ranks) of the forward's exchanges and of
    the backward's. Every rank's timeline lists its waits in order, the forward's first; each
    forward exchange has one backward exchange (its gradient), so the first half is the forward's."""
    from autosp.strategies.collectives import split_waits

    def part(step: list, lo: int, hi: int) -> float:
        ranks = split_waits([mine[lo:hi] for mine in step])
        return sum(t for _, t in ranks) / len(ranks)

    n = len(steps[0][0])
    if n % 2:
        raise ValueError(f"{n} exchanges a step: the forward's and the backward's do not pair up")
    return (statistics.median(part(st, 0, n // 2) for st in steps),
            statistics.median(part(st, n // 2, n) for st in steps))


def interval(stat: Callable[[list[int]], float], rounds: int, draws: int = 2000) -> tuple[float, float]:
    """The 5th and 95th percentiles of ``stat`` over the timed rounds resampled with replacement.
    A round holds one step of every configuration (:func:`interleaved_times`), so resampling
    rounds keeps a configuration and its blocking form paired: drift between rounds, which falls
    on both, stays out of their ratio, and what is left is how well the steps decide it."""
    import math
    import random

    rng = random.Random(0)
    values = sorted(v for v in (stat([rng.randrange(rounds) for _ in range(rounds)]) for _ in range(draws))
                    if not math.isnan(v))
    return (values[int(0.05 * len(values))], values[int(0.95 * len(values)) - 1]) if values else (math.nan, math.nan)


def _median_of(values: list[float], idx: list[int]) -> float:
    return statistics.median(values[i] for i in idx)


def paired(r: dict, base: dict, key: str) -> str:
    """[5%-95%] of the ratio of ``key``'s medians to the blocking form's, rounds resampled."""
    if r is base:
        return ""
    a, b = r["rounds"][key], base["rounds"][key]
    lo, hi = interval(lambda i: _median_of(a, i) / d if (d := _median_of(b, i)) > 0 else float("nan"), len(a))
    return f"[{lo:.2f}-{hi:.2f}]"


def error_interval(predicted: float, r: dict) -> str:
    """[5%-95%] of the prediction's relative error, the measured transfer's rounds resampled."""
    t = r["rounds"]["transfer"]
    if statistics.median(t) < 0.005:
        return ""
    lo, hi = interval(lambda i: predicted / m - 1 if (m := _median_of(t, i)) > 0 else float("nan"), len(t))
    return f"[{lo:+.0%} to {hi:+.0%}]"


def choice_interval(measured: list[dict], pick: str) -> tuple[float, float, float]:
    """The planner's pick's step against the family's fastest, rounds resampled: the 5th and 95th
    percentiles of the gap and the share of resamples in which it is within 5%."""
    mine = next(r for r in measured if r["spec"] == pick)
    n = len(mine["rounds"]["time"])
    gaps = []

    def gap(idx: list[int]) -> float:
        g = _median_of(mine["rounds"]["time"], idx) / min(_median_of(r["rounds"]["time"], idx) for r in measured) - 1
        gaps.append(g)
        return g

    lo, hi = interval(gap, n)
    return lo, hi, sum(g <= 0.05 for g in gaps) / len(gaps)


def error(predicted: float, measured: float) -> str:
    """Relative where the measured wait is at least 5 ms; below that (a transfer hidden whole)
    the difference in ms, a ratio of two near-zero waits saying nothing."""
    if measured >= 0.005:
        return f"{predicted / measured - 1:+.0%}"
    return f"{(predicted - measured) * 1e3:+.1f} ms"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "-"


def blocking_form(spec: str) -> str:
    strategy, at, layout = spec.partition("@")
    return strategy.split(":")[0] + at + layout


def pred_gap(rows: list[dict], chosen: str, best: dict) -> float:
    mine = next((r for r in rows if r["spec"] == chosen), None)
    return mine["time"] / best["time"] - 1 if mine else float("nan")


if __name__ == "__main__":
    main()
