"""Cost model: what each op costs (FLOPs, bytes) and, later, how long it takes on a profile."""

from autosp.costmodel.flops import OpKind, classify, op_flops

__all__ = ["OpKind", "classify", "op_flops"]
