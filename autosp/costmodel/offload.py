"""What offloading a layer's saved tensors to host memory costs: device bytes, host bytes, time.

A layer whose saved tensors wait in host memory (:mod:`autosp.transform.offload`) holds them on
the device only while its forward still reads them and again during its own backward, with the
next layer's copy in flight beside it (one layer ahead). Its copies run beside compute; what
shows is the part longer than the compute they overlap, and each copy's issue latency.
"""

from __future__ import annotations

from typing import Any

from autosp.costmodel.profile import HardwareProfile


def copy_exposed(prof: HardwareProfile, kept: float, p: Any, layers: int, recompute_s: float) -> float:
    """Exposed seconds of one offloaded layer's two copies: the offload runs beside the forward of
    the layer and the next, the reload beside the backward of the layer before it (one layer ahead);
    each copy's issue and wait on the compute stream costs its latency even when it hides."""
    copy = prof.host_copy_time(kept)
    latency = prof.host_copy_time(0.0)
    forward = (p.layer_forward_s + p.attention_fwd_s) / layers
    backward = (p.layer_compute_s + recompute_s) / layers - forward
    return max(latency, copy - forward) + max(latency, copy - backward)


def host_budget(prof: HardwareProfile, world: int, dpn: int, margin: float) -> float:
    """Host memory per rank for offloaded layers: the node's, shared by its ranks, less the margin."""
    return prof.host_memory_bytes / min(world, dpn) * (1.0 - margin)


def _params(optimizer_bytes: float, param_bytes: int) -> float:
    """This rank's parameters in the optimizer, from its states' bytes on the device (fp32 moments,
    and fp32 masters for low-precision parameters: autosp.costmodel.memory.model_states)."""
    return optimizer_bytes / (8 + (4 if param_bytes < 4 else 0))


def host_optimizer_bytes(optimizer_bytes: float, param_bytes: int) -> float:
    """Host memory per rank of the optimizer stepped there: fp32 moments and fp32 masters, which
    :class:`autosp.transform.host_optimizer.HostOptimizer` keeps for fp32 parameters too."""
    return 12 * _params(optimizer_bytes, param_bytes)


def host_optimizer_step(prof: HardwareProfile, optimizer_bytes: float, param_bytes: int) -> float:
    """Seconds an optimizer step on the host adds per rank, not overlapped: this rank's gradients
    down, the step over its parameters (``optimizer_bytes`` of states on the device), the parameters
    back up. The device's own step is not costed either way (it is short beside the layers'), so
    this is the whole difference."""
    params = _params(optimizer_bytes, param_bytes)
    return 2 * prof.host_copy_time(params * param_bytes) + prof.host_optimizer_time(params)
