"""Mesh cases: data parallel x SP, ZeRO 0-3 (in-graph gathers, FSDP2), accumulation, resumable
checkpoints, and the errors of a mesh given wrong.

Run on every rank of a gloo pool (``dist_harness``); :mod:`dist_cases` is their index."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch

import autosp
from autosp.errors import AutospError

from dist_models import _batch, _dp_plan, _full, _grad_reductions_since, _local, _loss, _mesh22, _rel, _user_fsdp_step, _with_env, build


def dp_sp_compare(kind: str = "llama", zero_stage: int | None = 0, strategy: str = "ulysses", steps: int = 3,
                  seq_len: int = 32, rows: int = 2, uneven: bool = True, bucket_mb: float = 0.01,
                  plan_dir: str = "", zero_shard: Any = "mesh", compiler: str | None = None,
                  host_optimizer: bool = False, **cfg: Any) -> dict[str, Any]:
    """A dp x sp mesh (``rows`` data-parallel rows) against one process on the concatenated global
    batch: loss and every parameter gradient per AdamW step, and what ran (from the report);
    ``host_optimizer``: ``model.optimizer`` steps in host memory."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (rows, world // rows), mesh_dim_names=("dp", "sp"))
    row = mesh.get_local_rank("dp")
    ref = build(kind, **cfg)
    model = copy.deepcopy(ref)
    if plan_dir:           # the same configuration, as a plan file applied whole
        path = f"{plan_dir}/plan-{dist.get_rank()}.json"
        _dp_plan(kind, seq_len, rows, strategy, zero_stage).save(path)
        sp = autosp.compile(model, plan=path, zero=autosp.Zero(bucket_mb=bucket_mb))
    else:
        plan = autosp.Decisions.of(strategy=strategy, mesh=autosp.MeshChoice(host_optimizer=True)) \
            if host_optimizer else strategy
        sp = autosp.compile(model, plan=plan, mesh=mesh,
                            zero=autosp.Zero(stage=zero_stage, bucket_mb=bucket_mb, shard=zero_shard),
                            runtime=autosp.Runtime(compiler=compiler))
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt_sp = sp.optimizer(torch.optim.AdamW, lr=1e-3)
    out: dict[str, Any] = {"loss_err": 0.0, "grad_err": 0.0, "worst": "", "losses": []}
    per_row = 2
    for step in range(steps):
        ids, labels = _batch(step, per_row * rows, seq_len, uneven)
        if uneven and rows > 1:       # the rows' ignored labels differ a lot: a mean of row means would be off
            labels[per_row:, : seq_len * 3 // 4] = -100
        loss_ref = _loss(ref, kind, ids, labels)
        loss_ref.backward()
        mine = slice(row * per_row, (row + 1) * per_row)
        loss = _loss(sp, kind, ids[mine], labels[mine])
        loss.backward()
        out["losses"].append((loss_ref.item(), loss.item()))
        out["loss_err"] = max(out["loss_err"], abs(loss.item() - loss_ref.item()) / abs(loss_ref.item()))
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            e = _rel(_full(p.grad), q.grad)
            if e > out["grad_err"]:
                out["grad_err"], out["worst"] = e, f"step {step} {name}"
        opt_ref.step()
        opt_sp.step()
        grad_bytes = sum(_local(p.grad).numel() * p.grad.element_size() for p in model.parameters())
        opt_ref.zero_grad()
        opt_sp.zero_grad()
    flat = lambda m: torch.cat([_full(p.detach()).flatten() for p in m.parameters()])  # noqa: E731
    out["param_err"] = _rel(flat(model), flat(ref))
    out["strategies"] = sp.state.strategies
    out["report"] = sp.report().as_dict()
    out["row"] = row
    out["optimizer"] = type(opt_sp).__name__
    stepped = getattr(opt_sp, "optim", opt_sp)              # ZeRO 1: the optimizer of this rank's share
    out["stepped"] = (type(stepped).__name__, getattr(stepped, "on_host", None),
                      len(getattr(stepped, "masters", ())), len(stepped.param_groups[0]["params"]))
    out["params"] = sum(1 for p in model.parameters() if p.requires_grad)
    states = getattr(opt_sp, "optim", opt_sp).state.values()
    out["state_elements"] = sum(_local(t).numel() for st in states for t in st.values() if t.dim() > 0)
    out["param_elements"] = sum(p.numel() for p in model.parameters())
    out["local_param_elements"] = sum(_local(p).numel() for p in model.parameters())
    # what this rank holds between steps: parameters, gradients (before zero_grad), optimizer states
    out["state_bytes"] = grad_bytes + sum(_local(t).numel() * t.element_size() for st in states
                                          for t in st.values() if t.dim() > 0) + \
        sum(_local(p).numel() * p.element_size() for p in model.parameters())
    out["one_process_state_bytes"] = sum(p.numel() * p.element_size() for p in ref.parameters()) * 4  # p, g, 2 moments
    if zero_stage == 3:
        from autosp.costmodel.memory import model_states
        from autosp.graph import capture

        states_pred = model_states(capture(build(kind, **cfg), seq_len=seq_len, batch_size=per_row, dtype="float32"),
                                   world, zero_stage)
        out["predicted_state_bytes"] = sum(states_pred.values())
    out["fsdp_units"] = sum(1 for m in model.modules() if type(m).__name__.startswith("FSDP"))
    out["plan"] = None if sp.plan is None else {"zero_stage": sp.plan.mesh.zero_stage, "layers": sp.plan.layers}
    out["compiler"] = sp.config.compiler
    out["sp_rows"] = dist.get_world_size(sp.mesh.sp), dist.get_world_size(sp.mesh.whole)
    return out


def dp_sp_accumulate(seq_len: int = 32) -> dict[str, Any]:
    """Two micro-batches per step on a 2 x 2 mesh: under no_sync then one reduction, equal to one
    process on all four rows' batches; accumulating onto reduced gradients is refused."""
    import torch.distributed as dist

    mesh = _mesh22()
    row = mesh.get_local_rank("dp")
    ref = build("llama")
    model = copy.deepcopy(ref)
    sp = autosp.compile(model, plan="ulysses", mesh=mesh, zero=0)
    micro = [_batch(i, 4, seq_len, True) for i in range(2)]
    # one process: each micro-batch's loss over all four rows, backward twice (gradients add up)
    for ids, labels in micro:
        _loss(ref, "llama", ids, labels).backward()
    calls = _grad_reductions_since()
    with sp.no_sync():
        ids, labels = micro[0]
        _loss(sp, "llama", ids[2 * row:2 * row + 2], labels[2 * row:2 * row + 2]).backward()
    inside = calls()
    ids, labels = micro[1]
    _loss(sp, "llama", ids[2 * row:2 * row + 2], labels[2 * row:2 * row + 2]).backward()
    err = max(_rel(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
    try:           # a third backward without zero_grad: onto gradients already summed
        _loss(sp, "llama", ids[2 * row:2 * row + 2], labels[2 * row:2 * row + 2]).backward()
        refused = ""
    except AutospError as e:
        refused = str(e)
    dist.barrier()
    return {"grad_err": err, "refused": refused, "reduced_inside_no_sync": inside}


def dp_sp_errors() -> list[str]:
    """The one-line refusals of bad mesh / ZeRO input."""
    from torch.distributed.device_mesh import init_device_mesh

    import torch.distributed as dist

    out = []
    pair, _ = dist.new_subgroups(group_size=2)
    attempts = [
        lambda: autosp.compile(build("llama"), mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))),
        lambda: autosp.compile(build("llama"), mesh=3),
        lambda: autosp.compile(build("llama"), zero=5),
        lambda: autosp.compile(build("llama"), mesh=pair, zero=3),
        lambda: autosp.compile(build("llama"), zero=0, runtime=autosp.Runtime(reduce_grads=False)),
        lambda: autosp.compile(build("llama"), mesh=init_device_mesh("cpu", (4,), mesh_dim_names=("sp",)), sp_size=4),
        lambda: autosp.compile(build("llama")).no_sync(),
        lambda: _user_fsdp_step(),
        lambda: _with_env(LOCAL_WORLD_SIZE="2")(
            lambda: autosp.compile(build("llama"), plan=_dp_plan("llama", 32, 1, "hybrid:2x2", 0))),
        lambda: autosp.compile(build("llama"), mesh=_mesh22(), zero=autosp.Zero(stage=3, shard=3)),
        lambda: autosp.compile(build("llama"), mesh=_mesh22(), zero=autosp.Zero(stage=2, shard=2)),
    ]
    for attempt in attempts:
        try:
            attempt()
            out.append("")
        except AutospError as e:
            out.append(str(e))
    return out


def checkpoint_resume(path: str, zero_stage: int = 3, resumes: tuple[tuple[int, ...], ...] = ((2, 3),),
                      seq_len: int = 32, host_optimizer: bool = False) -> dict[str, Any]:
    """Train 2 AdamW steps on a 2 x 2 mesh, save (DCP), train 2 more; then for each (rows, ZeRO
    stage[, optimizer on the host]) in ``resumes`` a fresh model and optimizer on that mesh load and
    train the same 2 steps: the losses. Also the full parameters after the save, for a plain load to
    check. ``host_optimizer``: the first run's optimizer steps in host memory."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autosp.checkpoint

    def run(rows: int, stage: int | None, steps: range, load: bool = False,
            host: bool = False) -> tuple[list[float], Any]:
        mesh = init_device_mesh("cpu", (rows, 4 // rows), mesh_dim_names=("dp", "sp"))
        row = mesh.get_local_rank("dp")
        torch.manual_seed(1 if load else 0)                 # the resumed model starts from other weights
        model = build("llama")
        plan = autosp.Decisions.of(strategy="ulysses", mesh=autosp.MeshChoice(host_optimizer=host))
        sp = autosp.compile(model, plan=plan, mesh=mesh, zero=stage)
        opt = sp.optimizer(torch.optim.AdamW, lr=1e-2)
        extra = autosp.checkpoint.load(sp, opt, path) if load else {}
        losses, full = [], None
        per_row = 4 // rows
        for step in steps:
            if not load and step == 2:
                autosp.checkpoint.save(sp, opt, path, step=step)
                full = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
            ids, labels = _batch(step, 4, seq_len, True)
            mine = slice(row * per_row, (row + 1) * per_row)
            loss = _loss(sp, "llama", ids[mine], labels[mine])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, (full, extra)

    first, (full, _) = run(2, zero_stage, range(4), host=host_optimizer)
    out: dict[str, Any] = {"uninterrupted": first[2:], "resumed": {}, "extra": {},
                           "full": {n: t.tolist() for n, t in full.items()} if dist.get_rank() == 0 else None}
    for rows, stage, *host in resumes:
        dist.barrier()
        torch._dynamo.reset()
        key = f"{rows}x{4 // rows} stage {stage}" + (" host" if host and host[0] else "")
        out["resumed"][key], (_, out["extra"][key]) = run(rows, stage, range(2, 4), load=True,
                                                          host=bool(host and host[0]))
    return out


def zero3_in_graph(seq_len: int = 64, steps: int = 1, compilers: tuple[str, ...] = ("aot_eager",),
                   checkpoint: str = "none") -> dict[str, Any]:
    """ZeRO 3 gathered inside the graph on a 1 x 2 mesh, a 4-block Llama whose parameters outweigh
    its activations, every layer checkpointed as ``checkpoint`` says: per compiler, the worst
    gradient and loss error against one process over ``steps`` AdamW steps, what the report says
    ran, and the last step's peak bytes (memory probe) next to what the cost model predicts for it."""
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    from autosp.costmodel.predict import predict
    from autosp.costmodel.profile import load_profile
    from autosp.graph import capture
    from autosp.tools.memory_probe import step_peak

    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg)
    out: dict[str, Any] = {"param_bytes": sum(p.numel() * 4 for p in ref.parameters()),
                           "block_bytes": sum(p.numel() * 4 for p in ref.model.layers[0].parameters())}
    pred = predict(capture(copy.deepcopy(ref), seq_len=seq_len, batch_size=1, dtype="float32"),
                   load_profile("cpu-gloo"), sp=2, strategy="ulysses", seq_len=seq_len, zero_stage=3)
    out["predicted_step_peak"] = pred.memory["step_peak"]
    for compiler in compilers:
        torch._dynamo.reset()
        one, model = copy.deepcopy(ref), copy.deepcopy(ref)
        mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "sp"))
        sp = autosp.compile(model, plan=autosp.Decisions.of(strategy="ulysses", checkpoint=checkpoint), mesh=mesh,
                            zero=3, runtime=autosp.Runtime(compiler=compiler))
        opt, opt_one = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(one.parameters(), lr=1e-3)
        row: dict[str, Any] = {"loss_err": 0.0, "grad_err": 0.0}
        for step in range(steps):
            ids, labels = _batch(step, 1, seq_len, True)
            with _zero3_events() as events:       # the last step's order of collectives
                loss, row["peak"] = step_peak(sp, lambda: _marked(events, sp(input_ids=ids, labels=labels).loss))
            ref_loss = one(input_ids=ids, labels=labels).loss
            ref_loss.backward()
            row["loss_err"] = max(row["loss_err"], abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
            for p, q in zip(model.parameters(), one.parameters()):
                row["grad_err"] = max(row["grad_err"], _rel(_full(p.grad), q.grad))
            row["report"] = sp.report().as_dict()
            opt.step(), opt_one.step()
            opt.zero_grad(set_to_none=True), opt_one.zero_grad(set_to_none=True)
        row["events"] = events
        row["shard_elements"] = sum(_local(p).numel() for p in model.parameters())
        row["dtensors"] = all(type(p).__name__ == "DTensor" for p in model.parameters())
        row["keys_plain"] = list(model.state_dict()) == list(ref.state_dict())
        out[compiler] = row
    return out


def _marked(events: list[str], loss: torch.Tensor) -> torch.Tensor:
    events.append("|")
    return loss


@contextlib.contextmanager
def _zero3_events():
    """The order in which this rank starts and waits for ZeRO 3's collectives, with the SP
    all-to-alls (``a``) between them: ``G`` a gather starts, ``g`` waited for; ``R`` a gradient
    reduction starts, ``r`` waited for; ``|`` the backward begins."""
    from autosp.strategies import collectives
    from autosp.transform.zero import prefetch as zero3_overlap

    events: list[str] = []
    saved = collectives.tally, zero3_overlap.tally, zero3_overlap.wait_all
    marks = {zero3_overlap.GATHER_KIND: ("G", "g"), zero3_overlap.REDUCE_KIND: ("R", "r")}

    def tally(kind, group, *sent):
        events.append(marks[kind][0] if kind in marks else "a" if kind == "all_to_all" else "")
        return saved[0](kind, group, *sent)

    def wait_all(works, kind, group):
        events.append(marks[kind][1])
        return saved[2](works, kind, group)

    collectives.tally = zero3_overlap.tally = tally
    zero3_overlap.wait_all = wait_all
    try:
        yield events
    finally:
        collectives.tally, zero3_overlap.tally, zero3_overlap.wait_all = saved
