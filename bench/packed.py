"""Packed documents: attention work per rank and step time, by token layout.

    python bench/packed.py                                  # 32k tokens, 6 documents, SP 2, ring
    python bench/packed.py --docs 512,1024,6144,512 --strategy allgather_kv --repeats 1

Documents of mixed lengths packed into one row (position ids restart at 0 where each
begins; transformers builds the document mask). Built-in tiny Llama (hidden 256, 8
heads, 2 layers), fp32, ``--world`` gloo ranks with one thread each, the same batch
for every layout, measured in one run:

  work    causal-within-document query-key pairs per rank (``sp.report()``), busiest / mean
  calls   attention kernel calls per rank in one forward (masked tiles run, hidden ones skipped)
  step    forward + backward, slowest rank, median of ``--repeats`` after a warm-up

``contiguous`` gives rank r the r-th slice, ``zigzag`` balances one causal sequence,
``balanced`` deals chunks per batch from the documents (autosp.strategies.layout).
"""

from __future__ import annotations

import argparse
import time

from autosp.tools.launch import spawn_gloo

DOCS = "1024,2048,16384,3072,8192,2048"


def measure(docs: list[int], strategy: str, layouts: list[str], repeats: int) -> list[dict]:
    import torch
    import torch.distributed as dist

    import autosp
    from autosp.strategies.blockwise import BLOCK_TALLY
    from autosp.tools.validation import tiny_model

    s = sum(docs)
    ids = torch.randint(0, 2048, (1, s), generator=torch.Generator().manual_seed(s))
    pos = torch.cat([torch.arange(n) for n in docs]).unsqueeze(0)
    rows = []
    for layout in layouts:
        torch._dynamo.reset()
        sp = autosp.compile(tiny_model(), plan=autosp.Decisions.of(strategy=strategy, mesh=autosp.MeshChoice(layout=layout)))
        times, calls = [], 0
        for rep in range(repeats + 1):
            before = BLOCK_TALLY["computed"]
            dist.barrier()
            t0 = time.perf_counter()
            loss = sp(input_ids=ids, labels=ids, position_ids=pos).loss
            calls = BLOCK_TALLY["computed"] - before
            loss.backward()
            dist.barrier()
            if rep:
                times.append(time.perf_counter() - t0)
        rep_ = sp.report()
        mine = torch.tensor([float(calls)])
        every = [torch.zeros(1) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        step = torch.tensor([sorted(times)[len(times) // 2]])
        dist.all_reduce(step, op=dist.ReduceOp.MAX)
        rows.append(dict(layout=layout, work=rep_.work_per_rank, balance=rep_.work_balance,
                         calls=[int(c.item()) for c in every], step_s=step.item(), loss=loss.item()))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", default=DOCS, help="document lengths, comma-separated")
    ap.add_argument("--strategy", default="ring")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layouts", default="contiguous,zigzag,balanced")
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    docs = [int(x) for x in a.docs.split(",")]
    rows = spawn_gloo(measure, a.world, threads=1, docs=docs, strategy=a.strategy,
                      layouts=a.layouts.split(","), repeats=a.repeats)
    print(f"{a.strategy}, SP {a.world}, documents {docs} ({sum(docs)} tokens), tiny Llama fp32, one thread per rank")
    print(f"{'layout':<12}{'work busiest/mean':>18}{'kernel calls per rank':>24}{'step s':>9}{'vs contiguous':>15}"
          f"{'loss':>10}")
    base = rows[0]["step_s"]
    for r in rows:
        print(f"{r['layout']:<12}{r['balance']:>18.3f}{str(r['calls']):>24}{r['step_s']:>9.2f}"
              f"{base / r['step_s']:>14.2f}x{r['loss']:>10.5f}")


if __name__ == "__main__":
    main()
