"""The decisions a plan makes, as frozen typed values: the contract from planner to runtime.

    LayerChoice   per class of identical layers: attention strategy, activation checkpointing,
                  token chunks of the MLP (and, fully checkpointed, whether the MLP's input is kept),
                  offload of what it keeps to host memory
    MeshChoice    per mesh: SP degree, TP degree, token layout, token chunks of the LM head and loss,
                  the ZeRO stage and ZeRO 3's sharding group, optimizer states on the host
    Decisions     what the runtime applies: one LayerChoice per transformer layer (or one for
                  all) and the MeshChoice

The same objects are the ILP's keys (:mod:`autosp.planner.ilp`: an option of a layer class *is*
a ``LayerChoice``, a mesh candidate *is* a ``MeshChoice``), the fields of a
:class:`autosp.planner.plan.Plan`, and what :mod:`autosp.transform` consumes: no field is copied
by hand between them, and the spaces the planner searches (``CHECKPOINTS``, ``MLP_CHUNKS``,
``LOSS_CHUNKS``) are defined here once. A strategy is named by its spec (``"ulysses"``,
``"hybrid:2x4"``, ``"auto"``: the default choice per attention op); the registry in
:mod:`autosp.strategies` checks it, this module only carries it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from autosp.errors import AutospError

CHECKPOINTS = ("none", "selective", "full")    # activation checkpointing per layer
# In MLP_CHUNKS: as many chunks as ALST's TiledMLP runs, ceil(tokens per rank / hidden size), planned where
# that is more than the largest fixed count (at millions of tokens: chunks of about the hidden size)
HIDDEN_SIZED = -1
MLP_CHUNKS = (1, 8, 32, HIDDEN_SIZED)    # token chunks of a layer's MLP the planner chooses between (1: untiled)
LOSS_CHUNKS = (1, 8, 64, 256)         # ... and of the LM head and loss
OFFLOADS = (False, True)     # whether a layer class keeps its saved tensors in host memory
HOST_OPTIMIZERS = (False, True)    # whether optimizer states (and fp32 master weights) live and step on the host
LAYOUTS = ("contiguous", "zigzag", "balanced")


def mlp_chunk_counts(allowed: tuple[int, ...], tokens: float, hidden: float) -> tuple[int, ...]:
    """The MLP chunk counts planned at ``tokens`` per rank: ``allowed``, with HIDDEN_SIZED made ALST's own
    count, ceil(tokens / hidden), where that is more than the others (else, or with no hidden size, left out)."""
    fixed = tuple(c for c in allowed if c != HIDDEN_SIZED)
    alst = math.ceil(tokens / hidden) if hidden > 0 else 0
    return fixed + ((alst,) if HIDDEN_SIZED in allowed and alst > max(fixed, default=1) else ())


COMPILERS = ("inductor", "aot_eager", "eager")     # what may run a sharded step (autosp.options.Runtime)


def check_positive(name: str, k: Any, none_ok: bool = False) -> None:
    """A count of chunks (or an SP degree): a positive integer (``None`` too where ``none_ok``)."""
    if none_ok and k is None:
        return
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise AutospError(f"{name} must be a positive integer (1 = untiled){' or None' if none_ok else ''}, got {k!r}")


def check_zero_stage(stage: Any, none_ok: bool = True) -> None:
    """A ZeRO stage: 0-3, or (where ``none_ok``) ``None``: no ZeRO from autosp, gradients summed over
    each SP group inside the graphs."""
    if (none_ok and stage is None) or (not isinstance(stage, bool) and stage in (0, 1, 2, 3)):
        return
    raise AutospError(f"ZeRO stage must be 0, 1, 2 or 3{' (or None: no ZeRO)' if none_ok else ''}, got {stage!r}")


def check_compiler(name: Any) -> None:
    """A compiler autosp runs sharded graphs with."""
    if name not in COMPILERS:
        raise AutospError(f"unknown compiler '{name}'; use one of {', '.join(COMPILERS)}")


@dataclass(frozen=True)
class LayerChoice:
    """What one class of identical layers does (an ILP option, a plan's per-class decision)."""

    strategy: str = "auto"
    checkpoint: str = "none"
    mlp_chunks: int = 1
    offload: bool = False        # what the layer keeps for its backward waits in host memory
    # Under full checkpointing with a tiled MLP: True, the MLP block is a recompute region of its own
    # whose input is kept (one hidden state more per layer, the attention's recompute not alive
    # during the MLP chunks' backward); False, the whole layer is one region that keeps its input
    # alone (what a long context on many layers needs; offloaded, half the host memory).
    keep_mlp_input: bool = True

    def __post_init__(self) -> None:
        if self.checkpoint not in CHECKPOINTS:
            raise AutospError(f"unknown checkpointing '{self.checkpoint}'; use one of {', '.join(CHECKPOINTS)}")
        check_positive("mlp_chunks", self.mlp_chunks)
        for name in ("offload", "keep_mlp_input"):
            if not isinstance(getattr(self, name), bool):
                raise AutospError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def mlp_region_of_its_own(self) -> bool:
        """A fully checkpointed layer's tiled MLP recomputes as a region of its own (input kept)."""
        return self.checkpoint == "full" and self.mlp_chunks > 1 and self.keep_mlp_input

    @property
    def mlp_with_layer(self) -> bool:
        """A fully checkpointed layer's tiled MLP recomputes with the whole layer (input not kept)."""
        return self.checkpoint == "full" and self.mlp_chunks > 1 and not self.keep_mlp_input


@dataclass(frozen=True)
class MeshChoice:
    """What the whole mesh does (an ILP mesh candidate, a plan's per-mesh decision)."""

    sp_degree: int = 1
    layout: str | None = None    # None: what the layers' strategies need (zigzag for zigzag ring, else contiguous)
    loss_chunks: int = 1
    zero_shard: int = 0          # ZeRO 3: 0 shards parameters over every rank; k over each k (a node: HSDP)
    # Optimizer states and fp32 master weights in host memory, stepped there (each rank its ZeRO share):
    # the device keeps parameters and gradients alone (autosp.transform.host_optimizer)
    host_optimizer: bool = False
    # The ZeRO stage (0-3) run over the mesh, None: none from autosp. Beside zero_shard, so that the
    # ZeRO decisions live in one place; the planner plans the stage it is given (it is not searched).
    zero_stage: int | None = None
    # The tensor-parallel degree: ranks of a node that split each layer's weights (Megatron style,
    # autosp.costmodel.tensor_parallel); SP x TP x DP = the world
    tp_degree: int = 1

    def __post_init__(self) -> None:
        check_zero_stage(self.zero_stage)
        check_positive("tp_degree", self.tp_degree)
        if not isinstance(self.host_optimizer, bool):
            raise AutospError(f"host_optimizer must be True or False, got {self.host_optimizer!r}")
        if self.layout is not None and self.layout not in LAYOUTS:
            raise AutospError(f"unknown token layout '{self.layout}'; use one of {', '.join(LAYOUTS)}")
        check_positive("loss_chunks", self.loss_chunks)
        check_positive("sp_degree", self.sp_degree)


@dataclass(frozen=True)
class Decisions:
    """What the runtime applies. ``layers`` holds one choice per transformer layer in execution
    order, or a single choice for every layer (however graph breaks split them into graphs)."""

    layers: tuple[LayerChoice, ...] = (LayerChoice(),)
    mesh: MeshChoice = MeshChoice()

    @classmethod
    def of(cls, strategy: str | Sequence[str] = "auto", checkpoint: str | Sequence[str] = "none",
           mlp_chunks: int | Sequence[int] = 1, mesh: MeshChoice = MeshChoice(),
           offload: bool | Sequence[bool] = False, keep_mlp_input: bool | Sequence[bool] = True) -> "Decisions":
        """From per-field values, each one for all layers or a list with one per layer."""
        cols = {"strategy": strategy, "checkpoint": checkpoint, "mlp_chunks": mlp_chunks, "offload": offload,
                "keep_mlp_input": keep_mlp_input}
        lists = {k: [v] if isinstance(v, (str, int)) else list(v) for k, v in cols.items()}
        lengths = {len(v) for v in lists.values()} - {1}
        if len(lengths) > 1 or any(len(v) == 0 for v in lists.values()):
            given = ", ".join(f"{k}: {len(v)}" for k, v in lists.items() if len(v) != 1)
            raise AutospError(f"per-layer lists must have one entry per transformer layer, and the same length; "
                              f"got {given or 'an empty list'}")
        n = max(len(v) for v in lists.values())
        layers = tuple(LayerChoice(**{k: v[i if len(v) > 1 else 0] for k, v in lists.items()}) for i in range(n))
        return cls(layers, mesh)

    def layer(self, index: int) -> LayerChoice:
        """Layer ``index``'s choice (transformer layers, or attention ops, in execution order): the
        one rule every stage reads per-layer decisions by. One choice serves every layer; a list
        has one per layer, and an index past its end is refused, never wrapped or defaulted."""
        if len(self.layers) == 1:
            return self.layers[0]
        if not 0 <= index < len(self.layers):
            raise AutospError(f"the per-layer decisions have {len(self.layers)} entries but the model has more "
                              f"layers (layer {index}; a graph break can make one compiled frame serve several); "
                              "give one decision for every layer, or one for all")
        return self.layers[index]

    def any_layer(self, predicate: Callable[[LayerChoice], bool]) -> bool:
        """Whether some layer's choice satisfies ``predicate``."""
        return any(predicate(c) for c in self.layers)
