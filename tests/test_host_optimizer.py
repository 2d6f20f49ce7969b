"""The optimizer stepped in host memory (autosp/transform/host_optimizer.py), in one process: the same
parameters as the wrapped optimizer on the device, schedulers, checkpoints, low-precision masters.
ZeRO 3 shards over gloo ranks: tests/test_sp_2proc.py (offload) and test_sp_4proc.py (resume)."""

import copy
from dataclasses import replace

import pytest
import torch

import autosp

from autosp.transform.host_optimizer import MASTER, HostOptimizer


def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(dtype)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    torch.manual_seed(100 + i)
    x = torch.randn(8, 16, dtype=next(model.parameters()).dtype)
    model(x).float().square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_fp32_parameters_are_the_bits_adamw_gives_on_the_device_with_a_scheduler():
    ref, model = _model(), _model()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    # the scheduler changes the outer groups' lr; each step passes it down
    sched_ref = torch.optim.lr_scheduler.StepLR(opt_ref, step_size=1, gamma=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for i in range(4):
        _step(ref, opt_ref, i)
        _step(model, opt, i)
        sched_ref.step()
        sched.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p, q), i
    # the last step ran at the lr of 3 scheduler steps; the outer group holds the 4th's, for the next
    assert opt.on_host and opt.inner.param_groups[0]["lr"] == 1e-2 * 0.5 ** 3
    assert opt.param_groups[0]["lr"] == 1e-2 * 0.5 ** 4
    # the states are the masters' (host copies apart from the parameters), none the parameters'
    params = list(model.parameters())
    assert len(opt.masters) == 4 and all(m.data_ptr() != p.data_ptr() for m, p in zip(opt.masters, params))
    assert {id(k) for k in opt.inner.state} == {id(m) for m in opt.masters}
    assert opt.copies == {"grads_to_host": 4, "params_to_device": 4,
                          "bytes_to_host": 4 * sum(p.numel() for p in params),
                          "bytes_to_device": 4 * sum(p.numel() for p in params)}


def test_a_state_dict_resumes_the_same_bits_and_carries_the_masters():
    model = _model()
    opt = HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    for i in range(2):
        _step(model, opt, i)
    saved_model, saved = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    assert sorted(saved["state"][0]) == sorted(["step", "exp_avg", "exp_avg_sq", MASTER])
    _step(model, opt, 2)
    resumed = _model()
    resumed.load_state_dict(saved_model)
    opt2 = HostOptimizer(resumed.parameters(), torch.optim.AdamW, lr=1e-2)
    opt2.load_state_dict(saved)
    _step(resumed, opt2, 2)
    for p, q in zip(resumed.parameters(), model.parameters()):
        assert torch.equal(p, q)


def test_bf16_parameters_step_through_fp32_masters():
    """A bf16 model's host masters are fp32: the step is fp32 AdamW on the bf16 gradients, and the
    parameters are its result rounded to bf16 (a bf16 AdamW on the device would differ)."""
    model = _model(torch.bfloat16)
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    ref = torch.optim.AdamW(masters, lr=1e-2)
    opt = HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    for i in range(3):
        torch.manual_seed(100 + i)
        x = torch.randn(8, 16, dtype=torch.bfloat16)
        model(x).float().square().mean().backward()
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.float()
        ref.step()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert all(m.dtype == torch.float32 for m in opt.masters)
    for m, r, p in zip(opt.masters, masters, model.parameters()):
        assert torch.equal(m, r.detach()) and torch.equal(p, r.detach().to(torch.bfloat16))


def test_the_placement_is_asked_at_the_first_step():
    """``model.optimizer(...)`` is made before the first call's plan: on_host is asked at the first
    step, and False runs the wrapped optimizer on the parameters themselves."""
    ref, model = _model(), _model()
    decided = {"host": None}
    opt = HostOptimizer(model.parameters(), torch.optim.AdamW, on_host=lambda: decided["host"], lr=1e-2)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    decided["host"] = False                    # what the plan decided at the first call
    for i in range(2):
        _step(model, opt, i)
        _step(ref, opt_ref, i)
    assert opt.on_host is False and opt.masters == []
    assert {id(k) for k in opt.inner.state} == {id(p) for p in model.parameters()}
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    assert opt.state_dict()["state"].keys() == opt_ref.state_dict()["state"].keys()


def test_a_mesh_choice_checks_its_flag_and_plans_without_the_rate_never_step_on_the_host():
    from autosp.costmodel.profile import load_profile
    from autosp.decisions import MeshChoice
    from autosp.errors import AutospError

    with pytest.raises(AutospError, match="host_optimizer must be True or False"):
        MeshChoice(host_optimizer="yes")
    assert all(load_profile(name).steps_on_host for name in ("h100-sxm", "h200-sxm", "a100-sxm"))
    assert not load_profile("cpu-gloo").steps_on_host     # no host memory apart from the "device"'s


def test_the_first_calls_planner_steps_the_optimizer_on_the_host_where_only_that_fits(tmp_path):
    """``autosp.Auto(host_optimizer=None)``'s planner, on a profile with host memory: with the
    memory decisions fixed, a budget between the two peaks is met only with the optimizer's states
    off the device, so the plan keeps them on the host; allowed only the device, it refuses."""
    import json

    import transformers

    from autosp.autoplan import AutoPlanner
    from autosp.costmodel.profile import load_profile
    from autosp.errors import AutospError
    from autosp.planner.problem import Problem
    from autosp.planner.search import plan

    data = dict(load_profile("cpu-gloo").data)
    data["host"] = {**data["host"], "memory_bytes_per_node": 1e12}     # a host apart from the device
    path = tmp_path / "with-host.json"
    path.write_text(json.dumps(data))
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      attn_implementation="sdpa")
    model = transformers.AutoModelForCausalLM.from_config(config)
    fixed = dict(checkpoints=("none",), mlp_chunks=(1,), loss_chunks=(1,), offloads=(False,))
    kw = dict(seq_len=256, world_size=2, profile=str(path), dtype="float32", sp_degrees=(2,),
              memory_limit=float(2 ** 40), **fixed)
    on_device = plan(Problem.of(model, host_optimizers=(False,), **kw)).predicted
    states = on_device.memory.optimizer
    assert states > 0
    limit = (on_device.peak_bytes - states / 2) / 0.95         # between the two, with the 5% margin
    planner = AutoPlanner(autosp.Auto(checkpoint="none", mlp_chunks=1, loss_chunks=1, host_optimizer=None),
                          profile=str(path), cache=False, memory_limit=limit)
    chosen = planner.plan(model, 1, 256, 2)
    assert chosen.mesh.host_optimizer and chosen.predicted.memory.optimizer == 0
    assert chosen.predicted.peak_bytes == pytest.approx(on_device.peak_bytes - states)
    assert chosen.predicted.host_optimizer_bytes == pytest.approx(1.5 * states)     # fp32: + the masters
    # allowed only the device, what fits instead is named (here offload, tried first)
    on_the_device = replace(planner, auto=replace(planner.auto, host_optimizer=False))
    with pytest.raises(AutospError, match="without offload, the optimizer on the device; offloading"):
        on_the_device.plan(model, 1, 256, 2)


def test_a_plan_told_to_use_the_host_on_a_profile_without_one_is_refused():
    """cpu-gloo has no host memory apart from the device's: asked for the optimizer (or the
    checkpoints) there, the planner says so instead of planning without them."""
    from autosp.errors import AutospError
    from autosp.planner.problem import Problem
    from autosp.planner.search import plan

    kw = dict(seq_len=256, world_size=2, profile="cpu-gloo", dtype="float32", sp_degrees=(2,))
    with pytest.raises(AutospError, match="the optimizer in host memory was asked for, but profile cpu-gloo has no "
                                          "host memory.*autosp.Auto.host_optimizer=None"):
        plan(Problem.of("tiny", host_optimizers=(True,), **kw))
    with pytest.raises(AutospError, match="offloading checkpoints was asked for.*Decisions.of.offload=True"):
        plan(Problem.of("tiny", offloads=(True,), **kw))
    assert not plan(Problem.of("tiny", **kw)).mesh.host_optimizer


def test_a_plan_with_the_optimizer_on_the_host_warns_where_the_caller_made_their_own():
    """The first call's check (autosp/transform/first_call.py): a plan that keeps the states on the host,
    and no optimizer made by ``model.optimizer(...)``, warns that the caller's keeps them on the device."""
    from autosp.transform.first_call import optimizer_placement_warning

    msg = optimizer_placement_warning(True, 0)
    assert msg and "model.optimizer(torch.optim.AdamW" in msg and "on the device" in msg
    assert optimizer_placement_warning(True, 1) is None and optimizer_placement_warning(False, 0) is None
