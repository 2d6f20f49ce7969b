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
    out, _ = chunked_attention(_chunks(q, q_ids, 4), _chunks(k, kv_ids, 4), _chunks(v, kv_ids, 4), None, q_ids, kv_ids,
                               causal, d ** -0.5)
    got = torch.autograd.grad(out, (q, k, v), g)
    assert torch.allclose(out, ref, rtol=0, atol=1e-12)         # fp64: absolute 1e-12, no relative slack
    for a, e in zip(got, expected):
        assert torch.allclose(a, e, rtol=0, atol=1e-12)


def _masks(s: int) -> dict[str, torch.Tensor]:
    """[B, 1, S, S] boolean masks as models build them (True = attend)."""
    i = torch.arange(s)
    causal = i[:, None] >= i[None, :]
    window = causal & (i[:, None] - i[None, :] < 6)                 # sliding window of 6 tokens
    doc = torch.tensor([0] * 10 + [1] * 3 + [2] * 19)               # three packed documents
    packed = causal & (doc[:, None] == doc[None, :])
    left_pad = causal.clone().expand(2, s, s).clone()
    left_pad[1, :, :5] = False                                       # row 1: 5 pad tokens in front
    return {"window": window.expand(2, 1, s, s), "packed": packed.expand(2, 1, s, s),
            "left_pad": left_pad[:, None]}


@pytest.mark.parametrize("kind", ["window", "packed", "left_pad"])
@pytest.mark.parametrize("additive", [False, True])
def test_chunked_attention_with_a_mask_equals_sdpa_and_skips_hidden_blocks(kind, additive):
    from autosp.strategies.blockwise import BLOCK_TALLY

    torch.manual_seed(0)
    b, h, hkv, s, d = 2, 4, 2, 32, 8
    q = torch.randn(b, h, s, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, hkv, s, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, hkv, s, d, dtype=torch.float64, requires_grad=True)
    mask = _masks(s)[kind]
    if additive:
        mask = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, float("-inf"))
    q_ids, kv_ids = [3, 0], [2, 0, 3, 1]
    ref = _chunks(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), q_ids, 4)
    g = torch.randn_like(ref)
    expected = torch.autograd.grad(ref, (q, k, v), g)
    before = dict(BLOCK_TALLY)
    out, _ = chunked_attention(_chunks(q, q_ids, 4), _chunks(k, kv_ids, 4), _chunks(v, kv_ids, 4), mask, q_ids,
                               kv_ids, False, d ** -0.5)
    computed = BLOCK_TALLY["computed"] - before.get("computed", 0)
    skipped = BLOCK_TALLY["skipped"] - before.get("skipped", 0)
    got = torch.autograd.grad(out, (q, k, v), g)
    assert torch.allclose(out, ref, rtol=0, atol=1e-12)
    for a, e in zip(got, expected):
        assert torch.allclose(a, e, rtol=0, atol=1e-12)
    # Query chunks 3 and 0 over 4 key chunks of 8 tokens: 8 pairs. The causal part hides 3 of them
    # (chunk 0 sees only itself); the window of 6 also hides chunks 0 and 1 from chunk 3; the
    # documents (tokens 0-9, 10-12, 13-31) hide chunks 0 and 1 from chunk 3 too (tokens 24-31
    # belong to the third document, which starts at 13: chunk 1 = tokens 8-15 is still seen).
    hidden = {"window": 5, "packed": 4, "left_pad": 3}[kind]
    assert (computed, skipped) == (8 - hidden, hidden)


def test_masked_chunks_are_cut_into_tiles_that_a_window_hides(monkeypatch):
    import autosp.strategies.blockwise as bw

    monkeypatch.setattr(bw, "MASK_TILE", 4)         # chunks of 8 tokens -> tiles of 4
    torch.manual_seed(0)
    b, h, s, d = 1, 2, 32, 8
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = _masks(s)["window"][:1]
    q_ids, kv_ids = [3, 0], [2, 0, 3, 1]
    ref = _chunks(F.scaled_dot_product_attention(q, k, v, attn_mask=mask), q_ids, 4)
    g = torch.randn_like(ref)
    expected = torch.autograd.grad(ref, (q, k, v), g)
    before = dict(bw.BLOCK_TALLY)
    out, _ = chunked_attention(_chunks(q, q_ids, 4), _chunks(k, kv_ids, 4), _chunks(v, kv_ids, 4), mask, q_ids,
                               kv_ids, False, d ** -0.5)
    got = torch.autograd.grad(out, (q, k, v), g)
    assert torch.allclose(out, ref, rtol=0, atol=1e-12)
    for a, e in zip(got, expected):
        assert torch.allclose(a, e, rtol=0, atol=1e-12)
    # Query tiles 6, 7 (chunk 3) and 0, 1 (chunk 0) over 8 key tiles of 4 tokens, window 6: tile 6
    # sees key tiles 4-6, tile 7 sees 5-7, tile 0 itself, tile 1 tiles 0-1: 9 of 32 tile pairs
    # (whole chunks of 8: 3 of 8 pairs, twice the area).
    assert (bw.BLOCK_TALLY["computed"] - before.get("computed", 0),
            bw.BLOCK_TALLY["skipped"] - before.get("skipped", 0)) == (9, 23)


def test_the_math_tile_path_cuda_uses_for_masked_tiles_is_exact(monkeypatch):
    """On CUDA a masked (or fp32) tile runs as fp32 matmuls (no fused kernel there returns its
    lse under a mask); the same code, forced here on CPU in fp64, against SDPA."""
    import autosp.strategies.blockwise as bw

    def forward(q, k, v, causal, scale, bias=None):
        bw.BLOCK_TALLY["computed"] += 1
        return bw._math_forward(q, k, v, causal, scale, bias)

    monkeypatch.setattr(bw, "kernel_forward", forward)
    monkeypatch.setattr(bw, "kernel_backward", bw._math_backward)
    for kind in ("window", "left_pad"):
        test_chunked_attention_with_a_mask_equals_sdpa_and_skips_hidden_blocks(kind, False)
    test_chunked_attention_equals_sdpa_forward_and_backward(True, [0, 3], [2, 0, 3, 1])
