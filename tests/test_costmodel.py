"""Cost model: lookups, profile loading and its errors, predictions' sense."""

import json
import os
import warnings

import pytest

from autosp.costmodel.interp import AlphaBeta, LogLogTable, monotone
from autosp.costmodel import load_profile, predict, shipped_profiles
from autosp.errors import AutospError
from autosp.graph import capture


def test_monotone_and_loglog_interpolation():
    # the lower envelope: one slow sample at a small size lifts nothing above it
    assert monotone([(4, 1.0), (2, 2.0), (8, 3.0)]) == [(2, 1.0), (4, 1.0), (8, 3.0)]
    assert monotone([(1, 5.0), (2, 1.0), (2, 0.5), (4, 2.0)]) == [(1, 0.5), (2, 0.5), (4, 2.0)]
    t = LogLogTable([(10, 1.0), (1000, 100.0)])
    assert t(100) == pytest.approx(10.0)            # straight line in log-log
    assert t(1) == pytest.approx(1.0)               # below the table: the smallest time
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert t(1000 * 100) == pytest.approx(100.0 * 100)      # slope 1 continues
        assert any("beyond the largest measured" in str(x.message) for x in w)
    # a sub-linear last segment (a fixed cost amortised) extrapolates along its chord: the next
    # units cost the marginal time, 1 s per 100, not the log-log slope's falling per-unit time
    sub = LogLogTable([(100, 2.0), (200, 3.0)])
    assert sub(400) == pytest.approx(5.0)           # log-log slope 0.585 would give 4.5
    # a super-linear one stops at linear scaling from the last point
    sup = LogLogTable([(100, 1.0), (200, 4.0)])
    assert sup(400) == pytest.approx(8.0)


def test_alpha_beta_fit_recovers_latency_and_bandwidth():
    pts = [(b, 1e-5 + b / 5e9) for b in (1e3, 1e5, 1e7, 1e9)]
    ab = AlphaBeta.fit(pts)
    assert ab.alpha == pytest.approx(1e-5, rel=1e-3) and ab.bandwidth == pytest.approx(5e9, rel=1e-6)


def test_shipped_profiles_load_and_say_where_they_come_from():
    names = shipped_profiles()
    assert {"h100-sxm", "h200-sxm", "a100-sxm"} <= set(names)
    h100 = load_profile("h100-sxm")
    assert h100.source["kind"] == "published" and any("datasheet" in c for c in h100.source["citations"])
    # what CUDA gives a process on an H100 80GB (79.10 GiB, not the datasheet's decimal 80 GB), less what
    # the CUDA context and NCCL hold outside the allocator; the measured H200's total is CUDA's own
    assert h100.memory_bytes == int(79.10 * 2 ** 30) and h100.devices_per_node == 8
    assert h100.tensor_memory_bytes == h100.memory_bytes - 4.34e9
    h200, measured = load_profile("h200-sxm"), load_profile("h200-sxm-measured")
    assert abs(h200.memory_bytes - measured.memory_bytes) < 0.001 * measured.memory_bytes
    assert load_profile("cpu-gloo").tensor_memory_bytes == load_profile("cpu-gloo").memory_bytes
    # NVLink bus bandwidth ~370 GB/s: a 1 GiB all-gather shard over 8 GPUs moves 7 GiB per rank.
    t = h100.collective_time("all_gather", 8, 2 ** 30)
    assert t == pytest.approx(7 * 2 ** 30 / 370e9, rel=0.05)
    # Across nodes the InfiniBand table (48 GB/s per GPU) is used.
    assert h100.collective_time("all_to_all", 16, 2 ** 30, inter=True) > 5 * h100.collective_time(
        "all_to_all", 8, 2 ** 30)


def test_profile_errors_name_the_file_and_key(tmp_path):
    with pytest.raises(AutospError, match="profile 'nope' not found.*h100-sxm"):
        load_profile("nope")
    bad = tmp_path / "bad.json"
    bad.write_text("{oops")
    with pytest.raises(AutospError, match=r"bad.json is not valid JSON"):
        load_profile(str(bad))
    doc = json.loads(json.dumps(load_profile("h100-sxm").data))
    del doc["collectives"]["all_to_all"]
    p = tmp_path / "partial.json"
    p.write_text(json.dumps(doc))
    prof = load_profile(str(p))
    with pytest.raises(AutospError, match=r"partial.json has no key 'collectives.all_to_all.intra'"):
        prof.collective_time("all_to_all", 8, 1e6)
    doc2 = dict(doc)
    del doc2["compute"]
    (tmp_path / "nocompute.json").write_text(json.dumps(doc2))
    with pytest.raises(AutospError, match="nocompute.json has no key 'compute.matmul'"):
        load_profile(str(tmp_path / "nocompute.json"))


@pytest.fixture(scope="module")
def llama8b():
    return capture("llama3-8b", seq_len=8192)


def test_llama3_8b_on_one_h100_has_a_realistic_mfu(llama8b):
    p = predict(llama8b, load_profile("h100-sxm"), sp=1)
    # Published practice for dense LLM training on H100: 35-55% MFU (Llama 3: 38-43%).
    assert 0.35 <= p.mfu <= 0.65, p.mfu
    assert p.exposed_comm_s == 0 and p.total_s == pytest.approx(p.compute_s)


def test_sp_predictions_make_sense(llama8b):
    prof = load_profile("h100-sxm")
    one = predict(llama8b, prof, sp=1, seq_len=32768)
    res = {st: predict(llama8b, prof, sp=8, strategy=st, seq_len=32768)
           for st in ("ulysses", "ring", "zigzag_ring", "allgather_kv", "hybrid:2x4")}
    for st, p in res.items():
        assert p.memory["activations"] < one.memory["activations"] / 4, st      # activations split 8 ways
        assert p.compute_s < one.compute_s / 4, st
    # Causal balance: zigzag ring beats contiguous ring; Ulysses has no imbalance either.
    assert res["zigzag_ring"].compute_s < res["ring"].compute_s
    assert res["ulysses"].compute_s == pytest.approx(res["zigzag_ring"].compute_s, rel=0.02)
    with pytest.raises(AutospError, match="not divisible by the SP degree 3"):
        predict(llama8b, prof, sp=3, seq_len=32768)


def test_checkpointing_modes_keep_what_they_apply(llama8b):
    from autosp.costmodel.memory import saved_per_layer

    (m,) = saved_per_layer(llama8b, 8192).values()                    # the compiled path
    (eager,) = saved_per_layer(llama8b, 8192, compiled=False).values()
    # Selective keeps every matmul and attention output of a layer, per token: q, o, down and the
    # attention output (4 x 4096), k and v (2 x 1024), gate and up (2 x 14336) in bf16, the attention's
    # fp32 log-sum-exp (32 heads); eagerly the checkpointed region's input too. Full keeps the
    # layer input only.
    hidden = 2 * 4096 * 8192
    assert m["full"] == eager["full"] == hidden
    assert m["selective"] == 2 * (4 * 4096 + 2 * 1024 + 2 * 14336) * 8192 + 4 * 32 * 8192
    assert eager["selective"] == m["selective"] + hidden
    # No checkpointing, compiled: the partitioner's min-cut keeps, per token, the two norms' outputs
    # (the projections read them for their weight gradients), q and k after the rotary embedding
    # and v, the attention output, the residual after attention, gate, up and their product, the
    # layer's output (6 x 4096 + 2 x 1024 + 3 x 14336 in bf16), the norms' fp32 statistics and the
    # log-sum-exp; it recomputes the rest (eager autograd saves 44% more).
    assert m["none"] == (2 * (6 * 4096 + 2 * 1024 + 3 * 14336) + 2 * 4 + 4 * 32) * 8192
    assert eager["none"] > 1.4 * m["none"]
    assert m["full"] < m["selective"] < m["none"]


def test_ring_costs_the_tiles_a_sliding_window_shows():
    """Ring under a causal mask (HF's, no window) vs a 4096-token window at 32k tokens, SP 2: the
    busiest rank's calls are the masked tiles each shows (bench/window.py measured the same
    counts: 392 and 80)."""
    from autosp.strategies import AttentionShape, SPMesh, resolve

    ring, mesh = resolve("ring"), SPMesh(2)
    base = dict(heads=4, kv_heads=4, head_dim=32, seq_len=32768, elem_bytes=4, masked=True)
    calls = {w: max(sum(c.count for c in r) for r in ring.cost(AttentionShape(**base, window=w), mesh).kernels)
             for w in (0, 4096)}
    # Rank 1 holds tiles 16..31 of 1024 tokens. Causal: tile a sees a+1 tiles -> sum(17..32) = 392.
    # Window 4096: d_max = ceil(4095 / 1024) = 4 -> 5 tiles each -> 80.
    assert calls == {0: 392, 4096: 80}
    # Without a mask the fused causal kernel runs whole chunks: 1 causal + 1 full call.
    unmasked = ring.cost(AttentionShape(heads=4, kv_heads=4, head_dim=32, seq_len=32768, elem_bytes=4), mesh)
    assert [sum(c.count for c in r) for r in unmasked.kernels] == [1, 2]
    # Ulysses' fused kernel computes every block under a mask: non-causal area.
    uly = resolve("ulysses").cost(AttentionShape(**base, window=4096), mesh)
    assert [c.causal for c in uly.kernels[0]] == [False]


def test_ring_costs_the_tiles_packed_documents_show():
    """The bench/packed.py mix (8 documents of 1024 tokens, then 24576) on 2 ranks, contiguous:
    rank 0's 16 tiles see 8 x 1 + (1..8) = 44, rank 1's see 9..24 = 264 per layer, the kernel
    calls bench/packed.py counted ([88, 528] over 2 layers)."""
    from autosp.strategies import AttentionShape, SPMesh, resolve

    docs = (1024,) * 8 + (24576,)
    shape = AttentionShape(heads=8, kv_heads=4, head_dim=32, seq_len=32768, elem_bytes=4, masked=True,
                           documents=docs)
    calls = [sum(c.count for c in r) for r in resolve("ring").cost(shape, SPMesh(2)).kernels]
    assert calls == [44, 264]


def test_plan_costs_packed_documents(capsys):
    from autosp.cli import main

    assert main(["plan", "--model", "tiny", "--seq-len", "4096", "--world-size", "2", "--profile", "cpu-gloo",
                 "--dtype", "float32", "--documents", "1024,1024,2048", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["predicted"]["documents"] == [1024, 1024, 2048]
    assert main(["plan", "--model", "tiny", "--seq-len", "4096", "--world-size", "2", "--profile", "cpu-gloo",
                 "--documents", "1024,1024"]) != 0
    assert "sum to the sequence length" in capsys.readouterr().err


class OneSecondCollectives:
    """A profile whose every collective takes 1 s, 1.5x slower beside compute that it slows 1.2x."""

    def collective_time(self, *args):
        return 1.0

    def concurrency(self):
        return 1.5, 1.2

    def sync_skew(self, group_size):
        return 0.0


def test_pipelined_transfers_hide_behind_the_groups_kernels():
    # One head group's transfers take a = 2 x 1 s; 4 groups; the phase's kernels 8 s; a collective
    # beside compute runs 1.5x slower and slows the compute 1.2x (the profile's concurrency).
    from autosp.costmodel.overlap import transfer_times
    from autosp.strategies.base import AttentionCost, Transfer

    piped = AttentionCost(kernels=[], transfers=[Transfer("all_to_all", 2, 1.0, "fwd", 2, pipeline=4)],
                          workspace_bytes=0)
    comm, exposed = transfer_times(OneSecondCollectives(), piped, t_fwd=8.0, t_bwd=0.0)
    # first group's inputs and last group's output: 2; 3 groups of 1.5 x 2 = 3 s beside 2 s of kernel: 3 x 1;
    # the kernels beside transfers: 0.2 x min(6, 9)
    assert comm == 8.0 and exposed == pytest.approx(2 + 3 * 1 + 0.2 * 6)
    blocking = AttentionCost(kernels=[], transfers=[Transfer("all_to_all", 2, 4.0, "fwd", 2)], workspace_bytes=0)
    assert transfer_times(OneSecondCollectives(), blocking, 8.0, 0.0) == (2.0, 2.0)       # unpipelined: all exposed

    class Skewed(OneSecondCollectives):            # the ranks meet 0.25 s late at every wait after their own compute
        def sync_skew(self, group_size):
            return 0.25

    # blocking: each collective waits for the ranks to meet; pipelined: the two waits in full only
    # (the other groups' lag hides beside the kernels with their transfers)
    assert transfer_times(Skewed(), blocking, 8.0, 0.0) == (2.5, 2.5)
    comm, exposed = transfer_times(Skewed(), piped, t_fwd=8.0, t_bwd=0.0)
    assert comm == 8.5 and exposed == pytest.approx(2 + 2 * 0.25 + 3 * 1 + 0.2 * 6)


def test_first_groups_inputs_issued_where_made_hide_behind_the_prologue(llama8b):
    # Pipelined in 2 groups, one group's q, k, v and output 1 s each; the forward makes v 3 s of
    # compute before the attention, q 0.5 s and k 0.2 s (V's projection, then RoPE on Q, then K).
    # The link moves one at a time: v done at -2 s, q at +0.5, k (queued behind q) at +1.5.
    from autosp.costmodel.overlap import first_inputs_exposed, transfer_times
    from autosp.costmodel.predict import made_before
    from autosp.graph import OpKind
    from autosp.strategies.base import AttentionCost, Transfer

    windows = {"q": 0.5, "k": 0.2, "v": 3.0}
    assert first_inputs_exposed([(windows[r], 1.0) for r in "qkv"]) == pytest.approx(1.5)
    assert first_inputs_exposed([(10.0, 1.0)] * 3) == 0.0          # all moved before the attention
    assert first_inputs_exposed([(0.0, 1.0)] * 3) == 3.0           # issued at the attention: in full
    cost = AttentionCost(kernels=[], workspace_bytes=0, transfers=[
        Transfer("all_to_all", 2, 1.0, "fwd", 1, pipeline=2, lead=lead) for lead in ("q", "k", "v", "")])
    comm, exposed = transfer_times(OneSecondCollectives(), cost, t_fwd=8.0, t_bwd=0.0, made_before=windows)
    # the output back 1 + the inputs' wait 1.5 + the second group's 1.5 x 4 s beside a 4 s kernel: 2;
    # the kernels beside transfers: 0.2 x (min(4, 6) + the 1.5 s of inputs hidden by the prologue)
    assert comm == 8.0 and exposed == pytest.approx(1 + 1.5 + 2 + 0.2 * (4 + 1.5))
    # with nothing made before the attention it costs what the attention-issued form costs
    _, at_attention = transfer_times(OneSecondCollectives(), cost, 8.0, 0.0, made_before={})
    assert at_attention == pytest.approx(4 + 2 + 0.2 * 4)

    # On a captured Llama block: V's projection runs before RoPE, which makes Q then K.
    attention = next(n for n in llama8b.nodes(phase="fwd") if n.kind == OpKind.ATTENTION)
    w = made_before(llama8b, attention, load_profile("h100-sxm"), 8192.0, 1.0, 0.0)
    assert w["v"] > w["q"] > w["k"] >= 0, w           # K made last, right before the attention


def test_exposed_attention_communication_splits_into_forward_and_backward(llama8b):
    prof = load_profile("h100-sxm")
    res = {st: predict(llama8b, prof, sp=8, strategy=st, seq_len=32768)
           for st in ("ulysses", "ulysses:c4", "zigzag_ring")}
    # blocking Ulysses moves the same all-to-alls each way: half of its exposure is the backward's
    u = res["ulysses"]
    assert u.attention_exposed_s > 0 and u.attention_exposed_bwd_s == pytest.approx(u.attention_exposed_s / 2)
    # the ring's forward hops hide behind its blocks; what stays exposed is the backward's final
    # hop of the dK/dV accumulators, which nothing follows
    r = res["zigzag_ring"]
    assert r.attention_exposed_bwd_s == pytest.approx(r.attention_exposed_s) and r.attention_exposed_s > 0
    # pipelined: the forward's first inputs hide behind the prologue, while nothing runs beside
    # the backward's last output gradient or its first group's dQ, dK, dV: the backward holds
    # more than half
    c = res["ulysses:c4"]
    assert c.attention_exposed_s / 2 < c.attention_exposed_bwd_s < c.attention_exposed_s


def test_bucketed_gradient_reduction_hides_behind_the_backward(llama8b):
    # Llama-3-8B on 8 H100s: 16 GB of bf16 gradients, 25 MiB buckets all-reduced during the backward
    # (stage 0) vs one FSDP unit's gathers and reduce-scatter around it (stage 3): exposed in full.
    # The H100 profile's concurrency (measured on an H200): a collective beside compute takes SMs
    # and HBM bandwidth, so the hidden part slows the compute beside it by s_compute - 1.
    prof = load_profile("h100-sxm")
    s_comm, s_compute = prof.concurrency()
    assert s_comm > 1 and s_compute > 1
    last_bucket = prof.collective_time("all_reduce", 8, 25 * 2**20, False)
    long = predict(llama8b, prof, sp=8, strategy="ulysses", seq_len=8192, zero_stage=0)
    assert long.gradient_comm_s < long.compute_s / 2         # the backward outlasts the reduction...
    hidden = s_comm * (long.gradient_comm_s - last_bucket)   # ...all but the last, at the slowed compute's cost
    assert hidden < long.backward_s
    assert long.exposed_comm_s - long.attention_exposed_s == pytest.approx(last_bucket + (s_compute - 1) * hidden)
    short = predict(llama8b, prof, sp=8, strategy="ulysses", seq_len=512, zero_stage=0)
    assert last_bucket < short.exposed_comm_s - short.attention_exposed_s < short.gradient_comm_s   # partly
    blocking = predict(llama8b, prof, sp=8, strategy="ulysses", seq_len=8192, zero_stage=3, overlap=False)
    assert blocking.gradient_exposed_s == pytest.approx(blocking.gradient_comm_s)
    assert blocking.exposed_comm_s - blocking.attention_exposed_s == pytest.approx(blocking.gradient_comm_s)
    sharded = predict(llama8b, prof, sp=8, strategy="ulysses", seq_len=8192, zero_stage=3)
    units = 32 + 2                                  # the blocks, the embedding, the head
    gbytes = llama8b.total_params * 2
    g = prof.collective_time("all_gather", 8, gbytes / units / 8, False)
    r = prof.collective_time("reduce_scatter", 8, gbytes / units, False)
    f = (sharded.compute_s - sharded.backward_s) / units
    b = sharded.backward_s / units
    assert g < f                                    # each gather alone is shorter than a unit's forward
    assert sharded.gradient_comm_s == pytest.approx(units * (2 * g + r))

    def hide(c, w):                                 # what stays of c beside w, and w's slowdown
        return max(0.0, s_comm * c - w) + (s_compute - 1) * min(w, s_comm * c)
    assert sharded.gradient_exposed_s == pytest.approx(units * g + g + r + (units - 1) * (hide(g, f) + hide(r, b)))


def test_ranks_sharing_a_core_finish_with_the_busier_ones_work_spread():
    # Contiguous causal blocks on 4 ranks: rank r makes 1 causal + r full calls, work 0.5/1.5/2.5/3.5
    # blocks. One rank per device: the busiest rank's 3.5. Two ranks per device: the 8 blocks over
    # 2 devices (4) — not twice the busiest (7), since a waiting rank yields its core.
    from autosp.costmodel.predict import kernel_time
    from autosp.strategies import AttentionShape, SPMesh, resolve

    class Unit:
        def attention_call_time(self, heads, q_len, kv_len, head_dim, causal, dtype, backward=False):
            return 0.5 if causal else 1.0

    shape = AttentionShape(heads=4, kv_heads=4, head_dim=32, seq_len=4096, causal=True)
    cost = resolve("allgather_kv").cost(shape, SPMesh(4, "contiguous"))
    assert kernel_time(Unit(), cost, "float32", False) == 3.5
    assert kernel_time(Unit(), cost, "float32", False, share=2.0) == 4.0
    zigzag = resolve("zigzag_ring").cost(shape, SPMesh(4, "zigzag"))     # balanced: 2 ranks per core, 2x
    assert kernel_time(Unit(), zigzag, "float32", False, share=2.0) == 2 * kernel_time(Unit(), zigzag, "float32", False)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "balanced"])
def test_allgather_kv_own_share_counts_the_busiest_ranks_own_blocks(layout):
    # by definition: of the busiest rank's (query chunk, key chunk) blocks, the share on its own
    # key chunks; a causal diagonal block is half a block
    from autosp.strategies.allgather_kv import own_share
    from autosp.strategies.base import AttentionShape, SPMesh
    from autosp.strategies.layout import n_chunks, rank_chunks

    for p in (2, 3, 4, 8):
        for causal in (True, False):
            shape = AttentionShape(heads=8, kv_heads=4, head_dim=32, batch=1, seq_len=4096 * p, elem_bytes=2,
                                   causal=causal)

            def blocks(mine, keys):
                return sum(0.5 if causal and a == b else 1.0 for a in mine for b in keys if not causal or b <= a)
            work = [(blocks(rank_chunks(layout, r, p), range(n_chunks(layout, p))),
                     blocks(rank_chunks(layout, r, p), rank_chunks(layout, r, p))) for r in range(p)]
            total, own = max(work)
            assert own_share(shape, SPMesh(p, layout, 8)) == pytest.approx(own / total), (p, causal)


def test_inductor_never_writes_a_bf16_norms_fp32_transients(llama8b):
    """Llama-3-8B in bf16: RMSNorm upcasts the hidden state to fp32 (two hidden states' bytes) and
    its backward makes more fp32 tensors of that size. Inductor fuses those chains: they leave the
    schedule's memory (fused_away) and the backward's transient falls. What a matmul reads stays,
    and so does what the other phase reads (the saved upcast); an fp32 model has nothing wider to drop."""
    from autosp.costmodel.fusion import fused_away
    from autosp.costmodel.memory import hidden_bytes, liveness_peak
    from autosp.graph import OpKind

    tokens = 4096
    h = hidden_bytes(llama8b, tokens)
    gone = fused_away(llama8b)
    wide = [n for n in gone if llama8b.op(n).layer == 1 and llama8b.op(n).shapes[0][-1] == 4096]
    # per norm: the square and the scaled tensor in the forward, seven in the backward
    assert sorted(llama8b.op(n).phase for n in wide) == ["bwd"] * 14 + ["fwd"] * 4, wide
    for n in gone:
        assert llama8b.op(n).dtypes[0] == "float32"
        assert all(llama8b.op(u).kind not in (OpKind.MATMUL, OpKind.ATTENTION, OpKind.LOSS)
                   and llama8b.op(u).phase == llama8b.op(n).phase for u in llama8b.graph.successors(n)), n
    eager, fused = {}, {}
    liveness_peak(llama8b, tokens, eager)
    liveness_peak(llama8b, tokens, fused, fused=True)
    # at the peak of the layer's backward (the norms' backward): an fp32 hidden state fewer at least
    assert fused["layers"][1]["rest"] <= eager["layers"][1]["rest"] - 2 * h
    assert fused["loss"] == eager["loss"]        # the fp32 logits: the loss reads them, never fused
    assert fused_away(capture("tiny", seq_len=256, dtype="float32")) == frozenset()


def test_ulysses_costs_multi_head_latent_attention_at_the_values_head_dim():
    # DeepSeek-V3: q/k head dim 192, v 128. V and the output move (and are saved) at 128, and the
    # kernel's FLOPs are q k^T at 192 plus p v at 128: a head dim of 160 on average
    from autosp.strategies import SPMesh, resolve
    from autosp.strategies.base import AttentionShape

    mla = AttentionShape(heads=128, kv_heads=128, head_dim=192, v_head_dim=128, batch=1, seq_len=131072)
    padded = AttentionShape(heads=128, kv_heads=128, head_dim=192, batch=1, seq_len=131072)
    costs = [resolve("ulysses").cost(s, SPMesh(8)) for s in (mla, padded)]
    moved = [sum(t.nbytes * t.count for t in c.transfers) for c in costs]
    assert moved[0] / moved[1] == pytest.approx((192 + 128) / (2 * 192)), moved
    assert [c.kernels[0][0].head_dim for c in costs] == [160, 192]
    assert costs[0].saved_bytes == pytest.approx(costs[1].saved_bytes * 128 / 192)


def test_sizes_a_chunked_scan_pads_to_evaluate_at_any_length():
    # Mamba-2's scan pads the length to a multiple of its chunk: torch's FloorDiv and Mod in the
    # size, which evaluate on integers only; the planner asks at per-rank lengths that are not whole
    from torch.utils._sympy.functions import FloorDiv, Mod

    from autosp.graph.opgraph import S, evaluate

    padded = S + Mod(256 - Mod(S, 256), 256)
    size = 512 * FloorDiv(padded, 256)
    assert evaluate(size, 65536) == 512 * 256
    assert evaluate(size, 62686.94) == 512 * 245      # 62687 tokens pad to 245 chunks of 256
    assert evaluate(2 * S, 62686.5) == 125373.0       # a plain size stays exact


def test_a_hybrids_sequence_mixer_is_costed_on_the_whole_sequence():
    # Bamba: a Mamba-2 layer, then attention. Under SP the Mamba-2 module runs gathered (whole
    # sequence on every rank), so its ops are costed at S, not S / P, and its input's gather and
    # gradient sum are exposed communication; the attention layer stays sharded
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from dist_models import build

    from autosp.costmodel.mixers import at_sp_degree
    from autosp.graph.opgraph import evaluate

    g = capture(build("bamba"), seq_len=256, dtype="float32")
    assert g.mixers == [(0, "mamba")], g.mixers
    gathered = [a for a in g.nodes() if a.gathered]
    assert gathered and {a.layer for a in gathered} == {0} and all(a.region == "mamba" for a in gathered)
    assert not any(a.gathered for a in g.nodes(layer=1))          # the attention layer
    at2 = at_sp_degree(g, 2)
    flops = lambda graph, tokens: sum(evaluate(a.flops, tokens) for a in graph.nodes() if a.gathered)  # noqa: E731
    assert flops(at2, 2048) == flops(g, 4096) > 0                 # a rank's 2048 tokens: the mixer at 4096
    prof = load_profile("cpu-gloo")
    one, two = (predict(g, prof, sp=sp, strategy="ulysses", seq_len=4096) for sp in (1, 2))
    assert one.mixer_comm_s == 0.0 < two.mixer_comm_s and two.exposed_comm_s >= two.mixer_comm_s
    assert two.model_flops == one.model_flops / 2                 # MFU counts the model's flops, not the repeats
