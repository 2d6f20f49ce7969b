"""The systems of ``peers.py``, one class each: how each runs one training step on this rank in
its own documented recipe (the module docstring of ``peers.py`` says which recipe and why).

A ``Peer`` sets its batch (``batch(S)``), runs forward and backward returning the global loss
(``forward_backward()``), gives the full gradient per parameter name (``grads()``) and steps its
optimizer (``finish()``).
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from vs_deepspeed_autosp import VOCAB, _deepspeed_engine, _deepspeed_step, _ids, tiny  # noqa: E402

LOSS_TOL, GRAD_TOL = 1e-5, 1e-4          # the suite's exactness bound against one process
# Where the ranks run: "cuda" on a lent GPU (bench/gpu_check.py --only peers: both ranks share one
# device over gloo), else the CPU. An environment variable, so that the spawned ranks see it too.
DEVICE_VAR = "AUTOSP_PEERS_DEVICE"
ON_ONE_GPU = ("autosp (shortest call)", "autosp, Ulysses", "PyTorch context_parallel", "hand-written Ulysses")


def _device() -> str:
    return os.environ.get(DEVICE_VAR, "cpu")


def _model(attn: str = "sdpa"):
    return tiny(attn).to(_device())


def _batch(seq_len: int):
    return _ids(seq_len).to(_device())


def _shifted(ids):
    import torch.nn.functional as F

    return F.pad(ids[:, 1:], (0, 1), value=-100)


def _local(t, rank: int, world: int):
    n = t.shape[1] // world
    return t[:, rank * n:(rank + 1) * n]


class Peer:
    """One system on this rank: ``batch(S)`` sets the sequence, ``forward_backward()`` returns the
    global loss, ``grads()`` the full gradient per parameter name, ``finish()`` steps the optimizer."""

    def batch(self, seq_len: int) -> None:
        self.ids = _batch(seq_len)

    def step(self) -> None:
        self.forward_backward()
        self.finish()

    # a plain model and optimizer on this rank (the peers without an engine of their own)
    def grads(self) -> dict:
        return {n: p.grad for n, p in self.model.named_parameters()}

    def finish(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class Autosp(Peer):
    def __init__(self, plan: Any = None, cap: float | None = None):
        import torch

        import autosp

        self.model = _model()
        kw: dict[str, Any] = {}
        if plan:
            kw["plan"] = plan
        if cap:
            # The cap bounds one step above the steady state; autosp's limit is the device's whole
            # budget, which also holds what the steady state does: the parameters and AdamW's moments.
            states = 3 * sum(p.numel() * p.element_size() for p in self.model.parameters())
            kw["memory_limit"] = cap + states
        self.sp = autosp.compile(self.model, **kw)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5)

    def forward_backward(self) -> float:
        loss = self.sp(input_ids=self.ids, labels=self.ids).loss
        loss.backward()
        return loss.item()


    def chose(self) -> str:
        plan = getattr(self.sp, "plan", None)
        if plan is None:
            return ""
        layers = {f"{c.strategy}, {c.checkpoint}, MLP x{c.mlp_chunks}" for c in (x.choice for x in plan.layers)}
        return "; ".join(sorted(layers)) + f", loss x{plan.mesh.loss_chunks}"


class Alst(Peer):
    def __init__(self):
        import deepspeed
        import torch
        import torch.distributed as dist
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        os.environ.update(LOCAL_RANK=str(dist.get_rank()), RANK=str(dist.get_rank()),
                          WORLD_SIZE=str(dist.get_world_size()), LOCAL_WORLD_SIZE=str(dist.get_world_size()))
        deepspeed.init_distributed(dist_backend="gloo")
        self.world = dist.get_world_size()
        model = tiny("sdpa")
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=self.world,
            micro_batch_size=1, seq_length_is_variable=True)
        for layer in model.model.layers:
            layer.mlp.forward = _tiled_mlp_forward.__get__(layer.mlp)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                  "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
                  "sequence_parallel_size": self.world}
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-5),
                                               config=config, mpu=mpu)
        self.group = mpu.get_sequence_parallel_group()
        self.rank = dist.get_rank(self.group)

    def batch(self, seq_len: int) -> None:
        import torch

        ids = _ids(seq_len)
        self.ids = _local(ids, self.rank, self.world)
        self.labels = _local(_shifted(ids), self.rank, self.world)
        self.pos = _local(torch.arange(seq_len).unsqueeze(0), self.rank, self.world)

    def forward_backward(self) -> float:
        import torch.distributed.nn.functional as dnn
        import torch.nn.functional as F
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

        model = self.engine.module
        hidden = model.model(input_ids=self.ids, position_ids=self.pos, use_cache=False).last_hidden_state

        def loss_sum(head, x, y):
            logits = head.lm_head(x).float()
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100,
                                   reduction="sum")

        shards = max(1, math.ceil(self.labels.numel() * VOCAB * 4 / 2**30))      # ~1 GiB fp32 logits
        total = TiledFusedLogitsLoss.apply(loss_sum, model, hidden, self.labels, None, shards,
                                           [model.lm_head.weight], "sum")
        good = (self.labels != -100).sum()
        # the per-rank losses weighted by their labelled tokens over the SP group, differentiably
        losses = dnn.all_gather(total / good.clamp(min=1), group=self.group)
        goods = dnn.all_gather(good, group=self.group)
        loss = sum(l * g for l, g in zip(losses, goods)) / sum(goods)
        self.engine.backward(loss)
        return loss.item()

    def grads(self) -> dict:
        from deepspeed.utils import safe_get_full_grad

        return {n: safe_get_full_grad(p) for n, p in self.engine.module.named_parameters()}

    def finish(self) -> None:
        self.engine.step()


def _tiled_mlp_forward(self, x):
    """ALST's tiled MLP, as its docstring patches a Llama MLP: shards of ``hidden`` tokens, the same
    count on every rank."""
    import torch
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    shards = torch.tensor(math.ceil(x.shape[-2] / x.shape[-1]))
    dist.all_reduce(shards, op=dist.ReduceOp.MAX)

    def mlp(module, h):
        return module.down_proj(module.act_fn(module.gate_proj(h)) * module.up_proj(h))

    return TiledMLP.apply(mlp, self, x, int(shards.item()), [self.down_proj.weight, self.gate_proj.weight,
                                                            self.up_proj.weight])


class DeepSpeedAutoSP(Peer):
    def __init__(self):
        self.engine, self.sp = _deepspeed_engine()

    def batch(self, seq_len: int) -> None:
        self._step = _deepspeed_step(self.engine, self.sp, seq_len, backward_only=True)

    def forward_backward(self) -> float:
        return self._step()

    def grads(self) -> dict:
        return {n: p.grad for n, p in self.engine.module.named_parameters()}

    def finish(self) -> None:
        self.engine.step()


class TorchContextParallel(Peer):
    def __init__(self):
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self.world = dist.get_world_size()
        self.mesh = init_device_mesh(_device(), (self.world,))
        self.model = _model("sdpa")
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5)

    def batch(self, seq_len: int) -> None:
        self.seq_len = seq_len
        self.full = _batch(seq_len)

    def forward_backward(self) -> float:
        import torch
        import torch.distributed as dist
        import torch.distributed.nn.functional as dnn
        import torch.nn.functional as F
        from torch.distributed.tensor.experimental import context_parallel

        ids, labels = self.full.clone(), _shifted(self.full)
        pos = torch.arange(self.seq_len, device=ids.device).unsqueeze(0)
        with context_parallel(self.mesh, buffers=[ids, labels, pos], buffer_seq_dims=[1, 1, 1]):
            logits = self.model(input_ids=ids, position_ids=pos, use_cache=False).logits
            total = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100,
                                    reduction="sum")
            loss = dnn.all_reduce(total) / (self.seq_len - 1)      # every label but the last is kept
            loss.backward()
        for p in self.model.parameters():        # each rank's rows: sum the partial gradients
            dist.all_reduce(p.grad)
        return loss.item()



class HandwrittenUlysses(Peer):
    def __init__(self):
        import torch
        import torch.distributed as dist

        from ulysses_vs_handwritten import _handwritten_model

        self.model = _model()
        self.loss_fn = _handwritten_model(self.model, dist.group.WORLD)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5)

    def forward_backward(self) -> float:
        import torch.distributed as dist

        loss = self.loss_fn(self.ids)
        loss.backward()
        for p in self.model.parameters():
            dist.all_reduce(p.grad)
        return loss.item()



SYSTEMS: dict[str, Callable[..., Peer]] = {
    "autosp (shortest call)": lambda cap=None: Autosp(cap=cap),
    "autosp, Ulysses": lambda cap=None: Autosp(plan="ulysses"),
    "autosp, Ulysses, full checkpointing, MLP and loss in 8 chunks": lambda cap=None: Autosp(plan=_saving()),
    "ALST": lambda cap=None: Alst(),
    "DeepSpeed AutoSP": lambda cap=None: DeepSpeedAutoSP(),
    "PyTorch context_parallel": lambda cap=None: TorchContextParallel(),
    "hand-written Ulysses": lambda cap=None: HandwrittenUlysses(),
}


def _saving():
    import autosp

    return autosp.Decisions.of(strategy="ulysses", checkpoint="full", mlp_chunks=8,
                               mesh=autosp.MeshChoice(loss_chunks=8))
