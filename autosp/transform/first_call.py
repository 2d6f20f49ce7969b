"""The checks of an SP model's first call, each refused in one line that names the fix: what
only the compiled graphs, the wrapped model or the launch can tell (no attention to shard,
parameters left outside the graphs, FSDP or DeepSpeed applied the wrong way round, per-layer
strategies that do not match the graphs)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from autosp.errors import AutospError
from autosp.graph.hf_compat import sdpa_unsupported


def check_first_call(sp: Any, padded: bool) -> None:
    """What the first call can tell only once the graphs are compiled: refused in one line."""
    if not sp.state.reports:
        raise AutospError(
            "torch.compile never called autosp's backend (compilation disabled, or the recompile limit of "
            f"{torch._dynamo.config.recompile_limit} per function was hit by earlier models); call "
            "torch._dynamo.reset() or raise torch._dynamo.config.recompile_limit")
    mixers = [m for r in sp.state.reports for m in r.mixers]
    if sp.state.attention_ops == 0 and mixers:
        raise AutospError(
            f"{type(sp.module).__name__} has no attention to shard: its token mixing ({len(mixers)} "
            f"{mixers[0].type} layers) runs gathered, on the whole sequence on every rank, so SP would "
            "save no memory; train it without SP (DP or ZeRO over the ranks, a mesh with SP 1)")
    if sp.state.attention_ops == 0:
        found = "; ".join(sp.state.eager_attention) or "no attention op at all"
        fix = "write it as softmax(q @ k^T ...) @ v on [batch, heads, seq, head_dim] tensors" \
            if sdpa_unsupported(sp.module) else "build the model with attn_implementation='sdpa'"
        raise AutospError(f"{type(sp.module).__name__} has no attention autosp can shard: no "
                          f"scaled_dot_product_attention, and no attention written by hand it could follow "
                          f"(found: {found}); {fix}, or call F.scaled_dot_product_attention")
    if not sp.config.reduce_grads and sp.sp_degree > 1:
        refuse_eager_parameters(sp)
    if sp.zero_stage is not None and sp.mesh.dp_degree > 1 and torch.is_grad_enabled() and \
            not any(r.global_reductions for r in sp.state.reports):
        raise AutospError(
            f"with data parallelism ({sp.mesh.dp_degree} rows of the mesh) autosp makes the loss global over "
            "the mesh where the model computes it, but no compiled graph computes a loss over the sharded "
            "tokens (it follows a graph break, or the model is called without labels); compute the loss in "
            "the model (pass labels), or use zero=None and reduce over data parallel ranks yourself")
    planned = sp.config.decisions.layers
    if len(planned) > 1 and len(planned) != sp.state.attention_ops:
        raise AutospError(
            f"{len(planned)} per-layer decisions were given but the compiled graphs hold "
            f"{sp.state.attention_ops} attention ops (a graph break can make one compiled frame serve several "
            "layers); give one decision for every layer, or remove the graph break")
    if padded and sp.state.unmasked_noncausal:
        raise AutospError("padding a non-causal attention without a mask would change results; pass an "
                          "attention_mask or a sequence length divisible by the SP degree")


def optimizer_placement_warning(host_optimizer: bool, optimizers_made: int) -> str | None:
    """What to tell a caller whose plan keeps the optimizer's states in host memory but who made no
    optimizer with ``model.optimizer(...)``: theirs keeps the states on the device, which the plan's
    device memory does not count (an out-of-memory at the length planned)."""
    if not host_optimizer or optimizers_made:
        return None
    return ("the plan keeps the optimizer's states in host memory (the device's memory was planned without "
            "them): make the optimizer with model.optimizer(torch.optim.AdamW, ...), which steps them there; "
            "an optimizer made otherwise keeps them on the device")


def refuse_eager_parameters(sp: Any) -> None:
    """With partial-sum gradients, a parameter no compiled graph reads ran eagerly (a graph break
    left its frame uncompiled) on the full sequence: its gradient is full on every rank, and the
    caller's sum over the SP group would count it P times. Refused when its gradient arrives
    (a parameter that is simply unused gets none)."""
    how, fix = (f"zero={sp.zero_stage}", "use zero=None (gradients summed inside the graphs)") \
        if sp.zero_stage is not None else ("runtime=autosp.Runtime(reduce_grads=False)",
                                           "use reduce_grads=True (the default)")
    for name, p in sp.module.named_parameters():
        if p.requires_grad and id(p) not in sp.state.graph_params:
            def refuse(grad: torch.Tensor, name: str = name) -> torch.Tensor:
                raise AutospError(f"parameter {name} ran outside autosp's compiled graphs (a graph break left "
                                  f"its code eager), so with {how} its gradient is not a partial sum; "
                                  f"{fix} or remove the graph break")
            p.register_hook(refuse)


def refuse_partitioned_parameters(module: nn.Module, sp: nn.Module, zero_stage: int | None) -> None:
    """DeepSpeed ZeRO 3 partitions parameters and gathers them on entry to each module it hooks. Given
    autosp's module, it hooks that one only (``_z3_leaf``) and the compiled graph stays whole; given
    the model itself it hooks every module, and torch.compile would stop at each, leaving graph pieces
    without the sequence length. FSDP applied by the caller does the same per unit, and its average
    (not sum) of the partial gradients and the eager code between its units would give wrong
    gradients without an error."""
    from torch.distributed.fsdp import FSDPModule

    if zero_stage not in (2, 3) and any(isinstance(m, FSDPModule) for m in module.modules()):
        raise AutospError("the model is already wrapped with FSDP (fully_shard); let autosp apply it: "
                          "autosp.compile(model, mesh=mesh, zero=2 or 3) on the unwrapped model")
    if any(hasattr(p, "ds_id") and getattr(p, "ds_z3_leaf_module", None) is not sp for p in module.parameters()):
        raise AutospError("DeepSpeed ZeRO stage 3 hooks every module of the model it was given, which cuts "
                          "autosp's compiled graph into pieces it cannot shard; give deepspeed.initialize the "
                          "module autosp.compile returns (model=sp_model), on a model not built under "
                          "deepspeed.zero.Init")


def check_deepspeed_groups(group: dist.ProcessGroup) -> None:
    """Under DeepSpeed, autosp splits the sequence and DeepSpeed must see plain data parallelism over
    every rank (it then sums autosp's partial gradients over all of them). With its own
    ``sequence_parallel_size`` it reduces over its data-parallel group only: wrong gradients, refused."""
    import sys

    if "deepspeed" not in sys.modules:
        return
    from deepspeed.utils import groups

    try:
        if groups._get_sequence_parallel_world_size() == 1:
            return
        theirs = sorted(dist.get_process_group_ranks(groups._get_sequence_parallel_group()))
    except (AssertionError, KeyError, AttributeError):      # DeepSpeed without sequence-parallel groups
        return
    ours = sorted(dist.get_process_group_ranks(group))
    same = "the same ranks as autosp's" if theirs == ours else f"ranks {theirs}, autosp's are {ours}"
    raise AutospError(f"DeepSpeed has its own sequence-parallel group ({same}); leave sequence_parallel_size and "
                      "data_parallel_size out of the DeepSpeed config: autosp splits the sequence, and DeepSpeed "
                      "must reduce gradients over every rank")


class BatchCheck:
    """Every rank of an SP group passes the same batch: a rank with another shape would plan and
    compile other graphs, and its collectives would pair with another length's (a hang, or wrong
    numbers). Each step starts one all-gather of two integers (batch size, length) as it begins,
    without waiting (:meth:`start`); the wrapper prepares the batch meanwhile and waits for it
    (:meth:`wait`) before any other collective: before planning a new batch shape and before the
    compiled graphs run. Every rank starts it every step, so the collectives always pair."""

    def __init__(self, group: dist.ProcessGroup, shape: tuple[int, int], device: torch.device) -> None:
        self.group = group
        self.mine = torch.tensor(shape, dtype=torch.long, device=device)
        self.every = torch.empty(dist.get_world_size(group) * 2, dtype=torch.long, device=device)
        self.work: Any = dist.all_gather_into_tensor(self.every, self.mine, group=group, async_op=True)

    @classmethod
    def start(cls, group: dist.ProcessGroup, named: dict[str, Any], seq_len: int) -> "BatchCheck":
        ids = next(v for v in named.values() if isinstance(v, torch.Tensor) and v.dim() >= 2)
        device = ids.device if dist.get_backend(group) != "gloo" else torch.device("cpu")
        return cls(group, (ids.shape[0], seq_len), device)

    def wait(self) -> None:
        """Refuse a step whose ranks passed different batches (once the all-gather is in)."""
        if self.work is None:
            return
        self.work.wait()
        self.work = None
        shapes = [tuple(self.every[i:i + 2].tolist()) for i in range(0, self.every.numel(), 2)]
        if len(set(shapes)) > 1:
            seen = ", ".join(f"rank {r}: {b} x {s}" for r, (b, s) in enumerate(shapes))
            raise AutospError(f"the ranks of an SP group passed different batches ({seen} tokens); every rank of "
                              "an SP group must pass the same batch: give each SP group one data shard (split the "
                              "loader over the data-parallel dimension only)")

