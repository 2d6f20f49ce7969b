"""``autosp.compile(model, plan="auto")``: plan for the real batch on the first call, then apply.

The planner runs once, on the SP group's first rank, for the shape of the first batch
and the profile of the machine (``cpu-gloo`` on CPU; the H100/H200/A100 profile on
those GPUs); the plan is broadcast to the other ranks and cached on disk by model
fingerprint, world size, sequence length and profile (``$XDG_CACHE_HOME/autosp/plans``),
so a restarted job skips planning. The SP degree is the group's; the planner picks
the attention strategy and activation checkpointing per layer and the token layout at the
least predicted time under a memory limit: ``autosp.compile(memory_limit=...)`` in bytes,
by default the device's (a GPU's capacity; on CPU the available RAM shared by the ranks
on this machine).
Devices per node come from the launch (``LOCAL_WORLD_SIZE``), else from the profile.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from autosp.errors import AutospError


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


class AutoPlanner:
    """Called by the SP wrapper at its first forward: ``(module, batch, seq_len, group) -> Plan``."""

    def __init__(self, profile: str | None = None, cache: bool = True, fallback: bool = False,
                 memory_limit: float | None = None, checkpoints: tuple[str, ...] = ("none", "selective", "full"),
                 overlap: bool = True, mlp_chunks: tuple[int, ...] = (1, 8), loss_chunks: tuple[int, ...] = (1, 8),
                 zero_stage: int | None = None, offloads: tuple[bool, ...] = (False,),
                 host_optimizers: tuple[bool, ...] = (False,)):
        self.profile = profile
        self.cache = cache
        self.memory_limit = memory_limit        # bytes per device; None: the device's
        self.checkpoints = checkpoints
        self.mlp_chunks = mlp_chunks            # token chunks of a layer's MLP the planner may choose
        self.loss_chunks = loss_chunks          # ... and of the LM head and loss
        self.overlap = overlap                  # False: plan only unpipelined strategies
        self.fallback = fallback      # on a planning failure: warn and let the caller use its default
        self.cache_path: str | None = None
        self.zero_stage = zero_stage            # what the runtime applies: its memory is planned for
        self.offloads = offloads                # whether layers may keep saved tensors in host memory
        self.host_optimizers = host_optimizers  # whether the optimizer may step in host memory
        self.compiler: str | None = None        # what runs the step (set by the wrapper): its memory differs

    def __call__(self, module: nn.Module, batch_size: int, seq_len: int, group: dist.ProcessGroup,
                 documents: tuple[int, ...] = ()) -> Any:
        from autosp.planner.plan import Plan

        world = dist.get_world_size(group)
        # (plan JSON, error): every rank learns the outcome, so a failure raises on all of them
        # together instead of leaving the others waiting in a collective
        payload: list[Any] = [(None, None)]
        if dist.get_rank(group) == 0:
            try:
                payload[0] = (self._plan(module, batch_size, seq_len, world, documents).to_json(), None)
            except Exception as e:  # noqa: BLE001 - reported; the caller falls back or raises
                payload[0] = (None, (type(e).__name__, str(e)))
        dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0), group=group)
        plan_json, error = payload[0]
        if error is not None:
            kind, message = error
            if not self.fallback:
                # a budget the user set holds or fails: never a silent run without it
                raise AutospError(message if kind == "AutospError" else f"autosp could not plan this model "
                                  f"({kind}: {message[:300]})")
            import warnings

            warnings.warn(f"autosp could not plan this model ({kind}: {message[:200]}); using the default "
                          "strategy choice instead (only the default memory budget falls back: pass "
                          "memory_limit= to make planning failures errors)", stacklevel=3)
            return None
        import json

        return Plan(**json.loads(plan_json))

    def _plan(self, module: nn.Module, batch_size: int, seq_len: int, world: int,
              documents: tuple[int, ...] = ()) -> Any:
        from autosp.costmodel.profile import load_profile
        from autosp.decisions import HIDDEN_SIZED
        from autosp.graph import capture
        from autosp.planner.plan import SCHEMA, Plan, model_fingerprint
        from autosp.planner.search import plan

        param = next(module.parameters())
        profile = self.profile or machine_profile(param.device)
        dtype = str(param.dtype).replace("torch.", "")
        graph = capture(module, seq_len=seq_len, batch_size=batch_size, dtype=dtype)
        schema = SCHEMA.rsplit("/", 1)[-1]          # plans of another schema are never read back
        # on a GPU the device's memory less what the CUDA context and NCCL hold outside the allocator
        reserved = load_profile(profile).runtime_reserved_bytes if param.device.type == "cuda" else 0.0
        limit = self.memory_limit or device_memory(param.device, world) - reserved
        # devices per node: the launch's (torchrun sets LOCAL_WORLD_SIZE), else the profile's
        dpn = int(os.environ["LOCAL_WORLD_SIZE"]) if os.environ.get("LOCAL_WORLD_SIZE") else None
        chunks = ("hidden" if c == HIDDEN_SIZED else str(c) for c in self.mlp_chunks)     # ALST's count: by tokens
        modes = "-".join(self.checkpoints) + "-c" + "-".join(chunks) + \
            "-l" + "-".join(map(str, self.loss_chunks)) + ("-o" + "-".join(map(str, map(int, self.offloads)))
                                                           if self.offloads != (False,) else "") + \
            ("-h" + "-".join(map(str, map(int, self.host_optimizers))) if self.host_optimizers != (False,) else "")
        docs = f"-d{hashlib.sha1(str(documents).encode()).hexdigest()[:8]}" if documents else ""
        key = (f"v{schema}-{planner_version()}-{model_fingerprint(graph)}-w{world}-b{batch_size}-s{seq_len}-{profile}-"
               f"m{int(limit) >> 20}-z{self.zero_stage}-{modes}{docs}{f'-n{dpn}' if dpn else ''}"
               f"{'' if self.overlap else '-serial'}-{self.compiler or 'inductor'}.json")
        path = os.path.join(_cache_dir(), key)
        self.cache_path = path
        if self.cache and os.path.exists(path):
            return Plan.load(path)
        p = plan(None, graph=graph, seq_len=seq_len, batch_size=batch_size, world_size=world, profile=profile,
                 sp_degrees=(world,), checkpoints=self.checkpoints, memory_limit=limit, documents=documents,
                 devices_per_node=dpn, overlap=self.overlap, mlp_chunks=self.mlp_chunks,
                 loss_chunks=self.loss_chunks, zero_stage=self.zero_stage or 0, offloads=self.offloads,
                 compiler=self.compiler or "inductor", host_optimizers=self.host_optimizers)
        if self.cache:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            p.save(tmp)
            os.replace(tmp, path)            # atomic: concurrent jobs never read half a file
        return p
