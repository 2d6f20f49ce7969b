"""A Hugging Face Trainer script gets SP by swapping Trainer for AutospTrainer: on 2 gloo
processes (a small Llama, 3 steps, gradient accumulation 2) its logged losses are one process's."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("accelerate")

HERE = os.path.dirname(__file__)
JOB = os.path.join(HERE, "hf_trainer_job.py")


def test_a_trainer_script_with_autosp_logs_the_losses_of_one_process(tmp_path):
    from autosp.tools.launch import free_port

    # the path users take: compiled graphs (AOTAutograd), the strategy left to the planner
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", "AUTOSP_COMPILER": "aot_eager"}
    plain = subprocess.run([sys.executable, JOB, str(tmp_path), "plain"], env=env, capture_output=True, text=True,
                           timeout=300)
    assert plain.returncode == 0, (plain.stdout + plain.stderr)[-4000:]
    job = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(free_port()), JOB, str(tmp_path), "autosp"],
                         env=env, capture_output=True, text=True, timeout=400)
    assert job.returncode == 0, (job.stdout + job.stderr)[-4000:]
    ref = json.loads((tmp_path / "plain-0.json").read_text())
    assert ref["world"] == 1 and len(ref["losses"]) == 3
    for rank in (0, 1):
        r = json.loads((tmp_path / f"autosp-{rank}.json").read_text())
        assert r["world"] == 2 and len(r["losses"]) == 3, r
        for want, got in zip(ref["losses"], r["losses"]):
            assert abs(got - want) / want < 1e-5, (ref["losses"], r["losses"])
        # what ran: the planner's strategy on both attention layers, half the 64 tokens per rank,
        # and its collectives; the Trainer kept the plain model and trained through autosp's
        assert r["strategies"] == r["planned"], r          # what ran, per layer, is what was planned
        assert r["tokens_per_rank"] == [32, 32], r
        assert sum(n for kind, n in r["collectives"].items() if kind != "all_reduce") > 0, r   # the strategy's
        assert r["wrapped"] == "SequenceParallel" and r["model"] == "LlamaForCausalLM", r
