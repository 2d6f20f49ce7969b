"""Exact SP numerics on 4 gloo processes, including more ranks than KV heads."""

import pytest

from dist_harness import Pool
from test_sp_2proc import check_exact, run_ok


@pytest.fixture(scope="module")
def pool():
    p = Pool(4)
    yield p
    p.close()


@pytest.mark.parametrize("kind,cfg", [("llama", dict(heads=4, kv=1)),      # SP 4 > 1 KV head
                                      ("llama", dict(heads=8, kv=2)),      # SP 4 > 2 KV heads
                                      ("reference", dict(heads=4, kv=2)),
                                      ("gpt2", dict(heads=4))])
def test_ulysses_matches_single_device(pool, kind, cfg):
    check_exact(run_ok(pool, "train_compare", kind=kind, **cfg))


def test_uneven_labels_and_length_not_divisible(pool):
    check_exact(run_ok(pool, "train_compare", kind="reference", seq_len=30, uneven=True))


@pytest.mark.parametrize("kind", ["qwen2", "mistral", "qwen3", "olmo2"])
def test_other_sdpa_families_need_no_code(pool, kind):
    check_exact(run_ok(pool, "train_compare", kind=kind, steps=1, heads=4, kv=2))


def test_heads_that_ulysses_cannot_split(pool):
    msgs = run_ok(pool, "expect_error", kind="llama", heads=6, kv=2)
    assert "6 query heads" in msgs[0] and "SP degree 4" in msgs[0] and "ring" in msgs[0]
