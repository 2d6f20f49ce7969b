"""Gradient reduction: one blocking all-reduce per parameter vs buckets overlapped with the backward.

    python bench/grad_reduction.py [--ranks 2] [--seq-len 1024] [--layers 4] [--hidden 512] [--repeats 5]

Same Llama (random weights, fp32, vocabulary 8192), batch and strategy (Ulysses) on N gloo ranks,
one thread each, SP over all of them. ``zero_stage=None`` sums each parameter's gradient over the
SP group inside the graphs' backward (a blocking call per parameter use); ``zero_stage=0`` keeps
partial sums and all-reduces them in ~25 MiB buckets launched asynchronously as each fills
(:mod:`autosp.transform.zero.grad_reducer`). Both give the single-device gradients; the bench checks
they agree, then prints the median step of each and the ratio, measured in the same run.
"""

from __future__ import annotations

import argparse
import time

from autosp.tools.launch import median_time, spawn_gloo

MODES = {"per-parameter, blocking (zero_stage=None)": None, "bucketed, overlapped (zero_stage=0)": 0}


def build(layers: int, hidden: int):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
                                   num_attention_heads=8, num_key_value_heads=4, vocab_size=8192,
                                   attn_implementation="sdpa")
    return transformers.AutoModelForCausalLM.from_config(cfg)


def measure(seq_len: int, layers: int, hidden: int, repeats: int) -> list[dict]:
    import torch
    import torch.distributed as dist

    import autosp
    from autosp.strategies.collectives import TALLY

    ids = torch.randint(0, 8192, (1, seq_len), generator=torch.Generator().manual_seed(0))
    rows, grads = [], []
    for name, stage in MODES.items():
        torch._dynamo.reset()
        model = autosp.compile(build(layers, hidden), plan="ulysses", zero=stage)

        def step() -> None:
            model(input_ids=ids, labels=ids).loss.backward()

        def clear() -> None:
            for p in model.parameters():
                p.grad = None

        step()
        grads.append([p.grad.clone() for p in model.parameters()])
        clear()
        step()
        clear()
        calls = {k: v[0] for k, v in TALLY.items()}

        def timed() -> None:
            step()
            clear()

        seconds = median_time(timed, repeats, dist.barrier)
        issued = sum(v[0] - calls.get(k, 0) for k, v in TALLY.items() if k[1] in ("all_reduce", "grad_all_reduce"))
        rows.append(dict(mode=name, step_s=seconds, reductions=issued / repeats,
                         params=sum(p.numel() for p in model.parameters())))
    gap = max(((a - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in zip(*grads))
    return [dict(r, grad_gap=gap) for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = spawn_gloo(measure, args.ranks, threads=1, seq_len=args.seq_len, layers=args.layers,
                      hidden=args.hidden, repeats=args.repeats)
    print(f"Llama {args.layers} layers, hidden {args.hidden}, {rows[0]['params'] / 1e6:.1f}M parameters, "
          f"S={args.seq_len}, Ulysses on {args.ranks} gloo ranks (1 thread each), median of {args.repeats} steps; "
          f"gradients of the two modes agree to {rows[0]['grad_gap']:.1e} (relative)\n")
    print("| gradient reduction | step (s) | vs per-parameter | all-reduce calls per step |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['step_s']:.3f} | {r['step_s'] / rows[0]['step_s']:.2f}x | {r['reductions']:.0f} |")
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
