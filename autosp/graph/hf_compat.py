"""The one place where autosp adapts to Hugging Face transformers internals.

While tracing (fake tensors or Dynamo), HF cannot read position ids, so it
assumes they may describe *packed* sequences and builds an explicit
``[B, 1, S, S]`` attention mask instead of calling SDPA with ``is_causal``.
That mask is quadratic in the sequence length: exactly what long-context
training must avoid. When the caller passed no position ids the positions are
``arange(S)`` (one sequence per row), so packing detection can safely answer
"not packed". This holds for every HF family that uses the shared masking
utilities; no per-family code.
"""

from __future__ import annotations

import contextlib
from typing import Iterator


def is_hf_model(module: object) -> bool:
    """A Hugging Face ``PreTrainedModel`` (or anything shaped like one)."""
    config = getattr(module, "config", None)
    return config is not None and hasattr(config, "model_type")


@contextlib.contextmanager
def unpacked_positions(active: bool = True) -> Iterator[None]:
    """Within this context HF's packed-sequence detection answers "not packed"."""
    if not active:
        yield
        return
    try:
        import transformers.masking_utils as mu
    except ImportError:          # transformers not installed: nothing to adapt
        yield
        return
    original = getattr(mu, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    mu.find_packed_sequence_indices = _not_packed
    try:
        yield
    finally:
        mu.find_packed_sequence_indices = original


def _not_packed(position_ids):  # noqa: ANN001 - mirrors the HF signature
    return None
