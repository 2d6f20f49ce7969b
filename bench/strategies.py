"""Step time and per-rank peak memory of every SP strategy, relative to one process.

    python bench/strategies.py                    # SP 2 and 4, sequence 4k and 16k (long: minutes)
    python bench/strategies.py --seq-lens 4096 --degrees 2 --out bench/out/strategies.md

Built-in tiny Llama (hidden 256, 8 heads, 4 KV heads, 2 layers), fp32, gloo on
this machine's CPU cores (shared by all ranks). Time: one forward+backward step
after a warm-up step, median over ``--repeats``. Memory: peak bytes of tensors
allocated during one step on rank 0 (autosp.tools.memory_probe; the
allocator's view, not RSS), with parameters and inputs allocated before the step.
"""

from __future__ import annotations

import argparse
import os

from autosp.tools.launch import spawn_gloo as spawn  # noqa: E402

from autosp.tools.validation import measure_step, tiny_model  # noqa: E402

STRATEGIES = ["ulysses", "ring", "zigzag_ring", "allgather_kv", "hybrid:2x2"]


def distributed(seq_lens: list[int], strategies: list[str], repeats: int) -> list[dict]:
    import torch
    import torch.distributed as dist

    import autosp

    rows = []
    world = dist.get_world_size()
    for s in seq_lens:
        for st in strategies:
            torch._dynamo.reset()
            m = measure_step(autosp.compile(tiny_model(), plan=st), s, repeats, dist.barrier)
            rows.append(dict(world=world, seq_len=s, strategy=st, **m))
    return rows


def single(seq_lens: list[int], repeats: int) -> dict[int, dict]:

    return {s: measure_step(tiny_model(), s, repeats) for s in seq_lens}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--degrees", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    args = ap.parse_args()

    base = single(args.seq_lens, args.repeats)
    rows = []
    for p in args.degrees:
        sts = [st for st in STRATEGIES if not st.startswith("hybrid") or p == 4]
        rows += spawn(distributed, p, seq_lens=args.seq_lens, strategies=sts, repeats=args.repeats)
    lines = [f"cores: {os.cpu_count()}; single process: "
             + ", ".join(f"S={s}: {b['time']:.2f} s, {b['peak'] / 2**20:.0f} MiB" for s, b in base.items()),
             "", "| SP | seq | strategy | step (s) | time vs 1 proc | peak/rank (MiB) | memory vs 1 proc | loss gap |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = base[r["seq_len"]]
        lines.append(f"| {r['world']} | {r['seq_len']} | {r['strategy']} | {r['time']:.2f} | {r['time'] / b['time']:.2f} "
                     f"| {r['peak'] / 2**20:.0f} | {r['peak'] / b['peak']:.2f} | "
                     f"{abs(r['loss'] - b['loss']) / b['loss']:.1e} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
