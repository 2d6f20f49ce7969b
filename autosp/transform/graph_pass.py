"""How every FX pass of the transform ends: the graph checked and its code regenerated, once, where
the pass changed it (a pass that changed nothing leaves the module's code as it was)."""

from __future__ import annotations

import torch.fx as fx


def finish_pass(gm: fx.GraphModule, changed: int) -> int:
    """Lint ``gm``'s graph and recompile its code where ``changed`` (what the pass rewrote, counted)
    is non-zero; returns ``changed``, what the pass reports."""
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed
