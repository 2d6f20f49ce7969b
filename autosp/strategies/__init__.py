"""SP attention strategies: one module each, found through the registry in :mod:`.base`.

Importing this package registers the built-in strategies: replicate (SP degree 1),
ulysses, ring and zigzag_ring, allgather_kv, hybrid:UxR.
"""

from autosp.strategies import allgather_kv, hybrid, replicate, ring, ulysses  # noqa: F401 - register
from autosp.strategies.base import (AUTO, AttentionCost, AttentionShape, KernelCall, SPMesh, Strategy, Transfer,
                                    candidates, check_spec, names, pick, register, required_layout, resolve,
                                    unregister)

__all__ = ["AUTO", "AttentionCost", "AttentionShape", "KernelCall", "SPMesh", "Strategy", "Transfer", "candidates",
           "check_spec", "names", "pick", "register", "required_layout", "resolve", "unregister"]
