"""Measured memory: peak live bytes of the tensors that ops allocate inside a region.

A dispatch mode sees every op's outputs; an output whose storage is new (not
one of the op's inputs' storages) counts as allocated until its last Python
reference dies. Views and in-place results are not double counted. autosp's
own custom ops (collectives, ring attention) are entered with the mode still
active, so their internal buffers count too. This is the allocator's view of
*new* tensor memory during the region (what the memory model predicts), free of
RSS noise; on CUDA ``torch.cuda.max_memory_allocated`` gives the same quantity.

A measurement tool: the runtime never imports it.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


def _python_body(func):
    """The Python function behind a ``torch.library.custom_op`` (None for other ops)."""
    from torch._library.custom_ops import OPDEFS

    opdef = OPDEFS.get(func._schema.name)
    return getattr(opdef, "_init_fn", None)


def _has_storage(t: object) -> bool:
    """A tensor with memory of its own (not meta; not a wrapper such as a ZeRO-3 DTensor, whose
    local tensor the dispatcher sees on its own)."""
    return isinstance(t, torch.Tensor) and t.device.type != "meta" and not is_traceable_wrapper_subclass(t)


class PeakBytes(TorchDispatchMode):
    # AOTAutograd's recompute of an op that could draw random numbers (an attention kernel under
    # full checkpointing) runs as a higher-order op; it is run as it is and its outputs counted.
    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.host_live = 0            # offload's copies in host memory (autosp::offload), counted apart
        self.host_peak = 0
        self._tracked: dict[int, int] = {}
        self._refs: dict[int, int] = {}
        self._host: set[int] = set()

    def _inside(self, func, args, kwargs):
        body = _python_body(func)
        if body is None:
            return func(*args, **kwargs)
        with self:                     # re-enter: the body's own ops come back to this mode
            return body(*args, **kwargs)

    def _release(self, ptr: int) -> None:
        """One tensor on this storage died; the storage is free when the last one does."""
        self._refs[ptr] -= 1
        if self._refs[ptr] == 0:
            del self._refs[ptr]
            if ptr in self._host:
                self._host.discard(ptr)
                self.host_live -= self._tracked.pop(ptr, 0)
            else:
                self.live -= self._tracked.pop(ptr, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        host = func is torch.ops.autosp.offload.default if hasattr(torch.ops.autosp, "offload") else False
        if isinstance(func, torch._ops.HigherOrderOperator) or host:
            out = func(*args, **(kwargs or {}))     # (an offload's copy lives in host memory: not inside)
        elif func.namespace == "autosp":      # look inside our own ops: their buffers count
            out = self._inside(func, args, kwargs or {})
        else:
            out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if _has_storage(t)}
        for t in tree_leaves(out):
            if not _has_storage(t):
                continue
            st = t.untyped_storage()
            ptr, nbytes = st.data_ptr(), st.nbytes()
            if nbytes == 0:
                continue
            if ptr not in self._tracked:
                if ptr in inputs:
                    continue                 # a view or in-place result of memory from before
                self._tracked[ptr] = nbytes
                if host:
                    self._host.add(ptr)
                    self.host_live += nbytes
                    self.host_peak = max(self.host_peak, self.host_live)
                else:
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
            # Every tensor on a tracked storage (the allocation and its views) holds it alive:
            # e.g. a matmul output dies while the view autograd saved of it lives on.
            self._refs[ptr] = self._refs.get(ptr, 0) + 1
            weakref.finalize(t, self._release, ptr)
        return out


def step_peak(model: object, forward: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Run ``loss = forward()`` and ``loss.backward()`` under a fresh probe: (loss, peak bytes)."""
    loss, probe = step_memory(model, forward)
    return loss, probe.peak


def step_memory(model: object, forward: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, PeakBytes]:
    """Run ``loss = forward()`` and ``loss.backward()`` under a fresh probe: (loss, the probe: its
    ``peak`` of device bytes and ``host_peak`` of offloaded ones).

    torch.compile runs no compiled code while a dispatch mode is active (it falls back to
    eager, i.e. *unsharded*, execution), so for an autosp model the probe is entered inside
    each compiled graph through the model's graph hook, and around the (eager) backward.
    """
    from autosp.transform.api import SequenceParallel

    probe = PeakBytes()
    if isinstance(model, SequenceParallel):
        with model.graph_hook(lambda: probe):
            loss = forward()
    else:
        with probe:
            loss = forward()
    with probe:
        loss.backward()
    return loss, probe


class RssPeak:
    """Peak resident memory of this process above its level at entry, sampled every ``interval``
    seconds by a thread: what the OS sees, for code whose allocations bypass the dispatcher
    (Inductor's kernels). Run with ``MALLOC_MMAP_THRESHOLD_=65536`` so freed blocks go back to
    the OS and the level at entry is the steady state."""

    def __init__(self, interval: float = 0.0005):
        self.interval = interval
        self.peak = 0

    @staticmethod
    def _rss() -> int:
        import os

        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self) -> "RssPeak":
        import threading

        self._base = self._rss()
        self._top = self._base
        self._stop = threading.Event()

        def sample() -> None:
            while not self._stop.is_set():
                self._top = max(self._top, self._rss())
                self._stop.wait(self.interval)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._top = max(self._top, self._rss())
        self.peak = self._top - self._base
