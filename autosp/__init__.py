"""autosp: automatic sequence parallelism for long-context transformer training.

Public API:
    autosp.compile(model, ...)      wrap a model for SP training (transform/)
    autosp.plan(model, ...)         choose SP x DP, strategies and checkpointing (planner/)
    autosp.Plan                     the plan document (save / load / check)
    autosp.load_profile(name)       a hardware profile (costmodel/, profiles/)
    autosp.capture(model, ...)      the OpGraph of one training step on fake tensors (graph/)
    autosp.token_local(cls)         declare a module whose output per token depends on that token alone
    autosp.checkpoint.save / load   resumable checkpoints (torch.distributed.checkpoint)
    torch.compile(model, backend="autosp", dynamic=True)
"""

from autosp import checkpoint
from autosp.costmodel.profile import load_profile
from autosp.errors import AutospError
from autosp.graph import OpGraph, capture
from autosp.planner.plan import Plan
from autosp.planner.search import plan
from autosp.transform.api import SequenceParallel
from autosp.transform.api import compile as _compile
from autosp.transform.backend import register as _register_backend
from autosp.transform.token_local import token_local

_register_backend()


def compile(model, *, plan=None, memory_limit=None, **kwargs):  # noqa: A001 - mirrors torch.compile
    """``autosp.transform.api.compile``, planned: with ``strategy="auto"`` (the default) and no
    plan, or ``plan="auto"``, the ILP plans for the first batch (see :mod:`autosp.autoplan`;
    if it cannot, the default strategy choice applies, with a warning); a Plan or a plan path
    applies that plan. ``memory_limit``: bytes per device the plan must fit (attention strategy,
    checkpointing and MLP tiling per layer, the loss's tiling, chosen at the least predicted time);
    default the device's."""
    planned = plan == "auto" or (plan is None and kwargs.get("strategy", "auto") == "auto")
    if memory_limit is not None and not planned:
        raise AutospError("memory_limit is a budget for the planner: use it with strategy='auto' (the default) "
                          "or plan='auto', not with a named strategy or a saved plan")
    if planned:
        from autosp.autoplan import AutoPlanner

        explicit = "checkpoint" in kwargs and kwargs["checkpoint"] != "none"
        mlp = kwargs.get("mlp_chunks", 1) != 1                    # the caller's tiling is kept
        loss = kwargs.get("loss_chunks", 1) != 1
        # only the default budget may fall back to the default strategy; one the user set holds or fails
        plan = AutoPlanner(fallback=plan is None and memory_limit is None, memory_limit=memory_limit,
                           checkpoints=("none",) if explicit else ("none", "selective", "full"),
                           overlap=kwargs.get("overlap", True), mlp_chunks=(1,) if mlp else (1, 8),
                           loss_chunks=(1,) if loss else (1, 8), zero_stage=kwargs.get("zero_stage"))
    return _compile(model, plan=plan, **kwargs)


compile.__doc__ = (compile.__doc__ or "") + "\n\n" + (_compile.__doc__ or "")

__all__ = ["compile", "plan", "Plan", "load_profile", "capture", "OpGraph", "SequenceParallel", "AutospError",
           "token_local", "checkpoint"]
__version__ = "0.1.0"
