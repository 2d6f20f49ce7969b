"""Build the model to capture: on the ``meta`` device, shallow where the family allows.

No weights are allocated. Hugging Face configs are rebuilt with only a few of their
repeated blocks (at least one of every layer type): identical layers are costed once
and scaled to the full depth, whose parameters are counted per block.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator

import torch
import torch.nn as nn

from autosp.errors import AutospError
from autosp.graph.catalog import ModelSource, attention_for, resolve
from autosp.graph.hf_compat import is_hf_model

# --------------------------------------------------------------------------------------------
# building the (shallow, meta) model


class Built:
    def __init__(self, name: str, module: nn.Module, blocks: list[nn.Module],
                 full_keys: list[Any], captured_keys: list[Any], is_hf: bool, notes: list[str],
                 total_params: int):
        self.name, self.module, self.blocks = name, module, blocks
        self.full_keys, self.captured_keys = full_keys, captured_keys
        self.is_hf, self.notes, self.total_params = is_hf, notes, total_params


def build(model: Any, dtype: torch.dtype, seq_len: int, max_layers: int | None) -> Built:
    if isinstance(model, nn.Module):
        blocks = find_blocks(model)
        total = count_params(model)
        return Built(type(model).__name__, model, blocks, [0] * len(blocks), [0] * len(blocks),
                      is_hf_model(model), [], total)
    src = model if isinstance(model, ModelSource) else resolve(model)
    if src.is_hf:
        return build_hf(src, dtype, seq_len, max_layers)
    with torch.device("meta"):
        module = src.factory()
    if not isinstance(module, nn.Module):
        raise AutospError(f"factory '{src.name}' returned {type(module).__name__}, not an nn.Module; return the model")
    module = module.to(dtype) if dtype.is_floating_point else module
    blocks = find_blocks(module)
    return Built(src.name, module, blocks, [0] * len(blocks), [0] * len(blocks), False, [],
                  count_params(module))


def build_hf(src: ModelSource, dtype: torch.dtype, seq_len: int, max_layers: int | None) -> Built:
    import transformers

    cfg = copy.deepcopy(src.hf_config)
    notes = []
    n_full = cfg.num_hidden_layers
    layer_types = list(getattr(cfg, "layer_types", None) or [])
    # a layer's key: its attention type and whether its MLP is a mixture of experts; the trace
    # reaches the first layer of every key, and each untraced layer is costed as its key's
    full_keys = list(zip(layer_types if len(layer_types) == n_full else [0] * n_full, mlp_kinds(cfg, n_full)))
    if max_layers is None:
        k = n_full
    else:
        first = {}
        for i, key in enumerate(full_keys):
            first.setdefault(key, i)
        k = min(n_full, max(max_layers, max(first.values()) + 1))
    # Parameters of the full-depth model, counted from a meta build (no memory) would cost
    # time linear in depth; count per block instead and scale (see _count_hf_params).
    cfg.num_hidden_layers = k
    if len(layer_types) == n_full:
        cfg.layer_types = layer_types[:k]
    n_pos = getattr(cfg, "n_positions", None)
    if cfg.model_type == "gpt2" and n_pos is not None and seq_len > n_pos:
        notes.append(f"gpt2 has learned positions for {n_pos} tokens; planned with {seq_len} positions")
        cfg.n_positions = seq_len
    with torch.device("meta"):
        module = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attention_for(cfg))
    blocks = find_blocks(module)
    block_params = [count_params(b) for b in blocks]
    per_key = {key: block_params[i] for i, key in enumerate(full_keys[:k])}
    total = count_params(module) - sum(block_params) + sum(per_key[key] for key in full_keys)
    return Built(src.name, module, blocks, full_keys, full_keys[:k], True, notes, total)


def mlp_kinds(cfg: Any, n: int) -> list[str]:
    """Per layer, "moe" or "dense", where a family mixes them, as its config says (DeepSeek and
    Kimi: the first ``first_k_dense_replace`` layers dense, then every ``moe_layer_freq``-th;
    Qwen-MoE: ``mlp_only_layers`` dense, experts every ``decoder_sparse_step``-th); "" elsewhere."""
    first = getattr(cfg, "first_k_dense_replace", None)
    if isinstance(first, int):
        freq = getattr(cfg, "moe_layer_freq", 1) or 1
        return ["moe" if i >= first and i % freq == 0 else "dense" for i in range(n)]
    only = getattr(cfg, "mlp_only_layers", None)
    step = getattr(cfg, "decoder_sparse_step", None)
    if isinstance(step, int) and (getattr(cfg, "num_experts", 0) or 0) > 0:
        only = set(only or [])
        return ["moe" if i not in only and (i + 1) % step == 0 else "dense" for i in range(n)]
    return [""] * n


def count_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks: the longest ModuleList whose children share one class."""
    best: list[nn.Module] = []
    for sub in module.modules():
        if isinstance(sub, nn.ModuleList) and len(sub) > len(best):
            kinds = {type(c).__name__ for c in sub}
            if len(kinds) == 1:
                best = list(sub)
    return best


@contextlib.contextmanager
def fsdp_hooks_off(module: nn.Module) -> Iterator[None]:
    """Trace a model that FSDP2 (``fully_shard``, ZeRO 2) already sharded as the model it wraps.

    Its parameters report their global shapes, so the fake parameters capture swaps in are full
    size; but FSDP's forward hooks would initialise FSDP and all-gather parameters under the fake
    mode, failing there and leaving FSDP half-initialised for the real step. They are lifted for
    the trace and put back, in their order, after it."""
    from torch.distributed.fsdp import FSDPModule

    def is_fsdp(hook: Any) -> bool:
        owner = getattr(hook, "__self__", None)
        hook = getattr(hook, "__wrapped__", hook)
        return type(owner).__name__ == "FSDPState" or "_fully_shard" in getattr(hook, "__module__", "")

    lifted = []
    for m in module.modules():
        if isinstance(m, FSDPModule):
            for hooks in (m._forward_pre_hooks, m._forward_hooks):
                saved = dict(hooks)
                for key in [k for k, h in saved.items() if is_fsdp(h)]:
                    del hooks[key]
                lifted.append((hooks, saved))
    try:
        yield
    finally:
        for hooks, saved in lifted:
            hooks.clear()
            hooks.update(saved)
