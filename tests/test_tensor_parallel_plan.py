"""The planner's tensor-parallel axis (autosp.costmodel.tensor_parallel): what TP divides, what it
replicates, its collectives counted by hand, the ILP choosing it where ZeRO's gathers cross nodes,
and the refusals (a degree that cannot run; a TP plan the runtime does not apply yet)."""

import functools
import json

import pytest

from autosp.costmodel.memory import dtype_bytes, model_states
from autosp.costmodel.predict import predict
from autosp.costmodel.profile import load_profile
from autosp.costmodel.tensor_parallel import check_tp_degree, legal_tp_degrees, params_per_rank, split_ops, tp_comm
from autosp.errors import AutospError
from autosp.graph import OpKind, capture
from autosp.planner.plan import Plan
from autosp.planner.problem import Problem
from autosp.planner.search import plan


@functools.lru_cache(maxsize=None)
def _graph(name: str, seq_len: int = 4096):
    return capture(name, seq_len=seq_len)


def test_a_tp_degree_that_cannot_run_is_refused_naming_those_that_can(capsys):
    # 64 heads, 8 key/value heads, nodes of 8: TP 1, 2, 4, 8
    assert legal_tp_degrees(64, 8, 8, 64) == [1, 2, 4, 8]
    assert legal_tp_degrees(6, 2, 8, 16) == [1, 2]         # 6 heads: 4 and 8 do not divide them
    assert legal_tp_degrees(8, 3, 8, 8) == [1]             # 3 key/value heads
    for t, why in ((16, "would span nodes of 8 devices"), (3, "do not tile a node of 8 devices")):
        with pytest.raises(AutospError, match=f"TP degree {t} cannot run: .*{why}.*use one of 1, 2, 4, 8"):
            check_tp_degree(t, 64, 8, 8, 64)
    with pytest.raises(AutospError, match="6 attention heads do not divide over 4 ranks; use one of 1, 2"):
        check_tp_degree(4, 6, 2, 8, 16)
    from autosp.cli import main

    # the tiny model's 4 key/value heads: TP 8 would split none of them
    assert main(["plan", "--model", "tiny", "--world-size", "8", "--seq-len", "4096", "--tp", "8"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "TP degree 8 cannot run: 4 key/value heads do not divide over 8 ranks; use one of " \
        "1, 2, 4" in err[0], err


def test_tp_splits_the_blocks_parameters_and_keeps_the_rest_whole():
    g = _graph("tiny")           # hidden 256, 8 heads of 32, 4 key/value heads, 2 layers, vocabulary 2048
    n, blocks = g.total_params, sum(lc.params * lc.count for lc in g.layer_classes.values())
    assert g.nonlayer_params == 2 * 2048 * 256 + 256          # embedding, LM head, final norm: whole
    norms = 2 * 2 * 256                                        # each layer's two RMSNorm weights: whole
    assert params_per_rank(g, 1) == n and params_per_rank(g, 4) == g.nonlayer_params + norms + (blocks - norms) / 4
    # split by TP, then sharded by ZeRO 3 over the other axes
    states = model_states(g, 4, 3, tp=2)
    per_rank = g.nonlayer_params + norms + (blocks - norms) / 2
    assert states["parameters"] == pytest.approx(per_rank / 4 * dtype_bytes(g.dtype))
    assert states["optimizer"] == pytest.approx(per_rank / 4 * (8 + 4))


def test_tp_costs_only_what_the_runtime_splits():
    """The runtime splits SDPA attention on whole heads and a plain MLP; attention written by hand,
    multi-head latent attention and mixtures of experts stay whole, and so they are costed: once a
    TP 8 plan for DeepSeek-V3 credited TP with dividing all 671B parameters, of which it splits
    the 3 dense layers' MLPs."""
    from autosp.costmodel.memory import tp_split_params
    from autosp.costmodel.tensor_parallel import splits_attention, tp_refused_for

    ds = _graph("deepseek-v3", 1024)
    assert ds.total_params == pytest.approx(671.03e9, rel=1e-3)           # 3 dense layers, then 58 of experts
    dense_mlp = 3 * 3 * 7168 * 18432
    assert tp_split_params(ds) == pytest.approx(dense_mlp) and not splits_attention(ds)
    assert params_per_rank(ds, 8) == pytest.approx(ds.total_params - dense_mlp * 7 / 8)
    oss = _graph("gpt-oss-20b", 1024)
    assert tp_split_params(oss) == 0 and "TP splits no layer of gpt-oss-20b" in tp_refused_for(oss)
    with pytest.raises(AutospError, match="TP degree 2 cannot help: TP splits no layer of gpt-oss-20b"):
        plan(Problem.of(graph=oss, seq_len=4096, world_size=8, devices_per_node=8, profile="h100-sxm",
                        tp_degrees=(2,)))


def test_tp_collectives_and_work_are_what_the_rule_says_by_hand():
    g, prof = _graph("tiny"), load_profile("h100-sxm")
    S, sp, t = 4096, 2, 4
    h = g.batch_size * (S / sp) * 256 * dtype_bytes(g.dtype)       # one hidden state of the SP shard
    ar = prof.collective_time("all_reduce", t, h)
    c = tp_comm(g, prof, t, S / sp)
    blocks = 2 * 2                                                  # 2 layers x (attention, MLP), both split
    assert c.layer_forward_s == pytest.approx(blocks * ar) and c.layer_s == pytest.approx(2 * blocks * ar)
    assert c.outside_s == 0.0                                       # the head and loss run whole
    one, tp = (predict(g, prof, sp=sp, strategy="ulysses", seq_len=S, tp=k) for k in (1, t))
    assert tp.tp_comm_s == pytest.approx(c.total_s) and one.tp_comm_s == 0.0
    assert tp.exposed_comm_s == pytest.approx(tp.attention_exposed_s + tp.gradient_exposed_s + c.total_s)
    assert tp.model_flops == pytest.approx(one.model_flops / t)
    # the blocks' matmuls a quarter each, the head's whole: what is split is what the rule says
    work, _ = split_ops(g)
    mm = [a for a in g.nodes(kind=OpKind.MATMUL)]
    assert all(a.name in work for a in mm if a.layer is not None) and not any(a.name in work for a in mm
                                                                             if a.layer is None)
    assert one.head_forward_s == pytest.approx(tp.head_forward_s)
    assert tp.compute_s < one.compute_s
    assert tp.memory["activations"] < one.memory["activations"]


def test_the_planner_puts_tp_inside_the_nodes_for_70b_where_zero_gathers_cross_them():
    """Llama-3-70B at 128k on 64 H100 under ZeRO 3: SP alone gathers every parameter over 8 nodes;
    TP inside each node divides what crosses them. The ILP chooses TP itself, and the runner-ups
    hold the best plan at the other TP degrees."""
    g = _graph("llama3-70b")
    p = plan(Problem.of(graph=g, seq_len=131072, world_size=64, devices_per_node=8, profile="h100-sxm",
                        zero_stage=3, tp_degrees=None))
    mesh = p.mesh
    assert mesh.tp_degree > 1 and mesh.sp_degree * mesh.tp_degree * p.dp_degree == 64, mesh
    best_at = {}
    for a in p.alternatives:
        best_at.setdefault(a.mesh.tp_degree, a)
    assert 1 in best_at and len(best_at) >= 3, sorted(best_at)
    sp_only = best_at[1]
    pr = p.predicted
    assert pr.total_s < sp_only.total_s / 1.5 and pr.mfu > 1.5 * sp_only.mfu, (pr.total_s, sp_only.total_s)
    # where the time goes: TP's collectives exposed, less of the gradient reduction and gathers
    assert 0 < pr.exposed_tp_s < pr.exposed_comm_s and pr.exposed_comm_s - pr.exposed_tp_s < sp_only.exposed_comm_s
    assert pr.peak_bytes <= p.memory_limit_bytes * (1 - p.memory_margin)
    back = Plan.from_dict(json.loads(p.to_json()))
    assert back.mesh == mesh and back.predicted.exposed_tp_s == pr.exposed_tp_s
