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
from typing import Any, Iterator

import torch
import torch.nn.functional as F


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


def attention_window(block: object, config: object) -> int:
    """The sliding window (tokens) of one transformer block's causal mask, 0 for none.

    Families that mix window and full layers store the window on the attention module
    (``sliding_window``, None on full layers); the others (Mistral) apply the config's to all."""
    for m in block.modules():                    # type: ignore[attr-defined]
        if "sliding_window" in vars(m):
            return int(m.sliding_window or 0)
    if getattr(config, "layer_types", None):
        return 0
    return int(getattr(config, "sliding_window", None) or 0)



def is_hf_experts(cls: type) -> bool:
    """A transformers mixture-of-experts ``*Experts`` module (its forward, whichever experts
    implementation runs, maps each routed token through its experts and back: token-local)."""
    return hasattr(cls, "_apply_gate") and cls.__name__.endswith("Experts")


def install_output_hooks(module: object) -> None:
    """Install transformers' output-capturing hooks (router logits, hidden states) now.

    transformers installs them at the model's first call, under a ``threading.Lock`` that
    Dynamo cannot trace: a model compiled before it ever ran eagerly would break its graph
    there, and its LM head and loss would run in a graph of their own."""
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:          # other transformers versions: nothing to prepare
        return
    maybe_install_capturing_hooks(module)


@contextlib.contextmanager
def experts_as_compiled(active: bool = True) -> Iterator[None]:
    """Within this context transformers picks its experts kernel as it does under torch.compile.

    Capture traces on fake tensors outside Dynamo, where transformers would call the grouped
    matmul kernel for any dtype, whose fake kernel takes bf16 only; compiled training (what
    capture models) uses its fallback op for other dtypes."""
    try:
        import transformers.integrations.moe as moe
    except ImportError:
        yield
        return
    original = getattr(moe, "_can_use_grouped_mm", None)
    if not active or original is None:
        yield
        return
    moe._can_use_grouped_mm = lambda input, weight, offs: weight.dtype == torch.bfloat16 and original(
        input, weight, offs)
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original


@contextlib.contextmanager
def eager_experts_as_grouped(module: torch.nn.Module) -> Iterator[None]:
    """Within this context a model whose experts run as transformers' eager Python loop runs them
    as grouped matmuls instead. The loop branches on which experts got tokens, data no fake tensor
    holds, so it cannot be traced; the grouped form does the same matmuls on the same tokens (the
    same FLOPs and activations), which is what the planner costs."""
    configs = {id(c): c for m in module.modules()
               if getattr(c := getattr(m, "config", None), "_experts_implementation", None) == "eager"}
    for c in configs.values():
        c._experts_implementation = "grouped_mm"
    try:
        yield
    finally:
        for c in configs.values():
            c._experts_implementation = "eager"


def sdpa_unsupported(module: object) -> bool:
    """A transformers model whose family has no SDPA attention (Gemma-2, BLOOM): asking for it
    fails in transformers itself."""
    return is_hf_model(module) and getattr(type(module), "_supports_sdpa", True) is False


@contextlib.contextmanager
def broadcast_kv_as_gqa() -> Iterator[None]:
    """SDPA broadcasts a single K/V head over every query head (multi-query attention, Falcon);
    no fused kernel takes that, so SDPA would decompose into matmuls and a softmax and the capture
    would find no attention op. ``enable_gqa=True`` is the same math on the fused kernel."""
    original = F.scaled_dot_product_attention

    def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        hq, hk = query.shape[-3], key.shape[-3]
        if not kwargs.get("enable_gqa") and key.dim() == query.dim() == 4 and hk != hq and hq % hk == 0:
            kwargs["enable_gqa"] = True
        return original(query, key, value, *args, **kwargs)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


@contextlib.contextmanager
def pad_value_head_dim() -> Iterator[None]:
    """Multi-head latent attention (DeepSeek-V2/V3) gives the values a smaller head dim than the
    queries and keys (128 against 192 at full size). No CPU fused kernel takes that, so SDPA would
    decompose into matmuls and a softmax and the capture would find no attention op. The values
    padded to the queries' head dim and the output sliced back is the same math on the fused
    kernel (what flash-attention users of MLA run). Yields the values' real head dim per call, in
    call order (0 where nothing was padded), for the captured ops' ``v_head_dim``."""
    original = F.scaled_dot_product_attention
    value_dims: list[Any] = []

    def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        dq, dv = query.shape[-1], value.shape[-1]
        if key.shape[-1] == dq and dv < dq:
            value_dims.append(dv)
            return original(query, key, F.pad(value, (0, dq - dv)), *args, **kwargs)[..., :dv]
        value_dims.append(0)
        return original(query, key, value, *args, **kwargs)

    F.scaled_dot_product_attention = sdpa
    try:
        yield value_dims
    finally:
        F.scaled_dot_product_attention = original


@contextlib.contextmanager
def polar_as_view() -> Iterator[None]:
    """``torch.polar``'s fake kernel (``aten.complex``) reads concrete sizes, which pins the sequence
    length while tracing (DeepSeek-V2 builds its rotary table as complex numbers). The same values
    built through ``view_as_complex`` keep it symbolic."""
    original = torch.polar

    def polar(abs: torch.Tensor, angle: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is not None:
            return original(abs, angle, out=out)
        return torch.view_as_complex(torch.stack((abs * torch.cos(angle), abs * torch.sin(angle)), dim=-1))

    torch.polar = polar
    try:
        yield
    finally:
        torch.polar = original


@contextlib.contextmanager
def traced_as_exported() -> Iterator[None]:
    """``torch.linalg.solve_triangular``'s fake kernel expands with concrete sizes only, which a
    symbolic sequence length breaks (Qwen3-Next's gated DeltaNet solves its chunks' UT system with
    it). The models that call it keep a loop of plain ops for tracers (``is_torchdynamo_exporting``:
    forward substitution, the same values); within this context their modules take that path."""
    import inspect
    import sys

    # only the modules that solve triangular systems: elsewhere the flag may choose other paths
    patched = [m for name, m in list(sys.modules.items())
               if name.startswith("transformers.models.") and callable(getattr(m, "is_torchdynamo_exporting", None))
               and "solve_triangular" in inspect.getsource(m)]
    originals = [m.is_torchdynamo_exporting for m in patched]
    for m in patched:
        m.is_torchdynamo_exporting = lambda: True
    try:
        yield
    finally:
        for m, f in zip(patched, originals):
            m.is_torchdynamo_exporting = f
