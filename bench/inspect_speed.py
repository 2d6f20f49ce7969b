"""Wall time and peak memory of ``autosp inspect`` on big models, as a user runs it.

    python bench/inspect_speed.py

Each case is a fresh ``autosp inspect`` process (imports included); peak memory
is the child's maximum resident set size.
"""

from __future__ import annotations

import resource
import subprocess
import sys
import time

CASES = [("llama3-8b", 131072), ("llama3-70b", 131072), ("llama3.1-405b", 131072)]


def measure(model: str, seq_len: int) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "autosp.cli", "inspect", "--model", model, "--seq-len", str(seq_len),
                    "--json"], check=True, capture_output=True)
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return wall, max(peak, before) / 2 ** 20     # KiB -> GiB (the max over children so far)


def main() -> None:
    print(f"{'model':16s} {'seq':>7s} {'wall (s)':>9s} {'peak RSS (GiB)':>15s}")
    for model, seq in CASES:
        wall, peak = measure(model, seq)
        print(f"{model:16s} {seq:7d} {wall:9.2f} {peak:15.2f}")


if __name__ == "__main__":
    main()
