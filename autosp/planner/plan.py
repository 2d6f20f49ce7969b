"""``Plan``: the planner's answer, a frozen typed value and a versioned JSON document.

A plan names the model (by a structural fingerprint), the world (SP x TP x DP), the mesh's decisions
(:class:`autosp.decisions.MeshChoice`: SP degree, TP degree, token layout, loss tiling, the ZeRO stage and
ZeRO 3's sharding group, where the optimizer steps), per layer class its decisions
(:class:`autosp.decisions.LayerChoice`) with the strategy's Ulysses x ring grid, what it predicts
(:class:`Predicted`: the step time and its parts, the peak and its breakdown, host memory, what
binds) and the runner-ups (:class:`RunnerUp`). Everything is frozen: a plan is made once, by
:func:`autosp.planner.search.plan`, and read. ``check`` refuses a plan made for another model,
world size or sequence length; ``decisions()`` is what the runtime applies.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Any

from autosp.decisions import Decisions, LayerChoice, MeshChoice
from autosp.errors import AutospError

# 4: typed predictions and runner-ups, the ZeRO stage in the mesh; 3: typed decisions; 2: flat fields.
# The older ones are still read.
SCHEMA = "autosp.plan/4"
_READS = ("autosp.plan/2", "autosp.plan/3", SCHEMA)


def model_fingerprint(graph) -> str:
    """Structure of the model: layer classes (fingerprint x count), parameter count, and attention
    dropout (it changes which strategies may run)."""
    parts = sorted(f"{lc.fingerprint}x{lc.count}" for lc in graph.layer_classes.values())
    dropout = "|dropout" if graph.attention_dropout else ""
    return hashlib.sha1(f"{graph.total_params}|{'|'.join(parts)}{dropout}".encode()).hexdigest()[:16]


@dataclass(frozen=True)
class LayerPlan:
    """A class of ``count`` structurally identical layers and what the plan has them do."""

    module_type: str
    fingerprint: str
    count: int
    choice: LayerChoice
    ulysses_degree: int = 1
    ring_degree: int = 1
    overlap: str = "none"               # how the strategy pipelines its collectives, in words
    exposed_comm_s: float = 0.0         # predicted SP communication left exposed, all ``count`` layers


@dataclass(frozen=True)
class Memory:
    """Predicted bytes per device at the step's peak, by what holds them."""

    parameters: float
    optimizer: float                    # on the device (0 where the optimizer steps on the host)
    gradients: float
    activations: float
    peak: float


@dataclass(frozen=True)
class LiveTensor:
    """One of the captured step's largest tensors alive at its peak (before checkpointing and tiling)."""

    op: str
    target: str
    phase: str
    layer: int | None
    shape: tuple[int, ...]
    bytes: float


@dataclass(frozen=True)
class BoundBy:
    """Where device memory peaks (what bounds a longer context), and the host memory taken of its budget."""

    phase: str
    bytes: float
    host_bytes: float
    host_budget: float


@dataclass(frozen=True)
class Predicted:
    """What the plan predicts for one step, per device."""

    total_s: float
    compute_s: float
    exposed_comm_s: float
    exposed_copy_s: float               # offloaded layers' host copies left exposed
    peak_bytes: float
    memory: Memory
    host_bytes: float                   # host memory per rank: offloaded checkpoints and optimizer states
    host_optimizer_bytes: float
    host_optimizer_step_s: float
    tokens_per_s_per_device: float
    mfu: float
    saved_by: tuple[tuple[str, float], ...]     # (memory decision, peak bytes it saves)
    largest_live: tuple[LiveTensor, ...]
    bound_by: BoundBy
    compiler: str                       # what the memory model assumed runs the step
    runtime_reserved_bytes: float = 0.0     # left out of the device's memory by the default limit
    documents: tuple[int, ...] = ()         # packed documents the attention costs assumed
    # of exposed_comm_s, TP's collectives and the layers' SP collectives (the rest: the gradient
    # reduction over SP x DP and ZeRO's gathers)
    exposed_tp_s: float = 0.0
    exposed_sp_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["saved_by"] = dict(self.saved_by)
        for optional in ("runtime_reserved_bytes", "documents"):      # written only where they say something
            if not out[optional]:
                del out[optional]
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Predicted":
        """From its JSON form; what an older plan did not predict reads as 0 (its decisions still apply)."""
        numbers = {f.name: float(d.get(f.name, 0.0)) for f in fields(cls) if f.type == "float"}
        memory = {f.name: 0.0 for f in fields(Memory)} | d.get("memory", {})
        bound = {"phase": "", "bytes": 0.0, "host_bytes": 0.0, "host_budget": 0.0} | d.get("bound_by", {})
        return cls(**numbers, memory=Memory(**memory), saved_by=tuple(d.get("saved_by", {}).items()),
                   largest_live=tuple(LiveTensor(**{**t, "shape": tuple(t["shape"])}) for t in d.get("largest_live", ())),
                   bound_by=BoundBy(**bound), compiler=d.get("compiler", ""), documents=tuple(d.get("documents", ())))


@dataclass(frozen=True)
class RunnerUpLayer:
    fingerprint: str
    module_type: str
    choice: LayerChoice


@dataclass(frozen=True)
class RunnerUp:
    """Another plan the solver found, slower (or no faster) than the chosen one."""

    mesh: MeshChoice
    layers: tuple[RunnerUpLayer, ...]
    total_s: float
    compute_s: float
    exposed_comm_s: float
    exposed_copy_s: float
    peak_bytes: float
    host_bytes: float
    mfu: float

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunnerUp":
        return cls(**{**d, "mesh": MeshChoice(**d["mesh"]),
                      "layers": tuple(RunnerUpLayer(**{**x, "choice": LayerChoice(**x["choice"])})
                                      for x in d["layers"])})


@dataclass(frozen=True)
class Solver:
    """How the plan was found."""

    status: str
    candidates: int
    variables: int
    solves: int
    cost_s: float
    solve_s: float


@dataclass(frozen=True)
class Plan:
    model: str
    fingerprint: str
    seq_len: int
    batch_size: int
    dtype: str
    world_size: int
    devices_per_node: int
    dp_degree: int
    mesh: MeshChoice
    layers: tuple[LayerPlan, ...]             # per layer class, in model order
    predicted: Predicted
    profile: str
    memory_limit_bytes: float
    memory_margin: float                      # share of the limit left free for the memory model's error
    alternatives: tuple[RunnerUp, ...] = ()
    solver: Solver | None = None
    schema: str = SCHEMA

    def __post_init__(self) -> None:      # sequences given as lists: frozen here, as every field is
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "alternatives", tuple(self.alternatives))

    # ------------------------------------------------------------------ io
    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out.update(mesh=asdict(self.mesh), layers=[asdict(x) for x in self.layers],
                   predicted=self.predicted.to_dict(), alternatives=[asdict(a) for a in self.alternatives],
                   solver=asdict(self.solver) if self.solver else None)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        """A plan from its JSON form (an older schema's brought up to this one)."""
        if data.get("schema") not in _READS:
            raise AutospError(f"plan schema '{data.get('schema')}' is not one this autosp reads "
                              f"({', '.join(_READS)}); re-plan with `autosp plan`")
        data = _upgrade(data)
        return cls(**{**data, "mesh": MeshChoice(**data["mesh"]),
                      "layers": tuple(LayerPlan(**{**x, "choice": LayerChoice(**x["choice"])}) for x in data["layers"]),
                      "predicted": Predicted.from_dict(data["predicted"]),
                      "alternatives": tuple(RunnerUp.from_dict(a) for a in data.get("alternatives", ())),
                      "solver": Solver(**data["solver"]) if data.get("solver") else None})

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            f.write(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        try:
            with open(path) as f:
                data = json.load(f)
        except FileNotFoundError:
            raise AutospError(f"plan file {path} does not exist; make one with `autosp plan ... --out {path}`") \
                from None
        except json.JSONDecodeError as e:
            raise AutospError(f"plan file {path} is not valid JSON ({e.msg} at line {e.lineno})") from None
        try:
            return cls.from_dict(data)
        except AutospError as e:
            raise AutospError(f"plan file {path}: {e}") from None
        except (TypeError, KeyError, ValueError) as e:
            raise AutospError(f"plan file {path} is malformed ({e}); re-plan with `autosp plan`") from None

    # ------------------------------------------------------------------ applying
    def check(self, *, fingerprint: str | None = None, world_size: int | None = None,
              seq_len: int | None = None) -> None:
        """Refuse to apply this plan to another model, world size or sequence length."""
        if fingerprint is not None and fingerprint != self.fingerprint:
            raise AutospError(f"this plan was made for model '{self.model}' (fingerprint {self.fingerprint}), not "
                              f"this one ({fingerprint}); re-plan for this model")
        if world_size is not None and world_size != self.world_size:
            raise AutospError(f"this plan is for {self.world_size} devices but the job runs on {world_size}; "
                              f"re-plan with --world-size {world_size}")
        if seq_len is not None and seq_len != self.seq_len:
            raise AutospError(f"this plan is for sequence length {self.seq_len}, the batch has {seq_len}; "
                              f"re-plan with --seq-len {seq_len}")

    def summary(self) -> RunnerUp:
        """The chosen plan in its runner-ups' form (for tables that show them side by side)."""
        pr = self.predicted
        return RunnerUp(mesh=self.mesh, layers=tuple(RunnerUpLayer(x.fingerprint, x.module_type, x.choice)
                                                     for x in self.layers),
                        total_s=pr.total_s, compute_s=pr.compute_s, exposed_comm_s=pr.exposed_comm_s,
                        exposed_copy_s=pr.exposed_copy_s, peak_bytes=pr.peak_bytes, host_bytes=pr.host_bytes,
                        mfu=pr.mfu)

    def per_layer(self) -> list[LayerChoice]:
        """One choice per transformer layer, in execution order (classes in model order)."""
        return [layer.choice for layer in self.layers for _ in range(layer.count)]

    def decisions(self) -> Decisions:
        """What the runtime applies: the layers' choices (one for all when every layer has the same:
        that holds however graph breaks split the layers into compiled graphs) and the mesh's."""
        choices = self.per_layer()
        return Decisions(tuple(choices[:1]) if len(set(choices)) == 1 else tuple(choices), self.mesh)


def _upgrade(data: dict[str, Any]) -> dict[str, Any]:
    """A plan of schema 2 or 3 in schema 4's form."""
    data = dict(data)
    if data["schema"] == "autosp.plan/2":            # flat per-layer dicts, flat mesh fields
        data["mesh"] = {"sp_degree": data.pop("sp_degree"), "layout": data.pop("layout"),
                        "loss_chunks": data.pop("loss_chunks", 1), "zero_shard": data.pop("zero_shard", 0)}
        data["layers"] = [{"module_type": d["class"], "fingerprint": d.get("fingerprint", ""), "count": d["count"],
                           "choice": {"strategy": d["strategy"], "checkpoint": d["checkpoint"],
                                      "mlp_chunks": d.get("mlp_chunks", 1)},
                           "ulysses_degree": d.get("ulysses_degree", 1), "ring_degree": d.get("ring_degree", 1),
                           "overlap": d.get("overlap", "none"), "exposed_comm_s": d.get("exposed_comm_s", 0.0)}
                          for d in data["layers"]]
        data["alternatives"] = []                    # schema 2 wrote them in a form no longer read
    if data["schema"] in ("autosp.plan/2", "autosp.plan/3"):
        # the ZeRO stage joins zero_shard in the mesh; runner-ups become typed (they share the plan's ZeRO)
        mesh = {**data["mesh"], "zero_stage": data.pop("zero_stage", 0)}
        data["mesh"] = mesh
        data["alternatives"] = [
            {"mesh": {"sp_degree": a["sp"], "layout": a["layout"], "loss_chunks": a.get("loss_chunks", 1),
                      "zero_shard": mesh.get("zero_shard", 0), "host_optimizer": a.get("host_optimizer", False),
                      "zero_stage": mesh["zero_stage"]},
             "layers": [{"fingerprint": fp, "module_type": x["class"],
                         "choice": {k: v for k, v in x.items() if k != "class"}} for fp, x in a["layers"].items()],
             **{k: a.get(k, 0.0) for k in ("total_s", "compute_s", "exposed_comm_s", "exposed_copy_s", "peak_bytes",
                                            "host_bytes", "mfu")}}
            for a in data.get("alternatives", ())]
        data.setdefault("memory_margin", 0.0)
        solver = data.get("solver") or {}
        data["solver"] = {k: solver.get(k, d) for k, d in (("status", "unknown"), ("candidates", 0), ("variables", 0),
                                                           ("solves", 1), ("cost_s", 0.0), ("solve_s", 0.0))} \
            if solver else None
    data["schema"] = SCHEMA
    return data
