"""End-to-end planning time of ``autosp plan`` (fresh process, imports included) and the solve alone.

    python bench/plan_speed.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

CASES = [("llama3-70b", 131072, 64), ("llama3.1-405b", 131072, 128)]


def main() -> None:
    print(f"{'model':16s} {'seq':>7s} {'world':>6s} {'wall (s)':>9s} {'solve (s)':>10s} {'variables':>10s}  plan")
    for model, seq, world in CASES:
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "autosp.cli", "plan", "--model", model, "--seq-len", str(seq),
                            "--world-size", str(world), "--devices-per-node", "8", "--profile", "h100-sxm",
                            "--zero-stage", "3", "--json"], capture_output=True, text=True, check=True)
        wall = time.perf_counter() - t0
        doc = json.loads(r.stdout)
        layer = doc["layers"][0]
        print(f"{model:16s} {seq:7d} {world:6d} {wall:9.2f} {doc['solver']['solve_s']:10.2f} "
              f"{doc['solver']['variables']:10d}  SP {doc['mesh']['sp_degree']} x DP {doc['dp_degree']}, "
              f"{layer['choice']['strategy']}, checkpoint {layer['choice']['checkpoint']}")


if __name__ == "__main__":
    main()
