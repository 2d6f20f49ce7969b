"""The SP attention strategy interface and its registry.

A strategy is one module that declares, in one place, everything the rest of
autosp needs to know about one way of running attention over a sequence-sharded
group of ranks:

  legality   :meth:`Strategy.illegal`   heads and KV heads, ranks, layout, masks
  costs      :meth:`Strategy.cost`      attention kernel calls per rank, the
                                         collectives per call with their bytes,
                                         which of them overlap with which kernel
                                         work, and workspace memory
  runtime    :attr:`Strategy.attention_fn` and :meth:`Strategy.setup`: the function
                                         that replaces ``scaled_dot_product_attention``
                                         in the graph, and the process groups it needs

The cost model turns the declarations into seconds and bytes with a hardware
profile; the planner enumerates :func:`candidates`; the sharding pass calls
:func:`pick` and the strategy's runtime; reports print :attr:`Strategy.spec`.
Nothing outside ``strategies/`` compares strategy names. A new strategy is one
new module with a ``@register``-ed subclass (see ``tests/toy_strategy.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from autosp.errors import AutospError

AUTO = "auto"


@dataclass(frozen=True)
class SPMesh:
    """Where attention runs: the SP group's size, its token layout, and the topology."""

    degree: int
    layout: str = "contiguous"
    devices_per_node: int = 1 << 30        # the transform does not know the topology: one node
    overlap: bool = True                   # strategies may pipeline collectives with compute

    @property
    def crosses_nodes(self) -> bool:
        return self.degree > self.devices_per_node


@dataclass(frozen=True)
class AttentionShape:
    """One attention op with global sizes: ``q [batch, heads, seq_len, head_dim]``."""

    heads: int
    kv_heads: int
    head_dim: int = 0
    # the values' head dim where it is smaller than the queries' and keys' (multi-head latent
    # attention: 128 against 192); 0: the same
    v_head_dim: int = 0
    batch: float = 1
    seq_len: float = 0
    elem_bytes: int = 2
    causal: bool = True                    # tokens see only the past (the flag, or a causal LM's mask)
    masked: bool = False                   # an explicit attention mask is passed
    dropout: bool = False                  # attention dropout is on
    window: float = 0                      # the mask's sliding window in tokens (0: none)
    documents: tuple[int, ...] = ()        # packed document lengths (a causal mask within each)
    written: bool = False                  # attention the model writes itself (transform/attention_region.py)
    positional: bool = False               # ... that reads token positions inside it (tril, arange, ...)
    unsplit: str = ""                      # ... why its softmax cannot be split over key blocks ("": it can)
    # ... and the bytes per score entry (batch x heads x S x S) its S x S tensors take: saved for
    # the backward, live at once, moved by its pointwise ops (graph/written_attention.py)
    score_saved: float = 0.0
    score_live: float = 0.0
    score_traffic: float = 0.0

    def bytes(self, heads: float, tokens: float) -> float:
        """Size of a ``[batch, heads, tokens, head_dim]`` tensor of this op's dtype."""
        return self.batch * heads * tokens * self.head_dim * self.elem_bytes


@dataclass(frozen=True)
class KernelCall:
    """``count`` fused attention calls of one shape (batch folded into ``heads``)."""

    heads: float
    q_len: float
    kv_len: float
    head_dim: float
    causal: bool
    count: int = 1


@dataclass(frozen=True)
class Transfer:
    """``count`` collectives of one kind per attention op in one phase.

    ``nbytes`` is the per-rank buffer (the profile's convention). ``overlap_steps = n > 0``
    says each transfer runs beside one n-th of the phase's attention kernel work, so only
    ``max(0, t - kernel / n)`` of it is exposed; ``0`` means it blocks (fully exposed).
    ``pipeline = k > 0``: the transfer is one head group's of k, pipelined against the k
    groups' kernels (see :func:`autosp.costmodel.overlap.transfer_times`); ``count`` is per group.
    ``beside = f > 0``: the phase's transfers with this ``f`` run together beside the share ``f``
    of its attention kernel time, slowed by the profile's concurrency (the same function).
    ``lead`` = "q", "k" or "v": a pipelined transfer of the first group's input, issued where the
    graph makes that input (:meth:`Strategy.early_issue`), so it moves beside the forward compute
    between there and the attention.
    """

    collective: str            # all_to_all, all_gather, reduce_scatter, all_reduce, send_recv
    group: int
    nbytes: float
    phase: str                 # "fwd" or "bwd"
    count: int = 1
    inter: bool = False        # crosses nodes
    overlap_steps: int = 0
    pipeline: int = 0
    beside: float = 0.0
    lead: str = ""


@dataclass
class AttentionCost:
    """What one attention op costs under a strategy, before any profile is applied."""

    kernels: list[list[KernelCall]]    # per rank, its forward calls (backward: the same shapes)
    transfers: list[Transfer]
    workspace_bytes: float             # transient buffers alive around the op
    # Kept for the backward beyond what the fused kernel keeps, per op. The strategies return
    # a new [B, H, S, D]-contiguous output (a fused kernel's is [B, S, H, D] in memory), so the
    # layer's transpose-and-contiguous before the output projection copies it, and the
    # projection saves the copy; gathered inputs that the op saves (all-gather-KV's whole K/V).
    saved_bytes: float = 0.0
    # Bytes a token reorder reads and writes per forward (the backward moves as many): Ulysses on
    # a zigzag layout puts the gathered tokens into order for the causal kernel and back.
    copy_bytes: float = 0.0


class Strategy(ABC):
    """One way to run attention under SP. Instances are values: equal when their specs are."""

    family: ClassVar[str]                       # the registry key; specs start with it
    example: ClassVar[str] = ""                 # how users write it (defaults to ``family``)
    layout: ClassVar[str | None] = None         # the token layout it needs; None: any
    auto_rank: ClassVar[int | None] = None      # order in which strategy="auto" tries it
    attention_fn: ClassVar[Callable[..., Any]]  # replaces scaled_dot_product_attention
    # runs attention the model writes itself (strategies/region.py); None: this strategy cannot
    region_fn: ClassVar[Callable[..., Any] | None] = None

    @property
    def spec(self) -> str:
        """The strategy as written in plans, reports and ``strategy=``."""
        return self.family

    @classmethod
    def parse(cls, spec: str) -> "Strategy":
        if spec != cls.family:
            raise AutospError(f"bad strategy '{spec}'; write '{cls.example or cls.family}'")
        return cls()

    @classmethod
    def variants(cls, mesh: SPMesh, shape: AttentionShape) -> list["Strategy"]:
        """The instances the planner may choose under ``mesh`` (legality is checked after)."""
        return [cls()] if mesh.degree > 1 and cls.layout in (None, mesh.layout) else []

    @abstractmethod
    def illegal(self, shape: AttentionShape, mesh: SPMesh) -> str | None:
        """Why this strategy cannot run this op on this mesh (a sentence naming the fix), or None."""

    def refuses(self, shape: AttentionShape, mesh: SPMesh) -> str | None:
        """:meth:`illegal`, and for attention written by hand whether this strategy can run it."""
        if shape.written and self.region_fn is None:
            can = sorted(c.family for c in _REGISTRY.values() if c.region_fn is not None)
            return (f"is attention written by hand, which {self.spec} cannot run (it needs the scores "
                    f"inside its own kernel); use {' or '.join(can)}, or F.scaled_dot_product_attention")
        return self.illegal(shape, mesh)

    @abstractmethod
    def cost(self, shape: AttentionShape, mesh: SPMesh) -> AttentionCost:
        ...

    def setup(self, group: Any) -> dict[str, Any]:
        """Runtime keyword arguments of :attr:`attention_fn` for the SP ``group``.

        Called on every rank, in the same order, before compiling (a strategy that needs
        sub-groups creates them here)."""
        return {"group_name": group.group_name}

    def grid(self, mesh: SPMesh) -> tuple[int, int]:
        """(Ulysses degree, ring degree) of the 2-D SP grid this strategy uses."""
        return (1, mesh.degree)

    def early_issue(self, shape: AttentionShape) -> tuple[Callable[..., Any], dict[str, Any]] | None:
        """A function the sharding pass calls on each of q, k, v right where the graph makes it
        (with these keyword arguments and the runtime's), its results passed to
        :attr:`attention_fn` as ``first=(q's, k's, v's)``: an exchange started before the rest
        of the layer's prologue runs. None: the attention function starts its own."""
        return None

    @property
    def overlap(self) -> str:
        """How its collectives overlap its compute, in words, for reports."""
        return "none"

    def without_overlap(self) -> "Strategy":
        """The same strategy with its collectives not pipelined (``autosp.compile(overlap=False)``)."""
        return self

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Strategy) and other.spec == self.spec

    def __hash__(self) -> int:
        return hash(self.spec)

    def __repr__(self) -> str:
        return f"<strategy {self.spec}>"


# ------------------------------------------------------------------ registry

_REGISTRY: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: make a strategy known to compile, the cost model, the planner and reports."""
    _REGISTRY[cls.family] = cls
    return cls


def unregister(family: str) -> None:
    _REGISTRY.pop(family, None)


def names() -> list[str]:
    """How each registered strategy is written, for error messages and help."""
    return [cls.example or cls.family for cls in _REGISTRY.values()]


def resolve(spec: "str | Strategy") -> Strategy:
    """The strategy a spec names, e.g. ``"ulysses"`` or ``"hybrid:2x4"``."""
    if isinstance(spec, Strategy):
        return spec
    cls = _REGISTRY.get(str(spec).split(":", 1)[0])
    if cls is None:
        raise AutospError(f"unknown strategy '{spec}'; use one of {', '.join([AUTO] + names())}")
    return cls.parse(spec)


def check_spec(spec: "str | Strategy") -> None:
    if spec != AUTO:
        resolve(spec)


def pick(spec: "str | Strategy", shape: AttentionShape, mesh: SPMesh) -> Strategy:
    """The strategy to run: ``spec`` itself, or for ``"auto"`` the first legal one by ``auto_rank``."""
    if spec != AUTO:
        return resolve(spec)
    ranked = sorted((c for c in _REGISTRY.values() if c.auto_rank is not None), key=lambda c: c.auto_rank)
    for cls in ranked:
        for strat in cls.variants(mesh, shape):
            if strat.refuses(shape, mesh) is None:
                return strat
    raise AutospError(f"no strategy can run attention with {shape.heads} heads on {mesh.degree} ranks; "
                      f"name one of {', '.join(names())}")


def candidates(mesh: SPMesh, shape: AttentionShape, allowed: "tuple[str, ...] | None" = None) -> list[Strategy]:
    """Every legal strategy instance under ``mesh`` (``allowed``: only these families)."""
    unknown = set(allowed or ()) - set(_REGISTRY)
    if unknown:
        raise AutospError(f"unknown strategy {', '.join(sorted(unknown))}; use families of "
                          f"{', '.join(_REGISTRY)}")
    out = []
    for family, cls in _REGISTRY.items():
        if allowed is not None and family not in allowed:
            continue
        out += [s for s in cls.variants(mesh, shape) if s.refuses(shape, mesh) is None]
    return out


def required_layout(strategies: list[Strategy]) -> str | None:
    """The token layout these strategies need (one global choice), or None if any works."""
    need = {s.layout for s in strategies} - {None}
    if len(need) > 1:
        raise AutospError(f"strategies {', '.join(s.spec for s in strategies)} need different token layouts "
                          f"({', '.join(sorted(need))}); the layout is one global choice")
    return next(iter(need), None)
