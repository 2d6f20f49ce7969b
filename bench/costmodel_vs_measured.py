"""The cost model against measurements on this machine (profile cpu-gloo).

    python bench/costmodel_vs_measured.py                       # 2k/8k/16k x {1, SP2 strategies}, SP4 memory
    python bench/costmodel_vs_measured.py --seq-lens 2048 --sp4-seq-lens 2048

Built-in tiny Llama, fp32, one CPU thread per rank (one core = one device, as the
profile was measured). Prints predicted vs measured step time (MAPE) and per-rank
peak step memory (allocator view; see autosp.tools.validation).
"""

from __future__ import annotations

import argparse
import os

from autosp.tools.launch import spawn_gloo as spawn  # noqa: E402

from autosp.tools.validation import measured_single, measured_sp, predicted  # noqa: E402

SP2 = ["ulysses", "ring", "zigzag_ring", "allgather_kv"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192, 16384])
    ap.add_argument("--sp4-seq-lens", type=int, nargs="*", default=[4096], help="none: skip SP 4")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--profile", default="cpu-gloo")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = measured_single(args.seq_lens, args.repeats)
    rows += spawn(measured_sp, 2, seq_lens=args.seq_lens, strategies=SP2, repeats=args.repeats)
    if args.sp4_seq_lens:
        rows += spawn(measured_sp, 4, seq_lens=args.sp4_seq_lens, strategies=["ulysses", "zigzag_ring"],
                      repeats=args.repeats)
    rows = predicted(rows, args.profile)
    lines = ["| SP | seq | strategy | measured (s) | predicted (s) | error | measured peak (MiB) | "
             "predicted peak (MiB) | error |", "|---|---|---|---|---|---|---|---|---|"]
    terr, merr = [], {}
    for r in rows:
        te = (r["pred_time"] - r["time"]) / r["time"]
        me = (r["pred_peak"] - r["peak"]) / r["peak"]
        if r["sp"] in (1, 2):
            terr.append(abs(te))
        merr.setdefault(r["sp"], []).append(abs(me))
        lines.append(f"| {r['sp']} | {r['seq_len']} | {r['strategy']} | {r['time']:.3f} | {r['pred_time']:.3f} | "
                     f"{te:+.1%} | {r['peak'] / 2**20:.1f} | {r['pred_peak'] / 2**20:.1f} | {me:+.1%} |")
    lines.append("")
    lines.append(f"step time MAPE over {len(terr)} SP 1/2 configurations: {sum(terr) / len(terr):.1%}")
    for sp, errs in sorted(merr.items()):
        lines.append(f"peak memory, SP {sp}: worst |error| {max(errs):.1%}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        open(args.out, "w").write(text + "\n")


if __name__ == "__main__":
    main()
