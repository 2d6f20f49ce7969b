"""``Plan``: the planner's answer as a versioned JSON document.

A plan names the model (by a structural fingerprint), the world layout (SP x DP),
the token layout, per layer class the attention strategy (with its Ulysses x ring
grid) and activation checkpointing, the predicted step time and memory, and the runner-up
alternatives with their predictions. ``check`` refuses a plan made for another
model, world size or sequence length.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from autosp.errors import AutospError

SCHEMA = "autosp.plan/2"     # 2: the Ulysses x ring grid is per layer class, not global


def model_fingerprint(graph) -> str:
    """Structure of the model: layer classes (fingerprint x count), parameter count, and attention
    dropout (it changes which strategies may run)."""
    parts = sorted(f"{lc.fingerprint}x{lc.count}" for lc in graph.layer_classes.values())
    dropout = "|dropout" if graph.attention_dropout else ""
    return hashlib.sha1(f"{graph.total_params}|{'|'.join(parts)}{dropout}".encode()).hexdigest()[:16]


@dataclass
class Plan:
    model: str
    fingerprint: str
    seq_len: int
    batch_size: int
    dtype: str
    world_size: int
    devices_per_node: int
    sp_degree: int
    dp_degree: int
    layout: str
    # per layer class: class, fingerprint, count, strategy, checkpoint, mlp_chunks, ulysses_degree, ring_degree
    layers: list[dict[str, Any]]
    predicted: dict[str, Any]                 # compute_s, exposed_comm_s, total_s, memory, ...
    profile: str
    memory_limit_bytes: float
    zero_stage: int
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    solver: dict[str, Any] = field(default_factory=dict)
    schema: str = SCHEMA
    loss_chunks: int = 1                      # token chunks of the LM head and loss (1: untiled)
    memory_margin: float = 0.0                # share of the limit left free for the memory model's error
    zero_shard: int = 0                       # ZeRO 3: 0 shards over every rank; k over each k (a node, HSDP)

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
        if data.get("schema") != SCHEMA:
            raise AutospError(f"plan file {path} has schema '{data.get('schema')}', this autosp reads '{SCHEMA}'; "
                              "re-plan with `autosp plan`")
        try:
            return cls(**data)
        except TypeError as e:
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

    def strategy_per_layer(self) -> list[str]:
        """One strategy per attention layer, in execution order (classes in model order)."""
        out: list[str] = []
        for layer in self.layers:
            out += [layer["strategy"]] * layer["count"]
        return out

    def strategy(self) -> str | list[str]:
        """What ``autosp.compile(strategy=...)`` applies: one strategy when every layer class has
        the same (it holds however graph breaks split the layers into compiled graphs), else one
        per attention layer."""
        per_layer = self.strategy_per_layer()
        return per_layer[0] if len(set(per_layer)) == 1 else per_layer

    def checkpoint(self) -> str | list[str]:
        """Activation checkpointing to apply: one mode for every layer, or one per layer."""
        per_layer = [layer["checkpoint"] for layer in self.layers for _ in range(layer["count"])]
        return per_layer[0] if len(set(per_layer)) == 1 else per_layer

    def mlp_chunks(self) -> int | list[int]:
        """Token chunks of each layer's MLP (1: untiled): one count for every layer, or one per layer
        (plans written before the decision existed: 1)."""
        per_layer = [layer.get("mlp_chunks", 1) for layer in self.layers for _ in range(layer["count"])]
        return per_layer[0] if len(set(per_layer)) == 1 else per_layer
