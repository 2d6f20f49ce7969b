"""Sum parameter gradients over the mesh in buckets, overlapped with the backward.

Inside the sharded graphs every rank back-propagates its own tokens only, so each
parameter gradient is this rank's partial sum (the partial convention of
:mod:`autosp.transform.replicated`), and with data parallelism also only this
rank's batch. The full gradient is the sum over every rank of the dp x sp mesh,
since the loss is normalised by the global token count (:mod:`autosp.transform.loss`).

The reduction is DDP's scheme, written for that sum:

* parameters are grouped into buckets of about ``bucket_mb`` MiB, in reverse order
  of registration (the backward produces the last layers' gradients first);
* when the last gradient of a bucket has been accumulated (a post-accumulate-grad
  hook), the bucket is flattened and its all-reduce is launched *asynchronously*,
  so it travels while the backward computes earlier layers;
* buckets are launched strictly in index order on every rank (a collective's
  partner is found by order, so a bucket ready early waits for its predecessors);
* at the end of the backward (an autograd engine callback) the last buckets are
  launched, every reduction is waited on and the sums are copied back into
  ``.grad``. A parameter that got no gradient on this rank contributes zeros.

Each backward reduces what ``.grad`` holds. Accumulating micro-batches therefore
runs inside ``with sp.no_sync():`` until the last one (as with DDP); accumulating
onto an already reduced gradient is refused, since it would be summed twice.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from autosp.errors import AutospError
from autosp.strategies.collectives import tally, wait_all


class _Bucket:
    def __init__(self, index: int, params: list[torch.nn.Parameter]):
        self.index = index
        self.params = params
        self.ready = 0
        self.work: dist.Work | None = None
        self.flat: Tensor | None = None


class GradReducer:
    """Bucketed, asynchronous all-reduce (sum) of ``params``' gradients over ``group``."""

    def __init__(self, params: list[torch.nn.Parameter], group: dist.ProcessGroup, bucket_mb: float = 25.0):
        self.group = group
        self.enabled = True
        seen: set[int] = set()
        params = [p for p in params if p.requires_grad and not (id(p) in seen or seen.add(id(p)))]
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        current: list[torch.nn.Parameter] = []
        size = 0
        for p in reversed(params):
            # one dtype and device per bucket: it is flattened into one tensor
            if current and (size >= bucket_mb * 2**20 or (p.dtype, p.device) != (current[0].dtype, current[0].device)):
                self._add(current)
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
        if current:
            self._add(current)
        self._next = 0                  # the next bucket to launch, in index order
        self._in_backward = False
        self._reduced: dict[int, tuple[weakref.ref, int]] = {}   # param id -> (its reduced grad, version)
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for b in self.buckets for p in b.params]

    def _add(self, params: list[torch.nn.Parameter]) -> None:
        bucket = _Bucket(len(self.buckets), params)
        self.buckets.append(bucket)
        for p in params:
            self._bucket_of[id(p)] = bucket

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside this block accumulate this rank's partial gradients without reducing them."""
        before, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = before

    # ------------------------------------------------------------------ during the backward
    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if not self.enabled:
            return
        self._refuse_double_reduction(p)
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        bucket = self._bucket_of[id(p)]
        bucket.ready += 1
        while self._next < len(self.buckets) and self.buckets[self._next].ready == len(self.buckets[self._next].params):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _refuse_double_reduction(self, p: torch.nn.Parameter) -> None:
        """The same gradient tensor, accumulated once since we wrote the sum into it (version + 1),
        holds an already reduced gradient plus this rank's new partial one."""
        seen = self._reduced.get(id(p))
        if seen is not None and seen[0]() is p.grad and p.grad._version == seen[1] + 1:
            raise AutospError("a backward accumulated into gradients autosp had already summed over the mesh (they "
                              "would be summed twice); call optimizer.zero_grad() after each step, or accumulate "
                              "micro-batches inside `with sp.no_sync():` and leave it for the last one")

    def _launch(self, bucket: _Bucket) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        bucket.flat = torch.cat([g.reshape(-1) for g in grads])
        tally("grad_all_reduce", self.group.group_name, bucket.flat)
        bucket.work = dist.all_reduce(bucket.flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    def _finish(self) -> None:
        """End of the backward: launch what is left (in order), wait, write the sums back."""
        self._in_backward = False
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
            self._next += 1
        self._next = 0
        for bucket in self.buckets:
            wait_all([bucket.work], "grad_all_reduce", self.group.group_name)
            offset = 0
            for p in bucket.params:
                n = p.numel()
                total = bucket.flat[offset:offset + n].view_as(p)
                if p.grad is None:
                    p.grad = total.clone()
                else:
                    p.grad.copy_(total)
                self._reduced[id(p)] = (weakref.ref(p.grad), p.grad._version)
                offset += n
            bucket.ready, bucket.work, bucket.flat = 0, None, None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
