"""``autosp.compile``: one line turns a single-device model into an SP model.

    model = autosp.compile(model)
    loss = model(input_ids=ids, labels=ids).loss   # every rank passes the same full batch
    loss.backward()                                # grads == single-device grads

The wrapper does what must happen outside the graph: pad the sequence to a
multiple of the SP degree (labels with -100, masks with 0), mark the sequence
dim dynamic (one graph for every length), reduce parameter gradients over the
SP group, and trim padded outputs back. The graph rewrite itself lives in
:mod:`autosp.transform.sharding`.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from autosp.errors import AutospError
from autosp.hf_compat import unpacked_positions
from autosp.transform.backend import BackendState, make_backend

STRATEGIES = ("auto", "ulysses")
_PAD_VALUES = {"labels": -100, "attention_mask": 0}


def compile(model: nn.Module, *, strategy: str = "auto", sp_size: int | None = None,
            group: dist.ProcessGroup | None = None, reduce_grads: bool = True,
            gather_outputs: bool | None = None) -> nn.Module:
    """Wrap ``model`` for sequence-parallel training over ``group`` (default: the whole world).

    ``sp_size`` splits the world into consecutive groups of that many ranks (SP inside,
    data parallel across); ``reduce_grads=False`` leaves gradient reduction to DDP/FSDP;
    ``gather_outputs``: sequence-sharded outputs (logits) come back all-gathered (True), as
    this rank's tokens (False), or by default all-gathered only from graphs that compute no
    loss: a model called with labels returns the global loss and this rank's logits (full
    logits at 128k tokens would cost every rank what SP saves), one called without labels,
    or whose loss follows a graph break, returns full logits.
    Without an initialised process group there is nothing to split: the model is returned
    as it is, with a warning, so one training script runs alone or under torchrun.
    """
    if strategy not in STRATEGIES:
        raise AutospError(f"unknown strategy '{strategy}'; use one of {', '.join(STRATEGIES)}")
    if not dist.is_available() or not dist.is_initialized():
        if sp_size not in (None, 1) or group is not None:
            raise AutospError(f"sp_size={sp_size} needs torch.distributed initialised: call "
                              "torch.distributed.init_process_group() first, e.g. under torchrun")
        warnings.warn("torch.distributed is not initialised: autosp runs the model on this device alone "
                      "(SP degree 1); launch with torchrun to split the sequence", stacklevel=2)
        return model
    if group is None:
        group = _sp_group(sp_size)
    elif sp_size is not None and sp_size != dist.get_world_size(group):
        raise AutospError(f"sp_size={sp_size} but the given group has {dist.get_world_size(group)} ranks; pass one")
    return SequenceParallel(model, group, "ulysses", reduce_grads, gather_outputs)


def _sp_group(sp_size: int | None) -> dist.ProcessGroup:
    world = dist.get_world_size()
    if sp_size is None or sp_size == world:
        return dist.group.WORLD
    if sp_size <= 0 or world % sp_size:
        raise AutospError(f"sp_size={sp_size} does not divide the world size {world}; pick a divisor of {world}")
    group, _ = dist.new_subgroups(group_size=sp_size)
    return group


class SequenceParallel(nn.Module):
    """The module ``autosp.compile`` returns; ``.module`` is the original model."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup, strategy: str, reduce_grads: bool,
                 gather_outputs: bool | None = None):
        super().__init__()
        self.module = module
        self.group = group
        self.sp_degree = dist.get_world_size(group)
        self.state = BackendState()
        self.gather_outputs = gather_outputs
        # Not registered as a submodule: it wraps the same parameters.
        object.__setattr__(self, "_compiled",
                           torch.compile(module, backend=make_backend(group, strategy, self.state, gather_outputs)))
        self._signature = inspect.signature(module.forward)
        self._is_hf = hasattr(module, "config") and hasattr(module.config, "model_type")
        self._checked = False
        self._warned_lengths: set[int] = set()
        self._hooks = [p.register_hook(self._reduce_grad) for p in module.parameters()
                       if p.requires_grad] if reduce_grads and self.sp_degree > 1 else []

    def _reduce_grad(self, grad: torch.Tensor) -> torch.Tensor:
        # Each rank back-propagated its own tokens: the sum over the SP group is the full gradient.
        g = grad.clone()
        dist.all_reduce(g, group=self.group)
        return g

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        bound = self._signature.bind_partial(*args, **kwargs)
        named = bound.arguments
        seq_len = self._sequence_length(named)
        padded_len = -(-seq_len // self.sp_degree) * self.sp_degree
        if padded_len != seq_len and seq_len not in self._warned_lengths:
            self._warned_lengths.add(seq_len)
            warnings.warn(f"sequence length {seq_len} is not divisible by {self.sp_degree} (SP degree); "
                          f"autosp pads it to {padded_len} and masks the padding", stacklevel=2)
        for name, value in list(named.items()):
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == seq_len:
                value = _pad_seq(value, name, padded_len)
                if padded_len > 1:
                    # a hint, not a constraint: a graph with no attention (a loss after a
                    # graph break) may specialise the length without harm
                    torch._dynamo.maybe_mark_dynamic(value, 1)
                named[name] = value
        if self._is_hf and "use_cache" in self._signature.parameters and "use_cache" not in named:
            named["use_cache"] = False       # a KV cache concatenates along the sharded dim
        with unpacked_positions(self._is_hf and "position_ids" not in named):
            out = self._compiled(*bound.args, **bound.kwargs)
        self._check_once(padded_len != seq_len)
        if padded_len == seq_len or self.state.local_outputs:
            return out
        return _trim(out, padded_len, seq_len)

    def _sequence_length(self, named: dict[str, Any]) -> int:
        for key in ("input_ids", "inputs_embeds"):
            if isinstance(named.get(key), torch.Tensor):
                return named[key].shape[1]
        for value in named.values():
            if isinstance(value, torch.Tensor) and value.dim() >= 2:
                return value.shape[1]
        raise AutospError("no [batch, sequence, ...] tensor among the inputs; pass input_ids of shape [B, S]")

    def _check_once(self, padded: bool) -> None:
        if self._checked:
            return
        self._checked = True
        if self.state.attention_ops == 0:
            found = "; ".join(self.state.eager_attention) or "no attention op at all"
            raise AutospError(f"{type(self.module).__name__} has no scaled_dot_product_attention to shard "
                              f"(found: {found}); build the model with attn_implementation='sdpa' or call "
                              "F.scaled_dot_product_attention")
        if padded and self.state.unmasked_noncausal:
            raise AutospError("padding a non-causal attention without a mask would change results; pass an "
                              "attention_mask or a sequence length divisible by the SP degree")


def _pad_seq(t: torch.Tensor, name: str, length: int) -> torch.Tensor:
    extra = length - t.shape[1]
    if extra == 0:
        return t
    if name == "position_ids":       # keep positions increasing past the end
        tail = t[:, -1:] + torch.arange(1, extra + 1, device=t.device, dtype=t.dtype)
        return torch.cat([t, tail.expand(t.shape[0], extra)], dim=1)
    pad = [0, 0] * (t.dim() - 2) + [0, extra]
    return F.pad(t, pad, value=_PAD_VALUES.get(name, 0))


def _trim(out: Any, padded_len: int, seq_len: int) -> Any:
    if isinstance(out, torch.Tensor):
        return out.narrow(1, 0, seq_len) if out.dim() >= 2 and out.shape[1] == padded_len else out
    if isinstance(out, tuple):
        return type(out)(_trim(x, padded_len, seq_len) for x in out)
    if hasattr(out, "keys") and hasattr(out, "__setitem__"):     # HF ModelOutput / dict
        for k in list(out.keys()):
            out[k] = _trim(out[k], padded_len, seq_len)
    return out
