"""Graph capture on fake tensors: FLOPs, saved activations, layer classes, errors."""

import json
import resource

import pytest
import torch

from autosp.errors import AutospError
from autosp.graph import S, capture
from autosp.graph import evaluate


@pytest.fixture(scope="module")
def llama8b():
    return capture("llama3-8b", seq_len=8192, batch_size=1, dtype="bfloat16")


def llama3_8b_dims():
    return dict(h=4096, kv=1024, i=14336, heads=32, head_dim=128, layers=32, vocab=128256)


def test_llama3_8b_training_flops_match_analytic(llama8b):
    d = llama3_8b_dims()
    tokens = 8192
    # Parameters that take part in matmuls: q,k,v,o + gate,up,down per layer, and the LM head
    # (the embedding is a lookup).
    per_layer = d["h"] * (d["h"] + 2 * d["kv"] + d["h"]) + 3 * d["h"] * d["i"]
    matmul_params = d["layers"] * per_layer + d["h"] * d["vocab"]
    dense = 6 * matmul_params * tokens
    # Causal attention convention: QK^T and PV, 2 FLOPs per MAC, half the S x S square,
    # backward twice the forward -> 3 * 2 * heads * S^2 * head_dim per layer.
    attention = d["layers"] * 3 * 2 * d["heads"] * tokens ** 2 * d["head_dim"]
    analytic = dense + attention
    captured = llama8b.total_flops()
    assert abs(captured - analytic) / analytic < 1e-4, (captured, analytic)     # within 0.01%
    # Backward matmuls are twice the forward ones (dX and dW), also at layer level.
    rows = llama8b.layer_rows()
    assert rows[0]["bwd_flops_per_layer"] == pytest.approx(2 * rows[0]["fwd_flops_per_layer"], rel=1e-6)


def test_llama3_8b_saved_activations_per_layer_match_hand_count(llama8b):
    d = llama3_8b_dims()
    e, f32 = 2, 4          # bf16 activations, fp32 inside RMSNorm
    h, kv, i = d["h"], d["kv"], d["i"]
    # Per token, what eager autograd keeps for one HF Llama decoder layer (read off the
    # model code: each op's saved inputs/outputs):
    per_token = (
        f32 * h + f32          # input RMSNorm: fp32 input and rsqrt
        + e * h                # normalized (pre-weight) output, for the norm weight grad
        + e * h                # norm output: input of q/k/v projections
        + e * kv               # v projection output
        + e * h + e * kv       # q and k after RoPE (SDPA inputs)
        + f32 * d["heads"]     # SDPA logsumexp
        + e * h                # SDPA output (also the o_proj input: no copy on CPU flash)
        + f32 * h + f32        # post-attention RMSNorm: fp32 input and rsqrt
        + e * h + e * h        # normalized output and norm output (input of gate/up)
        + 4 * e * i            # gate out, silu(gate), up out, silu*up (input of down)
        + 2 * e * d["head_dim"]  # RoPE cos and sin: made once outside the layers, saved (as storages)
                                 # by the first traced block's rotary backward, so counted there
    )
    hand = per_token * 8192
    measured = llama8b.layer_rows()[0]["act_bytes_per_layer"]
    assert measured == hand, (measured, hand)                                   # exact


def test_identical_layers_share_one_class_and_scale_to_depth(llama8b):
    assert llama8b.captured_layers == 2
    (lc,) = llama8b.layer_classes.values()
    assert lc.count == 32 and lc.captured == [0, 1]
    assert llama8b.total_params == pytest.approx(8.03e9, rel=0.01)


def test_sizes_are_symbolic_in_the_sequence_length(llama8b):
    # Evaluating the same graph at 2x the length: dense FLOPs double, attention quadruples.
    rows1 = llama8b.layer_rows(4096)[0]
    rows2 = llama8b.layer_rows(8192)[0]
    assert 2.0 < rows2["fwd_flops_per_layer"] / rows1["fwd_flops_per_layer"] < 4.0
    assert rows2["act_bytes_per_layer"] == pytest.approx(2 * rows1["act_bytes_per_layer"])
    attn = [a for a in llama8b.nodes(phase="fwd") if a.kind.value == "attention"]
    assert attn and attn[0].seq_dims[0] == [2]          # [B, H, S, D]
    assert attn[0].attention.q_len == S and attn[0].attention.heads == 32 and attn[0].attention.kv_heads == 8
    assert attn[0].attention.causal
    grads = [a for a in llama8b.nodes(phase="bwd") if a.kind.value == "matmul" and a.shapes[0] == (4096, 4096)]
    assert grads and not grads[0].seq_dims[0]           # weight grads hold no S


@pytest.mark.parametrize("name,params", [("gpt2-xl", 1.56e9), ("mistral-7b", 7.24e9),
                                         ("qwen2.5-7b", 7.62e9), ("gpt-oss-20b", 20.91e9)])
def test_other_families_capture_with_no_per_family_code(name, params):
    g = capture(name, seq_len=512)
    assert g.total_params == pytest.approx(params, rel=0.01)
    assert len(g.attention_nodes("fwd")) == g.captured_layers
    assert len(g.attention_nodes("bwd")) == g.captured_layers
    # gpt-oss offers eager attention only (SDPA would drop its sinks): one written region per layer
    written = [n.attention.written for n in g.attention_nodes("fwd")]
    assert written == [name.startswith("gpt-oss")] * g.captured_layers, written
    if name.startswith("gpt-oss"):
        # its two [1, 1, S, S] masks (sliding, full), made whole on every rank: read by all 24
        # layers, the 22 untraced ones too, so alive at the end of the forward (once, they died
        # after the traced layers and a 128k plan left 64 GiB of masks out of its peak)
        from autosp.costmodel.memory import lifetimes

        order, ops, _, last, _ = lifetimes(g)
        fwd_end = max(i for i, n in enumerate(order) if ops[n].phase == "fwd" and ops[n].layer is not None)
        masks = [n for n in order if ops[n].replicated and ops[n].layer is None and ops[n].shapes
                 and len(ops[n].shapes[0]) == 4 and ops[n].target == "aten.where.self"]
        assert len(masks) == 2 and all(last[m] >= fwd_end for m in masks), [(m, last[m], fwd_end) for m in masks]


def test_405b_plans_without_allocating_weights():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    g = capture("llama3.1-405b", seq_len=131072)
    grown_gib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 2 ** 20
    assert g.total_params == pytest.approx(405.9e9, rel=0.01)
    assert grown_gib < 1.5      # 810 GB of bf16 weights were never allocated


def test_reference_transformer_and_generic_factory():
    g = capture("autosp.models.reference:reference_factory", seq_len=256, dtype="float32")
    assert sum(lc.count for lc in g.layer_classes.values()) == 2
    enc = capture("models_for_tests:tiny_encoder", seq_len=128, dtype="float32", inputs="x:float32[B,S,32]")
    # Block 0 needs no input grad (x is data), so it differs from blocks 1 and 2.
    counts = sorted(lc.count for lc in enc.layer_classes.values())
    assert counts == [1, 2] and {lc.module_type for lc in enc.layer_classes.values()} == {"Linear"}
    # Non-causal attention: full S x S count.
    fwd = [a for a in enc.nodes(phase="fwd") if a.kind.value == "attention"]
    assert evaluate(fwd[0].flops, 128) == 4 * 1 * 128 * 128 * 32 and not fwd[0].attention.causal


def test_config_json_path(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    g = capture(str(p), seq_len=64)
    assert sum(lc.count for lc in g.layer_classes.values()) == 3
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(AutospError, match="not valid JSON"):
        capture(str(bad), seq_len=64)


def test_bad_input_errors_name_the_fix():
    with pytest.raises(AutospError, match="unknown model 'llama-9000'.*llama3-8b"):
        capture("llama-9000", seq_len=128)
    with pytest.raises(AutospError, match="positive integer"):
        capture("tiny", seq_len=0)
    with pytest.raises(AutospError, match=r"cannot be captured as one graph.*models_for_tests.py:\d+ in forward"):
        capture("models_for_tests:data_dependent", seq_len=16, inputs="x:float32[B,S,8]", dtype="float32")
    with pytest.raises(AutospError, match="no sequence dim"):
        capture("models_for_tests:tiny_encoder", seq_len=16, inputs="x:float32[B,4,32]")


def test_symbol_is_the_public_sequence_symbol(llama8b):
    emb = [a for a in llama8b.nodes(phase="fwd") if a.kind.value == "embedding"]
    assert emb[0].shapes[0] == (1, S, 4096)


def test_attention_dropout_is_planned_without_it():
    # SDPA with dropout leaves the fused kernel while tracing: capture retries in eval mode
    # (the planner used to say "no attention op" and fall back).
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, attention_dropout=0.1,
                                   attn_implementation="sdpa")
    model = transformers.AutoModelForCausalLM.from_config(cfg).train()
    g = capture(model, seq_len=64, dtype="float32")
    assert len(g.attention_nodes()) == 2 and any("eval mode" in n for n in g.notes)
    assert model.training                                   # the user's module is left as it was


def test_capture_plans_a_training_step_under_no_grad():
    # An eval loop under torch.no_grad() used to make planning fail ("cannot be captured").
    with torch.no_grad():
        g = capture("tiny", seq_len=128, dtype="float32")
    assert len(g.attention_nodes("fwd")) == len(g.attention_nodes("bwd")) == 2


@pytest.mark.parametrize("family", ["DeepseekV3Config", "DeepseekV2Config"])
def test_multi_head_latent_attention_is_captured_and_planned_on_ulysses(family):
    """DeepSeek's MLA gives values a smaller head dim than queries and keys (16 against 24 here,
    128 against 192 at full size). Captured, each layer's SDPA is found with both head dims and
    the length stays symbolic (V2's complex rotary table once pinned it); planned, only Ulysses
    takes the two head dims (the block strategies' per-block kernels do not, and say so)."""
    import transformers

    from autosp.costmodel.predict import attention_shape
    from autosp.planner.problem import Problem
    from autosp.planner.search import plan
    from autosp.strategies import SPMesh, resolve

    cfg = getattr(transformers, family)(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, vocab_size=128,
        n_group=2, topk_group=1)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    g = capture(model, seq_len=256, batch_size=1, dtype="float32")
    ops = [n.attention for n in g.attention_nodes("fwd")]
    assert len(ops) == 2 and all(a.head_dim == 24 and a.v_head_dim == 16 and a.q_len == S for a in ops), ops
    shape = attention_shape(g.attention_nodes("fwd")[0], 256)
    assert "multi-head latent attention" in resolve("ring").illegal(shape, SPMesh(2))
    p = plan(Problem.of(graph=g, seq_len=256, world_size=2, profile="cpu-gloo", sp_degrees=(2,)))
    assert {layer.choice.strategy.split(":")[0] for layer in p.layers} == {"ulysses"}, p.summary()
