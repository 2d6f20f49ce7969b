"""A sharded bf16 training step per strategy against one process (``python bench/gpu_check.py --only e2e``).

The path users take on a GPU: a small Llama in bf16, ``autosp.compile(model, plan=strategy)`` through
Inductor, 2 ranks, each passing the same batch (some labels ignored); per strategy, over ``steps``
AdamW steps, the loss and every gradient against one process running the plain model on the whole
batch on the same device, and what ran: the strategy per attention op, the collectives of the last
step (calls and bytes), the step time. Ranks: one per GPU over NCCL where there are two; on one
GPU both ranks share it over gloo, whose collectives stage CUDA tensors through the host (a
strategy whose collective gloo cannot run on CUDA tensors is reported with its error, not
skipped). ``--dry`` runs the same on CPU over gloo (the suite runs one strategy, and ``tp``).
``tp``: tensor parallelism instead of SP, the 2 ranks one TP group (mesh ``("sp", "tp")`` of
1 x 2): each holds half of every block's attention heads and MLP features, and each gradient is
compared with its half of the one-process gradient.

bf16 tolerance: relative to the one-process value, 2.5e-2 for every step's loss and for each
gradient's norm of difference at the first step (the peers' tolerance; the kernels sum in other
orders). Later steps' gradients are reported too: there the two runs' bf16 parameters have
drifted by a rounding of AdamW's updates, so they measure the drift as well.
"""

from __future__ import annotations

import copy
import json
import os
import time
from typing import Any

import torch

STRATEGIES = ("ulysses", "ring", "zigzag_ring", "allgather_kv", "tp")
TOLERANCE = 2.5e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def rank_step(strategy: str, device: str, compiler: str, steps: int = 2, seq_len: int = 256) -> dict[str, Any]:
    """On every rank: ``strategy``'s sharded steps against one process's (see the module docstring)."""
    import torch.distributed as dist

    import autosp
    from autosp.costmodel.profiler import outside_allocator_bytes
    from autosp.tools.validation import tiny_model
    from autosp.transform.tensor_parallel import shard_of

    torch._dynamo.reset()
    dev = torch.device(device if device == "cpu" else f"cuda:{torch.cuda.current_device()}")
    ref = tiny_model().to(device=dev, dtype=torch.bfloat16)
    model = copy.deepcopy(ref)
    mesh = None
    if strategy == "tp":            # the ranks one TP group, no SP
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(dev.type, (1, dist.get_world_size()), mesh_dim_names=("sp", "tp"))
    sp = autosp.compile(model, plan="ulysses" if mesh is not None else strategy, mesh=mesh,
                        runtime=autosp.Runtime(compiler=compiler))
    tp_rank = mesh.get_local_rank("tp") if mesh is not None else 0
    opt, opt_ref = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(ref.parameters(), lr=1e-3)
    row: dict[str, Any] = {"strategy": strategy, "loss_err": 0.0, "grad_err": 0.0, "worst": "", "step_s": [],
                           "grad_err_per_step": []}
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 1000, (1, seq_len), generator=g).to(dev)
        labels = ids.clone()
        labels[:, : seq_len // 8] = -100                    # rank 0 holds fewer labelled tokens
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = sp(input_ids=ids, labels=labels).loss
        loss.backward()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        row["step_s"].append(time.perf_counter() - t0)
        loss_ref = ref(input_ids=ids, labels=labels).loss
        loss_ref.backward()
        row["loss_err"] = max(row["loss_err"], abs(loss.item() - loss_ref.item()) / abs(loss_ref.item()))
        errs = {name: _rel(p.grad, shard_of(q.grad, name, sp.tp_report, tp_rank))
                for (name, p), q in zip(model.named_parameters(), ref.parameters())}
        worst = max(errs, key=errs.__getitem__)
        row["grad_err_per_step"].append(errs[worst])
        if step == 0:       # the same parameters on both sides: what the sharded kernels change
            row["grad_err"], row["worst"] = errs[worst], worst
        opt.step(), opt_ref.step()
        opt.zero_grad(set_to_none=True), opt_ref.zero_grad(set_to_none=True)
    rep = sp.report().as_dict()
    row.update(ran=list(sp.state.strategies), compiler=rep["compiler"], world=dist.get_world_size(),
               collectives={k: {"calls": v["calls"], "bytes": v["bytes"]} for k, v in rep["collectives"].items()},
               loss_tokens=rep.get("loss_tokens"), dtype=str(next(model.parameters()).dtype),
               tokens_per_rank=[a["tokens_per_rank"] for a in rep["attention"]],     # observed as the step ran
               tp_degree=rep["tp_degree"], tp_collectives={k: v["calls"] for k, v in rep["tp_collectives"].items()},
               # the CUDA context and the communicators (the profiles' runtime_reserved_bytes); with two
               # ranks on one GPU, both processes'
               outside_allocator_bytes=outside_allocator_bytes(dev) if dev.type == "cuda" else None,
               device=str(dev), ok=row["loss_err"] < TOLERANCE and row["grad_err"] < TOLERANCE)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"loss_err": row["loss_err"], "grad_err": row["grad_err"],
                                      "loss_tokens": row["loss_tokens"], "tokens_per_rank": row["tokens_per_rank"]})
    row["ranks"] = gathered
    return row


def sharded_step_check(dry: bool = False, strategies: tuple[str, ...] = STRATEGIES, steps: int = 2,
                       compiler: str = "inductor") -> dict[str, Any]:
    """Every strategy's row (or its error), on 2 ranks."""
    from autosp.tools.launch import spawn_gloo

    gpus = 0 if dry else torch.cuda.device_count()
    backend = "nccl" if gpus >= 2 else "gloo"
    device = "cpu" if dry else "cuda"
    out: dict[str, Any] = {"device": "cpu" if dry else torch.cuda.get_device_name(), "backend": backend,
                           "gpus": gpus, "compiler": compiler, "tolerance": TOLERANCE, "rows": []}
    for strategy in strategies:
        t0 = time.perf_counter()
        try:
            row = spawn_gloo(rank_step, 2, timeout=600, backend=backend, strategy=strategy, device=device,
                             compiler=compiler, steps=steps)
        except Exception as e:  # noqa: BLE001 - reported per strategy: the others still run
            row = {"strategy": strategy, "ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
        row["wall_s"] = time.perf_counter() - t0
        out["rows"].append(row)
        print(_line(row), flush=True)
    return out


def _line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"  {r['strategy']:14s} FAILED {r['error']}"
    colls = ", ".join(f"{k} x{v['calls']}" for k, v in r["collectives"].items())
    return (f"  {r['strategy']:14s} {'ok' if r['ok'] else 'OFF'}: loss {r['loss_err']:.2e}, worst gradient "
            f"{r['grad_err']:.2e} ({r['worst']}; per step {', '.join(f'{e:.1e}' for e in r['grad_err_per_step'])}), "
            f"step {min(r['step_s']) * 1e3:.1f} ms, ran {r['ran']}, {colls}, tokens per rank {r['tokens_per_rank']}"
            + (f", outside the allocator {r['outside_allocator_bytes'] / 2**30:.2f} GiB"
               if r.get("outside_allocator_bytes") is not None else ""))


def main(out_dir: str, dry: bool, strategies: tuple[str, ...] | None = None, compiler: str = "inductor") -> dict[str, Any]:
    print(f"sharded bf16 steps, 2 ranks, against one process (tolerance {TOLERANCE}), compiled by {compiler}:")
    res = sharded_step_check(dry, strategies or STRATEGIES, compiler=compiler)
    with open(os.path.join(out_dir, "sharded_step.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res
