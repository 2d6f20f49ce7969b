"""autosp: automatic sequence parallelism for long-context transformer training.

Public API:
    autosp.compile(model, ...)      wrap a model for SP training (transform/)
    autosp.plan(model, ...)         choose SP x DP, strategies and checkpointing (planner/)
    autosp.Plan                     the plan document (save / load / check)
    autosp.load_profile(name)       a hardware profile (costmodel/, profiles/)
    autosp.capture(model, ...)      the OpGraph of one training step on fake tensors (planner/)
    torch.compile(model, backend="autosp", dynamic=True)
"""

from autosp.costmodel.profile import load_profile
from autosp.errors import AutospError
from autosp.planner.capture import capture
from autosp.planner.opgraph import OpGraph
from autosp.planner.plan import Plan
from autosp.planner.search import plan
from autosp.transform.api import SequenceParallel, compile
from autosp.transform.backend import register as _register_backend

_register_backend()

__all__ = ["compile", "plan", "Plan", "load_profile", "capture", "OpGraph", "SequenceParallel", "AutospError"]
__version__ = "0.1.0"
