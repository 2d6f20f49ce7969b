"""GPU checks, for a machine with one CUDA device (skipped without one).

    PYTHONPATH=. python bench/gpu_check.py [--out DIR]

1. Blockwise attention on CUDA (the kernels ring / all-gather-KV / hybrid run
   on): queries and keys in arbitrary chunk orders, merged by log-sum-exp,
   against one fused SDPA call; forward and backward, bf16 and fp32.
2. Masked blockwise attention on CUDA (the memory-efficient kernel): a sliding
   window and left padding, against SDPA with the same mask.
3. A measured single-GPU compute profile (matmul, attention, memory-bound),
   written to DIR/gpu-measured.json.
"""

from __future__ import annotations

import argparse
import os
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: GPU checks skipped")
        return
    print(torch.cuda.get_device_name(), torch.__version__)
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
