"""Two torchrun "nodes" of 2 processes each on this machine: planned by node, exact."""

import json
import os
import subprocess
import sys

from autosp.tools.launch import free_port

HERE = os.path.dirname(__file__)


def test_two_nodes_keep_ulysses_inside_a_node_and_ring_across(tmp_path):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                               "--node-rank", str(i), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                               "--rdzv-id", "autosp-two-nodes", os.path.join(HERE, "two_nodes.py"), str(tmp_path)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = []
    try:
        for p in nodes:
            logs.append(p.communicate(timeout=300)[0])
    finally:
        for p in nodes:
            p.kill()
    assert all(p.returncode == 0 for p in nodes), "\n".join(log[-3000:] for log in logs)
    with open(tmp_path / "result.json") as f:
        r = json.load(f)
    # the planner took 2 devices per node from the launch and split the SP group by node
    assert r["local_world"] == "2" and r["devices_per_node"] == 2
    assert [(c["choice"]["strategy"], c["ulysses_degree"], c["ring_degree"]) for c in r["plan_layers"]] == [("hybrid:2x2", 2, 2)]
    assert r["strategies"] == ["hybrid:2x2"] * 2
    for groups in r["groups"]:      # per rank: the nodes of its Ulysses group's and its ring group's ranks
        assert len(set(groups["ulysses_group"])) == 1, groups            # Ulysses inside one node
        assert len(set(groups["ring_group"])) == 2, groups               # the ring spans both nodes
    assert r["report"]["collectives"]["all_to_all"]["calls"] == 16        # Ulysses: 8 per attention op and step
    assert r["report"]["collectives"]["send_recv"]["calls"] > 0           # ring across the nodes
    assert r["loss_err"] < 1e-6 and r["grad_err"] < 1e-4, r       # the suite's bounds (AdamW steps amplify rounding)
