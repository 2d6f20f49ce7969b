"""What is planned, as one frozen value: the graph, the world, the profile, the budget, ZeRO, the
compiler and the space the ILP searches.

    problem = Problem.of("llama3-8b", seq_len=131072, world_size=8, profile="h100-sxm", zero_stage=3)
    plan(problem)            # autosp.planner.search
    max_seq_len(problem)     # autosp.planner.longest

``Problem.of`` is the one place every default is set (the profile's devices per node, the
memory limit: the device's memory less what the runtime holds outside the allocator, the margin,
the search space); ``autosp plan``, ``autosp.compile``'s first call (:mod:`autosp.autoplan`) and
the notebooks build the same value, and the first call's plan cache is keyed by it
(:meth:`Problem.key`). Nothing downstream mutates it or reads an option from anywhere else.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Any

from autosp.costmodel.profile import HardwareProfile, load_profile
from autosp.decisions import (CHECKPOINTS, HIDDEN_SIZED, HOST_OPTIMIZERS, LOSS_CHUNKS, MLP_CHUNKS, OFFLOADS,
                              check_compiler, check_zero_stage)
from autosp.errors import AutospError
from autosp.graph import OpGraph, capture
from autosp.options import Auto

# The share of the memory limit a plan leaves free: the memory model's tolerance (its predicted
# peaks are validated to within 5% of the measured ones), so that a plan predicted to fit fits.
MEMORY_MARGIN = 0.05
# "No limit" still needs an (int64-sized) number for the ILP
UNLIMITED = float(2 ** 60)


@dataclass(frozen=True)
class SearchSpace:
    """What the ILP may choose between (each field restricts one decision; the defaults: all).

    ``sp_degrees``: SP degrees (``None``: every divisor of the world); ``strategies``: strategy
    families (``None``: every registered one); ``checkpoints``, ``mlp_chunks`` (token chunks of a
    layer's MLP, 1 = untiled, ``HIDDEN_SIZED``: ALST's own count), ``loss_chunks`` (of the LM
    head and loss), ``offloads`` (whether layers may keep their saved tensors in host memory),
    ``host_optimizers`` (whether optimizer states may live and step in host memory);
    ``overlap=False``: only strategies that do not pipeline collectives with compute;
    ``zero_shards``: ZeRO 3's sharding groups (0: every rank, k: each k ranks; ``None``: the
    whole mesh, and one node where the world spans several); ``tp_degrees``: tensor-parallel
    degrees (``None``: 1, 2, 4 and 8 where they fit a node and divide the heads; the default
    TP 1: the first call plans on the mesh it was given, whose weights the optimizer already
    holds whole; ``autosp plan`` searches them, and ``autosp.compile(model, plan=...)`` applies
    them)."""

    sp_degrees: tuple[int, ...] | None = None
    strategies: tuple[str, ...] | None = None
    checkpoints: tuple[str, ...] = CHECKPOINTS
    mlp_chunks: tuple[int, ...] = MLP_CHUNKS
    loss_chunks: tuple[int, ...] = LOSS_CHUNKS
    offloads: tuple[bool, ...] = OFFLOADS
    host_optimizers: tuple[bool, ...] = HOST_OPTIMIZERS
    overlap: bool = True
    zero_shards: tuple[int, ...] | None = None
    tp_degrees: tuple[int, ...] | None = (1,)

    def __post_init__(self) -> None:
        for name in ("sp_degrees", "strategies", "checkpoints", "mlp_chunks", "loss_chunks", "offloads",
                     "host_optimizers", "zero_shards", "tp_degrees"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, tuple):      # lists from callers: frozen here
                object.__setattr__(self, name, tuple(value))
            if value is not None and not getattr(self, name):
                raise AutospError(f"the search space's {name} is empty; give at least one choice, or None for all")
        bad = [k for k in self.checkpoints if k not in CHECKPOINTS]
        if bad:
            raise AutospError(f"unknown checkpointing {bad}; use some of {', '.join(CHECKPOINTS)}")

    @classmethod
    def within(cls, auto: Auto, **fixed: Any) -> "SearchSpace":
        """The space an :class:`autosp.options.Auto` leaves open (its fields given are fixed), with
        ``fixed`` fields of the space set by the caller (the first call fixes the SP degree)."""
        return cls(checkpoints=auto.checkpoints, mlp_chunks=auto.mlp_chunk_choices,
                   loss_chunks=auto.loss_chunk_choices, offloads=auto.offload_choices,
                   host_optimizers=auto.host_optimizer_choices, **fixed)

    def words(self) -> str:
        """The space in a few words (the plan cache's key spells it out so a person can read it)."""
        chunks = ("hidden" if c == HIDDEN_SIZED else str(c) for c in self.mlp_chunks)
        parts = ["-".join(self.checkpoints), "c" + "-".join(chunks), "l" + "-".join(map(str, self.loss_chunks))]
        if self.offloads != (False,):
            parts.append("o" + "-".join(str(int(o)) for o in self.offloads))
        if self.host_optimizers != (False,):
            parts.append("h" + "-".join(str(int(h)) for h in self.host_optimizers))
        if self.sp_degrees is not None:
            parts.append("sp" + "-".join(map(str, self.sp_degrees)))
        if self.strategies is not None:
            parts.append("st" + "-".join(self.strategies))
        if self.zero_shards is not None:
            parts.append("zs" + "-".join(map(str, self.zero_shards)))
        if self.tp_degrees != (1,):
            parts.append("tp" + ("-".join(map(str, self.tp_degrees)) if self.tp_degrees else "any"))
        if not self.overlap:
            parts.append("serial")
        return "-".join(parts)


@dataclass(frozen=True)
class Problem:
    """One planning problem. Build it with :meth:`Problem.of`; every field is resolved (no
    ``None`` meaning "look it up later"), so what is planned is what this value says."""

    graph: OpGraph = field(compare=False, repr=False)
    seq_len: int
    world_size: int
    devices_per_node: int
    profile: HardwareProfile = field(compare=False, repr=False)
    memory_limit: float                 # bytes per device the plan must fit
    # what the default limit left out of the device's memory (the CUDA context, NCCL); 0 when given
    runtime_reserved_bytes: float = 0.0
    memory_margin: float = MEMORY_MARGIN
    zero_stage: int = 0
    compiler: str = "inductor"          # what runs the step: Inductor's fused kernels hold less
    documents: tuple[int, ...] = ()     # lengths of the documents packed into each sequence
    space: SearchSpace = SearchSpace()

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise AutospError(f"world size must be at least 1, got {self.world_size}")
        check_zero_stage(self.zero_stage, none_ok=False)
        check_compiler(self.compiler)
        if not 0.0 <= self.memory_margin < 1.0:
            raise AutospError(f"memory margin must be at least 0 and below 1 (a share of the limit), "
                              f"got {self.memory_margin}")
        if not self.memory_limit > 0:
            raise AutospError(f"memory limit must be a positive number of bytes, got {self.memory_limit}")

    @classmethod
    def of(cls, model: Any = None, *, seq_len: int | None = None, batch_size: int = 1, world_size: int = 1,
           devices_per_node: int | None = None, profile: str | HardwareProfile = "h100-sxm",
           memory_limit: float | None = None, device_memory: float | None = None, zero_stage: int = 0,
           dtype: str = "bfloat16", graph: OpGraph | None = None, memory_margin: float = MEMORY_MARGIN,
           compiler: str = "inductor", documents: tuple[int, ...] | None = None,
           zero_shard: int | None = None, space: SearchSpace | None = None, **restrict: Any) -> "Problem":
        """The problem of planning ``model`` (a catalogue name, a config path, a module; or a
        captured ``graph``) at ``seq_len`` tokens on ``world_size`` devices.

        Defaults, here alone: devices per node and the memory from ``profile``; the memory limit
        the device's memory (``device_memory``, else the profile's) less what the runtime holds
        outside PyTorch's allocator (``runtime_reserved_bytes``); the margin 5%; the search space
        everything (``space``, or its fields given as keywords: ``checkpoints=("full",)``);
        ``zero_shard`` fixes ZeRO 3's sharding group (0: every rank, k: each k ranks).
        Without ``seq_len`` (for :func:`autosp.planner.longest.max_seq_len`) the graph is
        captured at a small length: sizes are symbolic, one capture serves every length."""
        prof = profile if isinstance(profile, HardwareProfile) else load_profile(profile)
        if zero_shard is not None:
            restrict["zero_shards"] = (zero_shard,)
        if restrict:
            unknown = sorted(set(restrict) - set(SearchSpace.__dataclass_fields__))
            if unknown:
                raise AutospError(f"unknown planning option(s) {', '.join(unknown)}; the search space takes "
                                  f"{', '.join(SearchSpace.__dataclass_fields__)}")
            space = replace(space or SearchSpace(), **restrict)
        if graph is None:
            if model is None:
                raise AutospError("give the model to plan (a catalogue name, a config.json path or a module), "
                                  "or its captured graph")
            graph = capture(model, seq_len=seq_len or 2 * world_size * 64, batch_size=batch_size, dtype=dtype)
        reserved = 0.0 if memory_limit else prof.runtime_reserved_bytes
        limit = memory_limit or (device_memory or prof.memory_bytes) - reserved
        return cls(graph=graph, seq_len=seq_len or 0, world_size=world_size,
                   devices_per_node=devices_per_node or prof.devices_per_node, profile=prof,
                   memory_limit=UNLIMITED if limit == float("inf") else float(limit),
                   runtime_reserved_bytes=reserved, memory_margin=memory_margin, zero_stage=zero_stage,
                   compiler=compiler, documents=tuple(documents or ()), space=space or SearchSpace())

    # ------------------------------------------------------------------ derived
    @property
    def budget(self) -> float:
        """What the ILP may fill of the limit: the margin kept free for the memory model's error."""
        return self.memory_limit * (1.0 - self.memory_margin)

    @property
    def fused(self) -> bool:
        """Whether the memory model counts Inductor's fused kernels (the step compiled by Inductor)."""
        return self.compiler == "inductor"

    def at(self, **change: Any) -> "Problem":
        """The same problem with some fields changed (``seq_len=``, ``zero_stage=``, ``world_size=``)
        or some of the space's (``offloads=``)."""
        mine = {k: v for k, v in change.items() if k in self.__dataclass_fields__}
        theirs = {k: v for k, v in change.items() if k not in mine}
        return replace(self, **mine, **({"space": replace(self.space, **theirs)} if theirs else {}))

    def key(self, fingerprint: str) -> str:
        """A file name naming this problem (``fingerprint``: the model's): two problems with the
        same key plan the same. Every field enters it, so none can be forgotten."""
        docs = f"-d{hashlib.sha1(str(self.documents).encode()).hexdigest()[:8]}" if self.documents else ""
        margin = "" if self.memory_margin == MEMORY_MARGIN else f"-g{self.memory_margin:g}"
        return (f"{fingerprint}-w{self.world_size}-n{self.devices_per_node}-b{self.graph.batch_size}-s{self.seq_len}"
                f"-{self.graph.dtype}-{self.profile.name}-m{int(self.memory_limit) >> 20}{margin}-z{self.zero_stage}"
                f"-{self.space.words()}{docs}-{self.compiler}")
