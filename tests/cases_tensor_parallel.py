"""Tensor-parallel cases: TP x SP (x DP) against one process, on every rank of a gloo pool
(``dist_harness``); :mod:`dist_cases` is their index."""

from __future__ import annotations

import copy
from typing import Any

import torch

import autosp

from dist_models import _batch, _loss, _rel, build


def tp_compare(kind: str = "llama", strategy: str = "ulysses", shape: tuple[int, ...] = (2, 2),
               names: tuple[str, ...] = ("sp", "tp"), steps: int = 3, seq_len: int = 32, zero_stage: int | None = None,
               compiler: str | None = None, **cfg: Any) -> dict[str, Any]:
    """A mesh with a ``"tp"`` dimension against one process on the global batch (each DP row its
    own rows of it): the loss and every gradient (this rank's shard of the one-process gradient)
    per AdamW step, the parameters after them, and what ran (from the report)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autosp.transform.tensor_parallel import shard_of

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    rows = mesh["dp"].size() if "dp" in names else 1
    row = mesh.get_local_rank("dp") if "dp" in names else 0
    tp_rank = mesh.get_local_rank("tp")
    ref = build(kind, **cfg)
    model = copy.deepcopy(ref)
    sp = autosp.compile(model, plan=strategy, mesh=mesh, zero=autosp.Zero(stage=zero_stage, bucket_mb=0.01),
                        runtime=autosp.Runtime(compiler=compiler))
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt_sp = sp.optimizer(torch.optim.AdamW, lr=1e-3)
    refs = dict(ref.named_parameters())
    out: dict[str, Any] = {"loss_err": 0.0, "grad_err": 0.0, "worst": ""}
    per_row = 2
    for step in range(steps):
        ids, labels = _batch(step, per_row * rows, seq_len, True)
        loss_ref = _loss(ref, kind, ids, labels)
        loss_ref.backward()
        mine = slice(row * per_row, (row + 1) * per_row)
        loss = _loss(sp, kind, ids[mine], labels[mine])
        loss.backward()
        out["loss_err"] = max(out["loss_err"], abs(loss.item() - loss_ref.item()) / abs(loss_ref.item()))
        for name, p in model.named_parameters():
            e = _rel(p.grad, shard_of(refs[name].grad, name, sp.tp_report, tp_rank))
            if e > out["grad_err"]:
                out["grad_err"], out["worst"] = e, f"step {step} {name}"
        opt_ref.step()
        opt_sp.step()
        opt_ref.zero_grad()
        opt_sp.zero_grad()
    out["param_err"] = max(_rel(p.detach(), shard_of(refs[n].detach(), n, sp.tp_report, tp_rank))
                           for n, p in model.named_parameters())
    out["shapes"] = {n: tuple(p.shape) for n, p in model.named_parameters() if ".0." in n or "layers" not in n}
    out["strategies"] = sp.state.strategies
    out["report"] = sp.report().as_dict()
    out["rank"] = dist.get_rank()
    return out


def tp_plan_and_errors(seq_len: int = 32) -> dict[str, Any]:
    """A saved plan with TP 2 x SP 2 applied by ``autosp.compile(model, plan=path)`` with no mesh given
    (it builds the ('dp', 'sp', 'tp') mesh), against one process; and the refusals of a TP mesh
    autosp cannot run."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autosp.errors import AutospError
    from autosp.planner.problem import Problem
    from autosp.planner.search import plan as make_plan
    from autosp.transform.tensor_parallel import shard_of

    ref = build("llama")
    problem = Problem.of(copy.deepcopy(ref), seq_len=seq_len, batch_size=2, world_size=4, devices_per_node=2,
                         profile="cpu-gloo", dtype="float32", compiler="aot_eager", tp_degrees=(2,),
                         sp_degrees=(2,))
    p = make_plan(problem)
    model = copy.deepcopy(ref)
    sp = autosp.compile(model, plan=p)
    ids, labels = _batch(0, 2, seq_len, True)
    loss_ref = _loss(ref, "llama", ids, labels)
    loss_ref.backward()
    loss = _loss(sp, "llama", ids, labels)
    loss.backward()
    tp_rank = dist.get_rank() % 2
    refs = dict(ref.named_parameters())
    out: dict[str, Any] = {"mesh": (p.mesh.sp_degree, p.mesh.tp_degree, p.dp_degree),
                           "loss_err": abs(loss.item() - loss_ref.item()) / abs(loss_ref.item()),
                           "grad_err": max(_rel(q.grad, shard_of(refs[n].grad, n, sp.tp_report, tp_rank))
                                           for n, q in model.named_parameters()),
                           "report": sp.report().as_dict(), "errors": {}}

    def refused(name, call):
        try:
            call()
        except AutospError as e:
            out["errors"][name] = str(e)

    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    mesh3 = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp", "sp", "tp"))
    refused("plan's TP, mesh without", lambda: autosp.compile(build("llama"), plan=p, mesh=mesh2))
    refused("ZeRO 3", lambda: autosp.compile(build("llama"), "ulysses", mesh=mesh3, zero=3))
    refused("not HF", lambda: autosp.compile(build("reference"), "ulysses", mesh=mesh3))
    refused("tp outer", lambda: autosp.compile(build("llama"), "ulysses",
                                              mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "sp"))))
    return out
