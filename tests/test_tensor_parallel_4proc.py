"""Tensor parallelism composed with SP (and DP) on 4 gloo processes, against one process: loss,
every gradient (each rank's shard of the one-process gradient), parameters after 3 AdamW steps;
what was split, the per-rank heads and tokens, and the TP group's collectives from the report."""

import pytest

from dist_harness import Pool
from test_sp_2proc import run_ok


@pytest.fixture(scope="module")
def pool():
    p = Pool(4)
    yield p
    p.close()


def _exact(res, strategy, layers=2):
    for r in res:
        assert r["loss_err"] < 1e-5 and r["grad_err"] < 1e-4 and r["param_err"] < 1e-4, \
            (r["loss_err"], r["grad_err"], r["worst"], r["param_err"])
        assert r["strategies"] == [strategy] * layers, r["strategies"]


# (Llama under Ulysses: the plan case below and docs/howto/dp-sp-zero.md; through Inductor in bf16:
# gpu_check.py --only e2e's tp row, dry in test_docs.py)
@pytest.mark.parametrize("kind,strategy,compiler", [("qwen3", "zigzag_ring", None)])
def test_tp_2_by_sp_2_is_exact(pool, kind, strategy, compiler):
    """4 heads, 2 key/value heads, hidden 64: each TP rank holds 2 query heads and 1 key/value head
    of every attention layer and half of every MLP; its SP pair splits the 32 tokens."""
    res = run_ok(pool, "tp_compare", kind=kind, strategy=strategy, compiler=compiler)
    _exact(res, strategy)
    rep = res[0]["report"]
    assert rep["tp_degree"] == 2 and rep["sp_degree"] == 2
    assert all((a["heads"], a["kv_heads"], a["tokens_per_rank"]) == (2, 1, 16) for a in rep["attention"]), rep
    split = rep["tp"]
    assert [n.rsplit(".", 1)[1] for n in split["column"][:5]] == ["q_proj", "k_proj", "v_proj", "gate_proj",
                                                                   "up_proj"], split
    assert [n.rsplit(".", 1)[1] for n in split["row"][:2]] == ["o_proj", "down_proj"] and not split["whole"], split
    # Qwen3's per-head norms of q and k meet the rank's own heads: their gradients summed over TP
    assert split["summed"] == ([] if kind == "llama" else [f"model.layers.{i}.self_attn.{n}_norm.weight"
                                                         for i in (0, 1) for n in ("q", "k")]), split["summed"]
    shapes, head_dim = res[0]["shapes"], 16 if kind == "llama" else 128       # Qwen3's own head size
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (2 * head_dim, 64)      # 2 of 4 heads
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (64, 2 * head_dim)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (64, 64)          # half of 128 features
    assert shapes["lm_head.weight"] == (128, 64)                              # whole on every rank
    # the last step, per layer: the two regions' outputs summed forward, their inputs' gradients
    # summed backward, each one hidden state of the SP shard (2 rows x 16 tokens x 64, fp32); and
    # the per-head norms' gradients (head_dim each)
    norms = len(split["summed"])
    assert rep["tp_collectives"] == {"all_reduce": {**rep["tp_collectives"]["all_reduce"], "calls": 2 * 2 * 2 + norms,
                                                    "bytes": 2 * 2 * 2 * (2 * 16 * 64 * 4) + norms * head_dim * 4}}, \
        rep["tp_collectives"]


def test_tp_2_by_dp_2_with_zero_1_and_heads_tp_cannot_split(pool):
    """A ('dp', 'sp', 'tp') mesh of 2 x 1 x 2 under ZeRO 1; one key/value head (TP 2 cannot split it):
    the attention stays whole on both TP ranks and says why, the MLPs split."""
    res = run_ok(pool, "tp_compare", kind="llama", strategy="ulysses", shape=(2, 1, 2), names=("dp", "sp", "tp"),
                 zero_stage=1, heads=4, kv=1)
    for r in res:
        assert r["loss_err"] < 1e-5 and r["grad_err"] < 1e-4 and r["param_err"] < 1e-4, r["worst"]
    rep = res[0]["report"]
    assert rep["tp_degree"] == 2 and rep["dp_degree"] == 2 and rep["sp_degree"] == 1
    whole = dict(rep["tp"]["whole"])
    assert "4 query / 1 key-value heads do not divide over 2 ranks" in whole["model.layers.0.self_attn.q_proj"]
    assert all(n.endswith(("gate_proj", "up_proj")) for n in rep["tp"]["column"]), rep["tp"]


def test_a_tp_plan_applies_whole_and_a_tp_mesh_autosp_cannot_run_is_refused(pool):
    res = run_ok(pool, "tp_plan_and_errors")
    r = res[0]
    assert r["mesh"] == (2, 2, 1) and r["report"]["tp_degree"] == 2 and r["report"]["sp_degree"] == 2
    for x in res:
        assert x["loss_err"] < 1e-5 and x["grad_err"] < 1e-4, (x["loss_err"], x["grad_err"])
    errors = r["errors"]
    assert "the plan splits each layer's weights over TP 2 but the mesh has TP 1" in errors["plan's TP, mesh without"]
    assert "ZeRO 3 does not compose with tensor parallelism" in errors["ZeRO 3"]
    assert "autosp.tensor_parallel(model" in errors["not HF"]
    assert "the 'tp' dimension goes innermost" in errors["tp outer"]
    assert all("\n" not in e for e in errors.values()), errors
