"""DeepSpeed ZeRO 3 around autosp's module: one gather for the whole compiled graph.

autosp's module carries DeepSpeed's ``_z3_leaf`` flag, so ZeRO 3 gathers every parameter when the
module is entered and hooks no module inside it (hooks inside would cut the compiled graph into
pieces). DeepSpeed reduces a leaf module's gradients in a full backward hook on that module. When
none of the module's inputs needs a gradient (token ids), torch calls such a hook as soon as the
backward *starts*, before any parameter has a gradient: DeepSpeed would reduce zeros and leave the
real gradients behind. autosp's module therefore keeps that hook off torch's list and runs it once
the whole backward has finished (an autograd engine callback), which is when DeepSpeed expects them.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn

# The name of the closure DeepSpeed's stage 3 registers per leaf module (deepspeed/runtime/zero/stage3.py).
_LEAF_HOOK = "reduce_leaf_module_grads"


def is_leaf_gradient_hook(hook: Callable) -> bool:
    """Whether ``hook`` is the gradient reduction DeepSpeed's stage 3 registers on a leaf module."""
    return getattr(hook, "__name__", "") == _LEAF_HOOK


def run_after_backward(module: nn.Module, hooks: list[Callable], output: Any) -> None:
    """Queue ``hooks`` to run once the backward through ``output`` has finished."""
    tensors = [t for t in _tensors(output) if t.requires_grad]
    if not hooks or not tensors:
        return
    queued = [False]          # one run per backward, whichever output's gradient arrives first

    def queue(grad: torch.Tensor) -> torch.Tensor:
        if not queued[0]:
            queued[0] = True
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: [hook(module, (), ()) for hook in hooks])
        return grad

    for t in tensors:
        t.register_hook(queue)


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        return [t for v in output.values() for t in _tensors(v)]
    if isinstance(output, (list, tuple)):
        return [t for v in output for t in _tensors(v)]
    return []
