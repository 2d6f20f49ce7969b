"""Peak live bytes of the tensors that aten ops allocate inside a region.

A dispatch mode sees every op's outputs; an output whose storage is new (not
one of the op's inputs' storages) counts as allocated until its last Python
reference dies. Views and in-place results are not double counted. This is
the allocator's view of *new* memory during the region, independent of RSS.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._tracked: dict[int, int] = {}

    def _free(self, ptr: int) -> None:
        self.live -= self._tracked.pop(ptr, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            ptr, nbytes = st.data_ptr(), st.nbytes()
            if nbytes == 0 or ptr in inputs or ptr in self._tracked:
                continue
            self._tracked[ptr] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._free, ptr)
        return out
