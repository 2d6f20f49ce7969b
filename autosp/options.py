"""The option groups of ``autosp.compile``: what users tune, as frozen typed values.

    Auto      plan on the first batch (the default), with some memory decisions fixed
    Zero      ZeRO: the stage, the gradient bucket size, the sharding group
    Runtime   how the step runs: the graph compiler, overlap, what outputs hold, who reduces

Each checks its own fields when built, so a typo fails at the line that made it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from autosp.decisions import (CHECKPOINTS, COMPILERS, LOSS_CHUNKS, MLP_CHUNKS, check_compiler, check_positive,
                              check_zero_stage)
from autosp.errors import AutospError

__all__ = ["Auto", "Zero", "Runtime", "COMPILERS", "parse_bytes"]


@dataclass(frozen=True)
class Auto:
    """Plan on the first batch: the ILP picks each layer class's strategy, checkpointing and MLP
    chunks, and the loss's chunks, at the least predicted time within the memory limit. A field
    given here is fixed (the planner chooses the rest around it); ``None`` leaves it to the planner.

    Args:
        checkpoint: ``"none"``, ``"selective"`` or ``"full"`` activation checkpointing for every layer.
        mlp_chunks: token chunks of every layer's MLP (1: untiled).
        loss_chunks: token chunks of the LM head and loss (1: untiled).
        offload: whether every layer's saved tensors wait for the backward in host memory
            (``None``: the planner decides). Default ``False`` at the first call: the copies' CUDA
            path has not run on a GPU yet (``bench/gpu_check.py --only offload`` checks it);
            ``autosp plan`` plans it.
        host_optimizer: whether the optimizer states (and fp32 master weights) live and step in host
            memory (``model.optimizer(cls, ...)`` returns one that does); ``None``: the planner
            decides. Default ``False`` at the first call, as for ``offload``; ``autosp plan`` plans it.
    """

    checkpoint: str | None = None
    mlp_chunks: int | None = None
    loss_chunks: int | None = None
    offload: bool | None = False
    host_optimizer: bool | None = False

    def __post_init__(self) -> None:
        if self.checkpoint is not None and self.checkpoint not in CHECKPOINTS:
            raise AutospError(f"unknown checkpointing '{self.checkpoint}'; use one of {', '.join(CHECKPOINTS)}")
        for name in ("mlp_chunks", "loss_chunks"):
            check_positive(name, getattr(self, name), none_ok=True)
        for name in ("offload", "host_optimizer"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise AutospError(f"{name} must be True, False or None (the planner decides), got {v!r}")

    @property
    def checkpoints(self) -> tuple[str, ...]:
        """The checkpointing modes the planner may choose between."""
        return CHECKPOINTS if self.checkpoint is None else (self.checkpoint,)

    @property
    def mlp_chunk_choices(self) -> tuple[int, ...]:
        return MLP_CHUNKS if self.mlp_chunks is None else (self.mlp_chunks,)

    @property
    def loss_chunk_choices(self) -> tuple[int, ...]:
        return LOSS_CHUNKS if self.loss_chunks is None else (self.loss_chunks,)

    @property
    def offload_choices(self) -> tuple[bool, ...]:
        return (False, True) if self.offload is None else (self.offload,)

    @property
    def host_optimizer_choices(self) -> tuple[bool, ...]:
        return (False, True) if self.host_optimizer is None else (self.host_optimizer,)


@dataclass(frozen=True)
class Zero:
    """ZeRO over the whole mesh (SP x DP), run by autosp.

    Args:
        stage: ``0``: the loss is global over the mesh (one process on the concatenated global batch)
            and gradients are summed over it once, in buckets launched during the backward; ``1``: the
            same, and ``model.optimizer(cls, **kw)`` shards the optimizer states; ``2``: FSDP2 shards
            gradients and optimizer states; ``3``: parameters too, gathered per transformer block inside
            the graph. ``None``: no ZeRO from autosp (gradients summed over each SP group inside the
            graphs; data parallelism, if any, is the caller's).
        bucket_mb: size of the gradient buckets (stages 0 and 1), MiB.
        shard: stage 3: ``"mesh"`` shards parameters over every rank; ``"node"`` (the launch's
            ``LOCAL_WORLD_SIZE``) or a number k over each k consecutive ranks, replicated across (HSDP).
    """

    stage: int | None = None
    bucket_mb: float = 25.0
    shard: int | str = "mesh"

    def __post_init__(self) -> None:
        check_zero_stage(self.stage)
        if not self.bucket_mb > 0:
            raise AutospError(f"bucket_mb must be positive, got {self.bucket_mb!r}")
        if self.shard != "mesh" and self.stage != 3:
            raise AutospError(f"Zero(shard={self.shard!r}) shards ZeRO 3's parameters by node (HSDP); it needs "
                              "stage=3")


@dataclass(frozen=True)
class Runtime:
    """How the sharded step runs.

    Args:
        compiler: how each sharded graph runs: ``"inductor"`` (AOTAutograd + Inductor: fused kernels,
            cheap ops recomputed in backward; the default), ``"aot_eager"`` (AOTAutograd's graphs as
            they are: the same partition and memory, no fusion) or ``"eager"`` (the traced graph with
            autograd as usual: compiles in seconds, for debugging). ``None``: ``$AUTOSP_COMPILER``, else
            ``"inductor"`` (``"aot_eager"`` with a warning where no C++ compiler exists).
        overlap: strategies pipeline their collectives with compute and ZeRO 3 prefetches the next
            block's parameters; ``False`` runs every collective unpipelined, for comparison.
        gather_outputs: sequence-sharded outputs (logits) come back all-gathered (``True``), as this
            rank's tokens (``False``), or by default all-gathered only from graphs that compute no loss.
        reduce_grads: ``True``: every rank's gradients are those of one process on its SP row's batch;
            ``False``: the loss is global over the whole mesh and gradients are this rank's partial
            sums, for the caller's DeepSpeed / FSDP to sum.
    """

    compiler: str | None = None
    overlap: bool = True
    gather_outputs: bool | None = None
    reduce_grads: bool = True

    def __post_init__(self) -> None:
        if self.compiler is not None:
            check_compiler(self.compiler)


_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_bytes(value: float | int | str | None) -> float | None:
    """``memory_limit``: bytes as a number, or a size such as ``"40GiB"`` / ``"80 GB"``."""
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
        return None if value is None else float(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)\s*", value.lower()) if isinstance(value, str) else None
    if m is None or m.group(2) not in _UNITS or float(m.group(1)) <= 0:
        raise AutospError(f"memory_limit must be a positive number of bytes or a size such as '40GiB', got {value!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]
