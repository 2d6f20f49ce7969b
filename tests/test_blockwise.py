"""Blockwise attention (the kernel of ring / all-gather-KV / hybrid) against one fused SDPA call."""

import pytest
import torch
import torch.nn.functional as F

from autosp.strategies.blockwise import chunked_attention


def _chunks(x, ids, n):
    size = x.shape[2] // n
    return torch.cat([x[:, :, c * size:(c + 1) * size] for c in ids], dim=2)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("q_ids,kv_ids", [([0, 3], [2, 0, 3, 1]), ([2], [0, 1, 2, 3]), ([1, 2], [3, 1, 0, 2])])
def test_chunked_attention_equals_sdpa_forward_and_backward(causal, q_ids, kv_ids):
    torch.manual_seed(0)
    b, h, hkv, s, d = 2, 4, 2, 32, 8
    q = torch.randn(b, h, s, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, hkv, s, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, hkv, s, d, dtype=torch.float64, requires_grad=True)
    ref = _chunks(F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True), q_ids, 4)
    g = torch.randn_like(ref)
    expected = torch.autograd.grad(ref, (q, k, v), g)
    out, _ = chunked_attention(_chunks(q, q_ids, 4), _chunks(k, kv_ids, 4), _chunks(v, kv_ids, 4), q_ids, kv_ids,
                               causal, d ** -0.5)
    got = torch.autograd.grad(out, (q, k, v), g)
    assert torch.allclose(out, ref, rtol=0, atol=1e-12)         # fp64: absolute 1e-12, no relative slack
    for a, e in zip(got, expected):
        assert torch.allclose(a, e, rtol=0, atol=1e-12)
