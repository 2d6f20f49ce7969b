"""Exact SP numerics on 2 gloo processes against a single-device run."""

import pytest

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


def check_exact(res, strategies=None):
    """Exact against one process; ``strategies``: the spec that must have run on each attention op."""
    for r in res:
        assert r["attention_ops"] > 0
        if strategies is not None:
            assert r["strategies"] == strategies, r["strategies"]
        assert r["loss_err"] <= LOSS_TOL, r
        assert r["grad_err"] <= GRAD_TOL, r
        assert r["param_err"] <= GRAD_TOL, r          # still equal after 3 AdamW steps


@pytest.mark.parametrize("kind,cfg", [("llama", dict(heads=4, kv=2)), ("gpt2", dict(heads=4)),
                                      ("reference", dict(heads=4, kv=2))])
def test_ulysses_matches_single_device(pool, kind, cfg):
    # "auto" takes Ulysses when the heads split: 4 heads on 2 ranks, both layers.
    check_exact(run_ok(pool, "train_compare", kind=kind, **cfg), ["ulysses"] * 2)


def test_uneven_ignored_labels_and_odd_length(pool):
    # 33 tokens on 2 ranks: padded to 34; most ignored labels sit on rank 0's half.
    check_exact(run_ok(pool, "train_compare", kind="llama", seq_len=33, uneven=True))


def test_eager_attention_is_refused_by_name(pool):
    msgs = run_ok(pool, "expect_error", kind="llama", attn="eager")
    assert "no scaled_dot_product_attention" in msgs[0] and "softmax" in msgs[0]
    assert "attn_implementation='sdpa'" in msgs[0]


def test_registered_torch_compile_backend(pool):
    for r in run_ok(pool, "backend_compare"):
        assert r["loss_err"] <= LOSS_TOL and r["grad_err"] <= GRAD_TOL, r


def test_logits_local_next_to_a_loss_full_otherwise(pool):
    for r in run_ok(pool, "logits_shapes"):
        assert r["with_labels_len"] == r["local_len"] and r["with_labels_err"] < 1e-5, r
        assert r["no_labels_len"] == 33 and r["no_labels_err"] < 1e-5, r
        assert r["gathered_len"] == 33 and r["gathered_err"] < 1e-5, r


@pytest.mark.parametrize("strategy", ["ring", "zigzag_ring", "allgather_kv"])
@pytest.mark.parametrize("kind", ["llama", "reference"])
def test_other_strategies_match_single_device(pool, strategy, kind):
    check_exact(run_ok(pool, "train_compare", kind=kind, strategy=strategy, heads=4, kv=2), [strategy] * 2)


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
    assert "for 4 devices but the job runs on 2" in r["wrong_world"]
    assert "sequence length 32, the batch has 64" in r["wrong_len"]


def test_auto_plan_is_exact_and_cached(pool, tmp_path):
    for r in run_ok(pool, "auto_plan_compare", cache_dir=str(tmp_path), heads=4, kv=2):
        check_exact([r])
        assert r["plan_layers"] and r["cached"] and r["cached"][0].endswith("-cpu-gloo.json")


def test_a_strategy_registered_from_a_test_runs_forced_and_planned(pool):
    # tests/toy_strategy.py is the whole strategy; nothing in autosp names it.
    for r in run_ok(pool, "toy_strategy_compare"):
        assert r["plan_strategies"] == ["toy_allgather_ar"]
        check_exact([r["forced"]], ["toy_allgather_ar"] * 2)
        check_exact([r["planned"]], ["toy_allgather_ar"] * 2)
