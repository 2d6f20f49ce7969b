"""What a sliding window saves ring attention: measured on gloo ranks, and predicted.

    python bench/window.py                                   # 32k tokens, window 4096, SP 2
    python bench/window.py --seq-len 8192 --window 1024 --repeats 2

One attention op (Hugging Face's causal mask, boolean ``[1, 1, S, S]``), forward +
backward through the ring strategy's runtime on ``--world`` gloo ranks, one thread
each; time = the slowest rank's median over ``--repeats`` after a warm-up. Three
masks, measured in the same run: none (``is_causal``), the causal mask without a
window, and the causal mask with ``--window``. Predicted: the ring strategy's
kernel calls (``Strategy.cost``: masked tiles the window shows) and transfers on the
``cpu-gloo`` profile, the same path the planner takes.
"""

from __future__ import annotations

import argparse
import time

from autosp.tools.launch import spawn_gloo


def measure(seq_len: int, window: int, heads: int, kv_heads: int, head_dim: int, repeats: int,
            strategy: str = "ring") -> dict:
    import torch
    import torch.distributed as dist

    from autosp.strategies import resolve
    from autosp.strategies.blockwise import BLOCK_TALLY

    strat = resolve(strategy)
    kw = {**strat.setup(dist.group.WORLD), "layout": strat.layout or "contiguous"}
    p, r = dist.get_world_size(), dist.get_rank()
    s_loc = seq_len // p
    g = torch.Generator().manual_seed(r)
    q = torch.randn(1, heads, s_loc, head_dim, generator=g, requires_grad=True)
    k = torch.randn(1, kv_heads, s_loc, head_dim, generator=g, requires_grad=True)
    v = torch.randn(1, kv_heads, s_loc, head_dim, generator=g, requires_grad=True)
    i = torch.arange(seq_len)
    causal = (i[:, None] >= i[None, :])[None, None]
    masks = {"is_causal": None, "causal mask": causal,
             f"window {window}": causal & (i[:, None] - i[None, :] < window)[None, None]}
    out = {}
    for name, mask in masks.items():
        times = []
        for rep in range(repeats + 1):
            before = BLOCK_TALLY["computed"]
            dist.barrier()
            t0 = time.perf_counter()
            o = strat.attention_fn(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True, **kw)
            o.sum().backward()
            dist.barrier()
            if rep:
                times.append(time.perf_counter() - t0)
            calls = BLOCK_TALLY["computed"] - before
        slowest = torch.tensor([sorted(times)[len(times) // 2], float(calls)])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        out[name] = (slowest[0].item(), int(slowest[1].item()))
    return out


def predicted(seq_len: int, window: int, heads: int, kv_heads: int, head_dim: int, world: int,
              strategy: str = "ring") -> dict:
    from autosp.costmodel.overlap import transfer_times
    from autosp.costmodel.predict import kernel_time
    from autosp.costmodel.profile import load_profile
    from autosp.strategies import AttentionShape, SPMesh, resolve

    strat = resolve(strategy)
    prof, mesh = load_profile("cpu-gloo"), SPMesh(world, strat.layout or "contiguous")
    out = {}
    for name, masked, w in (("is_causal", False, 0), ("causal mask", True, 0), (f"window {window}", True, window)):
        shape = AttentionShape(heads=heads, kv_heads=kv_heads, head_dim=head_dim, seq_len=seq_len, elem_bytes=4,
                               masked=masked, window=w)
        cost = strat.cost(shape, mesh)
        fwd, bwd = kernel_time(prof, cost, "float32", False), kernel_time(prof, cost, "float32", True)
        _, exposed = transfer_times(prof, cost, fwd, bwd)
        out[name] = (fwd + bwd + exposed, max(sum(c.count for c in calls) for calls in cost.kernels))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=32768)
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--strategy", default="ring", choices=("ring", "zigzag_ring"),
                    help="zigzag_ring keeps both ranks busy (as when the profile was measured)")
    a = ap.parse_args()
    shape = dict(seq_len=a.seq_len, window=a.window, heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim,
                 strategy=a.strategy)
    got = spawn_gloo(measure, a.world, threads=1, repeats=a.repeats, **shape)
    pred = predicted(world=a.world, **shape)
    print(f"{a.strategy} attention, fwd+bwd, S={a.seq_len}, SP {a.world}, {a.heads} heads x {a.head_dim}, fp32, "
          f"one thread per rank (slowest rank)")
    print(f"{'mask':<14}{'measured s':>11}{'kernel calls':>13}{'predicted s':>12}{'pred calls':>11}{'pred/meas':>10}")
    base_m, base_p = got["causal mask"][0], pred["causal mask"][0]
    for name in got:
        (m, mc), (p, pc) = got[name], pred[name]
        print(f"{name:<14}{m:>11.3f}{mc:>13d}{p:>12.3f}{pc:>11d}{p / m:>10.2f}")
    w = f"window {a.window}"
    print(f"window / no window: measured {got[w][0] / base_m:.3f}, predicted {pred[w][0] / base_p:.3f}")


if __name__ == "__main__":
    main()
