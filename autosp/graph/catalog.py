"""Built-in model catalogue: names that resolve to configs with no download.

A model *spec* is one of
  * a catalogue name (``llama3-8b``, ``tiny``, ...);
  * a path to a Hugging Face ``config.json``;
  * ``package.module:factory`` — a callable returning an ``nn.Module``
    (used with an input spec, see :mod:`autosp.graph.inputs`).

Configs follow the published model cards (hidden size, layers, heads, vocab);
weights are never loaded.
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass
from typing import Any, Callable

from autosp.errors import AutospError


def _llama3(hidden: int, ffn: int, layers: int, heads: int, max_positions: int) -> tuple[str, dict[str, Any]]:
    """The Llama 3 family shares its vocabulary, 8 KV heads, RoPE base and norm epsilon."""
    return ("LlamaConfig", dict(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                                num_attention_heads=heads, num_key_value_heads=8, vocab_size=128256,
                                rope_theta=500000.0, max_position_embeddings=max_positions, rms_norm_eps=1e-5))


def _gpt_oss(layers: int, experts: int) -> tuple[str, dict[str, Any]]:
    """gpt-oss-120b and -20b differ in depth and experts only."""
    return ("GptOssConfig", dict(
        hidden_size=2880, intermediate_size=2880, num_hidden_layers=layers, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=experts, num_experts_per_tok=4, vocab_size=201088,
        sliding_window=128, max_position_embeddings=131072, rope_theta=150000.0,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]))


# family -> transformers config class name; kwargs follow the public config.json files.
CATALOG: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3-8b": _llama3(4096, 14336, 32, 32, 8192),
    "llama3-70b": _llama3(8192, 28672, 80, 64, 8192),
    "llama3.1-405b": _llama3(16384, 53248, 126, 128, 131072),
    "mistral-7b": ("MistralConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
        rope_theta=1000000.0, max_position_embeddings=32768, sliding_window=None)),
    "qwen2.5-7b": ("Qwen2Config", dict(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
        rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=False)),
    "gpt2-xl": ("GPT2Config", dict(
        n_embd=1600, n_layer=48, n_head=25, vocab_size=50257, n_positions=1024,
        # Long-context training runs without dropout; with it SDPA leaves the fused kernel.
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)),
    # Multi-head latent attention: queries and keys of head dim 192 (128 + 64 rotary), values 128;
    # the first layers dense, then mixtures of experts.
    "deepseek-v3": ("DeepseekV3Config", dict(
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
        num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5, first_k_dense_replace=3,
        vocab_size=129280, max_position_embeddings=163840, rope_theta=10000.0)),
    # Learned attention sinks (a logit per head joining each row's softmax), sliding-window layers of
    # 128 tokens alternating with full ones, mixtures of 128 (32) experts; eager attention only.
    "gpt-oss-120b": _gpt_oss(36, 128),
    "gpt-oss-20b": _gpt_oss(24, 32),
    "deepseek-v2-lite": ("DeepseekV2Config", dict(
        hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2,
        num_experts_per_tok=6, n_group=1, topk_group=1, topk_method="greedy", first_k_dense_replace=1,
        vocab_size=102400, max_position_embeddings=163840, rope_theta=10000.0)),
    # A hybrid: three gated DeltaNet layers (a causal conv1d, then the gated delta rule's chunked
    # scan; run gathered under SP) to one gated softmax-attention layer, 512 experts.
    "qwen3-next-80b-a3b": ("Qwen3NextConfig", dict(
        hidden_size=2048, intermediate_size=5120, num_hidden_layers=48, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32, num_experts=512,
        num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        decoder_sparse_step=1, norm_topk_prob=True, vocab_size=151936, max_position_embeddings=262144,
        rope_theta=10000000.0, partial_rotary_factor=0.25, tie_word_embeddings=False,
        layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(48)])),
    # Small enough to train on a 2-core CPU: the default of the README's main job.
    "tiny": ("LlamaConfig", dict(
        hidden_size=256, intermediate_size=688, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, vocab_size=2048,
        max_position_embeddings=65536, rope_theta=10000.0)),
}


@dataclass
class ModelSource:
    """What a spec resolved to: an HF config, or a factory of our own/user's."""

    name: str
    hf_config: Any = None               # transformers.PretrainedConfig
    factory: Callable[[], Any] | None = None

    @property
    def is_hf(self) -> bool:
        return self.hf_config is not None


def known_models() -> list[str]:
    return sorted(CATALOG)


def hf_config(name: str) -> Any:
    """The transformers config of a catalogue name (SDPA attention)."""
    import transformers

    cls_name, kwargs = CATALOG[name]
    cfg = getattr(transformers, cls_name)(**kwargs)
    cfg._attn_implementation = attention_for(cfg)
    return cfg


def attention_for(cfg: Any) -> str:
    """SDPA where the family offers it; else eager, the attention the model writes itself (gpt-oss:
    SDPA would silently drop its sinks). autosp runs and costs either."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    import transformers

    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(cfg.model_type, ""), None)
    return "eager" if cls is not None and not getattr(cls, "_supports_sdpa", True) else "sdpa"


def resolve(spec: str) -> ModelSource:
    """Turn a model spec into a :class:`ModelSource`, or a one-line error naming the fix."""
    if spec in CATALOG:
        return ModelSource(spec, hf_config=hf_config(spec))
    if spec.endswith(".json") or os.path.isdir(spec):
        return ModelSource(os.path.basename(os.path.dirname(os.path.abspath(spec))) or spec,
                           hf_config=_config_from_file(spec))
    if ":" in spec:
        return ModelSource(spec, factory=_import_factory(spec))
    raise AutospError(
        f"unknown model '{spec}'; use one of {', '.join(known_models())}, "
        "a path to a Hugging Face config.json, or package.module:factory")


def _config_from_file(path: str) -> Any:
    import transformers

    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.exists(path):
        raise AutospError(f"config file {path} does not exist; pass the path to a Hugging Face config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise AutospError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}); fix the file") from None
    model_type = raw.get("model_type")
    if not model_type:
        raise AutospError(f"{path} has no 'model_type' key; a Hugging Face config.json names its model family there")
    try:
        cfg = transformers.AutoConfig.for_model(**raw)
    except (ValueError, KeyError) as e:
        raise AutospError(f"{path}: transformers does not know model_type '{model_type}' ({e}); "
                          "upgrade transformers or use a known family") from None
    cfg._attn_implementation = attention_for(cfg)
    return cfg


def _import_factory(spec: str) -> Callable[[], Any]:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise AutospError(f"cannot import '{module_name}' for model '{spec}' ({e}); "
                          "check the module path and that it is on PYTHONPATH") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise AutospError(f"'{attr}' in module '{module_name}' is not a callable factory; "
                          "give package.module:function that returns an nn.Module")
    return factory
