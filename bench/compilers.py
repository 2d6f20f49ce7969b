"""What the compiled path buys: eager vs AOTAutograd vs Inductor on the same SP step.

    MALLOC_MMAP_THRESHOLD_=65536 python bench/compilers.py [--seq-len 8192] [--repeats 3]

Built-in tiny Llama (hidden 256, 8 heads, 4 KV heads, 2 layers), fp32, Ulysses over 2 gloo
ranks, one thread each, same weights and batch for every compiler. Per compiler: the first
step (compile included), the median step after it, the per-rank peak resident memory above
the steady state during one step (``autosp.tools.memory_probe.RssPeak``: the OS's view,
which also sees Inductor's allocations), and the loss against one process.
"""

from __future__ import annotations

import argparse
import os
import time

from autosp.tools.launch import median_time, spawn_gloo

COMPILERS = ["eager", "aot_eager", "inductor"]


def measure(seq_len: int, repeats: int) -> list[dict]:
    import torch
    import torch.distributed as dist

    import autosp
    from autosp.tools.memory_probe import RssPeak
    from autosp.tools.validation import tiny_model

    ids = torch.randint(0, 2048, (1, seq_len), generator=torch.Generator().manual_seed(0))
    single = tiny_model()(input_ids=ids, labels=ids).loss.item()
    rows = []
    for compiler in COMPILERS:
        torch._dynamo.reset()
        model = autosp.compile(tiny_model(), plan="ulysses", runtime=autosp.Runtime(compiler=compiler))

        def step() -> float:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            for p in model.parameters():
                p.grad = None
            return loss.item()

        dist.barrier()
        t0 = time.perf_counter()
        loss = step()
        first = time.perf_counter() - t0
        step()                                     # second warm-up: the steady state
        seconds = median_time(step, repeats, dist.barrier)
        with RssPeak() as rss:
            step()
        peaks = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, rss.peak)
        rows.append(dict(compiler=compiler, first_s=first, step_s=seconds, peak=max(peaks),
                         loss_gap=abs(loss - single) / abs(single)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:
        print("note: set MALLOC_MMAP_THRESHOLD_=65536 for a stable steady state")
    rows = spawn_gloo(measure, 2, threads=1, seq_len=args.seq_len, repeats=args.repeats)
    base = rows[0]
    print(f"tiny Llama, S={args.seq_len}, Ulysses on 2 gloo ranks, 1 thread each\n")
    print("| compiler | first step (s) | step (s) | vs eager | peak step memory / rank | vs eager | loss gap vs 1 proc |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['compiler']} | {r['first_s']:.1f} | {r['step_s']:.2f} | {r['step_s'] / base['step_s']:.2f}x | "
              f"{r['peak'] / 2**20:.0f} MiB | {r['peak'] / base['peak']:.2f}x | {r['loss_gap']:.1e} |")


if __name__ == "__main__":
    main()
