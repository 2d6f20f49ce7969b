"""Predicted against measured per-rank step peak, for every memory decision the planner takes.

    python bench/memory_decisions.py [--seq-len 4096] [--degrees 1 2] [--compiler aot_eager]
        [--strategy ulysses] [--layers 2] [--decisions none/1/1 full/8/8 full/8/8/recomputed ...]

The bench's tiny Llama (hidden 256, 8 heads, 4 KV heads, 2 layers, MLP 688, vocabulary
1000), fp32, Ulysses, each of checkpointing none / selective / full with the MLPs whole or
in 8 token chunks (and the LM head and loss in 8 chunks with full checkpointing; a fourth field
``recomputed``: the fully checkpointed layer's tiled MLP recomputes with the whole layer instead
of keeping its input). Measured:
the peak bytes of the tensors allocated during one training step
(``autosp.tools.memory_probe``, the allocator's view; Inductor's kernels bypass it, hence
``aot_eager``, which partitions forward and backward the same way). Predicted: the cost
model's step peak for the same decisions (:func:`autosp.costmodel.predict.step_peak`), the
quantity the planner's memory constraint adds model states to; for Inductor, with the pointwise
chains it fuses never written (:mod:`autosp.costmodel.fusion`). ``--dtype bfloat16`` runs the
model in bf16, where that matters most (the norms' fp32 upcasts).

``--compiler inductor``: Inductor's kernels allocate outside the dispatcher, so the probe cannot
see them; the bench then reads malloc's bytes in use (``mallinfo2``: its arenas' in-use blocks
and its mapped ones; sampled every 0.2 ms during the step, less what was in use before it; the
lowest of 3 steps), with glibc told to map every block above 64 KiB (``MALLOC_MMAP_THRESHOLD_``).
The process's resident pages, read before, moved by 16 MiB between runs (see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
from typing import Any
import os
import threading
import time

from autosp.tools.launch import spawn_gloo

DECISIONS = [("none", 1, 1), ("selective", 1, 1), ("full", 1, 1), ("none", 8, 1), ("selective", 8, 1),
             ("full", 8, 1), ("full", 8, 8), ("full", 8, 8, "recomputed")]
# (checkpointing, MLP chunks, loss chunks[, the tiled MLP's input kept or recomputed under full])


def _keeps_input(decision: tuple) -> bool:
    return len(decision) < 4 or decision[3] == "kept"


def tiny(layers: int = 2, dtype: str = "float32"):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=layers,
                                   num_attention_heads=8, num_key_value_heads=4, vocab_size=1000,
                                   attn_implementation="sdpa")
    return transformers.AutoModelForCausalLM.from_config(cfg).to(getattr(torch, dtype))


def in_use_step_peak(step) -> tuple[Any, int]:
    """(what the last ``step()`` returned, the peak bytes in use a step adds: the lowest of 3 runs;
    the sampler misses no peak that lasts longer than its period, and page-cache noise only adds)."""
    import gc

    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                          "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2

    def in_use() -> int:
        """Bytes malloc has handed out and not taken back (its arenas' in-use blocks and its mapped
        ones): the allocator's view, which pages the kernel keeps or the arenas retain do not blur."""
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd

    peaks = []
    for _ in range(3):
        gc.collect()
        base = in_use()
        peak, done = [base], threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], in_use())
                time.sleep(0.0002)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            result = step()
        finally:
            done.set()
            sampler.join()
        peaks.append(peak[0] - base)
    return result, min(peaks)


def measure(seq_len: int, compiler: str, strategy: str = "ulysses", decisions: list | None = None,
            layers: int = 2, dtype: str = "float32") -> list[dict]:
    import torch

    import autosp
    from autosp.tools.memory_probe import step_peak

    ids = torch.randint(0, 1000, (1, seq_len), generator=torch.Generator().manual_seed(0))
    rows = []
    # One rank runs what autosp runs there (attention as it is), more the strategy named.
    strategy = strategy if torch.distributed.get_world_size() > 1 else "auto"
    for decision in decisions or DECISIONS:
        checkpoint, mlp_chunks, loss_chunks = decision[:3]
        torch._dynamo.reset()
        model = tiny(layers, dtype)
        sp = autosp.compile(model, plan=autosp.Decisions.of(strategy=strategy, checkpoint=checkpoint, mlp_chunks=mlp_chunks,
                                                            keep_mlp_input=_keeps_input(decision),
                                                            mesh=autosp.MeshChoice(loss_chunks=loss_chunks)),
                            runtime=autosp.Runtime(compiler=compiler))
        sp(input_ids=ids, labels=ids).loss.backward()                 # compile outside the probe
        model.zero_grad(set_to_none=True)
        if compiler == "inductor":
            def step() -> torch.Tensor:
                loss = sp(input_ids=ids, labels=ids).loss
                loss.backward()
                model.zero_grad(set_to_none=True)
                return loss.detach()
            loss, peak = in_use_step_peak(step)
        else:
            loss, peak = step_peak(sp, lambda: sp(input_ids=ids, labels=ids).loss)
        rows.append(dict(checkpoint=checkpoint, mlp_chunks=mlp_chunks, loss_chunks=loss_chunks, peak=peak,
                         loss=loss.item(), keep_mlp_input=_keeps_input(decision)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--degrees", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--compiler", default="aot_eager")
    ap.add_argument("--strategy", default="ulysses", help="what SP > 1 runs")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="bfloat16: the norms' fp32 upcasts, which Inductor fuses away")
    ap.add_argument("--decisions", nargs="*", default=None,
                    help="a subset, as checkpoint/mlp_chunks/loss_chunks (e.g. selective/8/8)")
    args = ap.parse_args()
    if args.compiler == "inductor":         # read by glibc when each rank's process starts
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
        os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", "0")
    decisions = [(c, int(m), int(k), *rest) for c, m, k, *rest in (d.split("/") for d in args.decisions)] \
        if args.decisions else DECISIONS

    from autosp.costmodel.predict import step_peak
    from autosp.costmodel.profile import load_profile
    from autosp.graph import capture

    graph = capture(tiny(args.layers, args.dtype), seq_len=args.seq_len, dtype=args.dtype)
    prof = load_profile("cpu-gloo")
    print(f"tiny Llama, {args.layers} layers, {args.dtype}, {args.seq_len} tokens, {args.strategy}, {args.compiler}; "
          "per-rank step peak\n")
    print("| SP | checkpoint | MLP chunks | MLP input | loss chunks | measured | predicted | predicted / measured |")
    print("|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for sp in args.degrees:
        for r in spawn_gloo(measure, sp, threads=1, seq_len=args.seq_len, compiler=args.compiler,
                            strategy=args.strategy, decisions=decisions, layers=args.layers, dtype=args.dtype):
            pred = step_peak(graph, prof, sp=sp, strategy=args.strategy, seq_len=args.seq_len,
                             checkpoint=r["checkpoint"], mlp_chunks=r["mlp_chunks"], loss_chunks=r["loss_chunks"],
                             keep_mlp_input=r["keep_mlp_input"], fused=args.compiler == "inductor")
            worst = max(worst, abs(pred / r["peak"] - 1))
            tiled_full = r["checkpoint"] == "full" and r["mlp_chunks"] > 1
            mlp_input = ("kept" if r["keep_mlp_input"] else "recomputed") if tiled_full else "-"
            print(f"| {sp} | {r['checkpoint']} | {r['mlp_chunks']} | {mlp_input} | {r['loss_chunks']} | {r['peak'] / 2**20:.1f} MiB "
                  f"| {pred / 2**20:.1f} MiB | {pred / r['peak']:.3f} |", flush=True)
    print(f"\nworst |predicted / measured - 1|: {worst:.3f}")


if __name__ == "__main__":
    main()
