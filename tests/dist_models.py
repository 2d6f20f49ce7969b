"""Models and helpers the cases share: the models under test, their batches and losses, the
autosp.compile arguments of a test's knobs, and train_compare (autosp against one process).

Run on every rank of a gloo pool (``dist_harness``); :mod:`dist_cases` is their index."""

from __future__ import annotations

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
        # a learned bias on the scores per head and key position (T5-like). Not per head alone: that
        # shifts whole rows, which the softmax cancels, so its exact gradient is zero (rounding noise)
        self.head_bias = torch.nn.Parameter(0.5 * torch.randn(1, heads, 1, max_len)) if learned else None
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
            att = att + self.head_bias[..., :t]
        y = torch.softmax(att, dim=-1) @ v
        return x + self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class _CausalConv(torch.nn.Module):
    """A short causal convolution over the tokens (a left pad, then a depthwise conv1d, no trim):
    what a Mamba-2 or gated DeltaNet layer runs before its scan."""

    def __init__(self, dim: int, k: int = 4):
        super().__init__()
        self.k, self.conv = k, torch.nn.Conv1d(dim, dim, k, groups=dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.nn.functional.pad(x.transpose(1, 2), (self.k - 1, 0))).transpose(1, 2)


class _ConvMixerBlock(torch.nn.Module):
    """The causal convolution, then SDPA attention."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.mixer, self.heads, self.qkv = _CausalConv(dim), heads, torch.nn.Linear(dim, 3 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        mixed = self.mixer(x)
        q, k, v = (y.view(b, t, self.heads, -1).transpose(1, 2) for y in self.qkv(mixed).split(c, dim=2))
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + att.transpose(1, 2).reshape(b, t, c)


class _RunningMeanBlock(_ConvMixerBlock):
    """A running mean over the tokens in the block's own forward (no submodule to run gathered)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x + x.cumsum(1) / torch.arange(1, x.shape[1] + 1, device=x.device)[:, None])


class _ConvMixer(torch.nn.Module):
    def __init__(self, heads: int, dim: int = 64, vocab: int = 128, block: type = _ConvMixerBlock):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(vocab, dim), torch.nn.Linear(dim, vocab)
        self.layers = torch.nn.ModuleList(block(dim, heads) for _ in range(2))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


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
    if kind == "conv_mixer":
        return _ConvMixer(heads)
    if kind == "running_mean":
        return _ConvMixer(heads, block=_RunningMeanBlock)
    if kind == "qwen3_next":      # gated DeltaNet (a causal conv1d, then a chunked scan) beside gated attention
        return transformers.AutoModelForCausalLM.from_config(transformers.Qwen3NextConfig(
            hidden_size=16 * heads, intermediate_size=64, num_hidden_layers=2, num_attention_heads=heads,
            num_key_value_heads=kv, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
            linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=32,
            layer_types=["linear_attention", "full_attention"], **common))
    if kind == "bamba":           # Mamba-2 layers (a causal conv1d, then the chunked SSD scan) beside attention
        return transformers.AutoModelForCausalLM.from_config(transformers.BambaConfig(
            hidden_size=16 * heads, intermediate_size=64, num_hidden_layers=2, num_attention_heads=heads,
            num_key_value_heads=kv, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1,
            mamba_d_state=16, mamba_chunk_size=8, **common))
    if kind == "jamba":           # Mamba-1 layers (a conv1d, then a selective scan), attention, experts
        return transformers.AutoModelForCausalLM.from_config(transformers.JambaConfig(
            hidden_size=16 * heads, intermediate_size=64, num_hidden_layers=2, num_attention_heads=heads,
            num_key_value_heads=kv, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
            expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_dt_rank=4,
            use_mamba_kernels=False, **common))
    if kind == "minimax":         # lightning (linear) attention with decay, in blocks, beside softmax attention
        return transformers.AutoModelForCausalLM.from_config(transformers.MiniMaxConfig(
            hidden_size=16 * heads, intermediate_size=64, num_hidden_layers=2, num_attention_heads=heads,
            num_key_value_heads=kv, head_dim=16, num_local_experts=4, num_experts_per_tok=2, block_size=8,
            layer_types=["linear_attention", "full_attention"], **common))
    if kind == "mamba2":          # Mamba-2 alone: no attention at all
        return transformers.AutoModelForCausalLM.from_config(transformers.Mamba2Config(
            hidden_size=16 * heads, num_heads=4, head_dim=32, state_size=16, n_groups=1, num_hidden_layers=2,
            chunk_size=8, vocab_size=128))
    if kind.startswith("handwritten"):         # handwritten[_mixing|_einsum|_tril|_learned]
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
    if kind in ("deepseek_v3", "deepseek_v2"):   # multi-head latent attention (q/k head dim 24, v 16), then MoE
        cls = transformers.DeepseekV3Config if kind == "deepseek_v3" else transformers.DeepseekV2Config
        return transformers.AutoModelForCausalLM.from_config(cls(
            hidden_size=16 * heads, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
            n_group=2, topk_group=1, **common))
    if kind == "gpt_oss":         # eager attention only: a learned sink logit per head joins each row's softmax
        return transformers.AutoModelForCausalLM.from_config(transformers.GptOssConfig(
            hidden_size=16 * heads, intermediate_size=64, num_hidden_layers=2, num_attention_heads=heads,
            num_key_value_heads=kv, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
            attn_implementation="eager", **{k: v for k, v in common.items() if k != "attn_implementation"}))
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
    if kind.startswith(("reference", "token_local", "handwritten", "conv_mixer", "running_mean")):
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


def _nan_inf(e: float) -> float:
    return float("inf") if e != e else e


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
    out: dict[str, Any] = {"loss_err": 0.0, "grad_err": 0.0, "worst": "", "losses": [], "grad_by_name": {}}
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
        # a NaN is the worst error (max() would keep the error before it)
        out["loss_err"] = max(out["loss_err"], _nan_inf(abs(loss_sp.item() - loss_ref.item()) / abs(loss_ref.item())))
        for (name, p), q in zip(sp_model.named_parameters(), ref.parameters()):
            if q.grad is None:
                continue
            e = _nan_inf(_rel(p.grad, q.grad))
            out["grad_by_name"][name] = max(e, out["grad_by_name"].get(name, 0.0))
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
    plan = getattr(sp, "plan", None)
    out["plan_documents"] = list(plan.predicted.documents) if plan is not None else None
    out["plan_layers"] = sp.plan.layers if getattr(sp, "plan", None) is not None else None
    out["plan_devices_per_node"] = sp.plan.devices_per_node if getattr(sp, "plan", None) is not None else None
    out["runtime"] = next(iter(sp.strategy_setups.values()), {})     # the groups of the (first) strategy
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


def _dp_plan(kind: str, seq_len: int, rows: int, strategy: str, zero_stage: int | None,
             devices_per_node: int = 4) -> Any:
    from autosp.decisions import LayerChoice, MeshChoice
    from autosp.planner.plan import LayerPlan, Plan, Predicted

    sp = 4 // rows
    u, r = (int(x) for x in strategy.split(":")[1].split("x")) if strategy.startswith("hybrid") else \
        ((sp, 1) if strategy == "ulysses" else (1, sp))
    return Plan(model=kind, fingerprint="x", seq_len=seq_len, batch_size=2, dtype="float32", world_size=4,
                devices_per_node=devices_per_node, dp_degree=rows,
                mesh=MeshChoice(sp, "contiguous", zero_stage=zero_stage or 0),
                layers=[LayerPlan("Layer", "", 2, LayerChoice(strategy), ulysses_degree=u, ring_degree=r)],
                predicted=Predicted.from_dict({}), profile="cpu-gloo", memory_limit_bytes=1e12, memory_margin=0.0)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP's shard) made whole; a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


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
