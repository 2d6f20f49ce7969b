"""``autosp.compile(model, plan="auto")``: plan for the real batch on the first call, then apply.

The planner runs once per batch shape, on the SP group's first rank: it builds the planning
problem (:class:`autosp.planner.problem.Problem`) from the batch's shape, the machine's profile
(``cpu-gloo`` on CPU; the H100/H200/A100 profile on those GPUs), the memory limit
(``autosp.compile(memory_limit=...)``; by default the device's memory less what the runtime holds:
a GPU's capacity, on CPU the available RAM shared by the ranks on this machine), the ZeRO stage and
compiler that will run the step, and the space ``autosp.Auto`` leaves open; devices per node come
from the launch (``LOCAL_WORLD_SIZE``), else from the profile. The plan is broadcast to the other
ranks and cached on disk under a name derived from the whole problem
(:meth:`Problem.key <autosp.planner.problem.Problem.key>`, in ``$XDG_CACHE_HOME/autosp/plans``), so a
restarted job skips planning.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from autosp.errors import AutospError
from autosp.options import Auto
from autosp.planner.plan import SCHEMA, Plan, model_fingerprint
from autosp.planner.problem import Problem, SearchSpace
from autosp.planner.search import plan


def machine_profile(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu-gloo"
    name = torch.cuda.get_device_name(device).lower()
    for key, prof in (("h200", "h200-sxm"), ("h100", "h100-sxm"), ("a100", "a100-sxm")):
        if key in name:
            return prof
    return "h100-sxm"


def device_memory(device: torch.device, local_ranks: int) -> float:
    """Bytes one rank may use: the GPU's capacity, or on CPU the RAM available now shared by
    the ranks of this machine (``LOCAL_WORLD_SIZE`` from the launcher, else the SP group)."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", local_ranks))
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    except (OSError, StopIteration):
        return float("inf")
    return avail / max(per_node, 1)


def _cache_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "autosp", "plans")


@functools.cache
def planner_version() -> str:
    """A digest of what plans are made from: the capture, cost model, planner, strategies and
    shipped profiles. A cached plan is read back only by the autosp that made it (a plan cached
    before the memory model changed would otherwise outlive the change)."""
    root = Path(__file__).parent
    h = hashlib.sha1()
    for part in ("graph", "costmodel", "planner", "strategies", "profiles"):
        for f in sorted((root / part).rglob("*")):
            if f.suffix in (".py", ".json"):
                h.update(f.read_bytes())
    return h.hexdigest()[:8]


@dataclass(frozen=True)
class AutoPlanner:
    """Plans at the SP wrapper's first forward of each batch shape:
    ``(module, batch_size, seq_len, group, documents) -> Plan``, or ``None`` where planning failed
    and ``fallback`` lets the caller run its default choice (said in a warning).

    ``auto`` is what it may choose (:class:`autosp.options.Auto`: a field given is fixed);
    ``memory_limit`` bytes per device (``None``: the device's memory less what the runtime holds);
    ``profile`` a profile name or path (``None``: this machine's); ``compiler`` and ``zero_stage``
    what the runtime applies (their memory is planned for; :func:`autosp.transform.api.build`
    gives them where the caller left them out)."""

    auto: Auto = Auto()
    memory_limit: float | None = None
    fallback: bool = False
    profile: str | None = None
    cache: bool = True
    compiler: str | None = None
    zero_stage: int | None = None
    overlap: bool = True                  # False: plan only unpipelined strategies

    def __call__(self, module: nn.Module, batch_size: int, seq_len: int, group: dist.ProcessGroup,
                 documents: tuple[int, ...] = ()) -> Plan | None:
        world = dist.get_world_size(group)
        # (plan JSON, error): every rank learns the outcome, so a failure raises on all of them
        # together instead of leaving the others waiting in a collective
        payload: list[Any] = [(None, None)]
        if dist.get_rank(group) == 0:
            try:
                payload[0] = (self.plan(module, batch_size, seq_len, world, documents).to_json(), None)
            except Exception as e:  # noqa: BLE001 - reported; the caller falls back or raises
                payload[0] = (None, (type(e).__name__, str(e)))
        dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0), group=group)
        plan_json, error = payload[0]
        if error is not None:
            kind, message = error
            why = message if kind == "AutospError" else f"{kind}: {message[:300]}"
            see = (f"`autosp plan --model <config.json | module:factory> --seq-len {seq_len} --batch-size {batch_size} "
                   f"--world-size {world}` shows why")
            if not self.fallback:
                # a budget the user set holds or fails: never a silent run without it
                raise AutospError(f"autosp could not plan this model under the memory limit it was given ({why}); "
                                  f"{see}")
            import warnings

            warnings.warn(f"autosp could not plan this model ({why[:200]}); using the default strategy choice "
                          f"instead; {see} (only the default memory budget falls back: with memory_limit= this "
                          "is an error)", stacklevel=3)
            return None
        return Plan.from_dict(json.loads(plan_json))

    def problem(self, module: nn.Module, batch_size: int, seq_len: int, world: int,
                documents: tuple[int, ...] = ()) -> Problem:
        """What is planned for a batch of ``batch_size`` x ``seq_len`` tokens on ``world`` ranks."""
        param = next(module.parameters())
        profile = self.profile or machine_profile(param.device)
        # devices per node: the launch's (torchrun sets LOCAL_WORLD_SIZE), else the profile's
        dpn = int(os.environ["LOCAL_WORLD_SIZE"]) if os.environ.get("LOCAL_WORLD_SIZE") else None
        return Problem.of(module, seq_len=seq_len, batch_size=batch_size, world_size=world, devices_per_node=dpn,
                          profile=profile, memory_limit=self.memory_limit,
                          device_memory=device_memory(param.device, world),
                          zero_stage=self.zero_stage or 0, dtype=str(param.dtype).replace("torch.", ""),
                          compiler=self.compiler or "inductor", documents=documents,
                          space=SearchSpace.within(self.auto, sp_degrees=(world,), overlap=self.overlap,
                                                   tp_degrees=(1,)))     # the mesh (and its TP) is the caller's

    def plan(self, module: nn.Module, batch_size: int, seq_len: int, world: int,
             documents: tuple[int, ...] = ()) -> Plan:
        """The plan for this batch shape: read back from the cache where this problem was planned
        before (by this autosp), else planned and cached."""
        problem = self.problem(module, batch_size, seq_len, world, documents)
        path = self.cache_path(problem)
        if self.cache and os.path.exists(path):
            return Plan.load(path)
        p = plan(problem)
        if self.cache:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            p.save(tmp)
            os.replace(tmp, path)            # atomic: concurrent jobs never read half a file
        return p

    @staticmethod
    def cache_path(problem: Problem) -> str:
        """Where the plan of ``problem`` is cached: named by the plan schema, the planner's version and
        the problem's every field (plans of another schema or planner are never read back)."""
        schema = SCHEMA.rsplit("/", 1)[-1]
        return os.path.join(_cache_dir(), f"v{schema}-{planner_version()}-"
                                          f"{problem.key(model_fingerprint(problem.graph))}.json")
