"""Cases run on every rank of a gloo pool (see dist_harness). Each compares autosp
against a single-device run of the same model, weights and batch, computed in the
same process without any parallelism."""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Any

import torch

import autosp
from autosp.errors import AutospError
from autosp.strategies.blockwise import BLOCK_TALLY


class _BreakingBlock(torch.nn.Module):
    """A reference block whose forward breaks the graph between attention and MLP: the last
    MLP, the final norm, the head and the loss land in a graph without attention."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b = self.block
        x = x + b.attn(b.attn_norm(x), cos, sin)
        torch._dynamo.graph_break()
        return x + b.w2(torch.nn.functional.gelu(b.w1(b.ffn_norm(x))))


class _BreakAfterBlock(torch.nn.Module):
    """A whole block in one graph, then a break: the model's own frame (embedding, norm, head,
    loss) runs eagerly."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = self.block(x, cos, sin)
        torch._dynamo.graph_break()
        return x


@autosp.token_local
class _SortedMLP(torch.nn.Module):
    """Token-local by declaration, yet it sorts its tokens (by their sum) before its linear layer
    and scatters them back, as an experts module does; ``leak`` returns a per-rank count too."""

    def __init__(self, dim: int, leak: bool):
        super().__init__()
        self.lin, self.leak = torch.nn.Linear(dim, dim), leak

    def forward(self, x: torch.Tensor) -> Any:
        flat = x.reshape(-1, x.shape[-1])
        order = flat.sum(-1).argsort()
        y = torch.empty_like(flat)
        y[order] = self.lin(flat[order])
        out = y.reshape(x.shape)
        return (out, (flat.sum(-1) > 0).sum()) if self.leak else (out, None)


class _TokenLocalModel(torch.nn.Module):
    def __init__(self, leak: bool = False, dim: int = 32, heads: int = 4):
        super().__init__()
        self.emb, self.qkv = torch.nn.Embedding(128, dim), torch.nn.Linear(dim, 3 * dim)
        self.mlp, self.head, self.heads = _SortedMLP(dim, leak), torch.nn.Linear(dim, 128), heads

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        x = x + torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        y, count = self.mlp(x)
        logits = self.head(x + y)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, 128), labels.view(-1))
        return loss if count is None else loss + 0.0 * count


class _HandWrittenBlock(torch.nn.Module):
    """Attention as many training scripts write it (nanoGPT): a causal mask by masked_fill."""

    def __init__(self, dim: int, heads: int, max_len: int = 1024, mixing: bool = False, einsum: bool = False,
                 tril: bool = False, learned: bool = False):
        super().__init__()
        # a learned per-head bias on the scores: refused (its gradient is not made whole yet)
        self.head_bias = torch.nn.Parameter(torch.linspace(-1, 1, heads).view(1, heads, 1, 1)) if learned else None
        self.tril = tril                 # scores cut by position inside the attention (tril): Ulysses only
        self.mixing = mixing             # scores that mix heads (a "talking heads" step): no SP splits them
        self.einsum = einsum             # scores by einsum: not a matmul autosp follows
        self.heads, self.qkv, self.proj = heads, torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.norm = torch.nn.LayerNorm(dim)
        self.register_buffer("causal", torch.tril(torch.ones(max_len, max_len)).view(1, 1, max_len, max_len))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for y in self.qkv(self.norm(x)).split(c, dim=2))
        att = (torch.einsum("bhsd,bhtd->bhst", q, k) if self.einsum else q @ k.transpose(-2, -1)) \
            * (1.0 / k.size(-1) ** 0.5)
        if self.mixing:
            att = att - att.mean(1, keepdim=True)
        att = att.masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf"))
        if self.tril:
            att = att.tril()
        if self.head_bias is not None:
            att = att + self.head_bias
        y = torch.softmax(att, dim=-1) @ v
        return x + self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class _HandWritten(torch.nn.Module):
    def __init__(self, heads: int, dim: int = 64, vocab: int = 128, **how: bool):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(vocab, dim), torch.nn.Linear(dim, vocab)
        self.layers = torch.nn.ModuleList(_HandWrittenBlock(dim, heads, **how) for _ in range(2))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def build(kind: str, heads: int = 4, kv: int = 2, **extra: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind in ("token_local", "token_local_leak"):
        return _TokenLocalModel(leak=kind == "token_local_leak")
    if kind == "reference_break_after":
        model = build("reference", heads, kv)
        model.layers = torch.nn.ModuleList(_BreakAfterBlock(layer) for layer in model.layers)
        return model
    if kind == "reference_break":
        model = build("reference", heads, kv)
        model.layers = torch.nn.ModuleList(_BreakingBlock(layer) for layer in model.layers)
        return model
    if kind == "reference":
        from autosp.models import ReferenceConfig, ReferenceTransformer

        return ReferenceTransformer(ReferenceConfig(vocab_size=128, dim=16 * heads, n_layers=2, n_heads=heads,
                                                    n_kv_heads=kv, ffn_dim=128))
    import transformers

    common = dict(vocab_size=128, attn_implementation=extra.pop("attn", "sdpa"))
    if kind == "mixtral_eager":
        # Experts as a Python loop (transformers' fallback when grouped experts cannot run): the
        # loop breaks the graph after the sequence is sharded, 10 graphs for 2 layers.
        cfg = transformers.MixtralConfig(hidden_size=16 * heads, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=heads, num_key_value_heads=kv, num_local_experts=4,
                                         num_experts_per_tok=2, **common)
        cfg._experts_implementation = "eager"
        return transformers.AutoModelForCausalLM.from_config(cfg)
    if kind == "mixtral_eager_aux":
        # The eager expert loop breaks the graph, so each layer's router logits leave a sharded graph
        # gathered, and the load-balancing loss is computed on them next to the sharded loss.
        cfg = transformers.MixtralConfig(hidden_size=16 * heads, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=heads, num_key_value_heads=kv, num_local_experts=4,
                                         num_experts_per_tok=2, output_router_logits=True,
                                         router_aux_loss_coef=0.02, **common)
        return transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager")
    if kind.startswith("handwritten"):         # handwritten[_mixing|_einsum|_tril]
        how = kind.split("_")[1] if "_" in kind else ""
        return _HandWritten(heads, **({how: True} if how else {}))
    if kind == "gemma2":          # transformers offers it eager attention only: soft-capped scores
        cfg = transformers.Gemma2Config(hidden_size=16 * heads, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=heads, num_key_value_heads=kv, head_dim=16,
                                        vocab_size=128, attn_implementation="eager", sliding_window=8,
                                        attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
        assert cfg.layer_types == ["sliding_attention", "full_attention"]
        return transformers.AutoModelForCausalLM.from_config(cfg)
    if kind == "bloom":           # eager attention only: ALiBi added by baddbmm on [batch*heads, S, d]
        return transformers.AutoModelForCausalLM.from_config(transformers.BloomConfig(
            hidden_size=16 * heads, n_layer=2, n_head=heads, vocab_size=128, hidden_dropout=0.0,
            attention_dropout=0.0))
    if kind == "falcon_alibi":    # multi-query (one K/V head); ALiBi's bias reaches SDPA inside a dense mask
        return transformers.AutoModelForCausalLM.from_config(transformers.FalconConfig(
            hidden_size=16 * heads, num_hidden_layers=2, num_attention_heads=heads, multi_query=True,
            new_decoder_architecture=False, alibi=True, **common))
    if kind == "gptj":            # rotary tables built by repeat_interleave over the feature dim
        return transformers.AutoModelForCausalLM.from_config(transformers.GPTJConfig(
            n_embd=16 * heads, n_layer=2, n_head=heads, rotary_dim=8, n_positions=256, attn_pdrop=0.0,
            resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=None, eos_token_id=None, **common))
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_embd=16 * heads, n_layer=2, n_head=heads, n_positions=256,
                                      attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, **common)
    else:
        cls = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "mistral": "MistralConfig",
               "qwen3": "Qwen3Config", "olmo2": "Olmo2Config", "mixtral": "MixtralConfig",
               "qwen2_moe": "Qwen2MoeConfig", "granitemoe": "GraniteMoeConfig"}[kind]
        if kind in ("mixtral", "qwen2_moe", "granitemoe"):   # grouped experts (the default), router loss on
            extra = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02,
                         **{"num_experts" if kind == "qwen2_moe" else "num_local_experts": 4}, **extra)
            if kind == "qwen2_moe":
                extra.update(moe_intermediate_size=64, shared_expert_intermediate_size=64)
        cfg = getattr(transformers, cls)(hidden_size=16 * heads, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=heads, num_key_value_heads=kv, **common, **extra)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def falcon_sdpa_kv_heads(heads: int) -> int:
    """The K/V heads SDPA is handed by a multi-query Falcon of ``heads`` query heads. From
    transformers 5.25 Falcon always materializes its causal mask (ALiBi is added onto it) and SDPA's
    grouped-query path takes no mask, so the one K/V head is repeated over the query heads before
    SDPA (and SP exchanges them all); before, SDPA got the one."""
    import transformers
    from packaging.version import Version

    return heads if Version(transformers.__version__) >= Version("5.25") else 1


def _loss(model: torch.nn.Module, kind: str, ids: torch.Tensor, labels: torch.Tensor,
          **extra: torch.Tensor) -> torch.Tensor:
    if kind.startswith("reference") or kind.startswith("token_local") or kind.startswith("handwritten"):
        return model(ids, labels=labels)
    # use_cache=False, as autosp runs HF models: without a cache transformers also reads packed
    # documents from restarting position ids (with one, it silently attends across them)
    return model(input_ids=ids, labels=labels, use_cache=False, **extra).loss


def _extra_inputs(inputs: str, batch: int, seq_len: int) -> dict[str, torch.Tensor]:
    """Inputs beside the ids: a padded batch (row 0 left-padded by 5 tokens, the last row
    right-padded by 3) or a packed batch (documents of 10, 3 and the rest: positions restart)."""
    if inputs == "padded":
        mask = torch.ones(batch, seq_len, dtype=torch.long)
        mask[0, :5] = 0
        mask[-1, -3:] = 0
        return {"attention_mask": mask}
    if inputs == "packed":
        pos = torch.cat([torch.arange(10), torch.arange(3), torch.arange(seq_len - 13)])
        return {"position_ids": pos.expand(batch, seq_len).clone()}
    return {}


def _batch(step: int, batch: int, seq_len: int, uneven: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 128, (batch, seq_len), generator=g)
    labels = ids.clone()
    if uneven:
        # Ignore most of the first half of each row: ranks hold very different counts.
        labels[:, : seq_len // 2][torch.rand(batch, seq_len // 2, generator=g) < 0.8] = -100
    return ids, labels


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def compile_options(strategy: str = "auto", plan: Any = None, checkpoint: Any = "none", layout: str | None = None,
                    loss_chunks: int = 1, mlp_chunks: Any = 1, memory_limit: float | None = None,
                    runtime: Any = None, keep_mlp_input: bool = True) -> dict[str, Any]:
    """autosp.compile's arguments for a test's knobs: a saved plan, a budget for the planner, the
    planner with some decisions fixed (strategy "auto"), or every decision fixed."""
    run = {"runtime": runtime} if runtime is not None else {}
    if plan is not None:
        return {"plan": plan, **run}
    if memory_limit is not None:
        return {"memory_limit": memory_limit, **run}
    if strategy == "auto":
        fixed = {"checkpoint": None if checkpoint == "none" else checkpoint,
                 "mlp_chunks": None if mlp_chunks == 1 else mlp_chunks, "loss_chunks": None if loss_chunks == 1 else loss_chunks}
        return {"plan": autosp.Auto(**fixed), **run}
    return {"plan": autosp.Decisions.of(strategy=strategy, checkpoint=checkpoint, mlp_chunks=mlp_chunks,
                                        keep_mlp_input=keep_mlp_input,
                                        mesh=autosp.MeshChoice(layout=layout, loss_chunks=loss_chunks)), **run}


def train_compare(kind: str, seq_len: int = 32, batch: int = 2, steps: int = 3, uneven: bool = False,
                  strategy: str = "auto", plan: Any = None, compiler: str | None = None, checkpoint: Any = "none",
                  inputs: str = "", layout: str | None = None, memory_limit: float | None = None,
                  loss_chunks: int = 1, mlp_chunks: int = 1, overlap: bool = True, **cfg: Any) -> dict[str, Any]:
    """Loss and per-parameter gradient errors of autosp vs single device, over AdamW steps."""
    ref = build(kind, **cfg)
    sp_model = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt_sp = torch.optim.AdamW(sp_model.parameters(), lr=1e-3)
    kw = compile_options(strategy, plan, checkpoint, layout, loss_chunks, mlp_chunks, memory_limit,
                         runtime=autosp.Runtime(compiler=None if compiler == "default" else compiler, overlap=overlap))
    if compiler == "default":          # what a user gets: no compiler named, no $AUTOSP_COMPILER
        saved = os.environ.pop("AUTOSP_COMPILER", None)
        try:
            sp = autosp.compile(sp_model, **kw)
        finally:
            if saved is not None:
                os.environ["AUTOSP_COMPILER"] = saved
    else:
        sp = autosp.compile(sp_model, **kw)
    out: dict[str, Any] = {"loss_err": 0.0, "grad_err": 0.0, "worst": "", "losses": []}
    extra = _extra_inputs("packed" if inputs == "cu_seqlens" else inputs, batch, seq_len)
    extra_sp = extra
    if inputs == "cu_seqlens":     # the same documents, as flash-attention's cumulative lengths
        starts = [r * seq_len + d for r in range(batch) for d in (0, 10, 13)]
        extra_sp = {"cu_seqlens": torch.tensor(starts + [batch * seq_len])}
    blocks = dict(BLOCK_TALLY)
    for step in range(steps):
        ids, labels = _batch(step, batch, seq_len, uneven)
        if "attention_mask" in extra:
            labels = labels.masked_fill(extra["attention_mask"] == 0, -100)
        loss_ref = _loss(ref, kind, ids, labels, **extra)
        loss_ref.backward()
        loss_sp = _loss(sp, kind, ids, labels, **extra_sp)
        loss_sp.backward()
        out["losses"].append((loss_ref.item(), loss_sp.item()))
        out["loss_err"] = max(out["loss_err"], abs(loss_sp.item() - loss_ref.item()) / abs(loss_ref.item()))
        for (name, p), q in zip(sp_model.named_parameters(), ref.parameters()):
            if q.grad is None:
                continue
            e = _rel(p.grad, q.grad)
            if e > out["grad_err"]:
                out["grad_err"], out["worst"] = e, f"step {step} {name}"
        opt_ref.step()
        opt_sp.step()
        opt_ref.zero_grad()
        opt_sp.zero_grad()
    # All parameters together: a per-tensor ratio is ill-posed for e.g. a key bias, whose exact
    # gradient is zero, so Adam turns rounding noise into +-lr steps in both runs.
    flat = lambda m: torch.cat([p.detach().flatten() for p in m.parameters()])  # noqa: E731
    out["param_err"] = _rel(flat(sp_model), flat(ref))
    out["attention_ops"] = sp.state.attention_ops
    out["strategies"] = sp.state.strategies          # the spec that ran, per attention op
    out["report"] = sp.report().as_dict()            # of the last step: collectives, tokens per rank
    out["labels"] = labels                           # the last step's
    out["graphs"] = len(sp.state.reports)
    out["replicated_params"] = sum(r.replicated_params for r in sp.state.reports)
    out["replicated_work"] = [w for r in sp.state.reports for w in r.replicated_work]
    out["token_statistics"] = sum(r.token_statistics for r in sp.state.reports)
    out["shared_replicated"] = sum(r.shared_replicated for r in sp.state.reports)
    out["tiled_losses"] = sum(r.tiled_losses for r in sp.state.reports)
    out["tiled_mlps"] = sum(r.tiled_mlps for r in sp.state.reports)
    out["graph_reports"] = [(r.attention, r.token_statistics, r.replicated_params, r.starts_at[-70:])
                            for r in sp.state.reports]
    out["blocks"] = {k: BLOCK_TALLY[k] - blocks.get(k, 0) for k in ("computed", "skipped")}
    out["plan_documents"] = getattr(sp.plan, "predicted", {}).get("documents") if getattr(sp, "plan", None) else None
    out["plan_layers"] = sp.plan.layers if getattr(sp, "plan", None) is not None else None
    out["plan_devices_per_node"] = sp.plan.devices_per_node if getattr(sp, "plan", None) is not None else None
    out["runtime"] = next(iter(sp.config.runtime.values()), {})     # the groups of the (first) strategy
    return out


def expect_error(kind: str, seq_len: int = 32, strategy: str = "auto", **cfg: Any) -> str:
    """The AutospError message autosp gives for this model, or '' if it ran."""
    model = build(kind, **cfg)
    sp = autosp.compile(model, plan=strategy)
    ids, labels = _batch(0, 1, seq_len, False)
    try:
        _loss(sp, kind, ids, labels)
    except AutospError as e:          # raised as itself, not wrapped in Dynamo's BackendCompilerFailed
        return str(e)
    return ""


def memory_budget_refused(seq_len: int = 256, limit: float = 2 ** 20) -> dict[str, Any]:
    """autosp.compile(model, memory_limit=...) with a budget no plan meets: every rank raises one
    AutospError at its first call, and no step runs without the budget."""
    model = build("llama")
    sp = autosp.compile(model, memory_limit=limit)
    ids, labels = _batch(0, 1, seq_len, False)
    try:
        _loss(sp, "llama", ids, labels).backward()
    except AutospError as e:
        return {"error": str(e), "graphs": len(sp.state.reports),
                "grads": sum(p.grad is not None for p in model.parameters())}
    return {"error": "", "graphs": len(sp.state.reports), "grads": sum(p.grad is not None for p in model.parameters())}


def memory_budget_compare(seq_len: int = 256) -> dict[str, Any]:
    """autosp.compile(model, memory_limit=...) between the predicted peaks without and with full
    checkpointing (MLPs untiled): the planner must checkpoint or tile, the transform apply what it
    chose, and training stay exact."""
    import torch.distributed as dist

    from autosp.graph import capture
    from autosp.planner.problem import Problem
    from autosp.planner.search import plan

    from autosp.transform.backend import default_compiler

    world = dist.get_world_size()
    graph = capture(build("llama"), seq_len=seq_len, batch_size=2, dtype="float32")
    peak = {k: plan(Problem.of(graph=graph, seq_len=seq_len, batch_size=2, world_size=world, profile="cpu-gloo", sp_degrees=(world,), checkpoints=(k,), mlp_chunks=(1,), compiler=default_compiler(), memory_limit=float("inf"))).predicted.peak_bytes
            for k in ("none", "full")}
    limit = (peak["none"] + peak["full"]) / 2
    import os
    import tempfile

    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp()        # plan afresh, not from a cached plan
    out = train_compare("llama", seq_len=seq_len, steps=1, plan=None, memory_limit=limit)
    out["peaks"], out["limit"] = peak, limit
    return out


def loss_tiling_memory(seq_len: int = 1024, vocab: int = 8192) -> dict[str, Any]:
    """Per-rank step peak (allocator's view) of a Llama with a large vocabulary, with the LM head
    and loss whole and in 8 chunks; the two losses against one process."""
    import transformers

    from autosp.tools.memory_probe import step_peak

    out: dict[str, Any] = {}
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, seq_len), generator=g)
    single = ref(input_ids=ids, labels=ids, use_cache=False).loss.item()
    for chunks in (1, 8):
        torch._dynamo.reset()
        sp = autosp.compile(copy.deepcopy(ref), plan=autosp.Decisions.of(strategy="ulysses", mesh=autosp.MeshChoice(loss_chunks=chunks)))
        sp(input_ids=ids, labels=ids).loss.backward()                      # compile outside the probe
        loss, peak = step_peak(sp, lambda: sp(input_ids=ids, labels=ids).loss)
        out[chunks] = {"peak": peak, "loss_err": abs(loss.item() - single) / single,
                       "tiled": sum(r.tiled_losses for r in sp.state.reports)}
    return out


def expect_error_compile(kind: str = "llama", **kw: Any) -> str:
    """The AutospError message ``autosp.compile`` gives for these arguments, or ''."""
    try:
        autosp.compile(build(kind), **kw)
    except AutospError as e:
        return str(e)
    return ""


def backend_compare(kind: str = "reference", seq_len: int = 32) -> dict[str, Any]:
    """torch.compile(model, backend="autosp", dynamic=True) with gradients reduced by hand."""
    import torch.distributed as dist

    ref = build(kind)
    model = copy.deepcopy(ref)
    compiled = torch.compile(model, backend="autosp", dynamic=True)
    ids, labels = _batch(0, 2, seq_len, True)
    loss_ref = _loss(ref, kind, ids, labels)
    loss_ref.backward()
    loss = _loss(compiled, kind, ids, labels)
    loss.backward()
    grad_err = 0.0
    for p, q in zip(model.parameters(), ref.parameters()):
        dist.all_reduce(p.grad)
        grad_err = max(grad_err, _rel(p.grad, q.grad))
    return {"loss_err": abs(loss.item() - loss_ref.item()) / abs(loss_ref.item()), "grad_err": grad_err}


def float_attribute_changed(compiler: str = "aot_eager", seq_len: int = 32) -> dict[str, Any]:
    """Python floats are constants of autosp's graphs: a norm's eps changed between steps compiles
    the graph again (Dynamo guards the value) and the loss follows one process's."""
    ref = build("llama")
    sp_model = copy.deepcopy(ref)
    sp = autosp.compile(sp_model, plan="ulysses", runtime=autosp.Runtime(compiler=compiler))
    out: dict[str, Any] = {"graphs": [], "loss_err": []}
    for step, eps in enumerate((1e-6, 1e-6, 0.5)):
        for m in (ref, sp_model):
            m.model.layers[0].input_layernorm.variance_epsilon = eps
        ids, labels = _batch(step, 2, seq_len, False)
        loss_ref, loss_sp = (m(input_ids=ids, labels=labels).loss for m in (ref, sp))
        out["loss_err"].append(abs(loss_sp.item() - loss_ref.item()) / abs(loss_ref.item()))
        out["graphs"].append(len(sp.state.reports))
    out["loss_moved"] = abs(loss_ref.item() - build("llama")(input_ids=ids, labels=labels).loss.item())
    out["compiler"] = sp.report().compiler
    return out


def logits_shapes(kind: str = "llama", seq_len: int = 33) -> dict[str, Any]:
    """What the user gets back as logits: local next to a loss, full otherwise (and exact)."""
    import torch.distributed as dist

    ref = build(kind)
    ids, labels = _batch(0, 2, seq_len, False)
    full = ref(input_ids=ids).logits
    world, rank = dist.get_world_size(), dist.get_rank()
    local_len = -(-seq_len // world)
    out = {}
    # Ulysses forced: what the user gets back does not depend on the strategy (planning would
    # capture the model once per compile).
    default = autosp.compile(copy.deepcopy(ref), plan="ulysses")
    with_labels = default(input_ids=ids, labels=labels).logits
    out["with_labels_len"] = with_labels.shape[1]
    lo = rank * local_len
    hi = min(lo + local_len, seq_len)
    out["with_labels_err"] = _rel(with_labels[:, : hi - lo], full[:, lo:hi])
    no_labels = autosp.compile(copy.deepcopy(ref), plan="ulysses")(input_ids=ids).logits
    out["no_labels_len"], out["no_labels_err"] = no_labels.shape[1], _rel(no_labels, full)
    gathered = autosp.compile(copy.deepcopy(ref), plan="ulysses", runtime=autosp.Runtime(gather_outputs=True))
    gathered = gathered(input_ids=ids, labels=labels).logits
    out["gathered_len"], out["gathered_err"] = gathered.shape[1], _rel(gathered, full)
    out["local_len"] = local_len
    return out


def ring_memory(seq_lens: tuple[int, ...] = (512, 1024), degrees: tuple[int, ...] = (2, 4)) -> dict[str, int]:
    """Peak bytes allocated by ring attention forward+backward on one rank, per (P, S)."""
    import torch.distributed as dist
    from autosp.strategies.layout import all_chunks
    from autosp.tools.memory_probe import PeakBytes
    from autosp.strategies.ring_kernel import ring_backward, ring_forward

    groups = {p: dist.new_group(list(range(p))) for p in degrees}   # every rank creates every group
    out: dict[str, int] = {}
    for p in degrees:
        if dist.get_rank() >= p:
            continue
        pg = groups[p]
        for s in seq_lens:
            g = torch.Generator().manual_seed(s)
            q, k, v = (torch.randn(1, h, s // p, 32, generator=g) for h in (8, 2, 2))
            chunks = all_chunks("contiguous", p)
            with PeakBytes() as mem:
                o, lse = ring_forward(q, k, v, None, chunks, True, 32 ** -0.5, pg)
                ring_backward(torch.ones_like(o), q, k, v, o, lse, None, chunks, True, 32 ** -0.5, pg)
            out[f"{p}x{s}"] = mem.peak
        dist.barrier(group=pg)
    dist.barrier()
    return out


def costmodel_measure(seq_len: int = 1024, strategies: tuple[str, ...] = ("ulysses", "zigzag_ring")) -> list:
    """Measured step time and peak step memory of tiny Llama under autosp (see autosp.tools.validation)."""
    from autosp.tools.validation import measured_sp

    return measured_sp([seq_len], list(strategies), repeats=2)


def plan_apply(tmp: str, seq_len: int = 32) -> dict[str, Any]:
    """A saved plan (mixed strategies) applied with plan=: exact, and refused when it does not match."""
    import torch.distributed as dist

    from autosp.decisions import LayerChoice, MeshChoice
    from autosp.planner.plan import LayerPlan, Plan

    world = dist.get_world_size()
    plan = Plan(model="reference", fingerprint="x", seq_len=seq_len, batch_size=2, dtype="float32",
                world_size=world, devices_per_node=world, dp_degree=1, mesh=MeshChoice(world, "zigzag", loss_chunks=2),
                layers=[LayerPlan("Block", "", 1, LayerChoice("ulysses"), ulysses_degree=world),
                        LayerPlan("Block", "", 1, LayerChoice("zigzag_ring"), ring_degree=world)],
                predicted={}, profile="cpu-gloo", memory_limit_bytes=1e12, zero_stage=0)
    path = f"{tmp}/plan-{dist.get_rank()}.json"
    plan.save(path)
    out = train_compare("reference", seq_len=seq_len, steps=1, strategy="auto", plan=path)
    wrong = Plan.load(path)
    wrong.world_size = world * 2
    try:
        autosp.compile(build("reference"), plan=wrong)
        out["wrong_world"] = ""
    except AutospError as e:
        out["wrong_world"] = str(e)
    sp = autosp.compile(build("reference"), plan=path)
    ids, labels = _batch(0, 1, seq_len * 2, False)
    try:
        sp(ids, labels=labels)
        out["wrong_len"] = ""
    except AutospError as e:
        out["wrong_len"] = str(e)
    return out


def auto_plan_compare(kind: str = "llama", cache_dir: str = "", **cfg: Any) -> dict[str, Any]:
    """plan="auto": the ILP plans on the first call (cpu-gloo profile); still exact; cached."""
    import os

    os.environ["XDG_CACHE_HOME"] = cache_dir
    out = train_compare(kind, seq_len=64, steps=2, plan="auto", **cfg)
    files = os.listdir(os.path.join(cache_dir, "autosp", "plans"))
    out["cached"] = files
    # the compiler the plan's memory was costed for: the one the wrapper runs (Inductor fuses)
    out["plan_compiler"] = autosp.Plan.load(os.path.join(cache_dir, "autosp", "plans", files[0])).predicted.compiler
    return out


def toy_strategy_compare(seq_len: int = 32) -> dict[str, Any]:
    """A strategy registered from the tests (tests/toy_strategy.py), forced and planned: exact."""
    import torch.distributed as dist

    import toy_strategy
    from autosp.strategies import register

    register(toy_strategy.ToyAllGatherAllReduce)         # idempotent: the pool may have run this before
    forced = train_compare("llama", seq_len=seq_len, steps=2, strategy=toy_strategy.FAMILY, heads=4, kv=2)
    world = dist.get_world_size()
    p = autosp.plan(autosp.Problem.of(build("llama", heads=4, kv=2), seq_len=seq_len, batch_size=2, world_size=world, profile="cpu-gloo", dtype="float32", strategies=(toy_strategy.FAMILY,), sp_degrees=(world,)))
    planned = train_compare("llama", seq_len=seq_len, steps=2, plan=p, heads=4, kv=2)
    return {"forced": forced, "planned": planned, "plan_strategies": [layer.choice.strategy for layer in p.layers]}


def inputs_embeds_compare(kind: str = "llama", seq_len: int = 32, steps: int = 2, strategy: str = "auto",
                          **cfg: Any) -> dict[str, Any]:
    """inputs_embeds made by an upstream module outside the model: its gradients too equal one process's."""
    ref = build(kind, **cfg)
    hidden = ref.config.hidden_size
    torch.manual_seed(1)
    up_ref = torch.nn.Sequential(torch.nn.Embedding(128, hidden), torch.nn.Linear(hidden, hidden))
    sp_model, up_sp = copy.deepcopy(ref), copy.deepcopy(up_ref)
    sp = autosp.compile(sp_model, plan=strategy)
    out: dict[str, Any] = {"loss_err": 0.0, "grad_err": 0.0, "upstream_grad_err": 0.0}
    for step in range(steps):
        ids, labels = _batch(step, 2, seq_len, False)
        loss_ref = ref(inputs_embeds=up_ref(ids), labels=labels).loss
        loss_ref.backward()
        loss_sp = sp(inputs_embeds=up_sp(ids), labels=labels).loss
        loss_sp.backward()
        out["loss_err"] = max(out["loss_err"], abs(loss_sp.item() - loss_ref.item()) / abs(loss_ref.item()))
        for key, a, b in (("grad_err", sp_model, ref), ("upstream_grad_err", up_sp, up_ref)):
            for p, q in zip(a.parameters(), b.parameters()):
                if q.grad is None:             # the model's token embedding: unused with inputs_embeds
                    assert p.grad is None or not p.grad.any()
                    continue
                out[key] = max(out[key], _rel(p.grad, q.grad))
        for m in (ref, sp_model, up_ref, up_sp):
            m.zero_grad()
    out["strategies"] = sp.state.strategies
    out["report"] = sp.report().as_dict()
    return out


def warnings_of(kind: str, strategy: str = "auto", seq_len: int = 32, compiler: str = "eager",
                **cfg: Any) -> list[str]:
    """The warnings autosp gives over one training step of this model (said where the graphs are
    sharded, before any compiler runs them: eager graphs by default, the quickest)."""
    import warnings

    model = build(kind, **cfg).train()
    sp = autosp.compile(model, plan=strategy, runtime=autosp.Runtime(compiler=compiler))
    ids, labels = _batch(0, 1, seq_len, False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _loss(sp, kind, ids, labels).backward()
    return [str(w.message) for w in caught if "autosp" in w.filename or "SP" in str(w.message)]


def checkpoint_memory(seq_len: int = 1024, strategy: str = "ulysses", compiler: str = "eager",
                      modes: tuple = ("none", "selective", "full")) -> dict[str, Any]:
    """Peak step memory (allocator view) of tiny Llama per memory decision (a checkpointing mode,
    or (mode, MLP chunks, loss chunks)), its losses, and the cost model's prediction of the peak."""
    import torch.distributed as dist

    from autosp.costmodel.predict import step_peak
    from autosp.costmodel.profile import load_profile
    from autosp.graph import capture
    from autosp.tools.validation import measure_step, tiny_model

    graph = capture(tiny_model(), seq_len=seq_len, dtype="float32")
    out = {}
    for mode in modes:
        ck, mlp, lc, *keep = (mode, 1, 1) if isinstance(mode, str) else mode
        keep_input = keep[0] if keep else True         # (a fourth field: the tiled MLP's input kept under full)
        torch._dynamo.reset()
        sp = autosp.compile(tiny_model(), **compile_options(strategy, checkpoint=ck, mlp_chunks=mlp, loss_chunks=lc,
                                                            keep_mlp_input=keep_input,
                                                            runtime=autosp.Runtime(compiler=compiler)))
        m = measure_step(sp, seq_len, repeats=0)
        predicted = step_peak(graph, load_profile("cpu-gloo"), sp=dist.get_world_size(), strategy=strategy,
                              seq_len=seq_len, checkpoint=ck, mlp_chunks=mlp, loss_chunks=lc, keep_mlp_input=keep_input)
        out[mode if isinstance(mode, str) else "/".join(map(str, mode))] = {
            "peak": m["peak"], "loss": m["loss"], "predicted": predicted,
            "tiled_mlps": sum(r.tiled_mlps for r in sp.state.reports)}
    return out


def partial_grads_with_eager_parameters(seq_len: int = 32) -> dict[str, Any]:
    """reduce_grads=False where a graph break leaves parameters eager: exact with True, refused with False."""
    import torch.distributed as dist

    exact = train_compare("reference_break_after", seq_len=seq_len, steps=1, strategy="ulysses")
    sp = autosp.compile(build("reference_break_after"), plan="ulysses", runtime=autosp.Runtime(reduce_grads=False))
    ids, labels = _batch(0, 2, seq_len, False)
    loss = _loss(sp, "reference", ids, labels)
    try:
        loss.backward()
        refused = ""
    except AutospError as e:
        refused = str(e)
    dist.barrier()
    return {"exact": exact, "refused": refused}


def dp_sp_compare(kind: str = "llama", zero_stage: int | None = 0, strategy: str = "ulysses", steps: int = 3,
                  seq_len: int = 32, rows: int = 2, uneven: bool = True, bucket_mb: float = 0.01,
                  plan_dir: str = "", zero_shard: Any = "mesh", compiler: str | None = None,
                  host_optimizer: bool = False, **cfg: Any) -> dict[str, Any]:
    """A dp x sp mesh (``rows`` data-parallel rows) against one process on the concatenated global
    batch: loss and every parameter gradient per AdamW step, and what ran (from the report);
    ``host_optimizer``: ``model.optimizer`` steps in host memory."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (rows, world // rows), mesh_dim_names=("dp", "sp"))
    row = mesh.get_local_rank("dp")
    ref = build(kind, **cfg)
    model = copy.deepcopy(ref)
    if plan_dir:           # the same configuration, as a plan file applied whole
        path = f"{plan_dir}/plan-{dist.get_rank()}.json"
        _dp_plan(kind, seq_len, rows, strategy, zero_stage).save(path)
        sp = autosp.compile(model, plan=path, zero=autosp.Zero(bucket_mb=bucket_mb))
    else:
        plan = autosp.Decisions.of(strategy=strategy, mesh=autosp.MeshChoice(host_optimizer=True)) \
            if host_optimizer else strategy
        sp = autosp.compile(model, plan=plan, mesh=mesh,
                            zero=autosp.Zero(stage=zero_stage, bucket_mb=bucket_mb, shard=zero_shard),
                            runtime=autosp.Runtime(compiler=compiler))
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt_sp = sp.optimizer(torch.optim.AdamW, lr=1e-3)
    out: dict[str, Any] = {"loss_err": 0.0, "grad_err": 0.0, "worst": "", "losses": []}
    per_row = 2
    for step in range(steps):
        ids, labels = _batch(step, per_row * rows, seq_len, uneven)
        if uneven and rows > 1:       # the rows' ignored labels differ a lot: a mean of row means would be off
            labels[per_row:, : seq_len * 3 // 4] = -100
        loss_ref = _loss(ref, kind, ids, labels)
        loss_ref.backward()
        mine = slice(row * per_row, (row + 1) * per_row)
        loss = _loss(sp, kind, ids[mine], labels[mine])
        loss.backward()
        out["losses"].append((loss_ref.item(), loss.item()))
        out["loss_err"] = max(out["loss_err"], abs(loss.item() - loss_ref.item()) / abs(loss_ref.item()))
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            e = _rel(_full(p.grad), q.grad)
            if e > out["grad_err"]:
                out["grad_err"], out["worst"] = e, f"step {step} {name}"
        opt_ref.step()
        opt_sp.step()
        grad_bytes = sum(_local(p.grad).numel() * p.grad.element_size() for p in model.parameters())
        opt_ref.zero_grad()
        opt_sp.zero_grad()
    flat = lambda m: torch.cat([_full(p.detach()).flatten() for p in m.parameters()])  # noqa: E731
    out["param_err"] = _rel(flat(model), flat(ref))
    out["strategies"] = sp.state.strategies
    out["report"] = sp.report().as_dict()
    out["row"] = row
    out["optimizer"] = type(opt_sp).__name__
    stepped = getattr(opt_sp, "optim", opt_sp)              # ZeRO 1: the optimizer of this rank's share
    out["stepped"] = (type(stepped).__name__, getattr(stepped, "on_host", None),
                      len(getattr(stepped, "masters", ())), len(stepped.param_groups[0]["params"]))
    out["params"] = sum(1 for p in model.parameters() if p.requires_grad)
    states = getattr(opt_sp, "optim", opt_sp).state.values()
    out["state_elements"] = sum(_local(t).numel() for st in states for t in st.values() if t.dim() > 0)
    out["param_elements"] = sum(p.numel() for p in model.parameters())
    out["local_param_elements"] = sum(_local(p).numel() for p in model.parameters())
    # what this rank holds between steps: parameters, gradients (before zero_grad), optimizer states
    out["state_bytes"] = grad_bytes + sum(_local(t).numel() * t.element_size() for st in states
                                          for t in st.values() if t.dim() > 0) + \
        sum(_local(p).numel() * p.element_size() for p in model.parameters())
    out["one_process_state_bytes"] = sum(p.numel() * p.element_size() for p in ref.parameters()) * 4  # p, g, 2 moments
    if zero_stage == 3:
        from autosp.costmodel.memory import model_states
        from autosp.graph import capture

        states_pred = model_states(capture(build(kind, **cfg), seq_len=seq_len, batch_size=per_row, dtype="float32"),
                                   world, zero_stage)
        out["predicted_state_bytes"] = sum(states_pred.values())
    out["fsdp_units"] = sum(1 for m in model.modules() if type(m).__name__.startswith("FSDP"))
    out["plan"] = None if sp.plan is None else {"zero_stage": sp.plan.mesh.zero_stage, "layers": sp.plan.layers}
    out["compiler"] = sp.config.compiler
    out["sp_rows"] = dist.get_world_size(sp.mesh.sp), dist.get_world_size(sp.mesh.whole)
    return out


def _dp_plan(kind: str, seq_len: int, rows: int, strategy: str, zero_stage: int | None,
             devices_per_node: int = 4) -> Any:
    from autosp.decisions import LayerChoice, MeshChoice
    from autosp.planner.plan import LayerPlan, Plan

    sp = 4 // rows
    u, r = (int(x) for x in strategy.split(":")[1].split("x")) if strategy.startswith("hybrid") else \
        ((sp, 1) if strategy == "ulysses" else (1, sp))
    return Plan(model=kind, fingerprint="x", seq_len=seq_len, batch_size=2, dtype="float32", world_size=4,
                devices_per_node=devices_per_node, dp_degree=rows, mesh=MeshChoice(sp, "contiguous"),
                layers=[LayerPlan("Layer", "", 2, LayerChoice(strategy), ulysses_degree=u, ring_degree=r)],
                predicted={}, profile="cpu-gloo", memory_limit_bytes=1e12, zero_stage=zero_stage or 0)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP's shard) made whole; a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def dp_sp_accumulate(seq_len: int = 32) -> dict[str, Any]:
    """Two micro-batches per step on a 2 x 2 mesh: under no_sync then one reduction, equal to one
    process on all four rows' batches; accumulating onto reduced gradients is refused."""
    import torch.distributed as dist

    mesh = _mesh22()
    row = mesh.get_local_rank("dp")
    ref = build("llama")
    model = copy.deepcopy(ref)
    sp = autosp.compile(model, plan="ulysses", mesh=mesh, zero=0)
    micro = [_batch(i, 4, seq_len, True) for i in range(2)]
    # one process: each micro-batch's loss over all four rows, backward twice (gradients add up)
    for ids, labels in micro:
        _loss(ref, "llama", ids, labels).backward()
    calls = _grad_reductions_since()
    with sp.no_sync():
        ids, labels = micro[0]
        _loss(sp, "llama", ids[2 * row:2 * row + 2], labels[2 * row:2 * row + 2]).backward()
    inside = calls()
    ids, labels = micro[1]
    _loss(sp, "llama", ids[2 * row:2 * row + 2], labels[2 * row:2 * row + 2]).backward()
    err = max(_rel(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
    try:           # a third backward without zero_grad: onto gradients already summed
        _loss(sp, "llama", ids[2 * row:2 * row + 2], labels[2 * row:2 * row + 2]).backward()
        refused = ""
    except AutospError as e:
        refused = str(e)
    dist.barrier()
    return {"grad_err": err, "refused": refused, "reduced_inside_no_sync": inside}


def _user_fsdp_step() -> Any:
    """A model the caller wrapped with FSDP per block, then compiled without a ZeRO stage: refused."""
    from torch.distributed.fsdp import fully_shard

    model = build("llama")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    ids, labels = _batch(0, 2, 32, False)
    return _loss(autosp.compile(model, plan="ulysses", runtime=autosp.Runtime(reduce_grads=False)), "llama", ids, labels)


def _with_env(**env: str) -> Any:
    import os

    def run(fn: Any) -> Any:
        before = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return fn()
        finally:
            for k, v in before.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return run


def _grad_reductions_since() -> Any:
    """A counter of autosp's gradient all-reduces issued since it was made."""
    from autosp.strategies.collectives import TALLY

    start = sum(v[0] for (g, k), v in TALLY.items() if k == "grad_all_reduce")
    return lambda: sum(v[0] for (g, k), v in TALLY.items() if k == "grad_all_reduce") - start


def _mesh22() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))


def dp_sp_errors() -> list[str]:
    """The one-line refusals of bad mesh / ZeRO input."""
    from torch.distributed.device_mesh import init_device_mesh

    import torch.distributed as dist

    out = []
    pair, _ = dist.new_subgroups(group_size=2)
    attempts = [
        lambda: autosp.compile(build("llama"), mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))),
        lambda: autosp.compile(build("llama"), mesh=3),
        lambda: autosp.compile(build("llama"), zero=5),
        lambda: autosp.compile(build("llama"), mesh=pair, zero=3),
        lambda: autosp.compile(build("llama"), zero=0, runtime=autosp.Runtime(reduce_grads=False)),
        lambda: autosp.compile(build("llama"), mesh=init_device_mesh("cpu", (4,), mesh_dim_names=("sp",)), sp_size=4),
        lambda: autosp.compile(build("llama")).no_sync(),
        lambda: _user_fsdp_step(),
        lambda: _with_env(LOCAL_WORLD_SIZE="2")(
            lambda: autosp.compile(build("llama"), plan=_dp_plan("llama", 32, 1, "hybrid:2x2", 0))),
        lambda: autosp.compile(build("llama"), mesh=_mesh22(), zero=autosp.Zero(stage=3, shard=3)),
        lambda: autosp.compile(build("llama"), mesh=_mesh22(), zero=autosp.Zero(stage=2, shard=2)),
    ]
    for attempt in attempts:
        try:
            attempt()
            out.append("")
        except AutospError as e:
            out.append(str(e))
    return out


def checkpoint_resume(path: str, zero_stage: int = 3, resumes: tuple[tuple[int, ...], ...] = ((2, 3),),
                      seq_len: int = 32, host_optimizer: bool = False) -> dict[str, Any]:
    """Train 2 AdamW steps on a 2 x 2 mesh, save (DCP), train 2 more; then for each (rows, ZeRO
    stage[, optimizer on the host]) in ``resumes`` a fresh model and optimizer on that mesh load and
    train the same 2 steps: the losses. Also the full parameters after the save, for a plain load to
    check. ``host_optimizer``: the first run's optimizer steps in host memory."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autosp.checkpoint

    def run(rows: int, stage: int | None, steps: range, load: bool = False,
            host: bool = False) -> tuple[list[float], Any]:
        mesh = init_device_mesh("cpu", (rows, 4 // rows), mesh_dim_names=("dp", "sp"))
        row = mesh.get_local_rank("dp")
        torch.manual_seed(1 if load else 0)                 # the resumed model starts from other weights
        model = build("llama")
        plan = autosp.Decisions.of(strategy="ulysses", mesh=autosp.MeshChoice(host_optimizer=host))
        sp = autosp.compile(model, plan=plan, mesh=mesh, zero=stage)
        opt = sp.optimizer(torch.optim.AdamW, lr=1e-2)
        extra = autosp.checkpoint.load(sp, opt, path) if load else {}
        losses, full = [], None
        per_row = 4 // rows
        for step in steps:
            if not load and step == 2:
                autosp.checkpoint.save(sp, opt, path, step=step)
                full = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
            ids, labels = _batch(step, 4, seq_len, True)
            mine = slice(row * per_row, (row + 1) * per_row)
            loss = _loss(sp, "llama", ids[mine], labels[mine])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, (full, extra)

    first, (full, _) = run(2, zero_stage, range(4), host=host_optimizer)
    out: dict[str, Any] = {"uninterrupted": first[2:], "resumed": {}, "extra": {},
                           "full": {n: t.tolist() for n, t in full.items()} if dist.get_rank() == 0 else None}
    for rows, stage, *host in resumes:
        dist.barrier()
        torch._dynamo.reset()
        key = f"{rows}x{4 // rows} stage {stage}" + (" host" if host and host[0] else "")
        out["resumed"][key], (_, out["extra"][key]) = run(rows, stage, range(2, 4), load=True,
                                                          host=bool(host and host[0]))
    return out


def allgather_kv_schedule(**kw: Any) -> dict[str, Any]:
    """``train_compare`` under ``allgather_kv:overlap``, with the order of the overlapped kernel's
    steps recorded on this rank: when each collective starts and is waited for, and which
    blocks (the own K/V chunks, or another rank's) attend in between; and the timeline the
    overlap bench reads: per wait, when its collectives were issued and when the wait began."""
    from autosp.strategies import allgather_kv_kernel as kernel
    from autosp.strategies import collectives

    events: list[str] = []
    saved = {n: getattr(kernel, n) for n in ("attend_forward", "attend_backward", "_gather_start",
                                             "_reduce_scatter_start", "wait_all")}

    def logged(name: str, label: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            events.append(label(*args) if callable(label) else label)
            return saved[name](*args, **kwargs)
        return run

    own = lambda q_chunks, kv_chunks: "own" if q_chunks == kv_chunks else "other"  # noqa: E731
    kernel.attend_forward = logged("attend_forward", lambda q, k, v, qc, kc, *_: "fwd " + own(qc, kc))
    kernel.attend_backward = logged("attend_backward", lambda d, q, k, v, o, l, qc, kc, *_: "bwd " + own(qc, kc))
    kernel._gather_start = logged("_gather_start", "gather starts")
    kernel._reduce_scatter_start = logged("_reduce_scatter_start", "reduce-scatter starts")
    kernel.wait_all = logged("wait_all", lambda works, kind, group, *_: f"wait {kind}")
    collectives.TIMELINE = timeline = []
    try:
        out = train_compare(strategy="allgather_kv:overlap", **kw)
    finally:
        for n, f in saved.items():
            setattr(kernel, n, f)
        collectives.TIMELINE = None
    out["events"] = events
    out["timeline"] = [(waited - issued, done - waited) for issued, waited, done in timeline]
    return out


def ulysses_schedule(**kw: Any) -> dict[str, Any]:
    """``train_compare`` under a pipelined Ulysses with the timeline on: per SP exchange, in the
    order they completed, (when it was issued, when it was waited for) relative to the step's
    first issue; and the model's layer count."""
    from autosp.strategies import collectives

    collectives.TIMELINE = timeline = []
    try:
        out = train_compare(**kw)
    finally:
        collectives.TIMELINE = None
    out["timeline"] = [(issued, waited) for issued, waited, _ in timeline]
    return out


def zero3_in_graph(seq_len: int = 64, steps: int = 1, compilers: tuple[str, ...] = ("aot_eager",),
                   checkpoint: str = "none") -> dict[str, Any]:
    """ZeRO 3 gathered inside the graph on a 1 x 2 mesh, a 4-block Llama whose parameters outweigh
    its activations, every layer checkpointed as ``checkpoint`` says: per compiler, the worst
    gradient and loss error against one process over ``steps`` AdamW steps, what the report says
    ran, and the last step's peak bytes (memory probe) next to what the cost model predicts for it."""
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    from autosp.costmodel.predict import predict
    from autosp.costmodel.profile import load_profile
    from autosp.graph import capture
    from autosp.tools.memory_probe import step_peak

    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg)
    out: dict[str, Any] = {"param_bytes": sum(p.numel() * 4 for p in ref.parameters()),
                           "block_bytes": sum(p.numel() * 4 for p in ref.model.layers[0].parameters())}
    pred = predict(capture(copy.deepcopy(ref), seq_len=seq_len, batch_size=1, dtype="float32"),
                   load_profile("cpu-gloo"), sp=2, strategy="ulysses", seq_len=seq_len, zero_stage=3)
    out["predicted_step_peak"] = pred.memory["step_peak"]
    for compiler in compilers:
        torch._dynamo.reset()
        one, model = copy.deepcopy(ref), copy.deepcopy(ref)
        mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "sp"))
        sp = autosp.compile(model, plan=autosp.Decisions.of(strategy="ulysses", checkpoint=checkpoint), mesh=mesh,
                            zero=3, runtime=autosp.Runtime(compiler=compiler))
        opt, opt_one = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(one.parameters(), lr=1e-3)
        row: dict[str, Any] = {"loss_err": 0.0, "grad_err": 0.0}
        for step in range(steps):
            ids, labels = _batch(step, 1, seq_len, True)
            with _zero3_events() as events:       # the last step's order of collectives
                loss, row["peak"] = step_peak(sp, lambda: _marked(events, sp(input_ids=ids, labels=labels).loss))
            ref_loss = one(input_ids=ids, labels=labels).loss
            ref_loss.backward()
            row["loss_err"] = max(row["loss_err"], abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
            for p, q in zip(model.parameters(), one.parameters()):
                row["grad_err"] = max(row["grad_err"], _rel(_full(p.grad), q.grad))
            row["report"] = sp.report().as_dict()
            opt.step(), opt_one.step()
            opt.zero_grad(set_to_none=True), opt_one.zero_grad(set_to_none=True)
        row["events"] = events
        row["shard_elements"] = sum(_local(p).numel() for p in model.parameters())
        row["dtensors"] = all(type(p).__name__ == "DTensor" for p in model.parameters())
        row["keys_plain"] = list(model.state_dict()) == list(ref.state_dict())
        out[compiler] = row
    return out


def _marked(events: list[str], loss: torch.Tensor) -> torch.Tensor:
    events.append("|")
    return loss


@contextlib.contextmanager
def _zero3_events():
    """The order in which this rank starts and waits for ZeRO 3's collectives, with the SP
    all-to-alls (``a``) between them: ``G`` a gather starts, ``g`` waited for; ``R`` a gradient
    reduction starts, ``r`` waited for; ``|`` the backward begins."""
    from autosp.strategies import collectives
    from autosp.transform.zero import prefetch as zero3_overlap

    events: list[str] = []
    saved = collectives.tally, zero3_overlap.tally, zero3_overlap.wait_all
    marks = {zero3_overlap.GATHER_KIND: ("G", "g"), zero3_overlap.REDUCE_KIND: ("R", "r")}

    def tally(kind, group, *sent):
        events.append(marks[kind][0] if kind in marks else "a" if kind == "all_to_all" else "")
        return saved[0](kind, group, *sent)

    def wait_all(works, kind, group):
        events.append(marks[kind][1])
        return saved[2](works, kind, group)

    collectives.tally = zero3_overlap.tally = tally
    zero3_overlap.wait_all = wait_all
    try:
        yield events
    finally:
        collectives.tally, zero3_overlap.tally, zero3_overlap.wait_all = saved


def _plan_by_length(module: Any, batch: int, seq_len: int, group: Any, documents: tuple = ()) -> Any:
    """A planner of one's own: Ulysses up to 128 tokens, zigzag ring beyond (so buckets switch plans)."""
    import torch.distributed as dist

    from autosp.decisions import LayerChoice, MeshChoice
    from autosp.planner.plan import LayerPlan, Plan

    world = dist.get_world_size(group)
    strategy, layout = ("ulysses", "contiguous") if seq_len <= 128 else ("zigzag_ring", "zigzag")
    return Plan(model="llama", fingerprint="x", seq_len=seq_len, batch_size=batch, dtype="float32", world_size=world,
                devices_per_node=world, dp_degree=1, mesh=MeshChoice(world, layout),
                layers=[LayerPlan("LlamaDecoderLayer", "", 2, LayerChoice(strategy))], predicted={},
                profile="cpu-gloo", memory_limit_bytes=1e12, zero_stage=0)


def varying_lengths(lengths: tuple[int, ...] = (64, 100, 200, 64, 300, 96), planner: str = "auto",
                    kind: str = "llama", compiler: str | None = None) -> dict[str, Any]:
    """One model trained over batches whose length and documents change every step (the last one
    packed with short documents), against one process at every step: per step the loss and worst
    gradient error, what ran (strategy per op, padded length, tokens per rank), and how many buckets
    were planned and decisions compiled. ``planner``: "auto" (the ILP) or "by_length" (switches)."""
    ref = build(kind)
    model = copy.deepcopy(ref)
    sp = autosp.compile(model, plan="auto" if planner == "auto" else _plan_by_length,
                        runtime=autosp.Runtime(compiler=compiler))
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt_sp = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out: dict[str, Any] = {"steps": []}
    for step, seq_len in enumerate(lengths):
        ids, labels = _batch(step, 2, seq_len, uneven=False)
        extra = {}
        if step == len(lengths) - 1:                 # short documents only: positions restart every 8 tokens
            extra["position_ids"] = (torch.arange(seq_len) % 8).expand(2, seq_len).clone()
        loss_ref = _loss(ref, kind, ids, labels, **extra)
        loss_ref.backward()
        loss = _loss(sp, kind, ids, labels, **extra)
        loss.backward()
        worst = max(_rel(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
        rep = sp.report().as_dict()
        out["steps"].append({"seq_len": seq_len, "grad_err": worst,
                             "loss_err": abs(loss.item() - loss_ref.item()) / abs(loss_ref.item()), "strategies": [a["strategy"] for a in rep["attention"]],
                             "padded_len": rep["padded_len"],
                             "tokens_per_rank": [a["tokens_per_rank"] for a in rep["attention"]],
                             "plans": rep["plans"], "variants": rep["compiled_variants"],
                             "plan_len": sp.plan.seq_len if sp.plan is not None else None})
        for opt in (opt_ref, opt_sp):
            opt.step()
            opt.zero_grad()
    return out


def written_attention_memory(kinds: tuple[str, ...] = ("handwritten", "gemma2", "bloom"), seq_len: int = 512,
                             strategies: tuple[str, ...] = ("ulysses", "allgather_kv"),
                             cases: tuple[tuple[str, str], ...] = ()) -> dict[str, Any]:
    """Per model with attention written by hand and per strategy: the probe's step peak (allocator
    view, through AOTAutograd) against the planner's prediction, whose S x S scores the region's
    attention op carries (score_saved / score_live per score entry, from the captured graph)."""
    import torch.distributed as dist

    from autosp.costmodel.predict import predict, step_peak
    from autosp.costmodel.profile import load_profile
    from autosp.graph import capture
    from autosp.tools.memory_probe import step_peak as probe_peak

    world, out = dist.get_world_size(), {}
    ids = torch.randint(0, 128, (1, seq_len), generator=torch.Generator().manual_seed(0))
    for kind in dict.fromkeys(k for k, _ in cases) if cases else kinds:
        graph = capture(build(kind), seq_len=seq_len, dtype="float32")
        attention = graph.first_attention()
        for strategy in [s for k, s in cases if k == kind] if cases else strategies:
            torch._dynamo.reset()
            sp = autosp.compile(build(kind), plan=strategy, runtime=autosp.Runtime(compiler="aot_eager"))
            _loss(sp, kind, ids, ids).backward()                          # compile outside the probe
            for p in sp.parameters():
                p.grad = None
            loss, peak = probe_peak(sp, lambda: _loss(sp, kind, ids, ids))
            predicted = step_peak(graph, load_profile("cpu-gloo"), sp=world, strategy=strategy, seq_len=seq_len)
            scores = predict(graph, load_profile("cpu-gloo"), sp=world, strategy=strategy, seq_len=seq_len)
            out[f"{kind}/{strategy}"] = {
                "peak": peak, "predicted": predicted, "strategies": sp.state.strategies,
                "score_saved": attention.score_saved, "written": attention.written,
                "attention_saved": sum(scores.attention_saved.values())}
    return out


def batches_differ_across_ranks() -> dict[str, Any]:
    """A step where the ranks of the SP group pass batches of different lengths: refused on every
    rank before anything compiles or communicates inside the model; the next common batch trains."""
    import torch.distributed as dist

    sp = autosp.compile(build("reference"), plan="ulysses")
    out: dict[str, Any] = {}
    ids, labels = _batch(0, 2, 32, False)
    out["first"] = _loss(sp, "reference", ids, labels).item()
    ids, labels = _batch(1, 2, 32 + 8 * dist.get_rank(), False)
    try:
        _loss(sp, "reference", ids, labels)
        out["error"] = ""
    except AutospError as e:
        out["error"] = str(e)
    ids, labels = _batch(2, 2, 32, False)
    out["after"] = _loss(sp, "reference", ids, labels).item()
    return out


def offload_step(seq_len: int = 256, steps: int = 3, compilers: tuple[str, ...] = ("aot_eager", "inductor"),
                 zero_stage: int | None = 3, strategy: str = "ulysses", mlp_chunks: int = 2,
                 loss_chunks: int = 2, keep_mlp_input: tuple[bool, ...] = (True, False),
                 host_optimizer: bool = True) -> dict[str, Any]:
    """Full checkpointing + offload + ZeRO ``zero_stage`` + tiled MLP and loss (+ the optimizer stepped
    in host memory: ``model.optimizer(AdamW)``) on a 1 x world mesh,
    per compiler (with ``keep_mlp_input``, one per compiler) against one process over ``steps`` AdamW steps (loss, every gradient, the
    parameters after), the report, and the last step's order of copies and all-to-alls: ``O`` an
    offload, ``R`` a reload issued, ``W`` its wait, ``a`` an all-to-all, ``|`` the backward begins."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autosp.decisions import MeshChoice
    from autosp.strategies import collectives
    from autosp.tools.validation import tiny_model
    from autosp.transform import offload as off

    ref = tiny_model()
    out: dict[str, Any] = {}
    marks = {"all_to_all": "a", off.OFFLOAD_KIND: "O", off.RELOAD_KIND: "R", off.WAIT_KIND: "W"}
    for compiler, keep in zip(compilers, keep_mlp_input):
        torch._dynamo.reset()
        one, model = copy.deepcopy(ref), copy.deepcopy(ref)
        mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "sp"))
        decisions = autosp.Decisions.of(strategy=strategy, checkpoint="full", mlp_chunks=mlp_chunks, offload=True,
                                        keep_mlp_input=keep,
                                        mesh=MeshChoice(loss_chunks=loss_chunks, host_optimizer=host_optimizer))
        sp = autosp.compile(model, plan=decisions, mesh=mesh, zero=zero_stage, runtime=autosp.Runtime(compiler=compiler))
        opt, opt_one = sp.optimizer(torch.optim.AdamW, lr=1e-3), torch.optim.AdamW(one.parameters(), lr=1e-3)
        row: dict[str, Any] = {"loss_err": 0.0, "grad_err": 0.0}
        events: list[str] = []
        saved = collectives.tally, off.tally

        def tally(kind, group, *sent):
            events.append(marks.get(kind, ""))
            return saved[0](kind, group, *sent)

        for step in range(steps):
            ids, labels = _batch(step, 1, seq_len, True)
            events.clear()
            collectives.tally = off.tally = tally
            try:
                loss = sp(input_ids=ids, labels=labels).loss
                events.append("|")
                loss.backward()
            finally:
                collectives.tally, off.tally = saved
            ref_loss = one(input_ids=ids, labels=labels).loss
            ref_loss.backward()
            row["loss_err"] = max(row["loss_err"], abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
            for p, q in zip(model.parameters(), one.parameters()):
                row["grad_err"] = max(row["grad_err"], _rel(_full(p.grad), q.grad))
            opt.step(), opt_one.step()
            opt.zero_grad(set_to_none=True), opt_one.zero_grad(set_to_none=True)
        flat = lambda m: torch.cat([_full(p.detach()).flatten() for p in m.parameters()])  # noqa: E731
        row["param_err"] = _rel(flat(model), flat(one))
        row["report"] = sp.report().as_dict()
        row["offloaded"] = sum(r.offloaded for r in sp.state.reports)
        row["events"] = "".join(events)
        row["optimizer"] = _where_optimizer_stepped(opt, model)
        out[compiler] = row
    return out


def _where_optimizer_stepped(opt: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, Any]:
    """What the optimizer holds and where: its type, whether it stepped on the host, the last step's
    copies, and per parameter its host master's shape and storage against the parameter's local part."""
    from autosp.transform.host_optimizer import HostOptimizer, _local

    if not isinstance(opt, HostOptimizer):
        return {"type": type(opt).__name__}
    params = list(model.parameters())
    locals_ = [_local(p) for p in params]
    return {"type": type(opt).__name__, "on_host": opt.on_host, "copies": dict(opt.copies),
            "local_numel": sum(t.numel() for t in locals_),
            "master_numel": sum(m.numel() for m in opt.masters),
            "shapes_match": all(m.shape == t.shape for m, t in zip(opt.masters, locals_)),
            "masters_apart": all(m.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
                                 for m, t in zip(opt.masters, locals_)),
            # the states the wrapped AdamW made, keyed by the masters (none by the model's parameters)
            "states_on_masters": sum(1 for k in opt.inner.state if any(k is m for m in opt.masters)),
            "states_on_params": sum(1 for k in opt.inner.state if any(k is p for p in params)),
            "state_numel": sum(v.numel() for st in opt.inner.state.values() for k, v in st.items() if k != "step"),
            "full_numel": sum(p.numel() for p in params)}


def offload_memory(seq_len: int = 2048, strategy: str = "ulysses") -> dict[str, Any]:
    """Device and host peaks (memory probe) of one step of tiny Llama with full checkpointing,
    through aot_eager, next to what the memory model predicts for each: the MLP whole, with and
    without offload ("kept", "offload"), and offloaded with the MLP and loss in 8 chunks, the MLP
    recomputed with its layer ("offload_tiled", one hidden state kept per layer)."""
    import torch.distributed as dist

    from autosp.costmodel.memory import layer_saved
    from autosp.costmodel.predict import step_peak as predicted_peak
    from autosp.costmodel.profile import load_profile
    from autosp.graph import capture
    from autosp.tools.memory_probe import step_memory
    from autosp.tools.validation import tiny_model

    graph = capture(tiny_model(), seq_len=seq_len, dtype="float32")
    out: dict[str, Any] = {}
    runs = {"kept": (False, 1, 1), "offload": (True, 1, 1), "offload_tiled": (True, 8, 8)}
    for name, (offload, chunks, loss_chunks) in runs.items():
        torch._dynamo.reset()
        mem = dict(checkpoint="full", mlp_chunks=chunks, offload=offload, keep_mlp_input=chunks == 1)
        decisions = autosp.Decisions.of(strategy=strategy, **mem, mesh=autosp.MeshChoice(loss_chunks=loss_chunks))
        sp = autosp.compile(tiny_model(), plan=decisions, runtime=autosp.Runtime(compiler="aot_eager"))
        ids, labels = _batch(0, 1, seq_len, False)
        sp(input_ids=ids, labels=labels).loss.backward()        # compile first: the probe sees a steady step
        _, probe = step_memory(sp, lambda: sp(input_ids=ids, labels=labels).loss)
        out[name] = {
            "peak": probe.peak, "host_peak": probe.host_peak,
            "predicted": predicted_peak(graph, load_profile("cpu-gloo"), sp=dist.get_world_size(), strategy=strategy,
                                        seq_len=seq_len, loss_chunks=loss_chunks, **mem),
            "offloaded_bytes": sp.report().as_dict()["collectives"].get("host_offload", {}).get("bytes", 0),
            "kept_per_layer": next(iter(layer_saved(graph, seq_len / dist.get_world_size(), "full", chunks,
                                                    chunks == 1).values())),
            "mlp_chunks": sorted({c for r in sp.state.reports for c in r.mlp_chunks.values()})}
    out["layers"] = sum(lc.count for lc in graph.layer_classes.values())
    return out


def encoder_compare(strategies: tuple[str, ...] = ("ulysses", "ring", "allgather_kv"), seq_len: int = 64,
                    steps: int = 1) -> dict[str, Any]:
    """A BERT-shaped encoder (bidirectional attention, a padding mask, masked-LM loss, absolute
    positions, token types) per strategy against one process over ``steps`` AdamW steps. Gradient
    error over all parameters together: a key bias's exact gradient is zero (a shift of every key
    leaves the softmax as it is), so its own ratio compares rounding noise."""
    import transformers

    cfg = transformers.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=128, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    torch.manual_seed(0)
    base = transformers.BertForMaskedLM(cfg)
    mask = torch.ones(2, seq_len, dtype=torch.long)
    mask[1, -13:] = 0                                     # the second sequence is 13 tokens shorter
    out: dict[str, Any] = {}
    for strategy in strategies:
        torch._dynamo.reset()
        ref, model = copy.deepcopy(base), copy.deepcopy(base)
        sp = autosp.compile(model, plan=strategy)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, model)]
        row: dict[str, Any] = {"loss_err": 0.0, "grad_err": 0.0}
        blocks = dict(BLOCK_TALLY)
        for step in range(steps):
            g = torch.Generator().manual_seed(200 + step)
            ids = torch.randint(5, 128, (2, seq_len), generator=g)
            labels = ids.masked_fill(torch.rand(2, seq_len, generator=g) > 0.3, -100).masked_fill(mask == 0, -100)
            losses = [m(input_ids=ids, attention_mask=mask, labels=labels).loss for m in (ref, sp)]
            for loss in losses:
                loss.backward()
            row["loss_err"] = max(row["loss_err"], abs(losses[1].item() - losses[0].item()) / losses[0].item())
            grads = [torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None]) for m in (ref, model)]
            row["grad_err"] = max(row["grad_err"], _rel(grads[1], grads[0]))
            for opt in opts:
                opt.step()
                opt.zero_grad()
        flat = lambda m: torch.cat([p.detach().flatten() for p in m.parameters()])  # noqa: E731
        row["param_err"] = _rel(flat(model), flat(ref))
        row["strategies"] = sp.state.strategies
        row["report"] = sp.report().as_dict()
        row["blocks"] = {k: BLOCK_TALLY[k] - blocks.get(k, 0) for k in ("computed", "skipped")}
        out[strategy] = row
    return out


# Document lengths of a packed stream, one row per step: long and short mixes, a length (70) that the
# balanced layout's 4 chunks per rank do not divide (padded), and a row of short documents only.
PACKED_STREAM = ((40, 8, 16), (4, 4, 56), (64,), (8,) * 8, (30, 30, 10), (16, 48))


def balanced_stream(strategy: str = "ring", docs: tuple = PACKED_STREAM, layout: str = "balanced",
                    compiler: str | None = None) -> dict[str, Any]:
    """Packed batches whose documents change every step under one layout, against one process at
    every step: loss and worst gradient error, the chunks this rank's slice held (read from the
    balanced deal as the step ran), the (query, key) pairs its attention kernels attended (counted
    as they ran), and how many graphs were compiled over the stream."""
    import torch._dynamo.utils as dynamo_utils
    import torch.distributed as dist

    from autosp.strategies import layout as lay

    ref = build("llama")
    model = copy.deepcopy(ref)
    sp = autosp.compile(model, plan=autosp.Decisions.of(strategy=strategy, mesh=autosp.MeshChoice(layout=layout)),
                        runtime=autosp.Runtime(compiler=compiler))
    opt_ref, opt_sp = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, model))
    frames = dynamo_utils.counters["stats"]["unique_graphs"]
    out: dict[str, Any] = {"steps": []}
    for step, lengths in enumerate(docs):
        seq_len = sum(lengths)
        ids, labels = _batch(step, 2, seq_len, uneven=False)
        pos = torch.cat([torch.arange(n) for n in lengths]).expand(2, seq_len).clone()
        loss_ref = _loss(ref, "llama", ids, labels, position_ids=pos)
        loss_ref.backward()
        before = BLOCK_TALLY["query_keys"]
        loss = _loss(sp, "llama", ids, labels, position_ids=pos)
        attended = BLOCK_TALLY["query_keys"] - before       # forward only: the backward does not count
        loss.backward()
        rep = sp.report().as_dict()
        world = rep["sp_degree"]
        out["steps"].append({
            "seq_len": seq_len, "padded_len": rep["padded_len"], "compiler": rep["compiler"],
            "loss_err": abs(loss.item() - loss_ref.item()) / abs(loss_ref.item()),
            "grad_err": max(_rel(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())),
            "chunks": lay.rank_chunks(layout, dist.get_rank(), world) if layout == "balanced" else None,
            "attended": attended, "strategies": [a["strategy"] for a in rep["attention"]]})
        for opt in (opt_ref, opt_sp):
            opt.step()
            opt.zero_grad()
    out["graphs"] = dynamo_utils.counters["stats"]["unique_graphs"] - frames
    return out


def _rows_time(seq: dict, k: int) -> float | None:
    """A stand-in cost model for the mixed-degree tests: work split k ways plus a price per extra rank,
    and at most 112 / world tokens per rank (so the longest rows need every rank)."""
    import torch.distributed as dist

    n = seq["input_ids"].shape[1]
    return None if n / k > 112 / dist.get_world_size() else n / k + 12.0 * (k - 1)


# Per step, the documents of each row of the global batch (a row per list).
MIXED_BATCHES = (((40, 30, 26), (16,), (8, 8, 8), (20,)), ((64, 37), (5, 5, 5, 5), (12,), (30, 2)))


def mixed_degree_compare(batches: tuple = MIXED_BATCHES, strategy: str = "ulysses",
                         compiler: str | None = None) -> dict[str, Any]:
    """Global batches of rows of different lengths and documents, each row at its own SP degree,
    against one process on the whole batch, over AdamW steps: per step the loss and worst gradient
    error, each row's degree, and what each degree's model ran on this rank (SP degree, padded length)."""
    import torch.distributed as dist

    ref = build("llama")
    model = copy.deepcopy(ref)
    trainer = autosp.MixedDegree(model, _rows_time, plan=autosp.Decisions.of(strategy=strategy),
                                 runtime=autosp.Runtime(compiler=compiler))
    opt_ref, opt_sp = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, model))
    out: dict[str, Any] = {"steps": [], "rank": dist.get_rank()}
    for step, rows in enumerate(batches):
        batch = []
        for r, docs in enumerate(rows):
            ids, labels = _batch(10 * step + r, 1, sum(docs), uneven=False)
            pos = torch.cat([torch.arange(n) for n in docs]).unsqueeze(0)
            batch.append({"input_ids": ids, "labels": labels, "position_ids": pos, "use_cache": False})
        total = sum(int((s["labels"][..., 1:] != -100).sum()) for s in batch)
        loss_ref = sum(ref(**s).loss * (int((s["labels"][..., 1:] != -100).sum()) / total) for s in batch)
        loss_ref.backward()
        loss = trainer.step(batch)
        ran = {k: m.report().as_dict() for k, m in trainer.models.items() if k > 1 and m.report().padded_len}
        out["steps"].append({
            "loss_err": abs(loss.item() - loss_ref.item()) / abs(loss_ref.item()),
            "grad_err": max(_rel(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())),
            "degrees": trainer.last.degrees(), "lengths": [s["input_ids"].shape[1] for s in batch],
            "mine": [(p.sequence, p.degree) for p in trainer.last.of_rank(dist.get_rank())],
            "ran": {k: (r["sp_degree"], r["padded_len"], sorted({a["strategy"] for a in r["attention"]}))
                    for k, r in ran.items()}})
        for opt in (opt_ref, opt_sp):
            opt.step()
            opt.zero_grad()
    return out


def mixed_degree_differing_batches() -> str:
    """Rank 1 holds another global batch than the others: refused on every rank, before any collective
    the others would wait on."""
    import torch.distributed as dist

    trainer = autosp.MixedDegree(build("llama"), _rows_time, plan=autosp.Decisions.of(strategy="ulysses"))
    n = 20 + (dist.get_rank() == 1)
    ids = torch.zeros(1, n, dtype=torch.long)
    try:
        trainer.step([{"input_ids": ids, "labels": ids, "use_cache": False}])
    except AutospError as e:
        return str(e)
    return "not refused"
