"""``Plan``: the planner's answer as a versioned JSON document.

A plan names the model (by a structural fingerprint), the world layout (SP x DP),
the mesh's decisions (:class:`autosp.decisions.MeshChoice`: SP degree, token layout, loss
tiling, ZeRO 3 sharding), per layer class its decisions (:class:`autosp.decisions.LayerChoice`:
attention strategy, checkpointing, MLP tiling) with the strategy's Ulysses x ring grid, the
predicted step time and memory, and the runner-up alternatives with their predictions.
``check`` refuses a plan made for another model, world size or sequence length;
``decisions()`` is what the runtime applies, as the planner chose it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from autosp.decisions import Decisions, LayerChoice, MeshChoice
from autosp.errors import AutospError

SCHEMA = "autosp.plan/3"     # 3: typed decisions (per mesh, per layer class); 2: flat fields, still read
_READS = ("autosp.plan/2", SCHEMA)


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


def _from_v2(data: dict[str, Any]) -> dict[str, Any]:
    """A schema-2 plan (flat per-layer dicts, flat mesh fields) in schema 3's form."""
    data = dict(data)
    data["mesh"] = {"sp_degree": data.pop("sp_degree"), "layout": data.pop("layout"),
                    "loss_chunks": data.pop("loss_chunks", 1), "zero_shard": data.pop("zero_shard", 0)}
    data["layers"] = [{"module_type": d["class"], "fingerprint": d.get("fingerprint", ""), "count": d["count"],
                       "choice": {"strategy": d["strategy"], "checkpoint": d["checkpoint"],
                                  "mlp_chunks": d.get("mlp_chunks", 1)},
                       "ulysses_degree": d.get("ulysses_degree", 1), "ring_degree": d.get("ring_degree", 1),
                       "overlap": d.get("overlap", "none"), "exposed_comm_s": d.get("exposed_comm_s", 0.0)}
                      for d in data["layers"]]
    data["schema"] = SCHEMA
    return data


@dataclass
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
    layers: list[LayerPlan]                   # per layer class, in model order
    predicted: dict[str, Any]                 # compute_s, exposed_comm_s, total_s, memory, ...
    profile: str
    memory_limit_bytes: float
    zero_stage: int
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    solver: dict[str, Any] = field(default_factory=dict)
    schema: str = SCHEMA
    memory_margin: float = 0.0                # share of the limit left free for the memory model's error

    def __post_init__(self) -> None:          # JSON gives dicts: typed on the way in
        if isinstance(self.mesh, dict):
            self.mesh = MeshChoice(**self.mesh)
        self.layers = [layer if isinstance(layer, LayerPlan) else
                       LayerPlan(**{**layer, "choice": LayerChoice(**layer["choice"])}) for layer in self.layers]

    # the mesh's decisions, read where they live
    @property
    def sp_degree(self) -> int:
        return self.mesh.sp_degree

    @property
    def layout(self) -> str:
        return self.mesh.layout

    @property
    def loss_chunks(self) -> int:
        return self.mesh.loss_chunks

    @property
    def zero_shard(self) -> int:
        return self.mesh.zero_shard

    # ------------------------------------------------------------------ io
    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str) -> "Plan":
        try:
            with open(path) as f:
                data = json.load(f)
        except FileNotFoundError:
            raise AutospError(f"plan file {path} does not exist; make one with `autosp plan ... --out {path}`") \
                from None
        except json.JSONDecodeError as e:
            raise AutospError(f"plan file {path} is not valid JSON ({e.msg} at line {e.lineno})") from None
        if data.get("schema") not in _READS:
            raise AutospError(f"plan file {path} has schema '{data.get('schema')}', this autosp reads "
                              f"{' and '.join(_READS)}; re-plan with `autosp plan`")
        try:
            return cls(**(_from_v2(data) if data["schema"] != SCHEMA else data))
        except (TypeError, KeyError, AutospError) as e:
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

    def per_layer(self) -> list[LayerChoice]:
        """One choice per transformer layer, in execution order (classes in model order)."""
        return [layer.choice for layer in self.layers for _ in range(layer.count)]

    def strategy_per_layer(self) -> list[str]:
        return [c.strategy for c in self.per_layer()]

    def decisions(self) -> Decisions:
        """What the runtime applies: the layers' choices (one for all when every layer has the same:
        that holds however graph breaks split the layers into compiled graphs) and the mesh's."""
        choices = self.per_layer()
        return Decisions(tuple(choices[:1]) if len(set(choices)) == 1 else tuple(choices), self.mesh)
