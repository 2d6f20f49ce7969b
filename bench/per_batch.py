"""Per-batch SP degrees against the best static plan, on a long-tailed document mix.

Predicted at cluster scale (default: Llama-3-8B on 64 H100s, 128k window, ZeRO 1): every step
draws documents from a lognormal length distribution (fixed seed) until the global batch holds
``--tokens`` tokens. Each document is a sequence of its own (attention never crosses documents).

  static     one SP degree for every sequence (any degree that fits the longest one), the
             world / k groups in data parallel, heaviest sequence to the least busy group; or
             the documents packed into window-long rows first (best fit), the same way; the
             fastest of all these
  per-batch  each sequence at its own degree and group (autosp.planner.assign)

A sequence's time at degree k is the cost model's compute plus exposed SP communication of one
forward and backward (the gradient reduction, once per step, is the same for both and left out);
it fits where the predicted peak is within the device memory. Prints per step and in total the
makespans, their ratio and the per-rank busy-time balance (max / mean).

    python bench/per_batch.py                      # Llama-3-8B, 64 H100s, 128k window
    python bench/per_batch.py --steps 4 --tokens 1048576
"""

from __future__ import annotations

import argparse
import functools
import importlib
import math
import random
import sys
import time

from autosp.data import pack
from autosp.planner.assign import Assignment, assign, best_static


def lognormal_documents(rng: random.Random, tokens: int, median: int, sigma: float, window: int,
                        shortest: int) -> list[int]:
    """Document lengths drawn until they hold ``tokens`` tokens (each within [shortest, window])."""
    out: list[int] = []
    while sum(out) < tokens:
        out.append(int(min(window, max(shortest, rng.lognormvariate(math.log(median), sigma)))))
    return out


def cost_model(model: str, profile: str, world: int, devices_per_node: int, zero_stage: int,
               memory_gib: float | None):
    """``time(length, documents, k)``: seconds of one sequence at SP degree ``k``, None where it
    does not fit (or no strategy runs it)."""
    from autosp.costmodel.profile import load_profile
    from autosp.graph.capture import capture

    predict = importlib.import_module("autosp.costmodel.predict").predict
    graph = capture(model, seq_len=4096)
    prof = load_profile(profile)
    limit = (memory_gib * 2 ** 30) if memory_gib else prof.memory_bytes

    @functools.lru_cache(maxsize=None)
    def time_of(length: int, documents: tuple[int, ...], k: int) -> float | None:
        padded = -(-length // (2 * k * 64)) * 2 * k * 64
        if len(documents) > 1 and padded > length:
            documents = documents + (padded - length,)      # the padding: a document of its own
        best = None
        for strategy in ("ulysses", "zigzag_ring"):
            try:
                p = predict(graph, prof, sp=k, strategy=strategy, seq_len=padded, dp=world // k,
                            zero_stage=zero_stage, reduce_grads=False, devices_per_node=devices_per_node,
                            documents=documents if len(documents) > 1 else (), fused=True)
            except Exception:           # noqa: BLE001 - a strategy that cannot run this shape
                continue
            if p.peak_bytes <= limit:
                t = p.compute_s + p.attention_exposed_s
                best = t if best is None else min(best, t)
        return best

    return time_of


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--profile", default="h100-sxm")
    ap.add_argument("--world-size", type=int, default=64)
    ap.add_argument("--devices-per-node", type=int, default=8)
    ap.add_argument("--zero-stage", type=int, default=1)
    ap.add_argument("--memory-gib", type=float, default=None, help="device memory (default: the profile's)")
    ap.add_argument("--window", type=int, default=131072)
    ap.add_argument("--tokens", type=int, default=2 ** 21, help="tokens per global batch")
    ap.add_argument("--median", type=int, default=4096, help="median document length")
    ap.add_argument("--sigma", type=float, default=1.5, help="lognormal sigma of document lengths")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    t0 = time.time()
    time_of = cost_model(args.model, args.profile, args.world_size, args.devices_per_node, args.zero_stage,
                         args.memory_gib)
    degrees = [k for k in range(1, args.world_size + 1) if args.world_size % k == 0]
    rng = random.Random(args.seed)
    totals = {"static": 0.0, "per-batch": 0.0}
    print(f"# {args.model} on {args.world_size} x {args.profile}, window {args.window}, {args.tokens} tokens per "
          f"step, documents lognormal(median {args.median}, sigma {args.sigma}), seed {args.seed}")
    print(f"{'step':>4} {'docs':>5} {'longest':>8} | {'static':>22} | {'per-batch':>22} | speed-up")
    for step in range(args.steps):
        docs = lognormal_documents(rng, args.tokens, args.median, args.sigma, args.window, 128)
        as_docs = [(n, (n,)) for n in docs]
        rows = [(len(r.tokens), tuple(r.lengths)) for r in pack([range(n) for n in docs], args.window)]
        candidates: list[tuple[str, Assignment]] = []
        for name, seqs in (("docs", as_docs), ("packed", rows)):
            try:
                a = best_static(lambda i, k, s=seqs: time_of(s[i][0], s[i][1], k), len(seqs), args.world_size,
                                degrees)
                candidates.append((name, a))
            except Exception as e:      # noqa: BLE001 - no single degree fits: that static form is out
                print(f"  ({name}: {e})", file=sys.stderr)
        name, static = min(candidates, key=lambda c: c[1].makespan_s)
        mixed = assign(lambda i, k: time_of(as_docs[i][0], as_docs[i][1], k), len(as_docs), args.world_size, degrees)
        totals["static"] += static.makespan_s
        totals["per-batch"] += mixed.makespan_s
        used = sorted(set(mixed.degrees()))
        print(f"{step:>4} {len(docs):>5} {max(docs):>8} | {static.makespan_s:7.2f} s k={static.placements[0].degree:<2} "
              f"{name:<6} bal {static.balance:4.2f} | {mixed.makespan_s:7.2f} s k={used} bal {mixed.balance:4.2f} | "
              f"{static.makespan_s / mixed.makespan_s:5.2f}x")
    print(f"total: static {totals['static']:.2f} s, per-batch {totals['per-batch']:.2f} s, speed-up "
          f"{totals['static'] / totals['per-batch']:.2f}x  ({time.time() - t0:.0f} s to plan)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
