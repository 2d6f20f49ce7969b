"""GPU checks, for a machine with one CUDA device (skipped without one).

    PYTHONPATH=. python bench/gpu_check.py [--out DIR] [--only concurrency|offload|e2e|peers] [--dry]

1. Blockwise attention on CUDA (the kernels ring / all-gather-KV / hybrid run
   on): queries and keys in arbitrary chunk orders, merged by log-sum-exp,
   against one fused SDPA call; forward and backward, bf16 and fp32.
2. Masked blockwise attention on CUDA (the memory-efficient kernel): a sliding
   window and left padding, against SDPA with the same mask.
3. A measured single-GPU compute profile (matmul, attention, memory-bound),
   written to DIR/gpu-measured.json.
4. Concurrency on one GPU (``--only concurrency`` runs this alone): how much a matmul
   loop and a flash-attention forward+backward loop slow down beside a transfer kernel
   on a second stream, and how much the transfer slows beside them. The overlap cost
   model prices a hidden collective with these two factors (``concurrency`` in a
   profile). One GPU has no peer to exchange with, so the transfer is a stand-in:
   a copy kernel on P thread blocks (NCCL's collectives run as kernels of one block
   per channel, so they take SMs and HBM bandwidth from the compute), and a
   device-to-device ``cudaMemcpyAsync`` at the full HBM rate (a bound, not a
   stand-in). Written to DIR/concurrency.json.
5. Long context with offload (``--only offload``, :mod:`offload_check`): Llama-3-8B's layer
   shapes at one rank's tokens, peak memory and step time against the plan, offload (of the
   checkpoints, and of the optimizer, stepped in host memory) on and off, the host optimizer's
   bytes and step time, and the device <-> host copy bandwidth. Written to DIR/offload.json. ``--dry`` runs it on CPU
   with a tiny model (the suite does).
6. A sharded training step per strategy (``--only e2e``, :mod:`sharded_step_check`): a small
   bf16 Llama through Inductor on 2 ranks (a GPU each over NCCL, or both on one GPU over gloo),
   loss and every gradient against one process within bf16 tolerance, and the collectives that
   ran; and ``tp``: the same model split by tensor parallelism over the 2 ranks, each gradient
   against its half of the one-process one. Written to DIR/sharded_step.json. ``--dry`` runs it
   on CPU (``--strategies`` picks some).
7. The peers beside autosp (``--only peers``, :mod:`peers`): autosp, PyTorch ``context_parallel``
   (which has no CPU rule for SDPA) and a hand-written Ulysses, both ranks on the GPU over gloo,
   4096 and 16384 tokens: step time, peak memory, loss and gradients against one process.
   Written to DIR/peers.json. ``--dry``: the smallest case on CPU, every peer (the suite runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F


def blockwise_check() -> list[str]:
    from autosp.strategies.blockwise import chunked_attention

    lines = []
    for dtype in (torch.bfloat16, torch.float16):       # the flash kernel's dtypes
        torch.manual_seed(0)
        b, h, hkv, s, d = 2, 8, 2, 2048, 128
        q, k, v = (torch.randn(b, n, s, d, device="cuda", dtype=dtype, requires_grad=True) for n in (h, hkv, hkv))
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        g = torch.randn_like(ref)
        n = 8
        L = s // n

        def ch(x, ids):
            return torch.cat([x[:, :, c * L:(c + 1) * L] for c in ids], 2)

        qids, kvids = [1, 6], [3, 0, 7, 5, 2, 1, 6, 4]
        out, _ = chunked_attention(ch(q, qids), ch(k, kvids), ch(v, kvids), None, qids, kvids, True, d ** -0.5)
        gq, gk, gv = torch.autograd.grad(out, (q, k, v), ch(g, qids))
        ref_sel = ch(ref, qids)
        eq, ek, ev = torch.autograd.grad(ref_sel, (q, k, v), ch(g, qids))
        rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
        lines.append(f"{str(dtype):15s} fwd {rel(out, ref_sel):.2e}  dq {rel(gq, eq):.2e}  dk {rel(gk, ek):.2e}  "
                     f"dv {rel(gv, ev):.2e}")
    return lines


def masked_check() -> list[str]:
    """Masked blocks on CUDA go through the memory-efficient kernel (flash takes no mask):
    a sliding window and left padding (rows that see nothing), tiles of 256 tokens."""
    import autosp.strategies.blockwise as bw
    from autosp.strategies.blockwise import chunked_attention

    bw.MASK_TILE = 256
    lines = []
    b, h, hkv, s, d = 2, 8, 2, 4096, 128
    i = torch.arange(s, device="cuda")
    causal = i[:, None] >= i[None, :]
    window = (causal & (i[:, None] - i[None, :] < 700)).expand(b, 1, s, s)
    pad = causal.expand(b, s, s).clone()
    pad[1, :, :300] = False
    masks = {"window 700": window, "left pad 300": pad[:, None]}
    for dtype in (torch.bfloat16, torch.float32):
        for name, mask in masks.items():
            torch.manual_seed(0)
            q, k, v = (torch.randn(b, n, s, d, device="cuda", dtype=dtype, requires_grad=True) for n in (h, hkv, hkv))
            ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            L = s // 4
            ch = lambda x, ids: torch.cat([x[:, :, c * L:(c + 1) * L] for c in ids], 2)  # noqa: E731
            qids, kvids = [3, 0], [2, 0, 3, 1]
            g = torch.randn_like(ch(ref, qids))
            before = dict(bw.BLOCK_TALLY)
            try:
                out, _ = chunked_attention(ch(q, qids), ch(k, kvids), ch(v, kvids), mask, qids, kvids, False,
                                           d ** -0.5)
                got = torch.autograd.grad(out, (q, k, v), g)
            except Exception as e:  # noqa: BLE001 - reported, the other checks go on
                lines.append(f"{str(dtype):15s} {name:13s} FAILED {type(e).__name__}: {str(e)[:300]}")
                continue
            # rows that see no key: SDPA's own output there is not defined on every backend
            seen = ch(mask.any(-1, keepdim=True).expand(b, h, s, 1), qids)
            g = g * seen
            out = out * seen
            exp = torch.autograd.grad(ch(ref, qids), (q, k, v), g)
            ref = torch.nan_to_num(ref) * mask.any(-1, keepdim=True)
            rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
            calls = bw.BLOCK_TALLY["computed"] - before.get("computed", 0)
            skipped = bw.BLOCK_TALLY["skipped"] - before.get("skipped", 0)
            lines.append(f"{str(dtype):15s} {name:13s} fwd {rel(out, ch(ref, qids)):.2e}  dq {rel(got[0], exp[0]):.2e}"
                         f"  dk {rel(got[1], exp[1]):.2e}  dv {rel(got[2], exp[2]):.2e}  tiles {calls} run, "
                         f"{skipped} skipped  nan {bool(out.isnan().any() or got[0].isnan().any())}")
    return lines


def _copy_kernel():
    """A device-to-device copy on a fixed number of thread blocks (fewer than the SMs: one an
    SM), each striding over the buffer: the SM and HBM footprint of a collective's kernel of
    that many channels."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy(src, dst, n, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr):
        pid = tl.program_id(0)
        for start in range(pid * BLOCK, n, PROGRAMS * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            keep = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=keep), mask=keep)

    def run(src: torch.Tensor, dst: torch.Tensor, programs: int) -> None:
        copy[(programs,)](src, dst, src.numel(), BLOCK=4096, PROGRAMS=programs, num_warps=8)

    return run


def _span(fn, stream: torch.cuda.Stream) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    """Queue ``fn`` on ``stream`` between two timing events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record()
        fn()
        end.record()
    return start, end


def _alone(fn, stream: torch.cuda.Stream, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        a, b = _span(fn, stream)
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def _together(transfer, compute, side: torch.cuda.Stream, main: torch.cuda.Stream,
              repeats: int) -> tuple[float, float]:
    """Medians of (transfer time, compute time) when both are queued at once, each on its
    own stream: the transfer first, as an overlapped schedule issues it, so its kernel holds
    its SMs before the compute's kernels fill the rest."""
    tt, tc = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = _span(transfer, side)
        c = _span(compute, main)
        torch.cuda.synchronize()
        tt.append(t[0].elapsed_time(t[1]) / 1e3)
        tc.append(c[0].elapsed_time(c[1]) / 1e3)
    return statistics.median(tt), statistics.median(tc)


def concurrency_check(repeats: int = 9) -> dict:
    """Slowdowns of compute and of a transfer stand-in queued at once on two streams.

    The transfer is one launch, as one collective is one NCCL kernel. Each pair is measured
    twice: the transfer longer than the compute (every compute kernel runs beside it: the
    compute's slowdown), and the compute about 2x the transfer (the transfer's slowdown)."""
    main, side = torch.cuda.Stream(), torch.cuda.Stream()
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q, k, v = (torch.randn(1, 16, 8192, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    g = torch.randn_like(q)

    def attention_step() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), g)

    computes = {"matmul bf16 8192^3": lambda: a @ b,
                "flash attention fwd+bwd (H=16, S=8192, D=128, causal)": attention_step}
    src = torch.randn(1 << 31, device="cuda")                       # 8 GiB: a long single launch
    dst = torch.empty_like(src)
    transfers = {"cudaMemcpyAsync D2D (full HBM rate)": (lambda n: dst[:n].copy_(src[:n]), 1 << 31)}
    try:
        blocks = _copy_kernel()
        for p in (8, 16, 32):    # int32 offsets in the kernel: at most 2^30 elements
            transfers[f"copy kernel on {p} blocks"] = (lambda n, p=p: blocks(src[:n], dst[:n], p), 1 << 30)
    except Exception as e:  # noqa: BLE001 - the cudaMemcpyAsync bound still runs
        print(f"  Triton copy kernel unavailable ({type(e).__name__}: {e}); the cudaMemcpyAsync bound only")
    for fn in computes.values():                                    # warm up, compile
        fn()
    for fn, _ in transfers.values():
        fn(1 << 20)
    torch.cuda.synchronize()
    rows = []
    for cname, cfn in computes.items():
        piece_c = _alone(cfn, main, repeats)
        for tname, (tfn, most) in transfers.items():
            probe = 1 << 28
            rate = probe / _alone(lambda: tfn(probe), side, repeats)          # elements a second
            row = {"compute": cname, "transfer": tname, "compute_piece_s": piece_c,
                   "transfer_GBps": 2 * 4 * rate / 1e9}                        # bytes read + written
            # the compute's slowdown: one transfer launch longer than n_c pieces of compute
            n_t = min(most, int(rate * 3 * piece_c)) // 1024 * 1024
            n_c = max(1, min(4, int(n_t / rate / piece_c / 1.5)))
            t_alone = _alone(lambda: tfn(n_t), side, repeats)
            c_alone = _alone(lambda: [cfn() for _ in range(n_c)], main, repeats)
            _, c_both = _together(lambda: tfn(n_t), lambda: [cfn() for _ in range(n_c)], side, main, repeats)
            row.update(compute_slowdown=c_both / c_alone, compute_run=f"{n_c} piece(s), {c_alone * 1e3:.2f} ms, "
                       f"beside a {t_alone * 1e3:.2f} ms transfer")
            # the transfer's slowdown: one launch beside about twice its time of compute
            n_t = min(most, int(rate * 1.5 * piece_c), int(rate * 3e-3)) // 1024 * 1024
            t_alone = _alone(lambda: tfn(n_t), side, repeats)
            n_c = max(2, round(2 * t_alone / piece_c + 0.5))
            t_both, _ = _together(lambda: tfn(n_t), lambda: [cfn() for _ in range(n_c)], side, main, repeats)
            row.update(comm_slowdown=t_both / t_alone, comm_run=f"{t_alone * 1e3:.2f} ms alone, beside {n_c} "
                       f"piece(s) ({n_c * piece_c * 1e3:.2f} ms)")
            rows.append(row)
            print(f"  {cname:53s} beside {tname:30s} ({row['transfer_GBps']:5.0f} GB/s alone): compute "
                  f"{row['compute_slowdown']:.3f}x [{row['compute_run']}], transfer {row['comm_slowdown']:.3f}x "
                  f"[{row['comm_run']}]", flush=True)
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "repeats": repeats, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--only", choices=["concurrency", "offload", "e2e", "peers"], help="run this check alone")
    ap.add_argument("--strategies", default=None, help="--only e2e: comma-separated (default: every one)")
    ap.add_argument("--compiler", default="inductor", choices=["inductor", "aot_eager"],
                    help="--only e2e: what compiles the sharded graphs (the suite's dry run: aot_eager, for time)")
    ap.add_argument("--dry", action="store_true", help="--only offload / e2e / peers on CPU with a tiny model")
    ap.add_argument("--tokens", type=int, default=None, help="--only offload: tokens per rank (default 131072)")
    args = ap.parse_args()
    if args.only == "offload":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import offload_check

        if args.dry or torch.cuda.is_available():
            offload_check.main(args.out, args.dry, args.tokens)
        else:
            print("no CUDA device: GPU checks skipped (--dry runs this one on CPU)")
        return
    if args.only == "e2e":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import sharded_step_check

        if args.dry or torch.cuda.is_available():
            picked = tuple(args.strategies.split(",")) if args.strategies else None
            res = sharded_step_check.main(args.out, args.dry, picked, args.compiler)
            return 0 if all(r["ok"] for r in res["rows"]) else 1
        print("no CUDA device: GPU checks skipped (--dry runs this one on CPU)")
        return
    if args.only == "peers":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import peers

        if args.dry or torch.cuda.is_available():
            peers.gpu_check(args.out, args.dry)
        else:
            print("no CUDA device: GPU checks skipped (--dry runs this one on CPU)")
        return
    if not torch.cuda.is_available():
        print("no CUDA device: GPU checks skipped")
        return
    print(torch.cuda.get_device_name(), torch.__version__)
    if args.only == "concurrency":
        print("concurrency on one GPU: slowdown beside a transfer stand-in on a second stream:")
        with open(os.path.join(args.out, "concurrency.json"), "w") as f:
            json.dump(concurrency_check(), f, indent=1)
        return
    print("blockwise attention vs fused SDPA (relative error):")
    for line in blockwise_check():
        print("  " + line)
    print("masked blockwise attention vs SDPA with the same mask (relative error):")
    for line in masked_check():
        print("  " + line)
    if os.environ.get("GPU_CHECK_SKIP_PROFILE"):
        return
    from autosp.costmodel.profiler import measure

    doc = measure(os.path.join(args.out, "gpu-measured.json"), quick=True, budget_s=120)
    for kind in ("matmul", "attention", "attention_backward"):
        for row in doc["compute"][kind].get("bfloat16", []):
            from autosp.costmodel.profile import _row_flops

            f = _row_flops(kind.split("_")[0] if kind != "attention_backward" else "attention",
                           {**row, "backward": kind == "attention_backward"})
            print(f"  {kind:19s} {f:10.3g} FLOP  {f / row['seconds'] / 1e12:7.1f} TFLOP/s")
    mb = doc["compute"]["memory_bound"][-1]
    print(f"  memory-bound       {mb['bytes'] / mb['seconds'] / 1e12:.2f} TB/s at {mb['bytes'] / 2**20:.0f} MiB")


if __name__ == "__main__":
    sys.exit(main())
