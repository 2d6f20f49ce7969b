"""One rank of a two-"node" torchrun job (``--nnodes 2``, 2 processes per node) on this machine.

Launched by ``test_two_nodes.py``. The planner is given this machine's CPU profile with the link
between nodes made 20x slower than loopback (what separates real nodes), sees 2 devices per node
from the launch (``LOCAL_WORLD_SIZE``), and plans; the model trains against one process. Rank 0
writes what ran and the errors to ``OUT/result.json``.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from dataclasses import asdict
from datetime import timedelta

import torch
import torch.distributed as dist


def two_node_profile(path: str, slower: float = 20.0) -> str:
    from autosp.costmodel.profile import load_profile

    with open(load_profile("cpu-gloo").path) as f:
        data = json.load(f)
    for table in data["collectives"].values():
        table["inter"] = {size: [{"bytes": r["bytes"], "seconds": r["seconds"] * slower} for r in rows]
                          for size, rows in table["intra"].items()}
    data["name"] = "cpu-gloo, nodes 20x apart"
    with open(path, "w") as f:
        json.dump(data, f)
    return path


def main(out_dir: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    sys.path.insert(0, os.path.dirname(__file__))
    import dist_cases

    import autosp
    from autosp.autoplan import AutoPlanner
    from autosp.strategies.collectives import resolve_group

    rank = dist.get_rank()
    profile = two_node_profile(os.path.join(out_dir, f"profile-{rank}.json"))
    planner = AutoPlanner(autosp.Auto(checkpoint="none"), profile=profile, cache=False)
    res = dist_cases.train_compare("llama", steps=2, plan=planner, heads=4, kv=2)
    sp_groups = res.pop("runtime")
    nodes: list = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, os.environ["GROUP_RANK"])
    groups = {k: [nodes[r] for r in dist.get_process_group_ranks(resolve_group(v))]
              for k, v in sp_groups.items() if k != "group_name"}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, groups)
    if rank == 0:
        keep = ("loss_err", "grad_err", "param_err", "strategies", "plan_layers", "report")
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump({**{k: res[k] for k in keep}, "groups": every, "local_world": os.environ["LOCAL_WORLD_SIZE"],
                       "devices_per_node": res["plan_devices_per_node"]}, f,
                      default=asdict)              # the plan's typed layers, as the plan file holds them
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
