"""The sequence-sharding pass over a Dynamo (Torch IR) graph.

(Over 400 lines: one pass, whose propagation rules and the checks that refuse unsafe
ops read and write the same per-node placement state.)

Placements (DTensor's vocabulary, restricted to what SP needs):
  R         replicated: every rank holds the whole tensor (inputs, parameters,
            positions and masks built from them)
  S(dims)   this rank holds its tokens along ``dims`` (the dims whose size
            expression holds the symbolic sequence length)

Propagation, in graph order:
  * ``scaled_dot_product_attention``  -> the chosen attention strategy's runtime
                                         (:mod:`autosp.strategies`); q,k,v S
  * ``F.cross_entropy`` on S logits   -> global token-weighted loss (R)
  * ``.sum()/.mean()`` of an S tensor -> global sum / mean (R)
  * a sum, mean or histogram *over* the sharded dim (a router's load-balancing
    statistics) -> all-reduced where it is made (R)
  * inside a token-local module (:mod:`autosp.transform.token_local`: a
    mixture-of-experts layer) any op runs on this rank's tokens as it is; tensors
    made from the global length there are made from the local one, and values
    without a sequence dim stay in the module (per rank)
  * any other op with an S input, or one that meets a *parameter* and a tensor
    with a sequence dim (the embedding lookup, the first projection), is
    token-wise: its output is S; R inputs with a sequence dim are sliced to
    this rank's tokens (the first slice of ``input_ids`` happens here, labels
    are sliced where the loss meets them, *after* the model shifted them on
    the full sequence), and shape arguments that hold the global length are
    divided by the SP degree;
  * everything else stays R (masks, rotary tables, label shifting: cheap,
    computed on the full sequence, sliced where used).
  * with ``reduce_grads``, every input that requires grad (parameters,
    ``inputs_embeds``, outputs of an earlier graph) enters through ``sum_grad``:
    gradients leave the graph full, the convention of
    :mod:`autosp.transform.replicated`; a graph with no attention runs replicated.
  * graph outputs that are S are all-gathered when the graph computes no loss,
    so the next graph (a loss after a graph break) sees single-device shapes;
    next to a loss they stay this rank's tokens unless ``gather_outputs=True``.

Ops that mix tokens along a sharded sequence dim (a softmax or cumsum over it,
slicing it, ...) are refused with the op and source line named, never run
silently wrong.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Mapping

import sympy
import torch
import torch.fx as fx
import torch.nn.functional as F

from autosp.decisions import Decisions, MeshChoice
from autosp.errors import AutospError
from autosp.strategies import AttentionShape, SPMesh, pick
from autosp.strategies.collectives import resolve_group
from autosp.strategies.layout import gather_seq, slice_seq
from autosp.transform.attention_region import REGION_TARGETS
from autosp.transform.graph_pass import finish_pass
from autosp.transform.loss import global_mean, global_sum, sharded_cross_entropy, token_total
from autosp.transform.observe import observe_tokens
from autosp.transform.replicated import share_grad, share_replicated_gradients, sum_grad
from autosp.transform.sequence_mixers import CONVOLUTIONS, MixerRun, gathered_mixers, module_paths, name_the_mixer
from autosp.transform.token_local import token_local_module

SDPA_TARGETS = {torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention}
ATTENTION_TARGETS = SDPA_TARGETS | REGION_TARGETS      # the model's SDPA calls, and attention it writes itself
CE_TARGETS = {F.cross_entropy}
_SHAPE_METHODS = {"size", "dim", "numel", "stride"}
# Ops whose ``dim`` argument mixes or reorders entries along that dim.
_DIM_MIXING = {"softmax", "log_softmax", "cumsum", "cumprod", "sort", "argsort", "topk", "flip", "roll",
               "cummax", "cummin", "logcumsumexp", "sum", "mean", "max", "min", "amax", "amin", "argmax",
               "argmin", "any", "all", "prod", "std", "var", "norm", "logsumexp", "narrow", "split",
               "tensor_split", "diff", "nansum", "count_nonzero", "chunk", "unbind"}
# Ops whose cost grows with the tokens times a weight: on the full sequence in a sharded graph,
# they are work SP should have split (reported, see ShardReport.replicated_work).
_HEAVY = {"linear", "embedding", "matmul", "mm", "bmm", "conv1d", "baddbmm", "addmm"}
# Reductions over a sharded dim whose per-rank results add up (a mean: of equal shards). Not
# bincount: its length follows each rank's largest value, so ranks' results need not match.
_TOKEN_STATISTICS = {"sum", "nansum", "mean", "histc", "count_nonzero"}
# Where the dim argument sits when it is not the second positional one.
_DIM_POSITION = {"split": 2, "chunk": 2, "tensor_split": 2, "topk": 2, "roll": 2}


@dataclass
class ShardContext:
    group_name: str
    world: int
    rank: int
    # the decisions applied: attention op i runs decisions.layer(i).strategy, in the mesh's token layout
    decisions: Decisions = Decisions(mesh=MeshChoice(layout="contiguous"))
    # runtime keyword arguments per strategy spec (process groups), from Strategy.setup: read-only
    # here; a strategy the default choice picks in the pass is set up there (ShardReport.setups)
    runtime: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    attention_offset: int = 0             # attention ops seen in earlier graphs
    # True: gradients leaving a sharded graph (parameters', inputs') are summed over the group
    # inside it, so every rank holds full gradients; False: they stay this rank's partial sums.
    reduce_grads: bool = False
    # all-gather sharded graph outputs: True, False, or None = only in graphs that compute no
    # loss (a loss after a graph break needs full logits; a 128k x 128k-vocab logits tensor
    # gathered next to the loss would cost every rank the memory SP exists to save)
    gather_outputs: bool | None = None
    # Where losses and token statistics are made global: the SP group, or with data parallelism
    # reduced by autosp (zero_stage) the whole dp x sp mesh, so the loss is the global batch's.
    seq_len: int = 0                      # the padded length of the batch being compiled for
    loss_group_name: str = ""             # "" = group_name
    loss_ranks: int = 0                   # ranks in that group (0 = world)

    @property
    def layout(self) -> str:
        return self.decisions.mesh.layout or "contiguous"

    @property
    def loss_group(self) -> str:
        return self.loss_group_name or self.group_name

    @property
    def loss_shards(self) -> int:
        return self.loss_ranks or self.world


@dataclass
class ShardReport:
    """What the pass did to one graph (read by the wrapper and the tests)."""

    attention: int = 0
    unmasked_noncausal: bool = False
    global_reductions: int = 0
    token_statistics: int = 0         # sums / histograms over tokens made global (a router's aux loss)
    shared_replicated: int = 0        # replicated values whose full gradient each rank keeps 1/P of (replicated.py)
    tiled_losses: int = 0             # LM head + loss pairs run over token chunks (tiled_loss.py)
    tiled_mlps: int = 0               # layer MLPs run over token chunks (tiled_mlp.py)
    offloaded: int = 0                # saved tensors that wait for the backward in host memory (offload.py)
    param_gathers: int = 0            # ZeRO 3: parameter all-gathers per forward, one per unit (zero/gather.py)
    param_prefetched: int = 0         # of which started while the unit before computes (zero/prefetch.py)
    mlp_chunks: dict[int, int] = field(default_factory=dict)   # layer index -> chunks its MLP ran in
    fused_norms: dict[int, int] = field(default_factory=dict)  # layer index -> RMSNorms run as one op
    strategies: list[str] = field(default_factory=list)     # the spec that ran, per attention op
    heads: list[tuple[int, int]] = field(default_factory=list)   # (query heads, KV heads), per attention op
    # runtime arguments of the strategies this pass set up itself (picked by the default choice)
    setups: dict[str, dict[str, Any]] = field(default_factory=dict)
    local_outputs: int = 0
    replicated_params: int = 0        # parameters read by this graph while it runs unsharded
    dropout_at: list[str] = field(default_factory=list)      # attention ops with dropout
    # ops of a sharded graph that read a parameter yet ran on the full sequence (work SP should split)
    replicated_work: list[str] = field(default_factory=list)
    # layers that mix tokens without attention, run on the gathered sequence (sequence_mixers.py)
    mixers: list[MixerRun] = field(default_factory=list)
    starts_at: str = ""               # where the graph's first op comes from (for messages)


def _name(n: fx.Node) -> str:
    t = n.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def _where(n: fx.Node) -> str:
    st = n.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in st.strip().splitlines() if ln.strip().startswith("File")]
    return lines[-1] if lines else f"graph node {n.name}"


def _inserted_meta(source: fx.Node) -> dict[str, Any]:
    """Meta of a node the pass inserts after ``source``: its values, not its module (a node's
    module says which transformer layer it belongs to; inserted nodes belong where they stand)."""
    return {k: v for k, v in source.meta.items() if k != "nn_module_stack"}


def _dropout_p(x: Any) -> float:
    """The attention dropout of this compile (a graph input when Dynamo keeps floats symbolic: its
    value now; the strategies' runtime checks refuse a later change they cannot take)."""
    if isinstance(x, fx.Node):
        try:
            return float(_val(x))
        except (TypeError, ValueError):
            return 1.0                   # unknown: assume dropout
    return float(x or 0.0)


def _val(n: Any) -> Any:
    return n.meta.get("example_value", n.meta.get("val")) if isinstance(n, fx.Node) else None


class Sharder:
    def __init__(self, gm: fx.GraphModule, example_inputs: list[Any], ctx: ShardContext):
        self.gm, self.graph, self.ctx = gm, gm.graph, ctx
        self.report = ShardReport()
        self.place: dict[fx.Node, tuple[int, ...] | None] = {}   # None = R
        self.local_sym: set[fx.Node] = set()
        self.slices: dict[tuple[fx.Node, int], fx.Node] = {}
        self.local_len: dict[fx.Node, fx.Node] = {}
        self.params: set[fx.Node] = set()
        self.with_grad: list[fx.Node] = []          # inputs that require grad
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        for n, ex in zip(placeholders, example_inputs):
            if isinstance(ex, torch.nn.Parameter):
                self.params.add(n)
            if isinstance(ex, torch.Tensor) and ex.requires_grad:
                self.with_grad.append(n)
        # nodes inside a token-local module (mixture-of-experts), by the module's path
        self.region = {n: r for n in self.graph.nodes if (r := token_local_module(n.meta)) is not None}
        self.per_rank: dict[fx.Node, str] = {}      # values of this rank's tokens, to stay in their module
        self.gathered: dict[fx.Node, str] = {}       # ops of sequence mixers that run on the whole sequence
        self.gathers: dict[fx.Node, fx.Node] = {}    # a sharded value -> its gathered copy
        first = next((n for n in self.graph.nodes if n.op == "call_function"), None)
        self.report.starts_at = _where(first) if first is not None else "an empty graph"

    # ------------------------------------------------------------------ sequence symbol
    def find_seq_symbols(self, attn: list[fx.Node]) -> set[sympy.Symbol]:
        syms: set[sympy.Symbol] = set()
        for n in attn:
            q = _val(n.args[0])
            d = q.shape[-2]
            if not isinstance(d, torch.SymInt):
                raise AutospError(
                    f"the sequence length ({d}) was compiled as a constant at {_where(n)}; autosp needs it "
                    "symbolic: use autosp.compile(model), or torch.compile(model, backend='autosp', dynamic=True)")
            syms |= d.node.expr.free_symbols
        return syms

    def find_seq_symbols_by_length(self, length: int) -> set[sympy.Symbol]:
        """A graph without attention but with a loss (the head and loss behind a graph break, e.g.
        after per-block FSDP units): its sequence dims are those of the batch's length. Sharding it
        keeps the logits this rank's and makes the loss global over the loss group."""
        syms: set[sympy.Symbol] = set()
        for n in self.graph.nodes:
            v = _val(n) if n.op == "placeholder" else None
            for d in (v.shape if isinstance(v, torch.Tensor) else ()):
                if isinstance(d, torch.SymInt) and d.node.hint == length and isinstance(d.node.expr, sympy.Symbol):
                    syms.add(d.node.expr)
        return syms

    def seq_dims(self, v: Any) -> tuple[int, ...]:
        if not isinstance(v, torch.Tensor):
            return ()
        out = []
        for i, d in enumerate(v.shape):
            if isinstance(d, torch.SymInt) and d.node.expr.free_symbols & self.syms:
                out.append(i)
        return tuple(out)

    def is_seq_sym(self, n: Any) -> bool:
        v = _val(n)
        return isinstance(v, torch.SymInt) and bool(v.node.expr.free_symbols & self.syms)

    # ------------------------------------------------------------------ main
    def run(self) -> ShardReport:
        attn = [n for n in self.graph.nodes if n.op == "call_function" and n.target in ATTENTION_TARGETS]
        losses = [n for n in self.graph.nodes if n.op == "call_function" and n.target in CE_TARGETS]
        if not attn and not (losses and self.ctx.seq_len and self.find_seq_symbols_by_length(self.ctx.seq_len)):
            return self._replicated()
        if self.ctx.reduce_grads:       # gradients leave whole (summed over the group), not as this rank's share
            self._route_inputs(self.with_grad, sum_grad, self.ctx.group_name)
        else:
            # Under the partial convention parameters keep this rank's share, but activations that
            # cross a graph boundary leave whole: the graph before may run replicated (it gets full
            # gradients, as it would from a replicated consumer) or sharded (it keeps its slice).
            self._route_inputs([n for n in self.with_grad if n not in self.params], sum_grad, self.ctx.group_name)
        self._no_baked_parameters()
        self.syms = self.find_seq_symbols(attn) if attn else self.find_seq_symbols_by_length(self.ctx.seq_len)
        self.full_len = self._full_len_node()
        entry = set() if attn else self._slice_activations_at_entry()
        mixing = module_paths(attn)         # where a refusal inside a block names its sequence mixer
        self.gathered, self.report.mixers = gathered_mixers(self.graph, self.seq_dims, mixing,
                                                            set(self.region.values()))
        for n in list(self.graph.nodes):
            if n in entry:
                continue
            if n.op in ("placeholder", "get_attr"):
                self.place[n] = None
            elif n.op == "output":
                gather = self.ctx.gather_outputs
                if gather or (gather is None and not self.report.global_reductions):
                    self._gather_outputs(n)
                else:
                    self.report.local_outputs = sum(
                        1 for x in torch.utils._pytree.tree_leaves(n.args)
                        if isinstance(x, fx.Node) and self.place.get(x) not in (None, (-1,)))
            elif n.op == "call_module":
                raise AutospError(f"graph calls module {n.target} opaquely ({_where(n)}); autosp needs it inlined")
            else:
                try:
                    self._visit(n)
                except AutospError as e:     # inside a layer that mixes tokens without attention: say so
                    raise name_the_mixer(n, e, _name(n), _where(n), mixing) from None
        self.report.shared_replicated = share_replicated_gradients(self.graph, self.place, self.ctx.world)
        for n, dims in self.place.items():     # read by later passes (tiled_mlp.py): which dims are tokens
            n.meta["autosp_seq"] = dims
        finish_pass(self.gm, 1)     # every graph is sharded: it changed
        return self.report

    def _slice_activations_at_entry(self) -> set[fx.Node]:
        """A loss graph without attention: the activations it receives (gathered by the graph before)
        are sliced to this rank's tokens where they enter, so the head and the loss run on them."""
        entry = set()
        for p in self.with_grad:
            if p in self.params or not self.seq_dims(_val(p)):
                continue
            src = p
            if len(p.users) == 1 and next(iter(p.users)).target in (sum_grad, share_grad):
                src = next(iter(p.users))            # the gradient convention's wrapper comes first
            s = self._slice(src)
            with self.graph.inserting_after(s):      # a view of the gathered tensor: views of it must work
                c = self.graph.call_method("contiguous", (s,))
            c.meta = _inserted_meta(src)
            self.place[c] = self.place[s]
            src.replace_all_uses_with(c, delete_user_cb=lambda user, s=s: user is not s)
            entry |= {s, c}
        return entry

    def _replicated(self) -> ShardReport:
        """No attention: every rank runs this graph on the same full tensors and gets the full
        gradients of the parameters it reads. Under the full convention they leave as they are;
        under the partial one each rank keeps its 1/P share (:func:`share_grad`), so the caller's
        sum over the group counts them once."""
        params = [n for n in self.with_grad if n in self.params]
        self.report.replicated_params = len(params)
        if params and self.ctx.world > 1 and not self.ctx.reduce_grads:
            self._route_inputs(params, share_grad, self.ctx.world)
            finish_pass(self.gm, len(params))
        return self.report

    def _no_baked_parameters(self) -> None:
        """A parameter read as a graph constant (get_attr) would escape the gradient sum."""
        for n in self.graph.nodes:
            if n.op == "get_attr":
                v = getattr(self.gm, str(n.target), None)
                if isinstance(v, torch.nn.Parameter) and v.requires_grad:
                    raise AutospError(f"parameter {n.target} is baked into the compiled graph as a constant; "
                                      "autosp needs parameters as graph inputs (keep torch._dynamo.config."
                                      "inline_inbuilt_nn_modules=True, the default)")

    def _route_inputs(self, inputs: list[fx.Node], fn: Any, *extra: Any) -> None:
        """Send every use of these placeholders through ``fn(input, *extra)``."""
        after = [n for n in self.graph.nodes if n.op == "placeholder"][-1] if inputs else None
        for p in inputs:
            with self.graph.inserting_after(after):
                b = self.graph.call_function(fn, (p, *extra))
            b.meta = _inserted_meta(p)
            p.replace_all_uses_with(b, delete_user_cb=lambda user, b=b: user is not b)
            if p in self.params:     # still a parameter to the propagation: the first op to read it shards
                self.params.add(b)
            after = b

    def _full_len_node(self) -> fx.Node:
        """A node holding the global sequence length, read off a replicated input at run time."""
        for n in self.graph.nodes:
            if n.op != "placeholder":
                continue
            v = _val(n)
            if isinstance(v, torch.SymInt) and v.node.expr in self.syms:
                return n
        for n in self.graph.nodes:
            if n.op == "placeholder":
                v = _val(n)
                if isinstance(v, torch.Tensor):
                    for i, d in enumerate(v.shape):
                        if isinstance(d, torch.SymInt) and d.node.expr in self.syms:
                            with self.graph.inserting_after(n):
                                return self.graph.call_function(torch.ops.aten.sym_size.int, (n, i))
        raise AutospError("no input carries the sequence length; pass the token ids as a graph input")

    # ------------------------------------------------------------------ per node
    def _visit(self, n: fx.Node) -> None:
        ins = n.all_input_nodes
        s_in = [a for a in ins if self.place.get(a) is not None]
        region = self.region.get(n)
        for a in ins:
            if a in self.per_rank and self.per_rank[a] != region:
                raise AutospError(
                    f"'{a.name}' is computed from this rank's tokens inside token-local module {self.per_rank[a]} "
                    f"and used outside it ({_where(n)}); under SP each rank holds its own value: return only "
                    "per-token outputs from the module")
        if n in self.gathered:
            return self._run_gathered(n)
        if n.target in ATTENTION_TARGETS:
            return self._attention(n)
        if n.target in CE_TARGETS and s_in:
            return self._cross_entropy(n)
        v = _val(n)
        # Symbolic sizes read off sharded tensors are local lengths already.
        if isinstance(v, (torch.SymInt, int)) or (isinstance(v, (tuple, list)) and v and
                                                  all(isinstance(x, (torch.SymInt, int)) for x in v)):
            if s_in or any(a in self.local_sym for a in ins):
                self.local_sym.add(n)
            self.place[n] = None
            return
        seqful_r = [a for a in ins if self.place.get(a) is None and self.seq_dims(_val(a))]
        meets_param = any(a in self.params for a in ins) and (s_in or seqful_r)
        # Inside a token-local module a tensor made from the global length (arange(tokens x top-k))
        # indexes this rank's tokens: it is made from the local length instead.
        made_from_length = (isinstance(v, torch.Tensor) and bool(self.seq_dims(v))
                            and all(_val(a) is None or not isinstance(_val(a), torch.Tensor) for a in ins))
        if region is not None and (s_in or meets_param or made_from_length or any(a in self.per_rank for a in ins)):
            return self._token_local(n, v, seqful_r, region)
        if not s_in and not meets_param:
            self.place[n] = None
            if any(a in self.params for a in ins) and not seqful_r and not self.seq_dims(v):
                # made from parameters alone (a ZeRO-3 shard gathered inside the graph, a weight
                # transposed or cast): still a parameter to the propagation, so the first op that
                # reads it with the sequence shards there
                self.params.add(n)
                return
            if _name(n) in _HEAVY and self.seq_dims(v):
                self.report.replicated_work.append(f"{_name(n)} at {_where(n)}")
            return
        if self._is_full_reduction(n):
            return self._global_reduction(n)
        if _name(n) in _TOKEN_STATISTICS and s_in and isinstance(v, torch.Tensor) and not self.seq_dims(v):
            return self._token_statistic(n)
        self._check_token_wise(n)
        out_dims = self._out_dims(n, v)
        if out_dims is None:
            raise AutospError(
                f"op '{_name(n)}' turns a sequence-sharded tensor into one without a sequence dim "
                f"({_where(n)}); autosp can shard only token-wise ops, attention, cross-entropy and full sums/means")
        for a in seqful_r:
            self._replace_input(n, a, self._slice(a))
        self._localize_shape_args(n)
        self.place[n] = out_dims

    def _run_gathered(self, n: fx.Node) -> None:
        """An op of a sequence mixer: it reads whole tensors (sharded ones gathered where they enter
        the mixer, lengths read off them the global one) and its output is replicated; a sharded op
        that reads it slices it (sequence_mixers.py)."""
        for a in n.all_input_nodes:
            dims = self.place.get(a)
            if a in self.local_sym:
                if not (isinstance(_val(a), torch.SymInt) and _val(a).node.expr in self.syms):
                    raise AutospError(f"sequence mixer {self.gathered[n]} reads '{a.name}', a size computed from this "
                                      f"rank's tokens outside it ({_where(a)}); read sizes inside the module")
                n.replace_input_with(a, self.full_len)
            elif dims is not None:
                if len(dims) != 1 or dims[0] < 0:
                    raise AutospError(f"sequence mixer {self.gathered[n]} reads '{a.name}' ({_where(n)}), which "
                                      f"holds {'a tuple of shards' if dims[0] < 0 else 'several sequence dims'}; "
                                      "autosp gathers a mixer's inputs one tensor at a time")
                n.replace_input_with(a, self._gathered_copy(a, dims[0]))
        self.place[n] = None

    def _gathered_copy(self, a: fx.Node, dim: int) -> fx.Node:
        """``a`` on the whole sequence: all-gathered forward; backward, the gradient (each rank's,
        from its own tokens' outputs) summed over the group before each keeps its tokens' part."""
        if a not in self.gathers:
            with self.graph.inserting_after(a):
                g = self.graph.call_function(gather_seq, (a, dim, self.full_len, self.ctx.world,
                                                          self.ctx.group_name, self.ctx.layout))
            with self.graph.inserting_after(g):
                self.gathers[a] = self.graph.call_function(sum_grad, (g, self.ctx.group_name))
            g.meta = _inserted_meta(a)
            self.gathers[a].meta = _inserted_meta(a)
            self.place[g] = self.place[self.gathers[a]] = None
        return self.gathers[a]

    def _out_dims(self, n: fx.Node, v: Any) -> tuple[int, ...] | None:
        if isinstance(v, torch.Tensor):
            d = self.seq_dims(v)
            return d if d else None
        if isinstance(v, (tuple, list)):
            return (-1,)          # a tuple of shards; getitem reads each element's dims
        return None

    # ------------------------------------------------------------------ special ops
    def _attention(self, n: fx.Node) -> None:
        q, k, v = (n.args + (None,) * 3)[:3]
        for a in (q, k, v):
            if not isinstance(a, fx.Node):
                raise AutospError(f"attention at {_where(n)} has non-tensor q/k/v")
            if self.place.get(a) is None:
                if not self.seq_dims(_val(a)):
                    raise AutospError(f"attention at {_where(n)} has an input without a sequence dim")
                self._replace_input(n, a, self._slice(a))
        written = n.target in REGION_TARGETS
        if written:
            mask, is_causal, dropout = self._region_inputs(n)
        else:
            mask = n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None)
            is_causal = n.kwargs.get("is_causal", n.args[5] if len(n.args) > 5 else False)
            dropout = _dropout_p(n.kwargs.get("dropout_p", n.args[4] if len(n.args) > 4 else 0.0))
        if isinstance(mask, fx.Node) and self.place.get(mask) is not None:
            raise AutospError(f"the attention mask at {_where(n)} is computed from sharded activations; "
                              "build it from the inputs (ids, positions, attention_mask)")
        if dropout:
            self.report.dropout_at.append(f"p={dropout:g} at {_where(n)}")
        if mask is None and not is_causal:
            self.report.unmasked_noncausal = True
        qv, kv = _val(q), _val(k)
        index = self.ctx.attention_offset + self.report.attention
        where = f"attention {index} at {_where(n)}"
        info = getattr(self.gm, str(n.kwargs["region"].target)).autosp_region if written else None
        vd = int(_val(v).shape[-1])
        shape = AttentionShape(heads=int(qv.shape[-3]), kv_heads=int(kv.shape[-3]), causal=bool(is_causal),
                               head_dim=int(qv.shape[-1]), v_head_dim=vd if vd != int(qv.shape[-1]) else 0,
                               masked=mask is not None, dropout=bool(dropout), written=written,
                               positional=bool(info and info.positional), unsplit=info.unsplit if info else "")
        mesh = SPMesh(self.ctx.world, self.ctx.layout)
        strat = pick(self._strategy_for(index), shape, mesh)
        reason = strat.refuses(shape, mesh)
        if reason:
            raise AutospError(f"{where} {reason}")
        runtime = self.ctx.runtime.get(strat.spec) or self.report.setups.get(strat.spec)
        if runtime is None:   # picked by "auto": compile prepared only named strategies (auto needs no sub-groups)
            runtime = self.report.setups[strat.spec] = strat.setup(resolve_group(self.ctx.group_name))
        n.target = strat.region_fn if written else strat.attention_fn
        n.kwargs = {**n.kwargs, **runtime, "layout": self.ctx.layout}
        early = strat.early_issue(shape)
        if early is not None:
            n.kwargs = {**n.kwargs, "first": tuple(self._issue_where_made(a, early, runtime) for a in n.args[:3])}
        self.place[n] = (qv.dim() - 2,)
        # what this rank holds here, recorded as the graph runs (report().attention[i].tokens_per_rank):
        # read off the attention's local output, which every strategy returns as this rank's tokens
        with self.gm.graph.inserting_after(n):
            seen = self.gm.graph.call_function(observe_tokens._opoverload,
                                               (n, qv.dim() - 2, index, self.ctx.group_name))
        seen.meta = _inserted_meta(n)
        self.report.attention += 1
        self.report.strategies.append(strat.spec)
        self.report.heads.append((shape.heads, shape.kv_heads))

    def _region_inputs(self, n: fx.Node) -> tuple[fx.Node | None, bool, float]:
        """(a mask among the extras of attention written by hand, False, its dropout): its extras are
        the single-device tensors the model computed (masks, biases, a sink column); the runtime
        slices them. A learned one (a bias parameter, gpt-oss's sinks) gets the gradient of the rows
        or heads this rank ran from its slice (every strategy's runtime differentiates it), and the
        parameter's sum over the group where it enters the graph makes that gradient whole."""
        info = getattr(self.gm, str(n.kwargs["region"].target)).autosp_region
        extras = [a for a in n.args[3:] if isinstance(a, fx.Node) and isinstance(_val(a), torch.Tensor)]
        for a in n.args[3:]:
            if isinstance(a, fx.Node) and self.place.get(a) is not None:
                raise AutospError(f"{a.name}, read by the attention written by hand at {info.where}, is computed "
                                  "from sharded activations; build masks and biases from the inputs")
            if a in self.local_sym:
                raise AutospError(f"the attention written by hand at {info.where} reads {a.name}, a size of this "
                                  "rank's tokens; read sizes off q, k or v inside the attention")
        return (extras[0] if extras else None), False, info.dropout

    def _issue_where_made(self, a: fx.Node, early: tuple[Any, dict[str, Any]], runtime: dict[str, Any]) -> fx.Node:
        """``early``'s call on ``a``, placed right after the node that makes ``a``: what the
        graph runs after it (the other projections, RoPE) runs while its exchange moves."""
        fn, kwargs = early
        after = self._last_placeholder() if a.op == "placeholder" else a
        with self.graph.inserting_after(after):
            issued = self.graph.call_function(fn, (a,), {**kwargs, **runtime})
        # in a's layer, as a is; not a's values (the result is a receive buffer of another shape)
        issued.meta.update({k: v for k, v in a.meta.items() if k not in ("val", "example_value", "tensor_meta")})
        return issued

    def _strategy_for(self, index: int) -> str:
        return self.ctx.decisions.layer(index).strategy

    def _cross_entropy(self, n: fx.Node) -> None:
        target = n.args[1] if len(n.args) > 1 else n.kwargs["target"]
        if isinstance(target, fx.Node) and self.place.get(target) is None and self.seq_dims(_val(target)):
            self._replace_input(n, target, self._slice(target))
        n.target = sharded_cross_entropy
        n.kwargs = {**n.kwargs, "group_name": self.ctx.loss_group}
        reduction = n.kwargs.get("reduction", n.args[6] if len(n.args) > 6 else "mean")
        self.place[n] = self.seq_dims(_val(n)) or None if reduction == "none" else None
        self.report.global_reductions += reduction != "none"

    def _token_local(self, n: fx.Node, v: Any, seqful_r: list[fx.Node], region: str) -> None:
        """Inside a token-local module any op may run on this rank's tokens as it is; what it computes
        without a sequence dim is this rank's own (:mod:`autosp.transform.token_local`)."""
        for a in seqful_r:
            self._replace_input(n, a, self._slice(a))
        self._localize_shape_args(n)
        dims = self._out_dims(n, v)
        self.place[n] = dims
        if dims is None:
            self.per_rank[n] = region

    def _token_statistic(self, n: fx.Node) -> None:
        """A sum, mean or histogram over this rank's tokens: all-reduced where it is made, so what
        follows (a router's load-balancing loss) sees the statistic of every token."""
        with self.graph.inserting_after(n):
            total = self.graph.call_function(token_total, (n,), {
                "group_name": self.ctx.loss_group, "shards": self.ctx.loss_shards if _name(n) == "mean" else 1})
        total.meta = _inserted_meta(n)
        n.replace_all_uses_with(total, delete_user_cb=lambda user: user is not total)
        self._localize_shape_args(n)
        self.place[n] = self.place[total] = None
        self.report.token_statistics += 1

    def _is_full_reduction(self, n: fx.Node) -> bool:
        name = _name(n)
        if name not in ("sum", "mean") or len(n.kwargs):
            return False
        # x.sum() / torch.sum(x): one positional arg, no dim.
        return len(n.args) == 1 and self.place.get(n.args[0]) is not None

    def _global_reduction(self, n: fx.Node) -> None:
        fn = global_sum if _name(n) == "sum" else global_mean
        n.op, n.target = "call_function", fn
        n.kwargs = {"group_name": self.ctx.loss_group}
        self.place[n] = None
        self.report.global_reductions += 1

    def _check_token_wise(self, n: fx.Node) -> None:
        name = _name(n)
        src = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        if name == "getitem" and src is not None and self.place.get(src) == (-1,):
            return                                   # element of a tuple of shards
        if name == "getitem" and src is not None and self.place.get(src) is not None:
            return self._check_getitem(n, src)
        if name in ("cat", "concat", "stack"):
            return self._check_cat(n)
        if src is not None and self.place.get(src) and self._along_sequence(n, name, src):
            raise AutospError(f"op '{name}' works along the sharded sequence dim ({_where(n)}); autosp cannot split "
                              "it across ranks")
        if name in _DIM_MIXING and src is not None and self.place.get(src):
            pos = _DIM_POSITION.get(name, 1)
            dim = n.kwargs.get("dim", n.kwargs.get("dims", n.args[pos] if len(n.args) > pos else None))
            if dim is None:
                return      # no dim: a full reduction, handled (or refused) by the caller
            ndim = _val(src).dim()
            dims = dim if isinstance(dim, (tuple, list)) else (dim,)
            for d in dims:
                if isinstance(d, int) and d % ndim in self.place[src]:
                    raise AutospError(
                        f"op '{name}' works along the sharded sequence dim ({_where(n)}); autosp cannot split "
                        "it across ranks: move it out of the model or express it as attention")

    def _along_sequence(self, n: fx.Node, name: str, src: fx.Node) -> bool:
        """A convolution over the sharded dim, or a pad of it: both need the neighbour's tokens."""
        ndim = _val(src).dim()
        if name in CONVOLUTIONS:
            return bool(set(self.place[src]) & set(range(2, ndim)))
        if name == "pad":
            pads = n.args[1] if len(n.args) > 1 else n.kwargs.get("pad", ())
            padded = {ndim - 1 - i // 2 for i, p in enumerate(pads) if not (isinstance(p, int) and p == 0)}
            return bool(padded & set(self.place[src]))
        return False

    def _check_getitem(self, n: fx.Node, src: fx.Node) -> None:
        idx = n.args[1]
        idx = idx if isinstance(idx, tuple) else (idx,)
        ndim = _val(src).dim()
        consumed = sum(1 for i in idx if i is not None and i is not Ellipsis)
        dims: list[Any] = []
        for i in idx:
            if i is Ellipsis:
                dims.extend([slice(None)] * (ndim - consumed))
            elif i is not None:
                dims.append(i)
        for d in self.place[src]:
            i = dims[d] if d < len(dims) else slice(None)
            full = isinstance(i, slice) and i.start in (None, 0) and i.stop is None and i.step in (None, 1)
            if not full:
                raise AutospError(
                    f"indexing '{i}' slices the sharded sequence dim ({_where(n)}); shift labels instead of "
                    "logits (pad labels and drop the first), or slice before the model")

    def _check_cat(self, n: fx.Node) -> None:
        tensors = n.args[0]
        dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else 0)
        out = _val(n)
        d = dim % out.dim()
        if d in self.seq_dims(out):
            nonempty = [t for t in tensors if _val(t).dim() > d and _val(t).shape[d] != 0]
            if len(nonempty) > 1:
                raise AutospError(f"concatenation along the sharded sequence dim ({_where(n)}); "
                                  "autosp cannot keep it exact (disable the KV cache: use_cache=False)")

    # ------------------------------------------------------------------ rewriting helpers
    def _slice(self, a: fx.Node) -> fx.Node:
        dims = self.seq_dims(_val(a))
        src = a
        while src.op == "call_method" and src.target in ("view", "reshape", "flatten", "contiguous") \
                and isinstance(src.args[0], fx.Node):
            src = src.args[0]
        if _name(src) == "repeat_interleave" and self._repeats_tokens(src, a):   # [B*S*k]: tokens not inner
            raise AutospError(f"tensor {a.name} repeats each token ({_where(src)}) and meets this rank's tokens; "
                              "autosp can slice only tensors whose tokens are contiguous along the sequence dim")
        if len(dims) != 1:
            raise AutospError(f"tensor {a.name} has {len(dims)} sequence dims {dims} and meets a sharded op; "
                              "autosp can slice tensors with one sequence dim")
        key = (a, dims[0])
        if key not in self.slices:
            with self.graph.inserting_after(a if a.op != "placeholder" else self._last_placeholder()):
                s = self.graph.call_function(slice_seq, (a, dims[0], self.full_len, self.ctx.rank, self.ctx.world,
                                                         self.ctx.layout))
            s.meta = _inserted_meta(a)
            self.place[s] = dims
            self.slices[key] = s
        return self.slices[key]

    def _repeats_tokens(self, rep: fx.Node, a: fx.Node) -> bool:
        """Whether ``repeat_interleave`` repeats tokens: along a sequence dim, over the flattened tensor,
        or along a dim that the views up to ``a`` fold into a sequence dim. A repeat along a feature dim
        (GPT-J's rotary tables: each frequency twice) keeps every token's features together."""
        dim = rep.kwargs.get("dim", rep.args[2] if len(rep.args) > 2 else None)
        out = _val(rep)
        if dim is None or not isinstance(dim, int) or (dim % out.dim()) in self.seq_dims(out):
            return True
        seq_sizes = [out.shape[d] for d in self.seq_dims(out)]
        return rep is not a and [_val(a).shape[d] for d in self.seq_dims(_val(a))] != seq_sizes

    def _last_placeholder(self) -> fx.Node:
        last = None
        for n in self.graph.nodes:
            if n.op == "placeholder":
                last = n
        # the full-length node may sit after the placeholders; slices must follow it
        if self.full_len.op != "placeholder":
            return self.full_len
        return last

    def _replace_input(self, n: fx.Node, old: fx.Node, new: fx.Node) -> None:
        n.replace_input_with(old, new)

    def _localize_shape_args(self, n: fx.Node) -> None:
        n.args = tuple(self._localize(a) for a in n.args)
        n.kwargs = {k: self._localize(v) for k, v in n.kwargs.items()}

    def _localize(self, x: Any) -> Any:
        """The local counterpart of a shape argument that holds the global sequence length."""
        if isinstance(x, (tuple, list)):
            return type(x)(self._localize(y) for y in x)
        if not isinstance(x, fx.Node) or x in self.local_sym:
            return x
        if x in self.local_len:
            return self.local_len[x]
        v = _val(x)
        after = x if x.op != "placeholder" else self._last_placeholder()
        if self.is_seq_sym(x):                       # s  ->  s // P
            with self.graph.inserting_after(after):
                local = self.graph.call_function(operator.floordiv, (x, self.ctx.world))
        elif isinstance(v, (tuple, list)) and any(isinstance(d, torch.SymInt) and
                                                  d.node.expr.free_symbols & self.syms for d in v):
            with self.graph.inserting_after(after):  # torch.Size([2, s, 192]) -> its local copy
                local = self.graph.create_node(x.op, x.target, self._localize(x.args),
                                               {k: self._localize(a) for k, a in x.kwargs.items()})
        else:
            return x
        self.local_len[x] = local
        self.local_sym.add(local)
        return local

    def _gather_outputs(self, out: fx.Node) -> None:
        def fix(x: Any) -> Any:
            if isinstance(x, fx.Node) and self.place.get(x) not in (None, (-1,)):
                dims = self.place[x]
                with self.graph.inserting_before(out):
                    g = self.graph.call_function(gather_seq, (x, dims[0], self.full_len, self.ctx.world,
                                                              self.ctx.group_name, self.ctx.layout))
                return g
            if isinstance(x, (tuple, list)):
                return type(x)(fix(y) for y in x)
            return x

        out.args = tuple(fix(a) for a in out.args)


def shard_graph(gm: fx.GraphModule, example_inputs: list[Any], ctx: ShardContext) -> ShardReport:
    """Rewrite ``gm`` in place for sequence parallelism; see the module docstring."""
    return Sharder(gm, example_inputs, ctx).run()
