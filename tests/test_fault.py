"""A rank killed mid-backward: torchrun restarts the job, which resumes from autosp.checkpoint
and trains on as if nothing happened (tests/fault_job.py)."""

import json
import os
import subprocess
import sys

import pytest
import torch

JOB = os.path.join(os.path.dirname(__file__), "fault_job.py")
STEPS, EVERY, KILL = 6, 2, 3          # checkpoints after steps 1, 3, 5; rank 1 dies in step 3's backward


def _start(out: str, *kill: int) -> subprocess.Popen:
    """One torchrun job of 2 gloo ranks (eager graphs: what is tested is the restart, not a compiler)."""
    os.makedirs(out)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AUTOSP_COMPILER": "eager",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", JOB, out, str(STEPS), str(EVERY), *map(str, kill)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _finish(job: subprocess.Popen, out: str) -> dict[int, list[dict]]:
    """Each rank's finished steps, in the order they finished."""
    try:
        _, err = job.communicate(timeout=300)
    finally:
        job.kill()
    assert job.returncode == 0, err[-3000:]
    logs = {}
    for rank in (0, 1):
        with open(os.path.join(out, f"rank{rank}.jsonl")) as f:
            logs[rank] = [json.loads(line) for line in f]
    return logs


def test_a_rank_killed_mid_backward_restarts_resumes_and_trains_on_unchanged(tmp_path):
    whole, killed = str(tmp_path / "whole"), str(tmp_path / "killed")
    jobs = _start(whole), _start(killed, KILL)          # side by side: each waits on its own ranks mostly
    ref, got = _finish(jobs[0], whole), _finish(jobs[1], killed)
    assert [r["step"] for r in ref[0]] == list(range(STEPS)) and {r["attempt"] for r in ref[0]} == {0}
    for rank in (0, 1):
        first = [r for r in got[rank] if r["attempt"] == 0]
        again = [r for r in got[rank] if r["attempt"] == 1]
        assert again, f"rank {rank} was not restarted"
        # Rank 1 died inside step 3: its first attempt finished steps 0-2, no more.
        if rank == 1:
            assert [r["step"] for r in first] == [0, 1, 2]
        # The restart resumed after the newest checkpoint every rank finished (step 1's; step 3's
        # was never written whole), and ran each later step once.
        assert [r["step"] for r in again] == list(range(2, STEPS)), again
        # Nothing lost, nothing repeated: the steps that count are the first attempt's up to the
        # checkpoint and the second's after it, and their losses are the uninterrupted run's.
        history = [r for r in first if r["step"] <= 1] + again
        assert [r["step"] for r in history] == list(range(STEPS))
        assert [r["loss"] for r in history] == [r["loss"] for r in ref[rank]]
    # the parameters at the end are the uninterrupted run's, bit for bit
    a, b = torch.load(os.path.join(whole, "final.pt")), torch.load(os.path.join(killed, "final.pt"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    steps = sorted(d for d in os.listdir(os.path.join(killed, "ckpt")))
    assert steps == ["step-1", "step-3", "step-5"]


def test_latest_skips_a_checkpoint_a_killed_rank_left_half_written(tmp_path):
    import warnings

    import autosp.checkpoint as ckpt

    assert ckpt.latest(str(tmp_path / "none yet")) is None
    model = torch.nn.Linear(2, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # DCP in one process, without a process group
        for step in (10, 2, 7):
            ckpt.save(model, None, str(tmp_path / f"s{step}"), step=step)
        os.makedirs(tmp_path / "s99")            # the newest name, never finished: no .metadata
        assert ckpt.latest(str(tmp_path)) == str(tmp_path / "s10")      # by step, not by name
        for name in ("a", "b"):                  # saved without a step: the last by name
            ckpt.save(model, None, str(tmp_path / "nostep" / name))
        assert ckpt.latest(str(tmp_path / "nostep")) == str(tmp_path / "nostep" / "b")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
