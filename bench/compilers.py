"""What the compiled path buys: eager vs AOTAutograd vs Inductor on the same SP step.

    MALLOC_MMAP_THRESHOLD_=65536 python bench/compilers.py [--seq-len 8192] [--repeats 3]
    python bench/compilers.py --trace-options      # compile time: Python floats constant or symbolic

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


def trace_times(compilers: tuple[str, ...]) -> list[dict]:
    """The first step (compile included) of a 2-layer Hugging Face Llama at 64 tokens, with autosp's
    trace options as shipped and with Python floats left symbolic (Dynamo's default under
    dynamic=True), each twice in a row (the second run: Dynamo's and the compiler's caches warm)."""
    import torch
    import torch.distributed as dist
    import transformers

    import autosp
    from autosp.transform import sequence_parallel

    shipped = dict(sequence_parallel.TRACE_OPTIONS)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(0))
    rows = []
    for compiler in compilers:
        for floats in ("constant", "symbolic"):
            sequence_parallel.TRACE_OPTIONS = {**shipped, "specialize_float": floats == "constant"}
            times = []
            for _ in range(2):
                torch._dynamo.reset()
                torch.manual_seed(0)
                model = autosp.compile(transformers.AutoModelForCausalLM.from_config(cfg), plan="ulysses",
                                       runtime=autosp.Runtime(compiler=compiler))
                dist.barrier()
                t0 = time.perf_counter()
                model(input_ids=ids, labels=ids).loss.backward()
                times.append(time.perf_counter() - t0)
            rows.append(dict(compiler=compiler, floats=floats, first_s=times[0], again_s=times[1]))
    sequence_parallel.TRACE_OPTIONS = shipped
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--trace-options", action="store_true",
                    help="compile time of a 2-layer HF Llama with Python floats constant (shipped) or symbolic")
    args = ap.parse_args()
    if args.trace_options:
        rows = spawn_gloo(trace_times, 2, threads=1, compilers=("aot_eager", "inductor"))
        print("2-layer HF Llama, 64 tokens, Ulysses on 2 gloo ranks, 1 thread each: first step, compile included\n")
        print("| compiler | Python floats | first step (s) | again, caches warm (s) | again vs constant |")
        print("|---|---|---|---|---|")
        for r in rows:
            base = next(b for b in rows if b["compiler"] == r["compiler"] and b["floats"] == "constant")
            print(f"| {r['compiler']} | {r['floats']} | {r['first_s']:.1f} | {r['again_s']:.1f} | "
                  f"{r['again_s'] / base['again_s']:.2f}x |")
        return
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
