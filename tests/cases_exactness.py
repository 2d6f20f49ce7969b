"""Exactness cases: autosp's loss, gradients and parameters against one process, across models,
inputs, backends and the checks of the first call.

Run on every rank of a gloo pool (``dist_harness``); :mod:`dist_cases` is their index."""

from __future__ import annotations

import copy
from typing import Any

import torch

import autosp
from autosp.errors import AutospError
from autosp.strategies.blockwise import BLOCK_TALLY

from dist_models import _batch, _loss, _rel, build, train_compare


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


def toy_strategy_compare(seq_len: int = 32) -> dict[str, Any]:
    """A strategy registered from the tests (tests/toy_strategy.py), forced and planned: exact."""
    import torch.distributed as dist

    import toy_strategy
    from autosp.strategies import register

    register(toy_strategy.ToyAllGatherAllReduce)         # idempotent: the pool may have run this before
    forced = train_compare("llama", seq_len=seq_len, steps=2, strategy=toy_strategy.FAMILY, heads=4, kv=2)
    world = dist.get_world_size()
    p = autosp.plan(autosp.Problem.of(build("llama", heads=4, kv=2), seq_len=seq_len, batch_size=2,
                                      world_size=world, profile="cpu-gloo", dtype="float32",
                                      strategies=(toy_strategy.FAMILY,), sp_degrees=(world,)))
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


def batches_differ_across_ranks() -> dict[str, Any]:
    """A step where the ranks of the SP group pass batches of different lengths: refused on every
    rank before anything compiles or communicates inside the model; the next common batch trains."""
    import torch.distributed as dist

    def refusal(model: Any) -> str:
        """What a step whose ranks pass 32 and 40 tokens raises ("" where nothing was raised)."""
        ids, labels = _batch(1, 2, 32 + 8 * dist.get_rank(), False)
        try:
            _loss(model, "reference", ids, labels)
        except AutospError as e:
            return str(e)
        return ""

    sp = autosp.compile(build("reference"), plan="ulysses")
    out: dict[str, Any] = {}
    ids, labels = _batch(0, 2, 32, False)
    out["first"] = _loss(sp, "reference", ids, labels).item()
    out["error"] = refusal(sp)
    ids, labels = _batch(2, 2, 32, False)
    out["after"] = _loss(sp, "reference", ids, labels).item()
    # planned at the first call: the rank whose length falls in a new bucket would plan (a
    # broadcast) while the other runs its graphs; both wait for the check first, and refuse
    planned = autosp.compile(build("reference"))
    ids, labels = _batch(0, 2, 32, False)
    _loss(planned, "reference", ids, labels)
    out["planned_error"] = refusal(planned)
    return out


def encoder_compare(strategies: tuple[str, ...] = ("ulysses", "ring"), seq_len: int = 64,
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
