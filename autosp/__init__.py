"""autosp: automatic sequence parallelism for long-context transformer training.

Public API:
    autosp.compile(model, plan="auto", *, mesh, memory_limit, zero, runtime)
                                    wrap a model for SP training (front.py)
    autosp.Auto / Zero / Runtime    the option groups users tune (options.py)
    autosp.Decisions                fixed decisions per layer and per mesh (decisions.py)
    autosp.Problem.of(model, ...)   what is planned: graph, world, profile, budget, ZeRO, search space
    autosp.plan(problem)            choose SP x DP, strategies and checkpointing (planner/)
    autosp.Plan                     the plan document (save / load / check)
    autosp.load_profile(name)       a hardware profile (costmodel/, profiles/)
    autosp.capture(model, ...)      the OpGraph of one training step on fake tensors (graph/)
    autosp.tensor_parallel(model, group, batch)
                                    split a model's linear pairs over a TP group (transform/tensor_parallel.py;
                                    autosp.compile does it for a Hugging Face model given a 'tp' mesh)
    autosp.token_local(cls)         declare a module whose output per token depends on that token alone
    autosp.checkpoint.save / load   resumable checkpoints (torch.distributed.checkpoint)
    autosp.data.pack / collate      pack documents into rows of a window, with restarting positions
    torch.compile(model, backend="autosp", dynamic=True)   (a torch_dynamo_backends entry point)
"""

from autosp import checkpoint, data
from autosp.costmodel.profile import load_profile
from autosp.decisions import Decisions, LayerChoice, MeshChoice
from autosp.errors import AutospError
from autosp.front import compile
from autosp.graph import OpGraph, capture
from autosp.mixed_degree import MixedDegree
from autosp.options import Auto, Runtime, Zero
from autosp.planner.plan import Plan
from autosp.planner.problem import Problem
from autosp.planner.search import plan
from autosp.transform.api import SequenceParallel
from autosp.transform.tensor_parallel import parallelize as tensor_parallel
from autosp.transform.token_local import token_local

__all__ = ["compile", "Auto", "Zero", "Runtime", "Decisions", "LayerChoice", "MeshChoice", "plan", "Plan", "Problem",
           "load_profile", "capture", "OpGraph", "SequenceParallel", "MixedDegree", "AutospError", "token_local", "tensor_parallel", "checkpoint", "data"]
__version__ = "0.1.0"
