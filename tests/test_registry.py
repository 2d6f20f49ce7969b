"""The strategy registry is real: a strategy added from a test reaches compile's checks, the
cost model and the planner; the built-in ones declare what the cost model charges."""


import pytest

import autosp
from autosp.costmodel import load_profile, predict
from autosp.errors import AutospError
from autosp.strategies import AttentionShape, SPMesh, candidates, names, register, resolve, unregister


@pytest.fixture
def toy():
    import toy_strategy

    register(toy_strategy.ToyAllGatherAllReduce)
    yield toy_strategy.FAMILY
    unregister(toy_strategy.FAMILY)


@pytest.fixture(scope="module")
def tiny():
    return autosp.capture("tiny", seq_len=4096, dtype="bfloat16")


def test_registered_strategy_is_costed_from_its_own_declaration(toy, tiny):
    prof = load_profile("h100-sxm")
    mine = predict(tiny, prof, sp=4, strategy=toy)
    base = predict(tiny, prof, sp=4, strategy="allgather_kv")
    # Same forward gathers and kernels; backward all-reduces (2(P-1)/P of P shards) where the
    # built-in reduce-scatters ((P-1)/P of P shards): more communication, the same compute.
    assert mine.strategy == toy and mine.attention_comm_s > base.attention_comm_s
    assert mine.compute_s == pytest.approx(base.compute_s)


def test_planner_chooses_among_registered_strategies(toy, tiny):
    shape = AttentionShape(heads=8, kv_heads=4)
    assert toy in {s.spec for s in candidates(SPMesh(2), shape)}
    p = autosp.plan(autosp.Problem.of(graph=tiny, seq_len=4096, world_size=2, profile="h100-sxm", sp_degrees=(2,),
                                      strategies=(toy,)))
    assert [layer.choice.strategy for layer in p.layers] == [toy]
    # Runner-ups come from the solver (no-good cuts): other layouts, checkpointing, tiling and offload, each once.
    assert p.solver.solves == len(p.alternatives) + 1 >= 2
    assert all(x.choice.strategy == toy for a in p.alternatives for x in a.layers)
    seen = {(a.mesh.layout, a.mesh.loss_chunks) + tuple((x.choice.strategy, x.choice.checkpoint, x.choice.mlp_chunks,
                                                         x.choice.offload) for x in a.layers)
            for a in (p.summary(), *p.alternatives)}
    assert len(seen) == len(p.alternatives) + 1
    assert all(a.total_s >= p.predicted.total_s for a in p.alternatives)


def test_unknown_strategies_are_refused_with_the_registered_names(toy):
    assert toy in names()
    with pytest.raises(AutospError, match=f"unknown strategy 'nope'.*{toy}"):
        resolve("nope")
    with pytest.raises(AutospError, match="unknown strategy nope"):
        candidates(SPMesh(2), AttentionShape(heads=8, kv_heads=4), allowed=("nope",))


def test_hybrid_shape_is_parsed_once_into_a_typed_value():
    h = resolve("hybrid:2x4")
    assert (h.ulysses, h.ring) == (2, 4) and h.spec == "hybrid:2x4" and h.grid(SPMesh(8)) == (2, 4)
    assert "U x R = 8" in h.illegal(AttentionShape(heads=8, kv_heads=8), SPMesh(4))
    assert "does not divide" in resolve("hybrid:4x2").illegal(AttentionShape(heads=6, kv_heads=2), SPMesh(8))
    with pytest.raises(AutospError, match="write hybrid:UxR"):
        resolve("hybrid:2by4")


@pytest.mark.parametrize("spec,collectives", [
    ("ulysses", {"all_to_all"}), ("ring", {"send_recv"}), ("allgather_kv", {"all_gather", "reduce_scatter"}),
    ("hybrid:2x2", {"all_to_all", "send_recv"})])
def test_each_strategy_declares_its_collectives_and_kernel_work(spec, collectives):
    shape = AttentionShape(heads=8, kv_heads=2, head_dim=64, batch=1, seq_len=4096, elem_bytes=2, causal=True)
    cost = resolve(spec).cost(shape, SPMesh(4))
    assert {t.collective for t in cost.transfers} == collectives
    # The ranks listed (all of them, or one representative of identical ranks) times the copies
    # cover the causal S x S / 2 area of all 8 heads exactly once.
    listed = sum(c.count * c.heads * c.q_len * c.kv_len * (0.5 if c.causal else 1.0)
                 for calls in cost.kernels for c in calls)
    assert listed * 4 / len(cost.kernels) == pytest.approx(8 * 4096 * 4096 / 2, rel=1e-9)
