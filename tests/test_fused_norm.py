"""RMSNorm as one op (autosp/transform/fused_norm.py): the same numbers as the module it replaces,
found where Hugging Face writes it and nowhere else, and what the memory model says it saves."""

import copy

import pytest
import torch
import transformers

from autosp.costmodel.fused_norm import fused_norm_saving
from autosp.costmodel.memory import hidden_bytes, tiled_region
from autosp.graph import capture
from autosp.transform.fused_norm import fuse_rms_norms, fused_rms_norm


def _llama(dtype: torch.dtype, layers: int = 2) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_op_gives_the_modules_output_bits_and_autograds_gradients(dtype):
    """Forward: the same bits as LlamaRMSNorm (the same ops per row, in blocks of rows). Backward:
    the gradients autograd gives the module's ops, to fp32 rounding (bf16: the same bits here)."""
    torch.manual_seed(0)
    norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = (torch.randn(3, 37, 48) * 3).to(dtype).requires_grad_()
    dy = torch.randn(3, 37, 48).to(dtype)
    y = norm(x)
    dx, dw = torch.autograd.grad(y, (x, norm.weight), dy)
    x2 = x.detach().clone().requires_grad_()
    w2 = norm.weight.detach().clone().requires_grad_()
    y2 = fused_rms_norm(x2, w2, 1e-5)
    dx2, dw2 = torch.autograd.grad(y2, (x2, w2), dy)
    assert y2.dtype == y.dtype and torch.equal(y2, y)
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    for a, b in ((dx2, dx), (dw2, dw)):
        assert a.dtype == b.dtype and ((a - b).abs().max() / b.abs().max()).item() <= tol


def _fused_counts(model: torch.nn.Module) -> tuple[list[int], torch.Tensor, list[torch.Tensor]]:
    counts: list[int] = []

    def backend(gm, example_inputs):
        counts.append(fuse_rms_norms(gm))
        return gm

    ids = torch.randint(0, 100, (1, 16), generator=torch.Generator().manual_seed(1))
    loss = torch.compile(model, backend=backend)(input_ids=ids, labels=ids).loss
    loss.backward()
    return counts, loss, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_llama_norm_is_found_and_the_step_is_unchanged(dtype):
    """A 2-layer Llama: two norms a layer and the final one run as one op each; the loss is the same
    bits as the model's own, every gradient the same to fp32 rounding."""
    model = _llama(dtype)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 100, (1, 16), generator=torch.Generator().manual_seed(1))
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    counts, loss, grads = _fused_counts(model)
    assert counts == [5] and torch.equal(loss, ref_loss)
    for g, p in zip(grads, ref.parameters()):
        assert ((g - p.grad).abs().max() / p.grad.abs().max()).item() <= 1e-5


def test_a_norm_written_another_way_is_left_as_written():
    """Gemma's norm scales by (1 + weight) in fp32: not the chain the op computes, so not replaced."""
    cfg = transformers.GemmaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=1, head_dim=16, vocab_size=100, attn_implementation="sdpa")
    torch.manual_seed(0)
    counts, loss, _ = _fused_counts(transformers.GemmaForCausalLM(cfg))
    assert counts == [0] and torch.isfinite(loss)


@pytest.mark.parametrize("dtype,hidden_states", [("bfloat16", 5), ("float32", 2)])
def test_the_memory_model_takes_the_norms_copies_out(dtype, hidden_states):
    """Per layer, what the two fused norms no longer save: bf16, the fp32 copy (two hidden states)
    and the normalised tensor of each (one), less the residual stream the second now saves; fp32,
    the normalised tensor of each (the input is saved either way)."""
    g = capture(_llama(getattr(torch, dtype)), seq_len=64, dtype=dtype)
    (fp, lc), = g.layer_classes.items()
    saving = fused_norm_saving(g, 1024, tiled_region(g, lc.captured[0]))[fp]
    assert saving == pytest.approx(hidden_states * hidden_bytes(g, 1024), rel=1e-3)
