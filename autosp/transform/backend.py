"""The ``torch.compile`` backend: shard each Dynamo graph, then run it.

``autosp.compile(model)`` builds one backend per wrapped model (it knows the
process group and whether it padded the batch); ``torch.compile(model,
backend="autosp", dynamic=True)`` uses the default process group and Ulysses.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, ContextManager, Mapping

import torch
import torch.distributed as dist
import torch.fx as fx

from autosp.decisions import Decisions, MeshChoice
from autosp.decisions import check_compiler as check_compiler_name
from autosp.errors import AutospError
from autosp.options import COMPILERS
from autosp.transform.attention_region import extract_regions
from autosp.transform.fused_norm import fuse_layer_norms
from autosp.transform.checkpointing import apply_checkpointing, tag_for_recompute
from autosp.transform.offload import OffloadingPartitioner
from autosp.transform.sharding import SDPA_TARGETS, ShardContext, ShardReport, _where, shard_graph
from autosp.transform.tiled_loss import tile_head_loss
from autosp.transform.tiled_mlp import tile_mlps
from autosp.transform.zero.gather import bucket_gathers, tag_gathers_for_recompute
from autosp.transform.zero.prefetch import prefetch_gathers


@dataclass
class BackendState:
    """What the graphs of one compiled model reported; read by the wrapper."""

    reports: list[ShardReport] = field(default_factory=list)
    eager_attention: list[str] = field(default_factory=list)
    graph_params: set[int] = field(default_factory=set)   # ids of the parameters some compiled graph reads
    # Entered around every run of a compiled graph: how measurement tools (the memory probe)
    # see inside compiled code, which runs no Python dispatch mode entered outside it.
    graph_hooks: list[Callable[[], ContextManager]] = field(default_factory=list)
    said: set[str] = field(default_factory=set)          # one-time warnings already given
    seq_len: int = 0                                     # padded length of the batch being run (by the wrapper)

    @property
    def strategies(self) -> list[str]:
        """The strategy spec that ran, per attention op, in execution order."""
        return [st for r in self.reports for st in r.strategies]

    @property
    def heads(self) -> list[tuple[int, int]]:
        return [h for r in self.reports for h in r.heads]

    @property
    def attention_ops(self) -> int:
        return sum(r.attention for r in self.reports)

    @property
    def local_outputs(self) -> bool:
        """Some graph returned sharded outputs as this rank's tokens (not trimmed to the length)."""
        return any(r.local_outputs for r in self.reports)

    @property
    def unmasked_noncausal(self) -> bool:
        return any(r.unmasked_noncausal for r in self.reports)


def _eager_attention_sites(gm: fx.GraphModule) -> list[str]:
    """Softmax over the last dim of a [..., S, S] score tensor: attention written by hand."""
    sites = []
    for n in gm.graph.nodes:
        name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
        if name in ("softmax", "_softmax"):
            v = n.meta.get("example_value")
            if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[-1] == v.shape[-2]:
                sites.append(f"{name} ({_where(n)})")
    return sites


@dataclass(frozen=True)
class SPConfig:
    """How one compiled model is parallelised (the groups exist on every rank): frozen, so the
    graphs compiled from it and the wrapper that runs them read the same decisions."""

    group: dist.ProcessGroup
    # the plan's decisions as the planner (or the caller) made them, the layout resolved: per layer
    # the strategy (sharding.py), checkpointing (checkpointing.py), MLP chunks (tiled_mlp.py) and
    # offload (offload.py); per mesh the token layout and the LM head's chunks (tiled_loss.py)
    decisions: Decisions = Decisions(mesh=MeshChoice(layout="contiguous"))
    gather_outputs: bool | None = None
    # spec -> Strategy.setup(group), for the strategies the decisions name (read-only here)
    runtime: Mapping[str, Mapping[str, Any]] = field(default_factory=lambda: MappingProxyType({}))
    reduce_grads: bool = False          # True: full gradients on every rank; False: partial sums
    compiler: str = "inductor"          # what runs each sharded graph: see compile_graph
    layer_paths: tuple[str, ...] = ()   # qualified names of the transformer layers
    loss_group: dist.ProcessGroup | None = None   # where the loss is made global (None: the SP group)
    prefetch_params: bool = True        # ZeRO 3: gather the next unit while this one computes (zero/prefetch.py)

    def __post_init__(self) -> None:
        if self.decisions.mesh.layout is None:
            raise AutospError("internal: an SP configuration needs its token layout resolved (layout_for)")
        object.__setattr__(self, "runtime", MappingProxyType({k: MappingProxyType(dict(v))
                                                               for k, v in self.runtime.items()}))
        object.__setattr__(self, "layer_paths", tuple(self.layer_paths))


def _with_hooks(fn: Callable, state: BackendState) -> Callable:
    def run(*args: Any) -> Any:
        if not state.graph_hooks:
            return fn(*args)
        with contextlib.ExitStack() as stack:
            for hook in state.graph_hooks:
                stack.enter_context(hook())
            return fn(*args)

    return run


def _say_once(state: BackendState, report: ShardReport) -> None:
    """What makes a step exact but not what the user may expect: said once per model."""
    if report.replicated_params and "replicated" not in state.said:
        state.said.add("replicated")
        warnings.warn(f"a graph break leaves the graph starting at {report.starts_at} without attention: it runs "
                      f"unsharded on every rank, on the full sequence ({report.replicated_params} parameters; "
                      "results stay exact, but that part saves no memory); torch._dynamo.explain(model)(...) "
                      "shows why the graph breaks", stacklevel=2)
    if report.dropout_at and "dropout" not in state.said:
        state.said.add("dropout")
        warnings.warn(f"attention dropout ({report.dropout_at[0]}): under SP each rank draws its own dropout masks, "
                      "so a step matches one device in distribution, not bit for bit; set attention dropout to 0 "
                      "for exact results", stacklevel=2)


COMPILER_ENV = "AUTOSP_COMPILER"


def default_compiler() -> str:
    """The compiler when none is given: ``$AUTOSP_COMPILER`` if set (a test suite or a debugging
    session switches every model without editing the script), else Inductor."""
    env = os.environ.get(COMPILER_ENV)
    if env and env not in COMPILERS:
        raise AutospError(f"{COMPILER_ENV}={env!r} is not a compiler; use one of {', '.join(COMPILERS)}")
    return env or "inductor"


def check_compiler(name: str) -> str:
    """The compiler to use for ``name``: Inductor needs a C++ compiler on CPU (else aot_eager, said once)."""
    check_compiler_name(name)
    if name == "inductor" and not torch.cuda.is_available() and not any(
            shutil.which(cc) for cc in ("c++", "g++", "clang++")):
        warnings.warn("no C++ compiler found for Inductor on this CPU machine; autosp compiles with "
                      "compiler='aot_eager' instead (install g++ for fused kernels)", stacklevel=3)
        return "aot_eager"
    return name


def compile_graph(gm: fx.GraphModule, example_inputs: list[Any], compiler: str,
                  partitioner: Callable | None = None) -> Callable:
    """Compile a sharded graph: ``eager`` runs it as is (autograd saves what eager saves);
    ``aot_eager`` traces forward and backward with AOTAutograd (the collectives and attention
    kernels are custom ops with fake kernels and registered autograd); ``inductor`` also fuses
    and recomputes cheap ops in backward (the min-cut partitioner). ``partitioner`` replaces
    AOTAutograd's (offload: :mod:`autosp.transform.offload`)."""
    if compiler == "eager":
        return gm.forward
    from torch._dynamo.backends.registry import lookup_backend

    if partitioner is None:
        return lookup_backend(compiler)(gm, example_inputs)
    if compiler == "aot_eager":
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import boxed_nop

        # boxed_nop runs each graph by an interpreter that drops its inputs as it goes: the backward
        # frees a saved tensor after its last use (a plain call would hold them all to the end)
        return aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=partitioner,
                            keep_inference_input_mutations=True)(gm, example_inputs)
    from torch._inductor import config as inductor_config

    with inductor_config.patch(custom_partitioner_fn=partitioner):
        return lookup_backend(compiler)(gm, example_inputs)


def _offloaded_layers(config: SPConfig) -> set[int]:
    return {i for i in range(len(config.layer_paths)) if config.decisions.layer(i).offload}


def _mode_of(config: SPConfig) -> Callable[[int], str]:
    return lambda layer: config.decisions.layer(layer).checkpoint


def _checkpointed(gm: fx.GraphModule, config: SPConfig) -> fx.GraphModule:
    mode_of = _mode_of(config)
    if config.compiler != "eager":          # AOTAutograd's partitioner reads the tags
        tag_for_recompute(gm, list(config.layer_paths), mode_of)
        return gm
    return apply_checkpointing(gm, list(config.layer_paths), mode_of)


def make_backend(config: SPConfig, state: BackendState | None = None) -> Callable:
    state = state if state is not None else BackendState()
    group = config.group
    loss_group = config.loss_group or group

    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        decisions, mesh = config.decisions, config.decisions.mesh
        layer_paths = list(config.layer_paths)
        ctx = ShardContext(
            group_name=group.group_name, world=dist.get_world_size(group), rank=dist.get_rank(group),
            decisions=decisions, gather_outputs=config.gather_outputs,
            runtime=config.runtime, attention_offset=state.attention_ops, reduce_grads=config.reduce_grads,
            loss_group_name=loss_group.group_name, loss_ranks=dist.get_world_size(loss_group),
            seq_len=state.seq_len)
        written = extract_regions(gm)        # attention the model writes itself: one call each
        if not written and not any(n.op == "call_function" and n.target in SDPA_TARGETS for n in gm.graph.nodes):
            sites = _eager_attention_sites(gm)
            state.eager_attention.extend(sites)
            if sites:               # hand-written attention: never sharded by length (refused by name after)
                ctx.seq_len = 0
        report = shard_graph(gm, example_inputs, ctx)
        if mesh.loss_chunks > 1 and report.attention:
            report.tiled_losses = tile_head_loss(gm, mesh.loss_chunks, loss_group.group_name,
                                                 aot=config.compiler != "eager")
        if report.attention:
            # a layer's RMSNorms run as one op each where its tiled MLP recomputes with the whole
            # layer, whose recomputed tensors then wait through the chunks (fused_norm.py)
            report.fused_norms = fuse_layer_norms(gm, layer_paths, lambda i: decisions.layer(i).mlp_with_layer)
        if report.attention and decisions.any_layer(lambda c: c.mlp_chunks > 1):
            report.tiled_mlps = tile_mlps(gm, lambda i: decisions.layer(i).mlp_chunks, layer_paths,
                                          aot=config.compiler != "eager", mode_of=_mode_of(config),
                                          own_region=lambda i: decisions.layer(i).mlp_region_of_its_own,
                                          record=report.mlp_chunks)
        report.param_gathers = bucket_gathers(gm, layer_paths)
        if report.param_gathers > 1 and config.prefetch_params:
            report.param_prefetched = prefetch_gathers(gm)
        if report.param_gathers and config.compiler != "eager":
            tag_gathers_for_recompute(gm)
        state.graph_params.update(id(x) for x in example_inputs if isinstance(x, torch.nn.Parameter))
        state.reports.append(report)
        if decisions.any_layer(lambda c: c.checkpoint != "none") and report.attention:
            gm = _checkpointed(gm, config)
        partitioner = None
        offloaded = _offloaded_layers(config)
        if offloaded and report.attention:
            if config.compiler == "eager":
                raise AutospError("offload moves what AOTAutograd's partitioner saves to host memory: it needs a "
                                  "compiled graph; use runtime=autosp.Runtime(compiler='aot_eager' or 'inductor')")
            partitioner = OffloadingPartitioner(offloaded, layer_paths,
                                                 lambda k: setattr(report, "offloaded", report.offloaded + k),
                                                 config.compiler)
        try:
            compiled = compile_graph(gm, example_inputs, config.compiler, partitioner)
        except torch._dynamo.exc.RestartAnalysis:
            state.reports.remove(report)      # Dynamo traces the frame again and calls us anew
            raise
        _say_once(state, report)
        return _with_hooks(compiled, state)

    backend.state = state  # type: ignore[attr-defined]
    return backend


def autosp_backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
    """``torch.compile(model, backend="autosp", dynamic=True)``: Ulysses over the default group."""
    if not dist.is_initialized():
        raise AutospError("backend 'autosp' needs torch.distributed initialised; call "
                          "torch.distributed.init_process_group() first (torchrun sets the environment)")
    return make_backend(SPConfig(dist.group.WORLD, compiler=check_compiler(default_compiler())))(gm, example_inputs)
