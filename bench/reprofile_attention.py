"""Re-measure a CPU profile's attention rows: the profiler's grid, one thread, on 2 ranks
measuring at the same time (as 2 SP ranks compute on a 2-core machine). Prints the rows.

    python bench/reprofile_attention.py autosp/profiles/cpu-gloo.json new.json
"""
import json, datetime, sys


def rows():
    import torch
    import torch.distributed as dist
    from autosp.costmodel import profiler
    F = torch.nn.functional
    torch.set_num_threads(1)
    grid = profiler._grids(False, False)["attention"]
    sync = dist.barrier
    fwd, bwd = [], []
    for b_, h, s, d in grid:
        q, k_, v = (torch.randn(b_, h, s, d, requires_grad=True) for _ in range(3))
        o = F.scaled_dot_product_attention(q, k_, v, is_causal=True)
        g = torch.randn_like(o)
        reps = 7 if s <= 8192 else 5
        tf = profiler._timeit(lambda: F.scaled_dot_product_attention(q, k_, v, is_causal=True), reps, sync)

        def fb():
            out_ = F.scaled_dot_product_attention(q, k_, v, is_causal=True)
            torch.autograd.grad(out_, (q, k_, v), g)
        tfb = profiler._timeit(fb, reps, sync)
        fwd.append(dict(batch=b_, heads=h, q_len=s, kv_len=s, head_dim=d, causal=True, seconds=tf))
        bwd.append(dict(batch=b_, heads=h, q_len=s, kv_len=s, head_dim=d, causal=True, backward=True,
                        seconds=max(tfb - tf, 1e-9)))
    return fwd, bwd


if __name__ == "__main__":
    from autosp.tools.launch import spawn_gloo
    fwd, bwd = spawn_gloo(rows, 2, threads=1)
    for f, b in zip(fwd, bwd):
        print(f["heads"], f["q_len"], f"{f['seconds']:.4f} {b['seconds']:.4f}")
    doc = json.load(open(sys.argv[1]))
    doc["compute"]["attention"]["float32"] = fwd
    doc["compute"]["attention_backward"]["float32"] = bwd
    doc["source"]["attention_remeasured"] = (
        datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        + ": attention rows re-measured, 2 ranks at once, one thread each (bench/window.py found the "
          "earlier rows 1.4-1.6x slower than this machine)")
    json.dump(doc, open(sys.argv[2], "w"), indent=1)
