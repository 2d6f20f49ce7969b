"""Planner: graph capture, strategy space, ILP, plans, reports."""

from autosp.planner.capture import capture
from autosp.planner.opgraph import S, LayerClass, OpGraph

__all__ = ["capture", "OpGraph", "LayerClass", "S"]
