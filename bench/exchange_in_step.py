"""Each all-to-all of a blocking SP step, timed inside the step and alone.

    python bench/exchange_in_step.py [--ranks 2] [--strategy ulysses] [--seq-len 16384] [--steps 7]

The cost model charges an exchange its collective table's time (timed alone, every rank entering
together after a barrier) plus the sync skew's transfer part. ``bench/overlap.py`` finds blocking
Ulysses' transfers on 2 gloo ranks slower in the step than that sum. This bench shows where: the
benches' tiny Llama (as ``bench/overlap.py``: hidden 256, 8 heads, 2 layers, fp32, one thread
per rank, glibc keeping freed memory) runs ``--steps`` steps (the first untimed) with the backend's
``all_to_all_single`` wrapped, so that each exchange's position, bytes, time after the last rank
issued it (mean over ranks, as the overlap bench's timeline counts transfer) and minor page faults
are recorded; then the same sizes alone, in the same processes: after a barrier (the table's
regime), and after the ranks slept 100 ms (their transfer threads idle for as long as a step's
compute between exchanges keeps them).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time


def measure(strategy: str, seq_len: int, steps: int, repeats: int = 9) -> dict:
    import torch
    import torch.distributed as dist

    import autosp
    from autosp.tools.validation import tiny_model

    torch.set_num_threads(1)
    world = dist.get_world_size()
    record: list[tuple[float, float, int, int]] = []
    backend_call = dist.all_to_all_single

    def timed(output, input, *args, **kwargs):
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        work = backend_call(output, input, *args, **kwargs)
        record.append((t0, time.perf_counter(), input.numel() * input.element_size(),
                       resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults))
        return work

    dist.all_to_all_single = timed
    try:
        ids = torch.randint(0, 2048, (1, seq_len), generator=torch.Generator().manual_seed(0))
        model = autosp.compile(tiny_model(), plan=strategy)
        in_step = []
        for _ in range(steps):
            record.clear()
            dist.barrier()
            model(input_ids=ids, labels=ids).loss.backward()
            for p in model.parameters():
                p.grad = None
            in_step.append(list(record))
        in_step = in_step[1:]                   # the first step compiles and grows the heap
        sizes = sorted({nbytes for _, _, nbytes, _ in in_step[0]})
        alone = {}
        for regime, before in (("after a barrier", lambda: None), ("after 100 ms idle", lambda: time.sleep(0.1))):
            for nbytes in sizes:
                x = torch.randn(nbytes // 4)
                calls = []
                for _ in range(repeats + 1):
                    record.clear()
                    dist.barrier()
                    before()
                    dist.all_to_all_single(torch.empty_like(x), x)
                    calls.append(list(record))
                alone[(regime, nbytes)] = calls[1:]
    finally:
        dist.all_to_all_single = backend_call
    every = [None] * world
    dist.all_gather_object(every, (in_step, alone))
    steps_of = [ranks_steps for ranks_steps, _ in every]
    per_exchange = []                           # per position: (bytes, [transfer per step], faults)
    for i in range(len(steps_of[0][0])):
        took = [_transfer([r[s][i] for r in steps_of]) for s in range(len(steps_of[0]))]
        faults = sum(r[s][i][3] for r in steps_of for s in range(len(steps_of[0])))
        per_exchange.append((steps_of[0][0][i][2], took, faults))
    alone_of = {key: [_transfer([r[1][key][c][0] for r in every]) for c in range(repeats)] for key in every[0][1]}
    return {"exchanges": per_exchange, "alone": alone_of}


def _transfer(calls: list[tuple[float, float, int, int]]) -> float:
    """One exchange on every rank (issue, return, ...): its transfer part as the overlap bench's
    timeline counts it (:func:`autosp.strategies.collectives.split_waits`), mean over ranks."""
    from autosp.strategies.collectives import split_waits

    return statistics.mean(transfer for _, transfer in split_waits([[(c[0], c[0], c[1])] for c in calls]))


def main() -> None:
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from overlap import KEEP_FREED_MEMORY

    from autosp.tools.launch import spawn_gloo

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--strategy", default="ulysses", help="a blocking form (its exchanges are synchronous calls)")
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=7)
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the first is untimed)")
    os.environ.update(KEEP_FREED_MEMORY)
    res = spawn_gloo(measure, args.ranks, threads=1, strategy=args.strategy, seq_len=args.seq_len, steps=args.steps)
    ms = lambda s: f"{s * 1e3:.2f}"  # noqa: E731
    print(f"{args.strategy}, {args.ranks} gloo ranks, S = {args.seq_len}, {args.steps - 1} timed steps; ms after the "
          "last rank issued, mean over ranks")
    print("| exchange | MiB | median in the step | mean in the step | min-max | minor faults |\n|---|---|---|---|---|---|")
    for i, (nbytes, took, faults) in enumerate(res["exchanges"]):
        print(f"| {i} | {nbytes / 2**20:g} | {ms(statistics.median(took))} | {ms(statistics.mean(took))} | "
              f"{ms(min(took))}-{ms(max(took))} | {faults} |")
    print("\n| MiB | in the step: median / mean | alone after a barrier: median / mean | alone after 100 ms idle: "
          "median / mean | step median / barrier median |\n|---|---|---|---|---|")
    for nbytes in sorted({n for n, _, _ in res["exchanges"]}):
        took = [t for n, ts, _ in res["exchanges"] if n == nbytes for t in ts]
        barrier, idle = res["alone"][("after a barrier", nbytes)], res["alone"][("after 100 ms idle", nbytes)]
        print(f"| {nbytes / 2**20:g} | {ms(statistics.median(took))} / {ms(statistics.mean(took))} | "
              f"{ms(statistics.median(barrier))} / {ms(statistics.mean(barrier))} | "
              f"{ms(statistics.median(idle))} / {ms(statistics.mean(idle))} | "
              f"{statistics.median(took) / statistics.median(barrier):.2f}x |")


if __name__ == "__main__":
    main()
