"""SP collectives overlapped with attention, measured against their blocking forms.

    python bench/overlap.py [--ranks 2 4] [--seq-len 16384] [--repeats 5] [--chunks 1 2 4] [--specs ...]

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

A second table splits the Ulysses forms' waits with the all-to-alls' timeline
(``autosp.strategies.collectives.TIMELINE``): the part a rank spent before the last rank had
issued the exchange (its peers' lag: load imbalance and scheduling on shared cores, which no
schedule hides) and the part after (the transfer still in flight, which overlap can hide).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from typing import Callable

from autosp.tools.launch import interleaved_times, spawn_gloo


def measure(seq_len: int, specs: list[str], repeats: int) -> list[dict]:
    """Every configuration compiled and warmed up first, then timed in interleaved rounds (one step of
    each per round), so that drift on a shared machine (and the first configuration's slower
    warm-up of the allocator) falls on all of them alike."""
    import statistics

    import torch
    import torch.distributed as dist

    import autosp
    from autosp.strategies import collectives
    from autosp.tools.validation import tiny_model

    torch.set_num_threads(1)
    ids = torch.randint(0, 2048, (1, seq_len), generator=torch.Generator().manual_seed(0))
    models, waited, losses, calls = {}, {s: [] for s in specs}, {}, {}
    split = {s: [] for s in specs}      # per step, per rank: (peers' lag, transfer) in the all-to-alls
    for spec in specs:
        torch._dynamo.reset()
        strategy, _, layout = spec.partition("@")
        models[spec] = autosp.compile(tiny_model(), strategy=strategy, layout=layout or None)

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
        calls[spec] = issued.get("all_to_all", {}).get("calls", 0)

    times = interleaved_times(specs, step, repeats, dist.barrier)
    waited = {spec: w[-repeats:] for spec, w in waited.items()}     # the timed steps'
    split = {spec: w[-repeats:] for spec, w in split.items()}
    # per step: the rank that waited most, and the one that waited least (the busiest: its waits
    # lie on the step's critical path; a less loaded rank's include waiting for it)
    return [dict(spec=spec, time=statistics.median(times[spec]),
                 exposed=statistics.median(max(w) for w in waited[spec]),
                 critical=statistics.median(min(w) for w in waited[spec]),
                 loss=losses[spec], calls=calls[spec], split=_split_medians(split[spec]))
            for spec in specs]


def _split_medians(steps: list[list[tuple[float, float]]]) -> dict[str, tuple[float, float]]:
    """Medians over steps of (peers' lag, transfer) of the all-to-alls' most- and least-waiting rank."""
    import statistics

    def pick(which: Callable) -> tuple[float, float]:
        chosen = [which(ranks, key=sum) for ranks in steps]
        return (statistics.median(c[0] for c in chosen), statistics.median(c[1] for c in chosen))

    return {"most": pick(max), "least": pick(min)}


def predicted(world: int, seq_len: int, specs: list[str]) -> tuple[dict[str, tuple[float, float]], str]:
    from autosp.costmodel.predict import predict
    from autosp.costmodel.profile import load_profile
    from autosp.graph import capture
    from autosp.planner.search import plan
    from autosp.tools.validation import tiny_model

    prof = load_profile("cpu-gloo")
    # The predicted waits alone: the same profile with no compute slowdown beside a transfer (the
    # overlapped forms' "exposed" also counts the compute they slow down, which no wait shows).
    waits_only = dataclasses.replace(prof, data=copy.deepcopy(prof.data))
    waits_only.data.setdefault("concurrency", {})["compute_slowdown"] = 1.0
    model = tiny_model()
    g = capture(model, seq_len=seq_len, batch_size=1, dtype="float32")
    out = {}
    for spec in specs:
        strategy, _, layout = spec.partition("@")
        kw = dict(sp=world, strategy=strategy, layout=layout or None, seq_len=seq_len,
                  devices_per_node=world)       # every rank on this machine
        p = predict(g, prof, **kw)
        out[spec] = (p.total_s, p.attention_exposed_s, predict(g, waits_only, **kw).attention_exposed_s)
    chosen = {}
    for family in ("ulysses", "allgather_kv"):
        best = plan(None, graph=g, seq_len=seq_len, world_size=world, profile=prof, sp_degrees=(world,),
                    checkpoints=("none",), strategies=(family,), memory_limit=float("inf"), devices_per_node=world)
        chosen[family] = best.layers[0]["strategy"]
    return out, chosen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--specs", nargs="+", default=["zigzag_ring", "allgather_kv", "allgather_kv:overlap",
                                                    "allgather_kv@zigzag", "allgather_kv:overlap@zigzag"],
                    help="strategies measured besides ulysses:cK (SPEC@zigzag: on the zigzag layout)")
    args = ap.parse_args()
    print(f"tiny Llama, S = {args.seq_len}, one thread per rank, median of {args.repeats} steps; exposed = "
          "seconds the most-waiting rank's compute waited on SP collectives per step; ratios against the "
          "same strategy's blocking form (ulysses, allgather_kv on the same layout)")
    print("| ranks | strategy | step (s) | exposed, most-waiting rank (s) | / blocking | exposed, least-waiting "
          "rank (s) | / blocking | step / blocking | predicted step (s) | predicted exposed (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for world in args.ranks:
        specs = [("ulysses" if k == 1 else f"ulysses:c{k}") for k in args.chunks if 8 % (k * world) == 0]
        specs += args.specs
        rows = spawn_gloo(measure, world, threads=1, seq_len=args.seq_len, specs=specs, repeats=args.repeats)
        losses = {round(r["loss"], 4) for r in rows}
        assert len(losses) == 1, f"configurations disagree on the loss: {rows}"
        pred, chosen = predicted(world, args.seq_len, specs)
        by_spec = {r["spec"]: r for r in rows}
        for r in rows:
            pt, pe, _ = pred[r["spec"]]
            base = by_spec.get(blocking_form(r["spec"]), r)
            print(f"| {world} | {r['spec']} | {r['time']:.3f} | {r['exposed']:.3f} | "
                  f"{ratio(r['exposed'], base['exposed'])} | {r['critical']:.3f} | {ratio(r['critical'], base['critical'])} "
                  f"| {r['time'] / base['time']:.2f}x | {pt:.3f} | {pe:.3f} |")
        print("\n| ranks | strategy | most-waiting rank: peers' lag / transfer (s) | / blocking | least-waiting "
              "rank: peers' lag / transfer (s) | / blocking | predicted waits (s) |\n|---|---|---|---|---|---|---|")
        for r in rows:
            if r["spec"].startswith("ulysses"):
                (ml, mt), (ll, lt) = r["split"]["most"], r["split"]["least"]
                base = by_spec.get("ulysses", r)["split"]          # the blocking form, where measured
                bt, blt = base["most"][1], base["least"][1]
                print(f"| {world} | {r['spec']} | {ml:.3f} / {mt:.3f} | {ratio(mt, bt)} | {ll:.3f} / {lt:.3f} | "
                      f"{ratio(lt, blt)} | {pred[r['spec']][2]:.3f} |")
        print()
        for family, pick in chosen.items():
            measured = [r for r in rows if r["spec"].split("@")[0].split(":")[0] == family and "@" not in r["spec"]]
            if not measured:
                continue
            best = min(measured, key=lambda r: r["time"])
            print(f"| {world} | planner's choice: {pick} | measured best: {best['spec']} "
                  f"({pred_gap(rows, pick, best):+.1%} step vs the best) | | | | | | | |")


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
