"""Stage 1: capture one training step on fake tensors as a typed :class:`OpGraph`.

Owns capture, the OpGraph, op classification and FLOPs, the model catalogue and
input specs. Imports no later stage (cost model, planner, transform, strategies).
"""

from autosp.graph.capture import capture
from autosp.graph.opgraph import S, AttentionOp, LayerClass, OpGraph, OpNode, evaluate
from autosp.graph.ops import OpKind

__all__ = ["capture", "OpGraph", "OpNode", "AttentionOp", "LayerClass", "OpKind", "S", "evaluate"]
