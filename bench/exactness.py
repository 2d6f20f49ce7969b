"""Exactness against one process, printed: the numbers the tests bound, for notes.

    python bench/exactness.py                                    # MoE, masks, tiled loss, memory budget
    python bench/exactness.py --cases moe
    python bench/exactness.py --cases dp                         # 2 (DP) x 2 (SP) on 4 processes, ZeRO 0-3

Runs cases of ``tests/dist_cases.py`` on 2 gloo processes (one thread each); each trains
a small model for one step with autosp and, in the same process, without it, and prints
the relative loss error and the worst per-parameter relative gradient error.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

CASES = {
    "moe": [dict(kind="mixtral", strategy="ulysses"), dict(kind="qwen2_moe", strategy="ring"),
            dict(kind="granitemoe", strategy="allgather_kv")],
    "masks": [dict(kind="mistral", sliding_window=8, strategy="ring"),
              dict(kind="llama", inputs="padded", strategy="zigzag_ring"),
              dict(kind="llama", inputs="packed", strategy="allgather_kv"),
              dict(kind="llama", inputs="cu_seqlens", strategy="ring")],
    "tiled": [dict(kind="llama", strategy="ring", loss_chunks=4)],
    # against one process on the global batch, 3 AdamW steps, the rows' ignored labels uneven
    "dp": [dict(kind=k, strategy=st, zero_stage=z) for z in (0, 1, 2, 3)
           for k, st in (("llama", "ulysses"), ("qwen2", "zigzag_ring"))] +
          [dict(kind="gpt2", strategy="ulysses", zero_stage=0)],
}


def main() -> None:
    from dist_harness import Pool

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="moe,masks,tiled,budget,tiled_memory")
    names = ap.parse_args().cases.split(",")
    pool = Pool(4 if "dp" in names else 2)
    try:
        for name in names:
            if name == "budget":
                r = pool.run("memory_budget_compare")[0][1]
                print(f"memory_limit {r['limit'] / 2**20:.2f} MiB between predicted peaks none "
                      f"{r['peaks']['none'] / 2**20:.2f} / full {r['peaks']['full'] / 2**20:.2f} MiB: planned "
                      f"{[x['checkpoint'] for x in r['plan_layers']]}, loss err {r['loss_err']:.1e}, "
                      f"grad err {r['grad_err']:.1e}")
            elif name == "tiled_memory":
                r = pool.run("loss_tiling_memory")[0][1]
                print(f"tiled loss, vocab 8192, 1024 tokens, SP 2: step peak whole {r[1]['peak'] / 1e6:.1f} MB, "
                      f"8 chunks {r[8]['peak'] / 1e6:.1f} MB; loss err {r[1]['loss_err']:.1e} / {r[8]['loss_err']:.1e}")
            elif name == "dp":
                for kw in CASES[name]:
                    r = pool.run("dp_sp_compare", **kw)[0][1]
                    print(f"{kw}: {r['strategies']} over 3 steps loss err {r['loss_err']:.1e}, grad err "
                          f"{r['grad_err']:.1e}, parameters after {r['param_err']:.1e}; held per rank "
                          f"{r['state_bytes']} B of one process's {r['one_process_state_bytes']} B")
            else:
                for kw in CASES[name]:
                    r = pool.run("train_compare", steps=1, **kw)[0][1]
                    print(f"{kw}: {r['strategies']} loss err {r['loss_err']:.1e}, grad err {r['grad_err']:.1e}")
    finally:
        pool.close()


if __name__ == "__main__":
    main()
