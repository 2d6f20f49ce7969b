"""Optimizer states in host memory, stepped there: the device keeps parameters and gradients alone.

At millions of tokens a device's memory is the activations' (:mod:`autosp.transform.offload`);
AdamW's fp32 moments and, for low-precision parameters, its fp32 master weights are 12 bytes per
parameter beside 2 of the parameter itself. :class:`HostOptimizer` keeps them in host memory:

* at its first step it makes an fp32 copy of each parameter's local part (this rank's ZeRO shard)
  in host memory (pinned on CUDA), and builds the wrapped optimizer over those copies;
* each step copies this rank's gradients down, steps the wrapped optimizer there, and copies the
  updated parameters up (cast to the parameters' dtype), then waits for the copies: the next
  forward reads them.

Its ``param_groups`` are the model's parameters with the wrapped optimizer's hyperparameters, so
learning-rate schedulers and ``zero_grad`` work as on any optimizer; each step passes the groups'
hyperparameters down. With an fp32 model the parameters after each step are the same bits as
the wrapped optimizer stepping them on the device. ``state_dict`` holds the states of the model's
parameters (as DTensors shaped like the parameters under ZeRO 2/3, so that a checkpoint reshards)
and the fp32 masters (key ``"host_master"``): a resume continues from the same bits.

``on_host`` may be a callable asked at the first step: ``model.optimizer(...)`` is made before the
model's first call, where the planner decides (:attr:`autosp.decisions.MeshChoice.host_optimizer`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

MASTER = "host_master"     # the state key of a parameter's fp32 master weights in state_dict()


def _local(t: Tensor) -> Tensor:
    """This rank's part of ``t`` (a ZeRO 2/3 parameter or gradient is a DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _host_like(t: Tensor, dtype: torch.dtype) -> Tensor:
    """An empty host tensor for ``t``'s values, pinned where ``t`` lives on CUDA (async copies)."""
    return torch.empty(t.shape, dtype=dtype, device="cpu", pin_memory=t.is_cuda)


class HostOptimizer(torch.optim.Optimizer):
    """``optimizer_class(params, **defaults)``, with its states and fp32 master weights in host memory
    (``on_host``: True, False: on the device as usual, or a callable asked at the first step)."""

    def __init__(self, params: Iterable[Any], optimizer_class: type[torch.optim.Optimizer],
                 on_host: bool | Callable[[], bool] = True, **defaults: Any) -> None:
        super().__init__(params, defaults)
        self.optimizer_class = optimizer_class
        self._on_host = on_host
        self.inner: torch.optim.Optimizer | None = None
        self.on_host: bool | None = None          # decided at the first step
        self.masters: list[Tensor] = []           # per parameter, in param_groups' order (host mode)
        # the last step's copies: tensors and bytes each way (tests and reports read them)
        self.copies = {"grads_to_host": 0, "params_to_device": 0, "bytes_to_host": 0, "bytes_to_device": 0}

    def _params(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _build(self) -> torch.optim.Optimizer:
        self.on_host = bool(self._on_host() if callable(self._on_host) else self._on_host)
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        if not self.on_host:
            groups = [{**h, "params": g["params"]} for h, g in zip(hyper, self.param_groups)]
        else:
            with torch.no_grad():
                for p in self._params():
                    m = _host_like(_local(p), torch.float32)
                    m.copy_(_local(p))
                    self.masters.append(m)
            it = iter(self.masters)
            groups = [{**h, "params": [next(it) for _ in g["params"]]} for h, g in zip(hyper, self.param_groups)]
        self.inner = self.optimizer_class(groups, **self.defaults)
        self.state = self.inner.state            # non-empty once stepped (DCP reads it so)
        return self.inner

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        inner = self.inner or self._build()
        for g, ig in zip(self.param_groups, inner.param_groups):     # schedulers change the outer groups
            ig.update({k: v for k, v in g.items() if k != "params"})
        if not self.on_host:
            inner.step()
            return loss
        params, counts = self._params(), dict.fromkeys(self.copies, 0)
        on_cuda = any(p.is_cuda for p in params)
        for p, m in zip(params, self.masters):
            if p.grad is None:
                m.grad = None
                continue
            grad = _local(p.grad)
            if m.grad is None:
                m.grad = _host_like(grad, torch.float32)
            m.grad.copy_(grad, non_blocking=True)
            counts["grads_to_host"] += 1
            counts["bytes_to_host"] += grad.numel() * grad.element_size()
        if on_cuda:
            torch.cuda.current_stream().synchronize()     # the gradients are on the host
        inner.step()
        for p, m in zip(params, self.masters):
            if p.grad is not None:
                local = _local(p)
                local.copy_(m, non_blocking=True)
                counts["params_to_device"] += 1
                counts["bytes_to_device"] += local.numel() * local.element_size()
        if on_cuda:
            torch.cuda.current_stream().synchronize()     # the host masters may change at the next step
        self.copies = counts
        return loss

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        inner = self.inner or self._build()
        sd = inner.state_dict()
        if not self.on_host:
            return sd
        params = self._params()
        state = {}
        for i, p in enumerate(params):
            entry = {**sd["state"].get(i, {}), MASTER: self.masters[i]}
            state[i] = {k: self._like_param(v, p) for k, v in entry.items()}
        return {"state": state, "param_groups": sd["param_groups"]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        inner = self.inner or self._build()
        if not self.on_host:
            inner.load_state_dict(state_dict)
            return
        # the saved groups name the parameters (positions, or DCP's names) in the order of ours
        position = {key: i for i, key in enumerate(k for g in state_dict["param_groups"] for k in g["params"])}
        state = {}
        for key, entry in state_dict["state"].items():
            entry = {k: _local(v) if isinstance(v, Tensor) else v for k, v in entry.items()}
            master = entry.pop(MASTER, None)
            if master is not None:
                self.masters[position[key]].copy_(master)
            state[key] = entry
        inner.load_state_dict({"state": state, "param_groups": state_dict["param_groups"]})

    @staticmethod
    def _like_param(v: Any, p: Tensor) -> Any:
        """A host state of a ZeRO-sharded parameter as a DTensor placed like it (checkpoints reshard)."""
        if isinstance(p, DTensor) and isinstance(v, Tensor) and v.shape == _local(p).shape and v.dim():
            return DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                      run_check=False)
        return v
