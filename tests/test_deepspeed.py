"""autosp inside DeepSpeed (optional extra): ZeRO 2 exact on a 2 x 2 mesh, ZeRO 3 refused by name.

(ZeRO 1 is the same recipe; the suite's time budget keeps one stage here.)"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("deepspeed")

HERE = os.path.dirname(__file__)


def test_deepspeed_zero_2_trains_exactly_and_zero_3_is_refused(tmp_path):
    from autosp.tools.launch import free_port

    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    job = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                          "--master-port", str(free_port()), os.path.join(HERE, "deepspeed_job.py"), str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=400)
    assert job.returncode == 0, (job.stdout + job.stderr)[-4000:]
    with open(tmp_path / "result.json") as f:
        res = json.load(f)
    for stage in ("2",):
        r = res[stage]
        assert r["strategies"] == ["ulysses"] * 2, r
        assert r["report"]["attention"][0]["tokens_per_rank"] == 16           # S/P on each rank
        for ref, got in r["losses"]:           # one process on the global batch, every step
            assert abs(got - ref) / ref < 1e-5, r["losses"]
        assert r["param_err"] < 1e-5, r
    assert "DeepSpeed ZeRO stage 3" in res["3"]["refused"] and "zero_stage=3" in res["3"]["refused"]
    assert "own sequence-parallel group (ranks [0, 1, 2, 3]" in res["own-sp"]["refused"]
    assert "leave sequence_parallel_size" in res["own-sp"]["refused"]
