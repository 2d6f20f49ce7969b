"""The shortest call as a user makes it: ``autosp.compile(model)`` (or with ``memory_limit``), the
default compiler (Inductor) and the planner choosing, on 2 gloo ranks against one process.

    python bench/shortest_call.py [--dtype float32|bfloat16] [--memory-limit MiB]

Prints, per AdamW step, the loss error and the error of all gradients together (relative norms),
and what ran: the compiler the plan was costed for, the decisions, tokens per rank, collectives.
A budget no plan meets raises autosp's one-line error on every rank.
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile

from autosp.tools.launch import spawn_gloo


def run(dtype: str, limit_mib: int, steps: int = 2) -> dict:
    import torch
    import transformers

    import autosp

    os.environ.pop("AUTOSP_COMPILER", None)           # what a user gets
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp()  # plan afresh
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=512, attn_implementation="sdpa")
    ref = transformers.AutoModelForCausalLM.from_config(cfg).to(getattr(torch, dtype))
    model = copy.deepcopy(ref)
    sp = autosp.compile(model, memory_limit=f"{limit_mib}MiB") if limit_mib else autosp.compile(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, model)]
    rows = []
    for step in range(steps):
        ids = torch.randint(0, 512, (1, 512), generator=torch.Generator().manual_seed(step))
        losses = [m(input_ids=ids, labels=ids, use_cache=False).loss for m in (ref, sp)]
        for loss in losses:
            loss.backward()
        grads = [torch.cat([p.grad.float().flatten() for p in m.parameters()]) for m in (ref, model)]
        rows.append((abs(losses[1].item() - losses[0].item()) / losses[0].item(),
                     ((grads[1] - grads[0]).norm() / grads[0].norm()).item()))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    rep = sp.report()
    return {"rows": rows, "compiler": rep.compiler, "plan_compiler": sp.plan.predicted.compiler,
            "decisions": [(c.choice.strategy, c.choice.checkpoint, c.choice.mlp_chunks) for c in sp.plan.layers],
            "tokens_per_rank": [a.tokens_per_rank for a in rep.attention],
            "collectives": {k: v["calls"] for k, v in rep.collectives.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--memory-limit", type=int, default=0, help="MiB per rank (0: the device's)")
    args = ap.parse_args()
    r = spawn_gloo(run, 2, threads=1, dtype=args.dtype, limit_mib=args.memory_limit)
    print(f"{args.dtype}: ran {r['compiler']}, plan costed for {r['plan_compiler']}, {r['decisions']}, "
          f"tokens per rank {r['tokens_per_rank']}, collectives {r['collectives']}")
    for i, (loss, grad) in enumerate(r["rows"]):
        print(f"step {i}: loss error {loss:.1e}, gradient error {grad:.1e}")


if __name__ == "__main__":
    main()
