"""`autosp profile` as a user runs it, the head-dim interpolation of attention rows, and the
out-of-sample property of the cost model's held-out validation."""

import json
import os
import subprocess
import sys

import pytest

from autosp.costmodel import load_profile, predict
from autosp.costmodel.profiler import GENERIC_DIMS
from autosp.graph import capture
from autosp.graph.catalog import ModelSource
from autosp.tools.validation import HELD_OUT, held_out_config


def test_profile_on_two_ranks_writes_a_profile_the_planner_reads(tmp_path):
    from autosp.tools.launch import free_port

    out = tmp_path / "here.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "autosp.cli", "profile", "--out", str(out), "--quick"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"wrote {out}" in run.stdout
    doc = json.loads(out.read_text())
    # the generic grid, both head dims, every collective at the world's size, the concurrency
    assert {(r["n"], r["k"]) for r in doc["compute"]["matmul"]["float32"]} == {(d, d) for d in GENERIC_DIMS}
    assert {r["head_dim"] for r in doc["compute"]["attention"]["float32"]} == {24, 96}
    assert len(doc["compute"]["attention_backward"]["float32"]) == len(doc["compute"]["attention"]["float32"])
    assert set(doc["collectives"]) == {"all_to_all", "all_gather", "reduce_scatter", "all_reduce", "send_recv"}
    assert all(list(c["intra"]) == ["2"] for c in doc["collectives"].values())
    assert doc["concurrency"]["comm_slowdown"] >= 1.0 and doc["source"]["where"].endswith("2 rank(s)")
    assert list(doc["sync_skew"]["seconds"]) == ["2"] and doc["sync_skew"]["seconds"]["2"] >= 0.0
    # its part after the last rank issued, from the ranks' timestamps after long compute (measured
    # apart from the whole), and how
    assert list(doc["sync_skew"]["transfer_seconds"]) == ["2"] and doc["sync_skew"]["transfer_seconds"]["2"] >= 0.0
    assert "after 8192-row matmuls" in doc["sync_skew"]["how"]
    assert doc["threads_per_device"] == 1                  # a CPU profile: its head counts are pooled
    prof = load_profile(str(out))
    g = capture(ModelSource("heldout-a", hf_config=held_out_config("heldout-a")), seq_len=1024, dtype="float32")
    p = predict(g, prof, sp=2, strategy="ulysses", devices_per_node=2)
    assert p.total_s > p.compute_s > 0 and p.attention_comm_s > 0


def test_a_budget_stops_every_rank_at_the_same_point_and_only_sections_are_re_measured(tmp_path):
    """`--only compute collectives sync_skew --budget 0.01` on the shipped profile. The budget cuts
    compute and collectives short on every rank alike (ranks that stopped at different points
    would wait for each other at a barrier forever); the skew is measured again; the section not
    named (concurrency) is kept as it was, and the source says what was re-measured."""
    from autosp.tools.launch import free_port

    out = tmp_path / "cpu.json"
    before = json.loads(json.dumps(load_profile("cpu-gloo").data))
    before["sync_skew"] = {"seconds": {"7": 1.0}, "how": "stale"}
    del before["threads_per_device"]                       # a profile from before the key: compute brings it
    out.write_text(json.dumps(before))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "autosp.cli", "profile", "--out", str(out), "--quick", "--budget", "0.01",
           "--only", "compute", "collectives", "sync_skew"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    after = json.loads(out.read_text())
    measured = len(after["compute"]["matmul"]["float32"]) + len(after["compute"]["attention"]["float32"])
    assert measured < 6 + 8                # cut short: fewer points than the quick grid's
    assert sum(len(c["intra"].get("2", [])) for c in after["collectives"].values()) < 5 * 6
    assert list(after["sync_skew"]["seconds"]) == ["2"] and after["sync_skew"]["how"] != "stale"
    assert after["threads_per_device"] == 1
    for key in ("concurrency", "memory_bytes"):
        assert after[key] == before[key], key
    assert after["source"]["updated"][-1].startswith("collectives, compute, sync_skew: ") and \
        after["source"]["when"] == before["source"]["when"]
    bad = subprocess.run([sys.executable, "-m", "autosp.cli", "profile", "--out", str(out), "--only", "skew"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "invalid choice: 'skew'" in bad.stderr
    from autosp.costmodel.profiler import measure
    from autosp.errors import AutospError

    with pytest.raises(AutospError, match="does not exist; measure a whole profile there first"):
        measure(str(tmp_path / "none.json"), only=("sync_skew",))


def test_the_timeline_splits_each_wait_into_peers_lag_and_transfer():
    """bench/overlap.py's split: blocking, rank 0 enters at 0 and rank 1 at 3, both leave at 5;
    issued at 0 and 5, rank 0 waits 4-6 for an in-flight exchange and rank 1 5-6."""
    from autosp.errors import AutospError
    from autosp.strategies.collectives import split_waits

    assert split_waits([[(0.0, 0.0, 5.0)], [(3.0, 3.0, 5.0)]]) == [(3.0, 2.0), (0.0, 2.0)]
    assert split_waits([[(0.0, 4.0, 6.0)], [(5.0, 5.0, 6.0)]]) == [(1.0, 1.0), (0.0, 1.0)]
    assert split_waits([[(0.0, 1.0, 2.0), (2.0, 2.0, 3.0)], [(0.5, 1.5, 2.0), (2.5, 2.5, 3.0)]]) == \
        [(0.5, 1.5), (0.0, 1.0)]
    with pytest.raises(AutospError, match="timelines hold \\[1, 2\\] exchanges"):
        split_waits([[(0.0, 0.0, 1.0)], [(0.0, 0.0, 1.0), (1.0, 1.0, 2.0)]])


def test_collectives_pay_the_profiles_sync_skew_where_no_compute_hides_it(tmp_path):
    from autosp.costmodel.overlap import transfer_times
    from autosp.strategies import AttentionShape, SPMesh, resolve

    doc = json.loads(json.dumps(load_profile("cpu-gloo").data))
    doc["sync_skew"] = {"seconds": {"2": 0.001, "4": 0.003}, "transfer_seconds": {"4": 0.002}}
    (tmp_path / "skewed.json").write_text(json.dumps(doc))
    del doc["sync_skew"]
    (tmp_path / "plain.json").write_text(json.dumps(doc))
    skewed, plain = (load_profile(str(tmp_path / f"{n}.json")) for n in ("skewed", "plain"))
    assert (skewed.sync_skew(4), skewed.sync_skew(2), skewed.sync_skew(8), skewed.sync_skew(1)) == \
        (0.003, 0.001, 0.003, 0.0)
    assert plain.sync_skew(4) == 0.0
    # its transfer part (what a timeline that splits waits counts as transfer), the nearest group
    assert (skewed.sync_skew(4, transfer_only=True), skewed.sync_skew(2, transfer_only=True),
            plain.sync_skew(4, transfer_only=True)) == (0.002, 0.002, 0.0)
    shape = AttentionShape(heads=8, kv_heads=4, head_dim=32, seq_len=4096, causal=True)
    ulysses = resolve("ulysses").cost(shape, SPMesh(4, "contiguous"))        # 8 blocking all-to-alls a step
    n = sum(t.count for t in ulysses.transfers)
    comm0, exposed0 = transfer_times(plain, ulysses, 1.0, 2.0)
    comm1, exposed1 = transfer_times(skewed, ulysses, 1.0, 2.0)
    assert n == 8 and exposed1 - exposed0 == pytest.approx(n * 0.003) and comm1 - comm0 == pytest.approx(n * 0.003)
    # the ring's steps overlap its blocks; only its backward's last dK/dV pass (4 moves) blocks
    ring = resolve("zigzag_ring").cost(shape, SPMesh(4, "zigzag"))
    blocking = sum(t.count for t in ring.transfers if not t.overlap_steps)
    assert blocking == 4 and any(t.overlap_steps for t in ring.transfers)
    assert transfer_times(skewed, ring, 1.0, 2.0)[1] - transfer_times(plain, ring, 1.0, 2.0)[1] == \
        pytest.approx(blocking * 0.003)
    # pipelined in 2 head groups beside long kernels: the ranks meet in full at the first group's
    # inputs and at the last group's output, once each per phase; the other group's lag hides
    # beside the kernels with its transfer (8 collectives a phase, 2 skews)
    pipelined = resolve("ulysses:c2").cost(shape, SPMesh(4, "contiguous"))
    assert all(t.pipeline == 2 for t in pipelined.transfers)
    (c0, e0), (c1, e1) = (transfer_times(p, pipelined, 1.0, 2.0) for p in (plain, skewed))
    assert e1 - e0 == pytest.approx(2 * 2 * 0.003) and c1 - c0 == pytest.approx(2 * 2 * 0.003)


def _attention_profile(dims: tuple[int, ...]) -> dict:
    """A profile whose attention rows follow t = heads * area * (a + b * head_dim) exactly."""
    doc = json.loads(json.dumps(load_profile("cpu-gloo").data))
    a, b = 2e-9, 1e-10
    rows = [dict(batch=1, heads=h, q_len=s, kv_len=s, head_dim=d, causal=True,
                 seconds=h * s * s / 2 * (a + b * d)) for h in (2, 8) for d in dims for s in (512, 2048, 8192)]
    doc["compute"]["attention"]["float32"] = rows
    doc["compute"]["attention_backward"]["float32"] = [dict(r, backward=True, seconds=2 * r["seconds"]) for r in rows]
    return doc


@pytest.mark.parametrize("head_dim", [48, 64, 80, 128, 16])
def test_attention_time_is_affine_in_head_dim_between_measured_dims(tmp_path, head_dim):
    path = tmp_path / "attn.json"
    path.write_text(json.dumps(_attention_profile((24, 96))))
    prof = load_profile(str(path))
    want = 4 * 3072 * 3072 / 2 * (2e-9 + 1e-10 * head_dim)          # 4 heads, 3072 tokens, causal
    assert prof.attention_call_time(4, 3072, 3072, head_dim, True, "float32") == pytest.approx(want, rel=1e-9)
    assert prof.attention_call_time(4, 3072, 3072, head_dim, True, "float32", backward=True) == pytest.approx(
        2 * want, rel=1e-9)


def test_one_measured_head_dim_scales_linearly(tmp_path):
    path = tmp_path / "attn1.json"
    path.write_text(json.dumps(_attention_profile((32,))))
    prof = load_profile(str(path))
    t32 = prof.attention_call_time(8, 2048, 2048, 32, True, "float32")
    assert prof.attention_call_time(8, 2048, 2048, 64, True, "float32") == pytest.approx(2 * t32, rel=1e-9)


def test_a_one_thread_profile_pools_its_head_counts_and_others_take_the_nearest(tmp_path):
    """Rows at 2 heads 10% dearer per head than at 8: with one thread per device (CPU) a call's
    heads run one after another, so both counts measure the same per-head time and their mean
    prices every call; without the key (a GPU profile) the nearest count decides."""
    doc = _attention_profile((32,))
    for r in doc["compute"]["attention"]["float32"] + doc["compute"]["attention_backward"]["float32"]:
        if r["heads"] == 2:
            r["seconds"] *= 1.1
    per_head = 2048 * 2048 / 2 * (2e-9 + 1e-10 * 32)
    (tmp_path / "cpu.json").write_text(json.dumps(doc))
    del doc["threads_per_device"]
    (tmp_path / "gpu.json").write_text(json.dumps(doc))
    cpu, gpu = (load_profile(str(tmp_path / f"{n}.json")) for n in ("cpu", "gpu"))
    for heads in (1, 2, 4, 8, 16):
        assert cpu.attention_call_time(heads, 2048, 2048, 32, True, "float32") == \
            pytest.approx(heads * per_head * 1.05, rel=1e-9)
        assert cpu.attention_call_time(heads, 2048, 2048, 32, True, "float32", backward=True) == \
            pytest.approx(2 * heads * per_head * 1.05, rel=1e-9)
    assert gpu.attention_call_time(2, 2048, 2048, 32, True, "float32") == pytest.approx(2 * per_head * 1.1, rel=1e-9)
    assert gpu.attention_call_time(8, 2048, 2048, 32, True, "float32") == pytest.approx(8 * per_head, rel=1e-9)
    assert load_profile("cpu-gloo").data["threads_per_device"] == 1


def _model_dims(cfg) -> set[int]:
    head = cfg.hidden_size // cfg.num_attention_heads
    return {cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, head * cfg.num_key_value_heads}


def test_the_held_out_models_share_no_shape_with_the_cpu_profile_or_the_test_models():
    from autosp.graph.catalog import hf_config

    prof = load_profile("cpu-gloo").data["compute"]
    grid_dims = {d for r in prof["matmul"]["float32"] for d in (r["n"], r["k"])}
    grid_head_dims = {r["head_dim"] for r in prof["attention"]["float32"]}
    grid_lens = {r["q_len"] for r in prof["attention"]["float32"]}
    tiny = hf_config("tiny")
    seen_models = [_model_dims(tiny), {256, 688, 1000, 128}]               # the catalogue's and the benches' tiny
    shapes = set()
    for name in HELD_OUT:
        cfg = held_out_config(name)
        dims = _model_dims(cfg)
        head = cfg.hidden_size // cfg.num_attention_heads
        assert not dims & grid_dims, (name, dims & grid_dims)
        assert head not in grid_head_dims and head != tiny.hidden_size // tiny.num_attention_heads, name
        assert all(not dims & seen for seen in seen_models), name
        shapes.add((head, cfg.num_attention_heads // cfg.num_key_value_heads))
    assert len(shapes) == len(HELD_OUT)                     # three head dims, three GQA ratios
    assert not {3072, 6144} & grid_lens                      # the bench's lengths are off the profile's
