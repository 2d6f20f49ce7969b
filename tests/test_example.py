"""The README's example as a user runs it: torchrun on 2 CPU processes equals one process."""

import os
import re
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_tiny.py")
ARGS = ["--steps", "3", "--seq-len", "256"]


def _losses(cmd: list[str]) -> list[float]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
    # Own process group: on a timeout the launcher *and* its workers are killed.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == 0, err[-3000:]
    return [float(x) for x in re.findall(r"^step \d+ loss ([0-9.]+)$", out, re.M)]


def test_train_tiny_sp2_prints_single_process_losses():
    single = _losses([sys.executable, SCRIPT, *ARGS])
    sp = _losses([sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc-per-node", "2", SCRIPT, *ARGS])
    assert len(single) == len(sp) == 3
    for a, b in zip(single, sp):
        assert abs(a - b) / a < 1e-5, (single, sp)
