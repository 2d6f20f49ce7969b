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
    python bench/per_batch.py --measure            # 4 CPU gloo ranks, a small Llama, measured

Measured (``--measure``): the same schedules run for real on 4 gloo ranks (one thread each) with a
4-layer Llama, a 2048-token window and a memory limit that makes the longest documents need all 4
ranks (the cost model's peak, as the planner reads it); every static degree that fits and the
per-batch schedule run the same batches, interleaved, after a warm-up step each; the step time is
the slowest rank's, the balance each rank's seconds inside its placements, max over mean.
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
    limit = (memory_gib * 2 ** 30) if memory_gib else prof.tensor_memory_bytes

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


def small_llama(seed: int = 0):
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
                                   attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg)


def _measure_rank(window: int, tokens: int, median: int, sigma: float, steps: int, seed: int,
                  compiler: str) -> dict:
    """On every rank: the static degrees that fit and the per-batch schedule over the same batches."""
    import torch
    import torch.distributed as dist

    import autosp
    from autosp.costmodel.profile import load_profile
    from autosp.graph.capture import capture

    predict = importlib.import_module("autosp.costmodel.predict").predict
    model = small_llama()
    graph = capture(model, seq_len=window)
    prof = load_profile("cpu-gloo")
    world = dist.get_world_size()
    limit = predict(graph, prof, sp=world, seq_len=window, reduce_grads=False).peak_bytes * 1.02

    scale: dict[int, float] = {}          # per degree: measured over predicted, from the warm-up

    @functools.lru_cache(maxsize=None)
    def predicted(length: int, k: int) -> float | None:
        padded = -(-length // (2 * k)) * 2 * k
        p = predict(graph, prof, sp=k, strategy="ulysses", seq_len=padded, reduce_grads=False)
        return p.compute_s + p.attention_exposed_s if p.peak_bytes <= limit else None

    def cost(length: int, k: int) -> float | None:
        t = predicted(-(-length // 64) * 64, k)       # 64-token buckets: planned once, cached (warmed below)
        return None if t is None else t * scale.get(k, 1.0)

    def time_of(seq: dict, k: int) -> float | None:
        return cost(seq["input_ids"].shape[1], k)

    degrees = [k for k in range(1, world + 1) if world % k == 0]
    plan = autosp.Decisions.of(strategy="ulysses")
    runtime = autosp.Runtime(compiler=compiler)
    trainers = {f"static k={k}": autosp.MixedDegree(model, time_of, degrees=(k,), plan=plan, runtime=runtime)
                for k in degrees}
    trainers["per-batch"] = autosp.MixedDegree(model, time_of, plan=plan, runtime=runtime)
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps + 1):       # the first draw is set aside (the figures in docs/benchmarks.md skip it)
        docs = lognormal_documents(rng, tokens, median, sigma, window, 16)
        batches.append([{"input_ids": (ids := torch.randint(0, 1024, (1, n), generator=g)), "labels": ids,
                         "use_cache": False} for n in docs])
    # Compile before timing: each degree's graph at two lengths, after which it is dynamic in the length;
    # then calibrate the cost model per degree on this machine: one more length, timed, on every rank
    for trainer in trainers.values():
        for k, m in trainer.models.items():
            for n in (96 * k, 160 * k):
                ids = torch.randint(0, 1024, (1, n), generator=g)
                m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    for k, m in trainers["per-batch"].models.items():
        ratios = []
        for n in (128, 512, 1024):
            if predicted(n, k) is None:
                continue
            ids = torch.randint(0, 1024, (1, n), generator=g)
            dist.barrier()
            t0 = time.perf_counter()
            m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            took = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            ratios.append(float(took) / predicted(n, k))
        scale[k] = sum(ratios) / len(ratios)
    model.zero_grad()
    for n in range(64, window + 1, 64):
        for k in degrees:
            cost(n, k)
    times: dict[str, list[float]] = {}
    busy: dict[str, list[float]] = {}
    # two passes over the same batches: the first compiles whatever a new length needs, the second is timed
    for step, batch in enumerate(batches[1:] * 2):
        for name, trainer in trainers.items():
            if any(time_of(s, k) is not None for s in batch for k in trainer.degrees) and all(
                    any(time_of(s, k) is not None for k in trainer.degrees) for s in batch):
                dist.barrier()
                t0 = time.perf_counter()
                mine = 0.0
                plan_ = trainer.schedule(batch)
                trainer.last = plan_
                for p in plan_.of_rank(dist.get_rank()):
                    t1 = time.perf_counter()
                    out = trainer.models[p.degree](**batch[p.sequence])
                    out.loss.backward()
                    mine += time.perf_counter() - t1
                trainer._sum_gradients()
                dist.barrier()
                if step >= steps:               # the second pass
                    times.setdefault(name, []).append(time.perf_counter() - t0)
                    busy.setdefault(name, []).append(mine)
                model.zero_grad()
    every = [None] * world
    dist.all_gather_object(every, busy)
    return {"times": times, "busy": every, "docs": [len(b) for b in batches[1:]], "scale": scale,
            "degrees": trainers["per-batch"].last.degrees() if trainers["per-batch"].last else []}


def measure(args: argparse.Namespace) -> int:
    from autosp.tools.launch import spawn_gloo

    res = spawn_gloo(_measure_rank, world=4, threads=1, window=args.window, tokens=args.tokens,
                     median=args.median, sigma=args.sigma, steps=args.steps, seed=args.seed,
                     compiler=args.compiler)
    print(f"# small Llama (4 layers, hidden 256) on 4 CPU gloo ranks, {args.compiler}, window {args.window}, "
          f"{args.tokens} tokens per step, documents lognormal(median {args.median}, sigma {args.sigma}), "
          f"seed {args.seed}, {args.steps} steps timed on a second pass; documents per step {res['docs']}")
    print("cost model calibrated per degree on this machine (measured / predicted): "
          + ", ".join(f"k={k}: {v:.2f}" for k, v in sorted(res["scale"].items())))
    totals = {name: sum(ts) for name, ts in res["times"].items()}
    statics = {n: t for n, t in totals.items() if n.startswith("static")}
    best = min(statics, key=statics.get)
    for name, total in totals.items():
        per_rank = [sum(b[name]) for b in res["busy"]]
        print(f"{name:>12}: {total / len(res['times'][name]):7.3f} s per step, rank busy max/mean "
              f"{max(per_rank) / (sum(per_rank) / len(per_rank)):.2f}")
    print(f"per-batch over the best static ({best}): {totals[best] / totals['per-batch']:.2f}x")
    return 0


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
    ap.add_argument("--measure", action="store_true", help="run on 4 CPU gloo ranks with a small Llama")
    ap.add_argument("--compiler", default="aot_eager", help="--measure: the graphs' compiler")
    args = ap.parse_args(argv)
    if args.measure:
        for name, small in (("window", 2048), ("tokens", 8192), ("median", 256)):
            if getattr(args, name) == ap.get_default(name):
                setattr(args, name, small)
        return measure(args)

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
