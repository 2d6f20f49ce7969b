"""Ulysses' all-to-alls overlapped with attention: head groups pipelined, measured against unpipelined.

    python bench/overlap.py [--ranks 2 4] [--seq-len 16384] [--repeats 5] [--chunks 1 2 4]

The benches' tiny Llama (hidden 256, 8 heads, 4 KV heads, 2 layers, fp32, random weights), batch 1,
on N gloo ranks with one thread each. For each head-group count K (``ulysses:cK``; K = 1 is plain
Ulysses, every all-to-all blocking) and ``zigzag_ring`` / ``allgather_kv`` for reference: the
median step time, and the *exposed communication* per step: the seconds rank 0's compute thread
spent blocked in the strategy's collectives (waiting for an all-to-all, or inside a blocking one),
counted at run time (``sp.report()``'s ``blocked_s``). Blocked time includes waiting for a slower
peer: all-gather-KV's contiguous layout gives the last rank the most causal work, so rank 0 waits. Next to them: the cost model's prediction of both (profile
``cpu-gloo``, with its measured concurrency slowdowns), and the planner's choice of K. Losses of
all configurations must agree (the same model and batch), checked before printing.
"""

from __future__ import annotations

import argparse

from autosp.tools.launch import interleaved_times, spawn_gloo


def measure(seq_len: int, specs: list[str], repeats: int) -> list[dict]:
    """Every configuration compiled and warmed up first, then timed in interleaved rounds (one step of
    each per round), so that drift on a shared machine (and the first configuration's slower
    warm-up of the allocator) falls on all of them alike."""
    import statistics

    import torch
    import torch.distributed as dist

    import autosp
    from autosp.tools.validation import tiny_model

    torch.set_num_threads(1)
    ids = torch.randint(0, 2048, (1, seq_len), generator=torch.Generator().manual_seed(0))
    models, waited, losses, calls = {}, {s: [] for s in specs}, {}, {}
    for spec in specs:
        torch._dynamo.reset()
        models[spec] = autosp.compile(tiny_model(), strategy=spec)

    def step(spec: str) -> None:
        sp = models[spec]
        loss = sp(input_ids=ids, labels=ids).loss
        loss.backward()
        for p in sp.parameters():
            p.grad = None
        losses[spec] = loss.item()
        issued = sp.report().collectives          # read before another model's step adds to the tally
        waited[spec].append(sum(c.get("blocked_s", 0.0) for kind, c in issued.items()
                                if kind not in ("all_reduce", "grad_all_reduce")))
        calls[spec] = issued.get("all_to_all", {}).get("calls", 0)

    times = interleaved_times(specs, step, repeats, dist.barrier)
    waited = {spec: w[-repeats:] for spec, w in waited.items()}     # the timed steps'
    return [dict(spec=spec, time=statistics.median(times[spec]), exposed=statistics.median(waited[spec]),
                 loss=losses[spec], calls=calls[spec])
            for spec in specs]


def predicted(world: int, seq_len: int, specs: list[str]) -> tuple[dict[str, tuple[float, float]], str]:
    from autosp.costmodel.predict import predict
    from autosp.costmodel.profile import load_profile
    from autosp.graph import capture
    from autosp.planner.search import plan
    from autosp.tools.validation import tiny_model

    prof = load_profile("cpu-gloo")
    model = tiny_model()
    g = capture(model, seq_len=seq_len, batch_size=1, dtype="float32")
    out = {}
    for spec in specs:
        p = predict(g, prof, sp=world, strategy=spec, seq_len=seq_len)
        out[spec] = (p.total_s, p.attention_exposed_s)
    chosen = plan(None, graph=g, seq_len=seq_len, world_size=world, profile=prof, sp_degrees=(world,),
                  checkpoints=("none",), strategies=("ulysses",), memory_limit=float("inf"))
    return out, chosen.layers[0]["strategy"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args()
    print(f"tiny Llama, S = {args.seq_len}, one thread per rank, median of {args.repeats} steps; exposed = "
          "seconds rank 0's compute waited on SP collectives per step")
    print("| ranks | strategy | step (s) | exposed comm (s) | exposed / K=1 | step / K=1 | predicted step (s) "
          "| predicted exposed (s) | all-to-alls |")
    print("|---|---|---|---|---|---|---|---|---|")
    for world in args.ranks:
        specs = [("ulysses" if k == 1 else f"ulysses:c{k}") for k in args.chunks if 8 % (k * world) == 0]
        specs += ["zigzag_ring", "allgather_kv"]
        rows = spawn_gloo(measure, world, threads=1, seq_len=args.seq_len, specs=specs, repeats=args.repeats)
        losses = {round(r["loss"], 4) for r in rows}
        assert len(losses) == 1, f"configurations disagree on the loss: {rows}"
        pred, chosen = predicted(world, args.seq_len, specs)
        base = rows[0]
        for r in rows:
            pt, pe = pred[r["spec"]]
            print(f"| {world} | {r['spec']} | {r['time']:.3f} | {r['exposed']:.3f} | "
                  f"{r['exposed'] / base['exposed']:.2f}x | {r['time'] / base['time']:.2f}x | {pt:.3f} | {pe:.3f} "
                  f"| {r['calls']} |")
        best = min((r for r in rows if r["spec"].startswith("ulysses")), key=lambda r: r["time"])
        print(f"| {world} | planner's choice: {chosen} | measured best: {best['spec']} "
              f"({pred_gap(rows, chosen, best):+.1%} step vs the best) | | | | | | |")


def pred_gap(rows: list[dict], chosen: str, best: dict) -> float:
    mine = next((r for r in rows if r["spec"] == chosen), None)
    return mine["time"] / best["time"] - 1 if mine else float("nan")


if __name__ == "__main__":
    main()
