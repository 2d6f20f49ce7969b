"""The module ``autosp.compile`` returns: what must happen outside the graph at each call.

It pads the sequence to a multiple of the SP degree (labels with -100, masks with 0),
marks the sequence dim dynamic (one graph for every length), deals tokens under the
balanced layout, plans on the first batch when asked to, checks once what compiled,
and trims padded outputs back; ``report()`` says what ran.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Callable, ContextManager, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from autosp.decisions import Decisions
from autosp.errors import AutospError
from autosp.graph.build import find_blocks
from autosp.graph.hf_compat import install_output_hooks, is_hf_model, unpacked_positions
from autosp.strategies import AUTO, required_layout, resolve
from autosp.strategies.collectives import TALLY
from autosp.strategies.layout import check_layout, deal_balanced, n_chunks, set_balanced
from autosp.transform.backend import BackendState, SPConfig, make_backend
from autosp.transform.first_call import (BatchCheck, check_deepspeed_groups, check_first_call,
                                         optimizer_placement_warning, refuse_partitioned_parameters)
from autosp.transform.batch import documents_of, pad_seq, positions_from_cu_seqlens, trim
from autosp.transform.zero.deepspeed import is_leaf_gradient_hook, run_after_backward
from autosp.transform.observe import new_step
from autosp.transform.host_optimizer import HostOptimizer
from autosp.transform.zero.gather import refresh_shards
from autosp.transform.zero.grad_reducer import GradReducer
from autosp.transform.mesh import Mesh
from autosp.transform.report import SPReport, report_of

# What Dynamo may keep constant while every tensor dim is symbolic (dynamic=True). Python ints: HF's
# logits_to_keep=0 must read as "keep all". Python floats (a norm's eps, rotary scaling, a
# soft-cap): unspecialized, each becomes a scalar graph input and compiling a 2-layer Llama takes
# about 2x as long (bench/compilers.py --trace-options); their values do not change between steps,
# and a float that did would compile again rather than go wrong.
TRACE_OPTIONS = {"specialize_int": True, "specialize_float": True}


def layout_for(strategies: list[str], layout: str | None) -> str:
    """The global token layout: the one the named strategies need, checked against ``layout``."""
    need = required_layout([resolve(st) for st in strategies if st != AUTO])
    if layout is None:
        return need or "contiguous"
    check_layout(layout)
    if need is not None and layout != need:
        raise AutospError(f"strategies {', '.join(strategies)} need layout='{need}' (the layout is one global "
                          f"choice), not '{layout}'")
    return layout


def set_up(group: dist.ProcessGroup, decisions: Decisions, made: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each named strategy's runtime arguments (and process groups) for ``decisions``: those in
    ``made`` (set up for an earlier variant) reused, the others set up now and added to it, on every
    rank in the same order."""
    for st in dict.fromkeys(c.strategy for c in decisions.layers):
        if st != AUTO:
            strat = resolve(st)
            if strat.spec not in made:
                made[strat.spec] = strat.setup(group)
    names = {resolve(c.strategy).spec for c in decisions.layers if c.strategy != AUTO}
    return {spec: made[spec] for spec in names}


@dataclass(frozen=True)
class Variant:
    """One compiled form of the model: the configuration its graphs were compiled from, what they
    report, and the compiled callable. A plan whose decisions an earlier one made runs its variant."""

    config: SPConfig
    state: BackendState
    compiled: Callable


def length_bucket(padded: int, sp_degree: int) -> int:
    """The length a batch of ``padded`` tokens is planned at: the next power of two, a multiple of
    2 x the SP degree (every layout's chunk count divides it)."""
    step = 2 * sp_degree
    return -(-(1 << max(padded - 1, 1).bit_length()) // step) * step


def layer_paths(model: nn.Module) -> list[str]:
    """Qualified names of the model's transformer layers, in order (where checkpointing cuts)."""
    blocks = {id(b) for b in find_blocks(model)}
    return [name for name, m in model.named_modules() if id(m) in blocks]


class SequenceParallel(nn.Module):
    """The module ``autosp.compile`` returns; ``.module`` is the original model."""

    def __init__(self, module: nn.Module, config: SPConfig, *, mesh: Mesh, zero_stage: int | None = None,
                 reducer: GradReducer | None = None, param_groups: list[str] | None = None, plan: Any = None,
                 provider: Callable | None = None, may_step_on_host: bool = False):
        super().__init__()
        self.module = module
        self.group = config.group
        self.sp_degree = dist.get_world_size(config.group)
        # How measurement tools (the memory probe) see inside compiled code: entered around every
        # run of every variant's graphs (graph_hook)
        self._graph_hooks: list[Callable[[], ContextManager]] = []
        self._setups: dict[str, dict[str, Any]] = {}      # strategy spec -> its runtime arguments, made once
        self._base = config
        # decisions -> its Variant: a bucket whose plan decides as an earlier one did runs that
        # one's compiled graphs; new decisions compile anew
        self._variants: dict[Decisions, Variant] = {}
        self._signature = inspect.signature(module.forward)
        self._is_hf = is_hf_model(module)
        if self._is_hf:
            install_output_hooks(module)
        self._checked = False
        self.plan = plan                 # the Plan applied, if any
        self.plan_provider = provider    # plans per batch-shape bucket (autosp.compile(plan="auto"))
        self.may_step_on_host = may_step_on_host     # a plan may keep the optimizer's states on the host
        self._plans: dict[tuple[int, int], Any] = {}       # (batch, length bucket) -> its plan
        self._warned_lengths: set[int] = set()
        self.mesh = mesh
        self.tp_report = None            # what tensor parallelism split (autosp.transform.api sets it)
        self.zero_stage = zero_stage
        self.reducer = reducer           # ZeRO 0/1: autosp's bucketed gradient reduction
        self.param_groups = param_groups or []    # ZeRO 2/3: the groups of its gathers and reductions
        # DeepSpeed ZeRO 3 reads this flag: it gathers every parameter at this module's entry and
        # hooks none of the modules inside, whose hooks would cut the compiled graph into pieces.
        self._z3_leaf = True
        self._after_backward: OrderedDict[int, Callable] = OrderedDict()     # DeepSpeed ZeRO 3: reduction
        self._optimizers_made = 0        # by optimizer(): the only one that follows a plan's host optimizer
        self._run(config.decisions)

    # the variant running now, read where it lives
    @property
    def config(self) -> SPConfig:
        return self._active.config

    @property
    def state(self) -> BackendState:
        return self._active.state

    @property
    def strategy_setups(self) -> dict[str, dict[str, Any]]:
        """Each strategy's runtime arguments (its process groups) in the variant running now: those
        its decisions name, and those the sharding pass set up for strategies the default picked."""
        return {**{k: dict(v) for k, v in self.config.runtime.items()},
                **{k: dict(v) for r in self.state.reports for k, v in r.setups.items()}}

    def _run(self, decisions: Decisions) -> None:
        """Make the variant for ``decisions`` the one that runs (compiled lazily, at its first call)."""
        if decisions not in self._variants:
            config = replace(self._base, decisions=decisions, runtime=set_up(self.group, decisions, self._setups))
            state = BackendState(graph_hooks=self._graph_hooks)
            # Not registered as a submodule: it wraps the same parameters.
            # dynamic=True: every input dim is symbolic (parameters stay static), so the sequence
            # length is a symbol in every graph, also in a loss graph after a graph break whose
            # inputs (gathered logits) no hint could mark.
            compiled = torch.compile(self.module, backend=make_backend(config, state), dynamic=True)
            self._variants[decisions] = Variant(config, state, compiled)
            self._checked = False        # its graphs get the first call's checks too
        object.__setattr__(self, "_active", self._variants[decisions])
        # zigzag cuts the sequence into 2P chunks: pad to a multiple of that
        self.pad_multiple = n_chunks(decisions.mesh.layout, self.sp_degree)

    def register_full_backward_hook(self, hook: Callable, *, prepend: bool = False) -> RemovableHandle:
        """DeepSpeed ZeRO 3 reduces this leaf module's gradients in a full backward hook, which torch
        would call before any gradient exists (token ids need none); autosp runs it after the
        backward instead (``zero/deepspeed.py``). Other hooks register as usual."""
        if not is_leaf_gradient_hook(hook):
            return super().register_full_backward_hook(hook, prepend=prepend)
        handle = RemovableHandle(self._after_backward)
        self._after_backward[handle.id] = hook
        return handle

    def no_sync(self) -> ContextManager:
        """Backwards inside this block keep this rank's partial gradients (micro-batches being
        accumulated); the backward after it sums them over the mesh once. Needs ``zero_stage``."""
        if self.zero_stage in (2, 3):
            return _fsdp_no_sync(self.module)
        if self.reducer is None:
            raise AutospError("no_sync() belongs to autosp's own gradient reduction; compile with "
                              "zero=autosp.Zero(stage=0..3) (or zero=0..3)")
        return self.reducer.no_sync()

    def optimizer(self, cls: type[torch.optim.Optimizer], **kwargs: Any) -> torch.optim.Optimizer:
        """The optimizer for this model: ``cls(params, **kwargs)``; with ``zero_stage=1`` its states
        are sharded over the whole mesh (``ZeroRedundancyOptimizer``: each rank updates its share of
        the parameters, then broadcasts them). Where the plan keeps optimizer states in host memory
        (``MeshChoice.host_optimizer``, which a planner at the first call may decide), ``cls`` steps
        there: :class:`autosp.transform.host_optimizer.HostOptimizer`."""
        self._optimizers_made += 1
        params = [p for p in self.module.parameters() if p.requires_grad]
        if self.may_step_on_host:
            # asked at the first step: by then the first call's plan is the model's
            on_host = (lambda: self.config.decisions.mesh.host_optimizer)  # noqa: E731
            cls = functools.partial(HostOptimizer, optimizer_class=cls, on_host=on_host)
        if self.zero_stage == 1:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=self.mesh.whole, **kwargs)
        return cls(params, **kwargs)

    @property
    def _loss_group_name(self) -> str:
        """The group this model's loss is made global over (the SP group unless the mesh's whole)."""
        return (self.config.loss_group or self.group).group_name

    def report(self) -> SPReport:
        """What autosp did to this model: per attention op and, for the last step (since its
        forward began), the collectives issued and the padding added."""
        return report_of(self)

    @contextlib.contextmanager
    def graph_hook(self, hook: Callable[[], ContextManager]) -> Iterator[None]:
        """Within this block, every compiled graph of this model runs inside ``hook()``.

        How measurement tools (the memory probe) see inside compiled code; the runtime
        itself installs none."""
        self._graph_hooks.append(hook)
        try:
            yield
        finally:
            self._graph_hooks.remove(hook)

    def forward(self, *args: Any, cu_seqlens: Any = None, **kwargs: Any) -> Any:
        """The model's forward, sequence-parallel. ``cu_seqlens`` (optional): cumulative document
        lengths over the flattened batch, ``[0, l1, l1+l2, ..., B*S]``, for packed documents: turned
        into position ids that restart at each document (the model then masks across them)."""
        if not self._checked:
            refuse_partitioned_parameters(self.module, self, self.zero_stage)
            check_deepspeed_groups(self.group)
        bound = self._signature.bind_partial(*args, **kwargs)
        named = bound.arguments
        seq_len = self._sequence_length(named)
        # started now, waited for before any other collective (planning, the compiled graphs)
        batch_check = BatchCheck.start(self.group, named, seq_len) if self.sp_degree > 1 else None
        if cu_seqlens is not None:
            self._positions_from(cu_seqlens, named, seq_len)
        if self.plan_provider is not None:
            self._plan_now(named, seq_len, batch_check)
        if self.zero_stage == 3:
            refresh_shards(self.module)
        if self.plan is not None and self.plan_provider is None:
            self.plan.check(seq_len=seq_len)
        padded_len = -(-seq_len // self.pad_multiple) * self.pad_multiple
        self.state.seq_len = padded_len
        self._step = {"seq_len": seq_len, "padded_len": padded_len,
                      "tally": {k: tuple(v) for k, v in TALLY.items()}}
        new_step(self._loss_group_name, self.group.group_name)     # this step's observations, or none
        if padded_len != seq_len and seq_len not in self._warned_lengths:
            self._warned_lengths.add(seq_len)
            what = "SP degree" if self.pad_multiple == self.sp_degree else "2 x SP degree, zigzag layout"
            warnings.warn(f"sequence length {seq_len} is not divisible by {self.pad_multiple} ({what}); "
                          f"autosp pads it to {padded_len} and masks the padding", stacklevel=2)
        for name, value in list(named.items()):
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == seq_len:
                named[name] = pad_seq(value, name, padded_len)
        self._deal_tokens(named, padded_len)
        if self._is_hf and "use_cache" in self._signature.parameters and "use_cache" not in named:
            named["use_cache"] = False       # a KV cache concatenates along the sharded dim
        with unpacked_positions(self._is_hf and "position_ids" not in named), \
                torch._dynamo.config.patch(**TRACE_OPTIONS), _own_errors():
            if batch_check is not None:
                batch_check.wait()
            out = self._active.compiled(*bound.args, **bound.kwargs)
        if not self._checked:
            self._checked = True
            check_first_call(self, padded_len != seq_len)
            placement = optimizer_placement_warning(self.config.decisions.mesh.host_optimizer, self._optimizers_made)
            if placement and torch.is_grad_enabled():
                warnings.warn(placement, stacklevel=2)
        if torch.is_grad_enabled():
            run_after_backward(self, list(self._after_backward.values()), out)
        if padded_len != seq_len and named.get("attention_mask") is None and \
                any(r.token_statistics for r in self.state.reports):
            raise AutospError(
                f"sequence length {seq_len} is not divisible by {self.pad_multiple}; autosp pads it to {padded_len}, "
                "and the padding would enter the statistics this model takes over all tokens (a router's "
                f"load-balancing loss) and change it; use a sequence length divisible by {self.pad_multiple}")
        if padded_len == seq_len or self.state.local_outputs:
            return out
        return trim(out, padded_len, seq_len)

    def _positions_from(self, cu_seqlens: Any, named: dict[str, Any], seq_len: int) -> None:
        if "position_ids" not in self._signature.parameters:
            raise AutospError(f"cu_seqlens becomes position ids, but {type(self.module).__name__}.forward takes no "
                              "position_ids; pass them to the model yourself")
        if named.get("position_ids") is not None:
            raise AutospError("give cu_seqlens or position_ids, not both (cu_seqlens becomes the position ids)")
        ids = next(v for v in named.values() if isinstance(v, torch.Tensor) and v.dim() >= 2)
        named["position_ids"] = positions_from_cu_seqlens(cu_seqlens, ids.shape[0], seq_len).to(ids.device)

    def _deal_tokens(self, named: dict[str, Any], padded_len: int) -> None:
        """Under the balanced layout, deal this batch's chunks from its documents (position ids
        restarting at 0). The positions are kept for the report, which computes every layout's
        attention work per rank when asked (no host copy on the training path otherwise)."""
        pos = named.get("position_ids")
        if not isinstance(pos, torch.Tensor) or pos.dim() != 2:
            pos = torch.arange(padded_len).unsqueeze(0)
        self._step["positions"] = pos.detach()
        if self.config.decisions.mesh.layout == "balanced":
            set_balanced(deal_balanced(pos.detach().cpu(), self.sp_degree), self.sp_degree)

    def _plan_now(self, named: dict[str, Any], seq_len: int, batch_check: BatchCheck | None = None) -> None:
        """The plan for this batch's shape: its bucket's (batch size, length rounded up to a power of
        two), planned at the bucket's length the first time a batch falls in it. Lengths change every
        step on real data; buckets keep re-planning and recompiling rare."""
        batch = next(v for v in named.values() if isinstance(v, torch.Tensor) and v.dim() >= 2).shape[0]
        padded = -(-seq_len // self.sp_degree) * self.sp_degree
        bucket = (batch, length_bucket(padded, self.sp_degree))
        if bucket not in self._plans:
            if batch_check is not None:
                batch_check.wait()      # the planner's broadcast pairs only with ranks of the same batch
            # the documents are costed where the batch fills its bucket (else the padding would count)
            docs = documents_of(named.get("position_ids"), padded) if bucket[1] == padded else ()
            plan = self.plan_provider(self.module, batch, bucket[1], self.group, documents=docs)
            if plan is None and not self._plans:      # the first plan failed (reported): the default choice
                self.plan_provider = None
                return
            self._plans[bucket] = plan if plan is not None else self.plan     # later: the last plan, warned
        self._use(self._plans[bucket])

    def _use(self, plan: Any) -> None:
        """Run the compiled variant for ``plan``'s decisions (applied as the planner made them; what
        the caller fixed, it was told: autosp.options.Auto)."""
        self.plan = plan
        decisions = plan.decisions()
        layout_for([c.strategy for c in decisions.layers], decisions.mesh.layout)
        if self._variants.keys() == {self._base.decisions} and not self._active.state.reports:
            self._variants.clear()       # the default's variant never ran: the plan's takes its place
        self._run(decisions)

    def _sequence_length(self, named: dict[str, Any]) -> int:
        for key in ("input_ids", "inputs_embeds"):
            if isinstance(named.get(key), torch.Tensor):
                return named[key].shape[1]
        for value in named.values():
            if isinstance(value, torch.Tensor) and value.dim() >= 2:
                return value.shape[1]
        raise AutospError("no [batch, sequence, ...] tensor among the inputs; pass input_ids of shape [B, S]")

@contextlib.contextmanager
def _fsdp_no_sync(module: nn.Module) -> Iterator[None]:
    """FSDP's own switch: backwards inside keep unsharded, unreduced gradients."""
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


@contextlib.contextmanager
def _own_errors() -> Iterator[None]:
    """An AutospError raised while compiling reaches the user as itself, not wrapped in Dynamo's
    BackendCompilerFailed with its boilerplate, so ``except autosp.AutospError`` catches it."""
    try:
        yield
    except AutospError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised unchanged unless an AutospError is inside
        inner: BaseException | None = e
        while inner is not None and not isinstance(inner, AutospError):
            inner = inner.__cause__ or inner.__context__
        if inner is None:
            raise
        raise AutospError(str(inner)) from None
