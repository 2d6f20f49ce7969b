"""Exact SP numerics on 2 gloo processes against a single-device run."""

import pytest
import torch

from dist_harness import Pool

LOSS_TOL, GRAD_TOL = 1e-5, 1e-4


@pytest.fixture(scope="module")
def pool():
    p = Pool(2)
    yield p
    p.close()


def run_ok(pool, case, **kw):
    results = pool.run(case, **kw)
    for status, value in results:
        assert status == "ok", value
    return [v for _, v in results]


def expected_collectives(strategy: str, world: int, ops: int = 2) -> dict[str, int]:
    """What one training step (forward + backward) must issue per strategy, besides the all-reduces
    of the loss and the gradients, for ``ops`` attention runs on ``world`` ranks."""
    if strategy == "ulysses":
        return {"all_to_all": 8 * ops}                  # q, k, v in and the output back; their grads
    if strategy.startswith("ulysses:c"):                # the same per head group
        return {"all_to_all": 8 * int(strategy[9:]) * ops}
    if strategy in ("ring", "zigzag_ring"):             # P-1 K/V hops forward, P-1 backward, P dK/dV hops
        return {"send_recv": (3 * world - 2) * ops}
    if strategy.startswith("allgather_kv"):            # K, V gathered; dK, dV reduce-scattered
        return {"all_gather": 2 * ops, "reduce_scatter": 2 * ops}
    u, r = (int(x) for x in strategy.split(":")[1].split("x"))     # hybrid:UxR
    return {"all_to_all": 8 * ops, "send_recv": (3 * r - 2) * ops}


def check_ran(r, strategy: str, world: int, ops: int = 2, runs: int | None = None,
              also: dict[str, int] | None = None) -> None:
    """The report pins what ran: the strategy per op, the tokens each rank held, the collectives
    (``runs``: attention calls per step when a graph serves several layers; ``also``: collectives
    besides attention's, e.g. the gather of a sharded graph's output before a graph break)."""
    rep = r["report"]
    assert [a["strategy"] for a in rep["attention"]] == [strategy] * ops, rep
    assert all(a["tokens_per_rank"] * world == rep["padded_len"] for a in rep["attention"]), rep
    issued = {k: v["calls"] for k, v in rep["collectives"].items() if k != "all_reduce"}
    expected = expected_collectives(strategy, world, runs or ops)
    for kind, calls in (also or {}).items():
        expected[kind] = expected.get(kind, 0) + calls
    assert issued == expected, (strategy, issued)


def check_exact(res, strategies=None):
    """Exact against one process; ``strategies``: the spec that must have run on each attention op."""
    for r in res:
        assert r["attention_ops"] > 0
        assert not r["replicated_work"], r["replicated_work"]    # every matmul ran on this rank's tokens
        if strategies is not None:
            assert r["strategies"] == strategies, r["strategies"]
        assert r["loss_err"] <= LOSS_TOL, r
        assert r["grad_err"] <= GRAD_TOL, r
        assert r["param_err"] <= GRAD_TOL, r          # still equal after 3 AdamW steps


@pytest.mark.parametrize("kind,cfg", [("llama", dict(heads=4, kv=2)), ("gpt2", dict(heads=4)),
                                      ])                  # the reference model: the compiled-path tests
def test_ulysses_matches_single_device(pool, kind, cfg):
    # Forced: what "auto" plans depends on the cost model (test_auto_plan_is_exact_and_cached).
    from conftest import SUITE_COMPILER

    res = run_ok(pool, "train_compare", kind=kind, strategy="ulysses", **cfg)
    check_exact(res, ["ulysses"] * 2)
    # the suite runs the compiled path: a test naming no compiler gets AOTAutograd, not eager graphs
    assert SUITE_COMPILER != "eager" and all(r["report"]["compiler"] == SUITE_COMPILER for r in res), res[0]["report"]
    if kind != "gpt2":          # GPT-2's loss follows a graph break: its logits are all-gathered too
        check_ran(res[0], "ulysses", world=2)


@pytest.mark.parametrize("strategy", ["ulysses"])
def test_gptj_whose_rotary_tables_repeat_features_not_tokens_is_exact(pool, strategy):
    # GPT-J builds its sin/cos tables with repeat_interleave over the feature dim (each frequency
    # twice): every token's features stay together, so the tables slice by token like any tensor
    # (they were refused as token-repeated).
    res = run_ok(pool, "train_compare", kind="gptj", strategy=strategy, heads=4)
    check_exact(res, [strategy] * 2)
    check_ran(res[0], strategy, world=2)


@pytest.mark.parametrize("strategy", ["ulysses", "ring"])
def test_falcon_multi_query_with_alibi_in_a_dense_mask_is_exact(pool, strategy):
    # The mask is materialized, so SDPA's grouped-query path is off and transformers (5.25 on)
    # repeats the one K/V head over the query heads before SDPA: the sharded mask must follow.
    res = run_ok(pool, "train_compare", kind="falcon_alibi", strategy=strategy)
    check_exact(res, [strategy] * 2)
    check_ran(res[0], strategy, world=2)
    from dist_cases import falcon_sdpa_kv_heads

    assert [a["kv_heads"] for a in res[0]["report"]["attention"]] == [falcon_sdpa_kv_heads(4)] * 2, res[0]["report"]


@pytest.mark.parametrize("strategy,compiler,cfg", [
    ("ulysses:c2", "eager", dict(heads=4, kv=2)),       # KV heads repeated so that each group has its own
    ("ulysses:c4", "eager", dict(heads=8, kv=8)),
    ("ulysses:c2", "aot_eager", dict(heads=8, kv=4))])
def test_ulysses_in_pipelined_head_groups_is_exact(pool, strategy, compiler, cfg):
    # Each head group's all-to-alls are issued before the previous group's attention and waited
    # for after it (forward and backward): the same kernel calls, the bytes moved in K pieces.
    res = run_ok(pool, "train_compare", kind="llama", strategy=strategy, compiler=compiler, steps=2, **cfg)
    check_exact(res, [strategy] * 2)
    check_ran(res[0], strategy, world=2)
    k = int(strategy[9:])
    assert [a["overlap"] for a in res[0]["report"]["attention"]] == [f"{k} head groups pipelined"] * 2


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
def test_the_first_head_groups_exchanges_start_where_q_k_v_are_made_and_the_backward_pipelines(pool, compiler):
    # HF Llama makes V (its projection) before Q and K (after RoPE): V's exchange of the first head
    # group is issued first, Q's and K's as RoPE makes each; inside the attention they would all
    # start together, in the order q, k, v.
    res = run_ok(pool, "ulysses_schedule", kind="llama", strategy="ulysses:c2", compiler=compiler, steps=1,
                 heads=4, kv=2)
    check_first_step_exact(res, ["ulysses:c2"] * 2)
    for r in res:
        tl = r["timeline"]
        # per layer and phase: 2 groups x (q, k, v in + the output back) = 8 exchanges, 2 layers
        assert len(tl) == 2 * 2 * 8, tl
        for layer in range(2):
            q, k, v = tl[8 * layer: 8 * layer + 3]          # the first group's, waited in that order
            assert v[0] < q[0] < k[0] <= q[1], (layer, q, k, v)
            # the second group's start at the attention, after the first group's all started
            assert all(later[0] >= k[0] for later in tl[8 * layer + 3: 8 * layer + 6]), tl[8 * layer: 8 * layer + 8]
        # The backward, per layer: the last group's output gradient is issued and waited for alone;
        # only then is the first group's issued, and it moves during the last group's attention
        # backward, which ends by issuing that group's dQ, dK, dV (waited for later)
        for layer in range(2):
            back = tl[16 + 8 * layer: 24 + 8 * layer]
            last_out, first_out, last_qkv = back[0], back[1], back[2:5]
            assert last_out[1] <= first_out[0], back
            assert all(first_out[0] < issued <= first_out[1] for issued, _ in last_qkv), back


def test_overlap_false_runs_the_plain_form(pool):
    res = run_ok(pool, "train_compare", kind="llama", strategy="ulysses:c2", overlap=False, steps=1, heads=4, kv=2)
    check_first_step_exact(res, ["ulysses"] * 2)
    check_ran(res[0], "ulysses", world=2)


def check_loss_tokens(res, world: int = 2) -> None:
    """Each rank's loss counted, as its graph ran, the labelled tokens of its contiguous share of
    the padded sequence, the labels shifted by one as a causal LM's loss shifts them."""
    labels, padded = res[0]["labels"], res[0]["report"]["padded_len"]
    shifted = torch.full((labels.shape[0], padded), -100)
    shifted[:, :labels.shape[1] - 1] = labels[:, 1:]
    per = padded // world
    held = [int((shifted[:, r * per:(r + 1) * per] != -100).sum()) for r in range(world)]
    assert [r["report"]["loss_tokens"] for r in res] == held, held


def test_uneven_ignored_labels_and_odd_length(pool):
    # 33 tokens on 2 ranks: padded to 34; most ignored labels sit on rank 0's half.
    res = run_ok(pool, "train_compare", kind="llama", strategy="ulysses", seq_len=33, uneven=True)
    check_exact(res, ["ulysses"] * 2)
    check_loss_tokens(res)
    assert res[0]["report"]["loss_tokens"] < res[1]["report"]["loss_tokens"]


@pytest.mark.parametrize("kind,strategy,layout,compiler", [
    ("handwritten_learned", "ulysses", None, None), ("handwritten_learned", "allgather_kv", None, None),
    ("handwritten_learned", "ring", None, None),
    ("gemma2", "ulysses", None, "inductor"), ("gemma2", "ring", None, None),
    ("bloom", "allgather_kv", None, None), ("bloom", "zigzag_ring", "zigzag", None)])
def test_attention_written_by_hand_matches_single_device(pool, kind, strategy, layout, compiler):
    # nanoGPT's masked_fill causal mask plus a learned bias per head and key position,
    # Gemma-2's soft-capped scores with a sliding-window layer, BLOOM's ALiBi added by baddbmm on
    # [batch*heads, S, d]: each region runs as written, on this rank's heads (Ulysses), on its
    # query rows against gathered keys (all-gather-KV), or block by block around the ring, its
    # softmax merged by log-sum-exp
    res = run_ok(pool, "train_compare", kind=kind, strategy=strategy, layout=layout, steps=2, compiler=compiler)
    check_exact(res, [strategy] * 2)
    check_ran(res[0], strategy, world=2)
    from conftest import SUITE_COMPILER

    assert res[0]["report"]["compiler"] == (compiler or SUITE_COMPILER), res[0]["report"]
    if kind == "handwritten_learned":     # the bias's gradient: the rows or heads of every rank, summed
        bias = {k: v for k, v in res[0]["grad_by_name"].items() if k.endswith("head_bias")}
        assert len(bias) == 2 and max(bias.values()) <= GRAD_TOL, bias


# (all-gather-KV runs the region as written, as Ulysses does, on this rank's rows: a learned extra
# under it is the bias case of test_attention_written_by_hand_matches_single_device)
# (zigzag ring, which merges the sink into each row's log-sum-exp: on 4 ranks)
# (through Inductor it passes too: measured for the note, out of the suite for its time)
@pytest.mark.parametrize("strategy,compiler", [("auto", None)])
def test_attention_sinks_are_exact(pool, strategy, compiler):
    # gpt-oss: a learned logit per head joins each row's softmax and is dropped after it; a
    # sliding-window layer, then a full one; mixtures of experts. "auto": the first call's planner
    # plans it (no fallback).
    res = run_ok(pool, "train_compare", kind="gpt_oss", strategy=strategy, compiler=compiler)
    ran = res[0]["strategies"]
    if strategy == "auto":
        assert res[0]["plan_layers"] is not None, "planned, not the fallback"
    else:
        assert ran == [strategy] * 2, ran
    check_exact(res, ran)
    for r in res:
        sinks = {k: v for k, v in r["grad_by_name"].items() if k.endswith("sinks")}
        assert len(sinks) == 2 and max(sinks.values()) <= GRAD_TOL, sinks


def test_attention_written_by_hand_is_planned_by_the_default_call(pool):
    # autosp.compile(model) on Llama with attn_implementation="eager": the planner captures the
    # region as one attention op and plans it; the strategy it chose is the one that ran
    res = run_ok(pool, "train_compare", kind="llama", attn="eager", steps=2)
    planned = [layer.choice.strategy for layer in res[0]["plan_layers"]]
    assert planned and set(planned) <= {"ulysses", "allgather_kv", "ring", "zigzag_ring"}, planned
    check_exact(res, planned * 2 if len(planned) == 1 else planned)


def test_attention_written_by_hand_memory_is_predicted(pool):
    """The region's S x S scores are in the planner's memory model, per rank as the strategy holds
    them, and the step peak it predicts is the probe's (through AOTAutograd, 512 tokens); and a
    hybrid's gathered mixer's."""
    m = run_ok(pool, "written_attention_memory", cases=(("gemma2", "ring"), ("bloom", "ulysses"), ("bamba", "ulysses")))[0]
    assert set(m) == {"gemma2/ring", "bloom/ulysses", "bamba/ulysses"}, m
    # Bamba's Mamba-2 layer runs gathered: its activations are the whole sequence's on each rank,
    # as the cost model sizes them (costmodel/mixers.py; sized as if sharded it predicted half)
    hybrid = m.pop("bamba/ulysses")
    assert hybrid["strategies"] == ["ulysses"] and 0.9 <= hybrid["predicted"] / hybrid["peak"] <= 1.1, hybrid
    for case, v in m.items():
        kind, strategy = case.split("/")
        assert v["written"] and v["strategies"] == [strategy] * 2, (case, v)
        # the scores the region keeps for its backward: the probabilities (fp32), and for Gemma-2
        # the soft-capped scores too; under Ulysses B*H*S*S/2 entries a rank (one layer of each
        # layer class, 4 heads), under ring none: its blocks are recomputed in the backward
        assert v["score_saved"] == (8.0 if kind == "gemma2" else 4.0), (case, v)
        if strategy == "ulysses":
            assert v["attention_saved"] >= v["score_saved"] * 4 * 512 * 512 / 2, (case, v)
        else:
            assert v["attention_saved"] < 512 * 512, (case, v)
        # masks every rank makes whole are sized at the whole length; dropout at p=0 copies nothing;
        # ring's blocks: the region's tensors and the blockwise backward's own
        low, high = (0.9, 1.1) if strategy == "ulysses" else (0.85, 1.15)
        assert low <= v["predicted"] / v["peak"] <= high, (case, v)


def test_attention_written_by_hand_is_refused_where_unsafe(pool):
    # the hybrid runs ring inside Ulysses groups over SDPA only
    msg = run_ok(pool, "expect_error", kind="handwritten", strategy="hybrid:2x1")[0]
    assert "attention 0 at" in msg and "is attention written by hand, which hybrid:2x1 cannot run" in msg, msg
    assert "use allgather_kv or ring or ulysses" in msg, msg
    # scores cut by position inside the region: a key block would see the wrong positions
    msg = run_ok(pool, "expect_error", kind="handwritten_tril", strategy="ring")[0]
    assert "reads token positions inside it (tril at" in msg and "use 'ulysses'" in msg, msg
    assert "allgather_kv" not in msg, msg
    # a score function that mixes heads: no strategy splits it safely; the op and line are named
    msg = run_ok(pool, "expect_error", kind="handwritten_mixing", strategy="ulysses")[0]
    assert "written by hand" in msg and "(mean at" in msg and "dist_models.py" in msg, msg
    # scores by einsum: no region is found, and the first call says what it saw and the fix
    msg = run_ok(pool, "expect_error", kind="handwritten_einsum", strategy="ulysses")[0]
    assert "no attention autosp can shard" in msg and "softmax (" in msg and "dist_models.py" in msg, msg
    assert "scaled_dot_product_attention" in msg, msg


# (kind, strategy, the mixer layers and their type, the op that made each a mixer)
HYBRIDS = [("qwen3_next", "ulysses", ["model.layers.0.linear_attn"], "Qwen3NextGatedDeltaNet", "conv1d"),
           ("bamba", "ring", ["model.layers.0.mamba"], "BambaMixer", "conv1d"),
           # (MiniMax's lightning attention, run gathered under zigzag ring: exact, measured for the note)
           ("conv_mixer", "ulysses", ["layers.0.mixer", "layers.1.mixer"], "_CausalConv", "pad")]


@pytest.mark.parametrize("kind,strategy,layers,mixer,trigger", HYBRIDS, ids=[h[0] for h in HYBRIDS])
def test_linear_attention_and_state_space_hybrids_run_their_mixers_gathered_and_are_exact(
        pool, kind, strategy, layers, mixer, trigger):
    # Qwen3-Next's gated DeltaNet, Bamba's Mamba-2, MiniMax's lightning attention, a hand-written
    # causal conv: each once refused (or, for the conv, silently wrong at each shard's start). The
    # mixer's module runs on the whole sequence (its input all-gathered where it enters, its input's
    # gradient summed over the ranks), the attention layers keep their strategy; exact against one
    # process, and the report says which layer ran how.
    res = run_ok(pool, "train_compare", kind=kind, strategy=strategy, steps=2)
    attention_layers = 2 if kind == "conv_mixer" else 1
    check_exact(res, [strategy] * attention_layers)
    ran = res[0]["report"]["mixers"]
    assert [m["layer"] for m in ran] == layers and {m["type"] for m in ran} == {mixer}, ran
    assert all(m["kind"] == "gathered" and m["trigger"].startswith(trigger) for m in ran), ran
    # one all-gather per mixer per step, besides what the strategy issues (on the zigzag layout the
    # gathered tokens are put back in token order before the mixer reads them)
    check_ran(res[0], strategy, world=2, ops=attention_layers, also={"all_gather": len(layers)})


def test_token_mixing_autosp_cannot_run_is_refused_naming_the_layer(pool):
    # a running mean in the block's own forward: no submodule to run gathered; refused naming the
    # layer, the op and the model's line, never labels advice
    msg = run_ok(pool, "expect_error", kind="running_mean", strategy="ulysses")[0]
    assert msg.startswith("layer layers.0 (_RunningMeanBlock) mixes tokens in a way autosp cannot shard: it "
                          "runs a cumulative op along the sequence"), msg
    assert "dist_models.py" in msg and "submodule" in msg and "labels" not in msg, msg
    # (Mamba-2 alone, nothing left for SP to split once its mixers run gathered, is refused too:
    # "Mamba2ForCausalLM has no attention to shard: ...", measured for the note: its compile costs 25 s)


def test_ranks_of_an_sp_group_passing_different_batches_are_refused(pool):
    res = run_ok(pool, "batches_differ_across_ranks")
    for r in res:       # every rank raises (none waits in a collective), and the next batch trains
        assert "passed different batches (rank 0: 2 x 32, rank 1: 2 x 40 tokens)" in r["error"], r
        assert "split the loader over the data-parallel dimension only" in r["error"], r
        assert r["first"] > 0 and r["after"] > 0, r
        assert "passed different batches (rank 0: 2 x 32, rank 1: 2 x 40 tokens)" in r["planned_error"], r


def test_registered_torch_compile_backend(pool):
    for r in run_ok(pool, "backend_compare"):
        assert r["loss_err"] <= LOSS_TOL and r["grad_err"] <= GRAD_TOL, r


def test_logits_local_next_to_a_loss_full_otherwise(pool):
    for r in run_ok(pool, "logits_shapes"):
        assert r["with_labels_len"] == r["local_len"] and r["with_labels_err"] < 1e-5, r
        assert r["no_labels_len"] == 33 and r["no_labels_err"] < 1e-5, r
        assert r["gathered_len"] == 33 and r["gathered_err"] < 1e-5, r


# (the reference model under ring and all-gather-KV: the compiled-path and graph-break tests)
@pytest.mark.parametrize("strategy,kind", [("ring", "llama"), ("zigzag_ring", "llama"), ("allgather_kv", "llama"),
                                           ("zigzag_ring", "reference")])
def test_other_strategies_match_single_device(pool, strategy, kind):
    res = run_ok(pool, "train_compare", kind=kind, strategy=strategy, heads=4, kv=2)
    check_exact(res, [strategy] * 2)
    for r in res:
        check_ran(r, strategy, world=r["report"]["sp_degree"])


@pytest.mark.parametrize("layout,compiler,steps", [("zigzag", "eager", 3), ("contiguous", "aot_eager", 1)])
def test_allgather_kv_overlapped_moves_kv_beside_the_own_block(pool, layout, compiler, steps):
    res = run_ok(pool, "allgather_kv_schedule", kind="llama", heads=4, kv=2, layout=layout, compiler=compiler,
                 steps=steps)
    if steps == 1:
        check_first_step_exact(res, ["allgather_kv:overlap"] * 2)
    else:
        check_exact(res, ["allgather_kv:overlap"] * 2)
    for r in res:
        check_ran(r, "allgather_kv:overlap", world=2)
        assert all(a["overlap"].startswith("K/V gather") for a in r["report"]["attention"])
        # one op on 2 ranks, forward: both gathers start, the own block attends while they move, then
        # the other rank's; backward: the other rank's block first, its dK/dV reduce while the own
        # block's backward runs
        fwd = ["gather starts", "gather starts", "fwd own", "wait all_gather", "fwd other"]
        bwd = ["bwd other", "reduce-scatter starts", "reduce-scatter starts", "bwd own", "wait reduce_scatter"]
        step = fwd * 2 + bwd * 2
        assert r["events"] == step * steps, r["events"]
        # the timeline has each wait (2 layers, forward and backward), issued before the own
        # block's attention and waited for after it
        assert len(r["timeline"]) == 4 * steps and all(before > 0 for before, _ in r["timeline"]), r["timeline"]


MASKED = {"window": dict(kind="mistral", sliding_window=8),      # HF builds a sliding-window mask
          "padded": dict(kind="llama", inputs="padded"),          # left- and right-padded rows
          "packed": dict(kind="llama", inputs="packed")}          # documents of 10, 3 and 19 tokens


def check_first_step_exact(res, strategies):
    """One step, fp32: the first gradients, before AdamW turns rounding into parameter noise."""
    for r in res:
        assert not r["replicated_work"], r["replicated_work"]
        assert r["strategies"] == strategies, r["strategies"]
        assert r["loss_err"] <= 1e-6 and r["grad_err"] <= 1e-5, r


# zigzag_ring under every mask (its blocks differ per mask); ring and all-gather-KV share the
# contiguous layout's blocks, so each takes a different mask or two.
@pytest.mark.parametrize("strategy,inputs", [("zigzag_ring", m) for m in MASKED if m != "padded"] +
                         [("ring", "padded"), ("allgather_kv", "packed")])
def test_blockwise_strategies_take_masks_and_skip_hidden_blocks(pool, strategy, inputs):
    res = run_ok(pool, "train_compare", strategy=strategy, steps=1, **MASKED[inputs])
    check_first_step_exact(res, [strategy] * 2)
    # Pairs (computed, hidden) per layer on rank 0 of 2, 32 tokens. Contiguous: chunk 0 sees only
    # itself (chunk 1 is its future). Zigzag, chunks 0 and 3 of 8 tokens: chunk 0 sees itself,
    # chunk 3 sees all 4 under padding, only chunks 2-3 through the window of 8, and chunks 1-3
    # as the third document (tokens 13-31).
    expected = {"zigzag_ring": {"window": (3, 5), "padded": (5, 3), "packed": (4, 4)}}.get(
        strategy, {k: (1, 1) for k in MASKED})[inputs]
    assert (res[0]["blocks"]["computed"], res[0]["blocks"]["skipped"]) == tuple(2 * x for x in expected)
    check_ran(res[0], strategy, world=2)


def test_a_bidirectional_encoder_with_padding_is_exact_under_each_strategy(pool):
    """BERT for masked LM (no causal mask, a padded second sequence, absolute positions), an AdamW
    step through AOTAutograd: loss, gradients and parameters equal one process's under Ulysses
    and ring. The ring skips no block (no key is in a query's future): each rank
    computes its own and the other's tokens, per layer."""
    res = run_ok(pool, "encoder_compare")
    for r in res:
        for strategy, row in r.items():
            assert row["strategies"] == [strategy] * 2, row["strategies"]
            assert row["loss_err"] <= LOSS_TOL and row["grad_err"] <= GRAD_TOL and row["param_err"] <= GRAD_TOL, row
            assert all(a["tokens_per_rank"] == 32 for a in row["report"]["attention"])
        calls = {s: {k: v["calls"] for k, v in row["report"]["collectives"].items()} for s, row in r.items()}
        assert calls["ulysses"]["all_to_all"] > 0 and calls["ring"]["send_recv"] > 0, calls
        # 2 blocks (its tokens' and the other rank's) x 2 layers; causal, rank 0 would skip half
        assert r["ring"]["blocks"] == {"computed": 4, "skipped": 0}, r["ring"]["blocks"]


@pytest.mark.parametrize("kind,strategy", [("mixtral", "ulysses"), ("qwen2_moe", "ring")])
def test_moe_with_grouped_experts_and_router_loss_is_exact(pool, kind, strategy):
    # Default (grouped) experts: each rank routes its own tokens; the load-balancing loss sees
    # every token (per layer a histogram and a sum over tokens, all-reduced: 4 for 2 layers).
    res = run_ok(pool, "train_compare", kind=kind, strategy=strategy, steps=1)
    check_first_step_exact(res, [strategy] * 2)
    for r in res:
        assert r["graphs"] == 1 and r["token_statistics"] == 4, r["graph_reports"]
    check_ran(res[0], strategy, world=2)


def balanced_work(lengths: tuple[int, ...], padded: int, chunks: list[int], world: int) -> int:
    """(query, key) pairs a rank holding ``chunks`` attends over a packed row of documents ``lengths``
    (padding continues the last document), for the 2 rows and 2 layers of the test model."""
    pos = torch.cat([torch.arange(n) for n in lengths] + [torch.arange(padded - sum(lengths)) + lengths[-1]])
    per = padded // (4 * world)
    return 2 * 2 * sum(int(pos[c * per:(c + 1) * per].sum()) + per for c in chunks)


def check_balanced_stream(res, world, strategy, stream=None):
    """Every step exact; each rank held this step's dealt chunks and its kernels attended exactly the
    work those chunks carry (so the compiled graph read each step's deal as it ran); work within 10%
    of the mean where the contiguous layout is up to 1.9x; the deal changed while nothing recompiled."""
    from dist_cases import PACKED_STREAM

    stream = stream or PACKED_STREAM
    steps = [r["steps"] for r in res]
    assert all(r["graphs"] == 1 for r in res), [r["graphs"] for r in res]
    for i, lengths in enumerate(stream):
        here = [rank_steps[i] for rank_steps in steps]
        assert all(s["loss_err"] <= LOSS_TOL and s["grad_err"] <= GRAD_TOL for s in here), here
        assert all(set(s["strategies"]) == {strategy} for s in here)
        padded = here[0]["padded_len"]
        assert padded == -(-sum(lengths) // (4 * world)) * 4 * world
        assert sorted(c for s in here for c in s["chunks"]) == list(range(4 * world))
        attended = [s["attended"] for s in here]
        if strategy != "hybrid:2x2":        # hybrid: a ring rank attends for its Ulysses group's chunks
            assert attended == [balanced_work(lengths, padded, s["chunks"], world) for s in here], (i, attended)
        assert max(attended) / (sum(attended) / world) <= 1.1, (i, attended)
    contiguous = [balanced_work(PACKED_STREAM[0], 64, [r], 1) for r in range(4)]   # 4 rank-sized chunks
    assert max(contiguous) / (sum(contiguous) / 4) > 1.5
    assert len({tuple(s["chunks"]) for s in steps[0]}) >= 3         # dealt anew from each step's documents


def test_the_balanced_layout_deals_each_batch_inside_an_inductor_graph(pool):
    """Packed batches whose documents change every step (one padded, one of short documents only),
    ring attention on the balanced layout, compiled by Inductor once."""
    res = run_ok(pool, "balanced_stream", strategy="ring", compiler="inductor")
    assert {s["compiler"] for s in res[0]["steps"]} == {"inductor"}
    check_balanced_stream(res, 2, "ring")


def test_cu_seqlens_become_restarting_positions_and_reach_the_planner(pool):
    # The SP model gets flash-attention-style cumulative lengths, the reference the same documents
    # as position ids; auto planning (the default) costs the documents it finds in the batch.
    res = run_ok(pool, "train_compare", kind="llama", inputs="cu_seqlens", steps=1)
    check_first_step_exact(res, res[0]["strategies"])
    assert res[0]["plan_documents"] == [10, 3, 19], res[0]["plan_documents"]


def test_a_module_declared_token_local_may_sort_its_tokens_but_not_leak_per_rank_values(pool):
    res = run_ok(pool, "train_compare", kind="token_local", strategy="ulysses", steps=1)
    check_first_step_exact(res, ["ulysses"])
    msg = run_ok(pool, "expect_error", kind="token_local_leak", strategy="ulysses")[0]
    assert "token-local module mlp" in msg and "used outside it" in msg, msg


def test_a_memory_limit_makes_the_planner_checkpoint_and_the_transform_apply_it(pool):
    res = run_ok(pool, "memory_budget_compare")
    r = res[0]
    assert r["peaks"]["full"] < r["limit"] < r["peaks"]["none"]
    chosen = [(layer.choice.checkpoint, layer.choice.mlp_chunks) for layer in r["plan_layers"]]
    assert chosen and all(c != ("none", 1) for c in chosen), chosen     # what the planner chose...
    ran = {(a["checkpoint"], a["mlp_chunks"]) for a in r["report"]["attention"]}
    assert ran == set(chosen), (ran, chosen)                              # ...is what ran
    check_first_step_exact(res, r["strategies"])


@pytest.mark.parametrize("strategy", ["ulysses"])          # ring with a tiled loss: the checkpointing tests
def test_tiled_head_and_loss_is_exact(pool, strategy):
    res = run_ok(pool, "train_compare", kind="llama", strategy=strategy, loss_chunks=4, steps=1)
    check_first_step_exact(res, [strategy] * 2)
    assert all(r["tiled_losses"] == 1 for r in res)
    check_ran(res[0], strategy, world=2)
    check_loss_tokens(res)          # counted by the tiled loss's chunks


def test_tiled_head_and_loss_never_holds_the_whole_shards_logits(pool):
    r = run_ok(pool, "loss_tiling_memory")[0]
    assert r[1]["tiled"] == 0 and r[8]["tiled"] == 1
    assert r[1]["loss_err"] < 1e-6 and r[8]["loss_err"] < 1e-6, r
    # 512 local tokens x 8192 vocabulary: 16 MiB of fp32 logits, with their gradient and the
    # softmax more than that; in 8 chunks an eighth of it is alive at a time.
    assert r[1]["peak"] - r[8]["peak"] > 16 * 2**20, r


@pytest.mark.parametrize("strategy,compiler,checkpoint,again", [
    ("ring", "eager", "none", {}),
    # through AOTAutograd with full checkpointing of layer 1 and the tiled loss: the chunks are
    # recomputed inside its recompute (its four all-to-alls again), the loss chunk by chunk
    ("ulysses", "aot_eager", ["none", "full"], {"all_to_all": 4})])
def test_tiled_mlp_is_exact(pool, strategy, compiler, checkpoint, again):
    res = run_ok(pool, "train_compare", kind="llama", strategy=strategy, mlp_chunks=4, steps=1, compiler=compiler,
                 checkpoint=checkpoint, loss_chunks=4 if compiler != "eager" else 1)
    check_first_step_exact(res, [strategy] * 2)
    assert all(r["tiled_mlps"] == 2 for r in res), [r["tiled_mlps"] for r in res]     # both layers' MLPs
    assert all(r["tiled_losses"] == (1 if compiler != "eager" else 0) for r in res)
    check_ran(res[0], strategy, world=2, also=again)


def test_padding_that_would_enter_a_router_loss_is_refused(pool):
    # 33 tokens on 2 ranks: the pad token would count in the load-balancing statistics.
    msg = run_ok(pool, "expect_error", kind="mixtral", strategy="ulysses", seq_len=33)[0]
    assert "load-balancing" in msg and "divisible by 2" in msg, msg


def test_mixed_strategies_per_layer(pool):
    # Ulysses on layer 0, zigzag ring on layer 1: one global zigzag layout; odd length.
    check_exact(run_ok(pool, "train_compare", kind="llama", seq_len=37, strategy=["ulysses", "zigzag_ring"]),
                ["ulysses", "zigzag_ring"])


def test_costmodel_predicts_sp2_memory_and_time(pool):
    from autosp.tools.validation import predicted

    rows = predicted(run_ok(pool, "costmodel_measure")[0])
    for r in rows:
        assert r["pred_peak"] == pytest.approx(r["peak"], rel=0.10), r
        # Only the order of magnitude here: a loaded machine doubles step times (seen when a bench
        # ran beside the suite); the accuracy claim (MAPE 8%) lives in bench/costmodel_vs_measured.py.
        assert 1 / 3 < r["pred_time"] / r["time"] < 3, r


def test_saved_plan_is_applied_exactly_and_refused_when_it_does_not_match(pool, tmp_path):
    (r, *_rest) = run_ok(pool, "plan_apply", tmp=str(tmp_path))
    check_exact([r], ["ulysses", "zigzag_ring"])
    assert r["tiled_losses"] == 1                       # the plan's loss in 2 chunks, applied
    assert "for 4 devices but the job runs on 2" in r["wrong_world"]
    assert "sequence length 32, the batch has 64" in r["wrong_len"]


def test_auto_plan_is_exact_and_cached(pool, tmp_path):
    for r in run_ok(pool, "auto_plan_compare", cache_dir=str(tmp_path), heads=4, kv=2):
        check_exact([r])
        # keyed by profile, memory budget (MiB), the checkpointing modes and MLP / loss chunks it could
        # choose, and the compiler its memory was costed for: the pool's, which the wrapper passed on
        assert r["plan_layers"] and r["cached"] and "-cpu-gloo-m" in r["cached"][0]
        assert r["cached"][0].endswith("-none-selective-full-c1-8-32-hidden-l1-8-64-256-sp2-aot_eager.json"), r["cached"]
        assert r["plan_compiler"] == "aot_eager"


def test_a_strategy_registered_from_a_test_runs_forced_and_planned(pool):
    # tests/toy_strategy.py is the whole strategy; nothing in autosp names it.
    for r in run_ok(pool, "toy_strategy_compare"):
        assert r["plan_strategies"] == ["toy_allgather_ar"]
        check_exact([r["forced"]], ["toy_allgather_ar"] * 2)
        check_exact([r["planned"]], ["toy_allgather_ar"] * 2)


def check_graph_break(pool, strategy):
    # The break sits in a loop, so the model's own frame runs eagerly (embedding, norm, head, loss on
    # the full sequence on every rank) and Dynamo compiles the block's two halves: attention (sharded,
    # one compiled graph serving both layers) and the MLP (no attention: run replicated, 3 parameters).
    # Eager and replicated parameters must not get P times their gradient.
    for r in run_ok(pool, "train_compare", kind="reference_break", strategy=strategy):
        check_exact([r], [strategy])
        assert r["graphs"] == 2 and r["replicated_params"] == 3, r      # ffn_norm, w1, w2
        # one attention graph, run for both layers; its output gathered for the eager frame each time
        check_ran(r, strategy, world=r["report"]["sp_degree"], ops=1, runs=2, also={"all_gather": 2})


def check_inputs_embeds(pool, strategy):
    for r in run_ok(pool, "inputs_embeds_compare", strategy=strategy, seq_len=33):
        assert r["strategies"] == [strategy] * 2, r
        assert r["loss_err"] <= LOSS_TOL and r["grad_err"] <= GRAD_TOL, r
        assert r["upstream_grad_err"] <= GRAD_TOL, r
        check_ran(r, strategy, world=r["report"]["sp_degree"])


@pytest.mark.parametrize("strategy", ["ulysses", "ring"])
def test_graph_break_between_sharded_layers_is_exact(pool, strategy):
    check_graph_break(pool, strategy)


@pytest.mark.parametrize("strategy", ["ulysses", "ring"])
def test_inputs_embeds_from_an_upstream_module_get_full_gradients(pool, strategy):
    check_inputs_embeds(pool, strategy)


def test_mixtral_with_eager_experts_breaks_the_graph_and_stays_exact(pool):
    # Before: the last layer's experts, the final norm and the head got exactly P x their gradient.
    for r in run_ok(pool, "train_compare", kind="mixtral_eager", strategy="ulysses", steps=2):
        check_exact([r], ["ulysses"])
        assert r["graphs"] > 2 and r["replicated_params"] > 0, r


def test_a_router_loss_on_logits_gathered_after_a_graph_break_gets_one_process_gradient(pool):
    # The planner choosing, through the suite's compiler (Inductor here took 45 s of the suite for its
    # 10 graphs). The eager expert loop breaks the graph, so the router
    # logits leave their sharded graph gathered and the load-balancing loss runs replicated next to
    # the sharded loss. Before: every rank got the full gradient of that replicated work and the
    # boundary's sum counted it twice (router gate 21-75% off, every other weight slightly off).
    from conftest import SUITE_COMPILER

    res = run_ok(pool, "train_compare", kind="mixtral_eager_aux", seq_len=96, steps=2)
    for r in res:
        check_exact([r], r["strategies"])
        assert r["shared_replicated"] >= 1, r      # the aux loss's replicated work kept 1/P of its gradient
        assert r["graphs"] > 2 and r["report"]["compiler"] == SUITE_COMPILER, r
        assert r["plan_layers"] is not None, "the planner chose the strategy"


# (DeepSeek-V3's multi-head latent attention, planned by the first call: on 4 ranks)


def test_a_memory_limit_no_plan_meets_fails_on_every_rank(pool):
    # Before: a warning, then a step with no checkpointing, far over the budget.
    for r in run_ok(pool, "memory_budget_refused"):
        assert "no plan fits" in r["error"] and "1 MiB" in r["error"], r
        assert r["graphs"] == 0 and r["grads"] == 0, r           # nothing ran without the budget


def test_a_model_the_planner_cannot_plan_warns_without_a_budget_and_fails_with_one(pool):
    for r in run_ok(pool, "planning_failure"):
        (warning,) = r["warnings"]
        assert "RuntimeError: the capture turned" in warning and "autosp plan --model" in warning, warning
        assert "--seq-len 32 --batch-size 1 --world-size 2" in warning, warning
        assert r["loss_err"] < 1e-5 and r["grad_err"] < 1e-4, r       # the default choice, exact
        assert "under the memory limit it was given" in r["error"] and "autosp plan --model" in r["error"], r
        assert "\n" not in r["error"] and r["grads"] == 0, r             # one line; nothing ran without the budget


def test_partial_gradients_refuse_parameters_a_graph_break_left_eager(pool):
    for r in run_ok(pool, "partial_grads_with_eager_parameters"):
        check_exact([r["exact"]], ["ulysses"])
        assert "ran outside autosp's compiled graphs" in r["refused"] and "reduce_grads=True" in r["refused"], r


def test_per_layer_strategies_that_a_graph_break_cannot_honour_are_refused(pool):
    msgs = run_ok(pool, "expect_error", kind="reference_break", strategy=["ulysses", "ring"])
    assert "2 per-layer decisions" in msgs[0] and "graph break" in msgs[0], msgs[0]


def test_what_is_exact_but_not_expected_is_said_once(pool):
    (drop, *_r) = run_ok(pool, "warnings_of", kind="llama", strategy="ulysses", attention_dropout=0.1)
    assert sum("attention dropout (p=" in w and "not bit for bit" in w for w in drop) == 1, drop
    (auto, *_r) = run_ok(pool, "warnings_of", kind="llama", attention_dropout=0.1)    # planned, not a fallback
    assert not any("could not plan" in w for w in auto) and any("attention dropout" in w for w in auto), auto
    (brk, *_r) = run_ok(pool, "warnings_of", kind="reference_break", strategy="ulysses")
    assert sum("graph break" in w and "runs unsharded on every rank" in w for w in brk) == 1, brk


@pytest.mark.parametrize("kind,strategy,compiler", [
    ("llama", "ulysses", "default"), ("reference", "allgather_kv", "aot_eager"),
    ("reference_break", "zigzag_ring", "aot_eager")])       # ring under AOTAutograd: the checkpointing tests
def test_compiled_path_through_aot_autograd_is_exact(pool, kind, strategy, compiler):
    # The collectives, the ring and blockwise kernels and their backwards are custom ops that
    # AOTAutograd traces; a graph break leaves a replicated graph compiled the same way.
    res = run_ok(pool, "train_compare", kind=kind, strategy=strategy, compiler=compiler, steps=2)
    check_exact(res, [strategy] * (1 if kind == "reference_break" else 2))
    # What ran each graph: no compiler named (and no $AUTOSP_COMPILER) is Inductor.
    assert res[0]["report"]["compiler"] == ("inductor" if compiler == "default" else compiler)
    if kind == "reference_break":       # one attention graph serving both layers, its output gathered
        check_ran(res[0], strategy, world=2, ops=1, runs=2, also={"all_gather": 2})
    else:
        check_ran(res[0], strategy, world=2)


def test_python_floats_are_constants_of_the_graph_and_a_changed_one_compiles_again(pool):
    # Traced symbolic, each float (a norm's eps) is a graph input and compiling takes ~2x as long
    # (bench/compilers.py --trace-options); constant, a changed value must recompile, not run stale.
    res = run_ok(pool, "float_attribute_changed")[0]
    assert res["graphs"] == [1, 1, 2], res          # compiled once, reused, compiled again for eps=0.5
    assert max(res["loss_err"]) < 1e-5 and res["loss_moved"] > 1e-4, res


@pytest.mark.parametrize("mode,strategy,compiler,again", [
    ("selective", "ulysses", "eager", {}), (["full", "none"], "ring", "eager", {"send_recv": 1}),
    # through AOTAutograd the layers' nodes carry recompute tags its partitioner follows
    # (["none", "full"] through AOTAutograd: test_tiled_mlp_is_exact, with its MLPs tiled)
    ("selective", "ring", "aot_eager", {}),
    # pipelined Ulysses, its first group issued where q, k, v are made: the recomputed forward
    # exchanges its 2 groups' q, k, v and output again (8 a layer)
    ("full", "ulysses:c2", "eager", {"all_to_all": 16}), ("full", "ulysses:c2", "aot_eager", {"all_to_all": 16})])
def test_activation_checkpointing_is_exact(pool, mode, strategy, compiler, again):
    res = run_ok(pool, "train_compare", kind="llama", strategy=strategy, checkpoint=mode, steps=2, compiler=compiler)
    check_exact(res, [strategy] * 2)
    # ``again``: what the backward issues a second time. Full checkpointing recomputes the layer's
    # forward: eagerly the whole checkpointed call (the ring's forward hop); under AOTAutograd the
    # Q, K, V and output all-to-alls (only the layer's input and output are kept). Selective keeps
    # attention outputs: no collective repeats.
    check_ran(res[0], strategy, world=2, also=again)


def test_activation_checkpointing_saves_memory_in_order_eagerly(pool):
    (m, *_r) = run_ok(pool, "checkpoint_memory", compiler="eager", seq_len=1024)
    assert m["none"]["loss"] == m["selective"]["loss"] == m["full"]["loss"], m
    # Per-layer activations dominate at 1024 tokens: full keeps one hidden state per layer.
    assert m["full"]["peak"] < m["selective"]["peak"] < m["none"]["peak"], m


def test_memory_decisions_save_what_the_memory_model_predicts(pool):
    """Through AOTAutograd (the compiled path, whose partitioner must follow the tags), per
    decision: the order they save in, and the probe's step peak against the planner's model."""
    m = run_ok(pool, "checkpoint_memory", compiler="aot_eager", seq_len=512,
               modes=("none", "full", ("none", 8, 1)))[0]     # selective: the eager test above
    losses = [v["loss"] for v in m.values()]
    assert max(losses) - min(losses) <= 1e-6 * abs(losses[0]), m
    assert m["full"]["peak"] < m["none/8/1"]["peak"] < m["none"]["peak"], m
    assert [v["tiled_mlps"] for v in m.values()] == [0, 0, 2], m
    # Tiled, a layer keeps none of what the partitioner saves of its MLP: gate, up and their
    # product, 256 local tokens x 688 features x 4 bytes each, in both layers.
    assert m["none"]["peak"] - m["none/8/1"]["peak"] > 0.9 * 3 * 256 * 688 * 4 * 2, m
    for decision, v in m.items():          # the compiled path's min-cut, tags and loss buffers
        assert abs(v["predicted"] / v["peak"] - 1) < 0.05, (decision, v)


def test_zero_3_gathers_each_block_inside_the_graph_and_holds_one_at_a_time(pool):
    res = run_ok(pool, "zero3_in_graph")        # through AOTAutograd (the 4-process cases run eagerly)
    for r in res:
        block, params = r["block_bytes"], r["param_bytes"]
        c = r["aot_eager"]
        assert c["loss_err"] < 1e-5 and c["grad_err"] < 1e-4, c
        rep = c["report"]
        assert rep["zero_stage"] == 3 and rep["compiler"] == "aot_eager"
        assert [a["strategy"] for a in rep["attention"]] == ["ulysses"] * 4
        assert all(a["tokens_per_rank"] == 32 for a in rep["attention"])
        # between steps: half of every parameter per rank, as DTensors, under the plain model's keys
        assert c["dtensors"] and c["keys_plain"] and c["shard_elements"] * 4 * 2 == params
        # one all-gather per unit (embedding | 4 blocks | final norm + head) and one reduce-scatter each;
        # the backward gathers all units but the embedding again (its backward reads no weight)
        assert rep["param_gathers"] == 6, rep
        assert rep["collectives"]["param_all_gather"]["calls"] == 6 + 5, rep["collectives"]
        assert rep["collectives"]["grad_reduce_scatter"]["calls"] == 6, rep["collectives"]
        # the step's new memory: the gradient shards, the activations (small here) and about one block
        # whole at a time (gathered again, its gradients, the reduce-scatter's buffer). Keeping what the
        # forward gathered would add every parameter whole: params / 2 + params.
        assert c["peak"] < params / 2 + 3.5 * block < params / 2 + params, (c["peak"], params, block)
        # the schedule (G/g: a unit's gather starts / is waited for, R/r: its gradients' reduction, a: an
        # SP all-to-all, |: the backward begins). Forward: each block's gather starts before the unit
        # before it computes. Backward: the blocks are gathered again where needed (blocking), and each
        # unit's reduction is waited for only after the next unit's backward (its 4 all-to-alls) ran.
        fwd, bwd = "".join(c["events"]).split("|")
        assert fwd == "GgG" + "g" + "G" + "aaaagG" * 3 + "aaaag", fwd
        assert bwd == "GgR" + "GgaaaarR" * 4 + "rRr", bwd
        assert abs(c["peak"] / r["predicted_step_peak"] - 1) < 0.10, (c["peak"], r["predicted_step_peak"])


def test_zero_3_with_full_checkpointing_gathers_each_block_again_for_its_recompute(pool):
    """ZeRO 3 + full checkpointing through AOTAutograd and Inductor (once refused: the DTensor
    parameters' device mesh was saved for the recomputed backward). Each block is gathered once in
    the forward and once in the backward, where its forward is recomputed before its backward."""
    # (through Inductor: the offload test below, which checkpoints fully under ZeRO 3 too)
    res = run_ok(pool, "zero3_in_graph", compilers=("aot_eager",), checkpoint="full", steps=2, timeout=600)
    for r in res:
        block, params = r["block_bytes"], r["param_bytes"]
        for compiler in ("aot_eager",):
            c = r[compiler]
            assert c["loss_err"] < 1e-5 and c["grad_err"] < 1e-4, (compiler, c)
            rep = c["report"]
            assert rep["compiler"] == compiler and rep["zero_stage"] == 3
            assert [a["checkpoint"] for a in rep["attention"]] == ["full"] * 4, rep["attention"]
            calls = {k: v["calls"] for k, v in rep["collectives"].items()}
            # q, k, v and the output's all-to-alls: forward, recomputed forward, backward (4 blocks)
            assert calls["all_to_all"] == 4 * 4 * 3, calls
            assert calls["param_all_gather"] == 6 + 5 and calls["grad_reduce_scatter"] == 6, calls
            assert c["dtensors"] and c["keys_plain"]
            assert c["peak"] < params / 2 + 3.5 * block, (c["peak"], params, block)
        # the block's gather (G, g), its recomputed forward and its backward (8 all-to-alls), its reduction
        fwd, bwd = "".join(r["aot_eager"]["events"]).split("|")
        assert fwd == "GgG" + "g" + "G" + "aaaagG" * 3 + "aaaag", fwd
        assert bwd == "GgR" + ("Gg" + "a" * 8 + "rR") * 4 + "rRr", bwd


def test_offload_with_full_checkpointing_zero_3_and_tiled_mlp_and_loss_is_exact_with_copies_in_order(pool):
    """What each fully checkpointed layer keeps (its input, and its tiled MLP's where that is a region
    of its own) waits in host memory, and the optimizer steps there: exact against one process
    through AOTAutograd (MLP input kept) and Inductor (MLP recomputed with its layer), loss, every
    gradient and the parameters after 3 AdamW steps, ZeRO 3, MLP and loss in 2 token chunks each."""
    res = run_ok(pool, "offload_step", steps=3, timeout=600)
    for r in res:
        for compiler in ("aot_eager", "inductor"):
            c = r[compiler]
            assert c["loss_err"] < 1e-5 and c["grad_err"] < 1e-4 and c["param_err"] < 1e-5, (compiler, c)
            # The AdamW that stepped is the host one: over fp32 copies of this rank's ZeRO 3 shards
            # (half of each parameter), apart from the parameters, holding every state; each step
            # copied all 21 shards' gradients down and the parameters up.
            o = c["optimizer"]
            assert o["type"] == "HostOptimizer" and o["on_host"] is True, o
            assert o["shapes_match"] and o["masters_apart"], o
            assert o["local_numel"] == o["master_numel"] and 2 * o["local_numel"] == o["full_numel"], o
            assert o["states_on_masters"] == 21 and o["states_on_params"] == 0, o
            assert o["state_numel"] == 2 * o["local_numel"], o           # exp_avg, exp_avg_sq
            assert o["copies"]["grads_to_host"] == o["copies"]["params_to_device"] == 21, o
            assert o["copies"]["bytes_to_host"] == o["copies"]["bytes_to_device"] == 4 * o["local_numel"], o
            rep = c["report"]
            assert rep["compiler"] == compiler and rep["zero_stage"] == 3
            assert [(a["checkpoint"], a["mlp_chunks"]) for a in rep["attention"]] == [("full", 2)] * 2
            assert [a["mlp_with_layer"] for a in rep["attention"]] == [compiler == "inductor"] * 2
            # recomputed with its layer, the layer's two RMSNorms run as one op each (saving bf16 input)
            assert [a["fused_norms"] for a in rep["attention"]] == [2 if compiler == "inductor" else 0] * 2
            fwd, bwd = c["events"].split("|")
            calls = rep["collectives"]
            if compiler == "aot_eager":     # the tiled MLP a region of its own, its input kept
                # per layer two saved tensors: its input and its tiled MLP's (128 local tokens x 256 x 4 bytes)
                assert c["offloaded"] == 4
                assert calls["host_offload"]["calls"] == calls["host_reload"]["calls"] == 4
                assert calls["host_offload"]["bytes"] == calls["host_reload"]["bytes"] == 4 * 128 * 256 * 4
                # Forward: a layer's two tensors leave after their last use (its attention's 4 all-to-alls,
                # then its MLP). Backward: the last layer's come back at once, layer 0's where layer 1's
                # backward begins (one layer ahead: before its 8 all-to-alls, recomputed and backward),
                # each waited for right before its first use.
                assert fwd == "aaaaOO" * 2, fwd
                assert bwd == "RRRR" + "WW" + "a" * 8 + "WW" + "a" * 8, bwd
            else:                           # (Inductor) the MLP recomputed with its layer: one tensor each
                assert c["offloaded"] == 2
                assert calls["host_offload"]["calls"] == calls["host_reload"]["calls"] == 2
                assert calls["host_offload"]["bytes"] == calls["host_reload"]["bytes"] == 2 * 128 * 256 * 4
                # The input leaves after the residual add that follows the attention's 4 all-to-alls.
                # Backward: both reloads issued where the backward begins, each waited for right
                # before its layer's recompute, after the later layer's 8 all-to-alls.
                assert fwd == "aaaaO" * 2, fwd
                assert bwd == "RR" + ("W" + "a" * 8) * 2, bwd


def test_offloaded_bytes_leave_the_device_as_the_memory_model_says(pool):
    """The memory probe counts device and host apart: offloaded, each layer's kept hidden state
    (1 MiB: 1024 local tokens x 256 x 4 bytes) moves to the host; the device keeps one layer's (the
    one in flight), as the memory model predicts, within 5%. A tiled MLP recomputed with its layer
    keeps nothing more: one hidden state per layer offloaded, the prediction within 5% too."""
    r = run_ok(pool, "offload_memory")[0]
    on, off, tiled = r["kept"], r["offload"], r["offload_tiled"]
    assert r["layers"] == 2 and [v["kept_per_layer"] for v in (on, off, tiled)] == [1024 * 256 * 4] * 3
    kept = on["kept_per_layer"]
    assert on["host_peak"] == 0 and off["host_peak"] == off["offloaded_bytes"] == r["layers"] * kept
    assert tiled["mlp_chunks"] == [8] and tiled["host_peak"] == tiled["offloaded_bytes"] == r["layers"] * kept
    assert on["peak"] - off["peak"] == pytest.approx(on["predicted"] - off["predicted"], rel=0.05)
    for v in (on, off, tiled):
        assert abs(v["peak"] / v["predicted"] - 1) < 0.05, v


def test_the_planner_plans_each_length_bucket_of_a_changing_stream(pool):
    res = run_ok(pool, "varying_lengths", lengths=(64, 200, 64, 250), planner="auto")
    for r in res:
        steps = r["steps"]
        for s in steps:
            assert s["loss_err"] <= LOSS_TOL and s["grad_err"] <= GRAD_TOL, s
        assert [s["plan_len"] for s in steps] == [64, 256, 64, 256]
        assert [s["plans"] for s in steps] == [1, 2, 2, 2] and 1 <= steps[-1]["variants"] <= 2, steps
