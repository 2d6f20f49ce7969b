"""Modules whose output for each token depends on that token alone, however they compute it.

A mixture-of-experts layer sorts its tokens by expert, gathers them, runs grouped
matmuls and scatters the results back: op by op, that looks like mixing tokens along
the sequence (a sort over it, indexing it with computed positions), which the sharding
pass refuses. As a whole it is token-wise, so under SP each rank routes its own tokens
through the experts. Inside such a module the pass lets any op run on this rank's
tokens; values it computes without a sequence dim (tokens per expert) are this rank's
own and may not leave the module.

Transformers' experts modules are recognised (:func:`autosp.graph.hf_compat.is_hf_experts`);
:func:`token_local` registers a module class of your own.
"""

from __future__ import annotations

import re
from typing import Any

from autosp.graph.hf_compat import is_hf_experts

_REGISTERED: set[type] = set()


def token_local(cls: type) -> type:
    """Class decorator (or call): declare that ``cls``'s output for each token depends on that
    token's inputs alone, so autosp may run it on each rank's tokens as it is."""
    _REGISTERED.add(cls)
    return cls


def is_token_local(cls: Any) -> bool:
    return isinstance(cls, type) and (cls in _REGISTERED or is_hf_experts(cls))


def token_local_module(meta: dict[str, Any]) -> str | None:
    """The path of the token-local module an FX node runs inside (from its ``nn_module_stack``), or None."""
    for path, cls in (meta.get("nn_module_stack") or {}).values():
        if is_token_local(cls):
            return re.sub(r"^L\['self'\]\.?", "", str(path)) or type(cls).__name__   # Dynamo's root prefix
    return None
