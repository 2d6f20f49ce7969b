"""autosp against DeepSpeed AutoSP, side by side on the same CPU run.

    MALLOC_MMAP_THRESHOLD_=65536 python bench/vs_deepspeed_autosp.py [--seq-lens 4096,16384] [--repeats 3]
        [--cap-mb 250 --cap-step 4096] [--systems "DeepSpeed AutoSP" "autosp, Inductor, ..."]

Same tiny Llama (hidden 256, 8 heads, 4 KV heads, 2 layers, vocabulary 1000, fp32, random
weights from one seed), batch 1, 2 gloo ranks with one thread each, a full AdamW training step
(forward, backward, gradient reduction, optimizer). Each system runs in its own two spawned
processes (DeepSpeed patches torch when its compile pass loads). Measured the same way for
both: the median step after two warm-up steps, and the per-rank peak resident memory of one
step above the steady state (``autosp.tools.memory_probe.RssPeak``; glibc returns freed
blocks to the OS under ``MALLOC_MMAP_THRESHOLD_=65536``). The first loss of each is printed
next to one process's on the same batch.

DeepSpeed AutoSP runs as ``../shared/REFERENCES.md`` describes its CPU recipe (deepcompile
with the ``autosp`` pass, a mask-free causal SDPA registered with transformers so that its
pass finds the attention, labels pre-shifted, ``prepare_autosp_inputs`` on each batch,
``engine.backward(loss * SP)``). autosp runs as a user would: ``autosp.compile(model)``
with Ulysses (eager graphs, the default), through Inductor, and through Inductor with its
memory-saving decisions (selective or full checkpointing, the LM head and loss in 8 chunks,
each layer's MLP in 8 chunks).

``--cap-mb``: also the longest sequence each trains under that per-rank step-memory cap: in one
launch per system, the length grows by ``--cap-step`` tokens while the measured peak of a full
step (after one warm-up step at that length) stays under the cap.
"""

from __future__ import annotations

import argparse
import os
import time

from autosp.tools.launch import median_time, spawn_gloo

VOCAB = 1000
def _options(config: dict) -> dict:
    """autosp.compile's arguments for a row of AUTOSP_CONFIGS: Ulysses with the memory decisions
    named, or the planner within a budget."""
    import autosp

    runtime = autosp.Runtime(compiler=config.get("compiler"))
    if "memory_limit" in config:
        return {"memory_limit": config["memory_limit"], "runtime": runtime}
    return {"plan": autosp.Decisions.of(strategy="ulysses", checkpoint=config.get("checkpoint", "none"),
                                        mlp_chunks=config.get("mlp_chunks", 1),
                                        mesh=autosp.MeshChoice(loss_chunks=config.get("loss_chunks", 1))),
            "runtime": runtime}


AUTOSP_CONFIGS = {
    "autosp": {},
    "autosp, Inductor": {"compiler": "inductor"},
    "autosp, Inductor, selective checkpointing + 8 loss chunks": {"compiler": "inductor", "checkpoint": "selective",
                                                                   "loss_chunks": 8},
    "autosp, Inductor, full checkpointing + 8 loss chunks": {"compiler": "inductor", "checkpoint": "full",
                                                              "loss_chunks": 8},
    "autosp, Inductor, selective checkpointing + 8 MLP chunks + 8 loss chunks": {
        "compiler": "inductor", "checkpoint": "selective", "mlp_chunks": 8, "loss_chunks": 8},
    "autosp, Inductor, full checkpointing + 8 MLP chunks + 8 loss chunks": {
        "compiler": "inductor", "checkpoint": "full", "mlp_chunks": 8, "loss_chunks": 8},
    # the planner's own choice (strategy, checkpointing, MLP and loss tiling) under a per-rank budget
    "autosp, Inductor, planned within 200 MiB": {"compiler": "inductor",
                                                 "memory_limit": 200 * 2**20},
    # a tighter budget: the planner checkpoints whole layers and tiles
    "autosp, Inductor, planned within 160 MiB": {"compiler": "inductor",
                                                 "memory_limit": 160 * 2**20},
}


def tiny(attn: str = "sdpa"):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=4, vocab_size=VOCAB,
                                   attn_implementation=attn)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _ids(seq_len: int):
    import torch

    return torch.randint(0, VOCAB, (1, seq_len), generator=torch.Generator().manual_seed(seq_len))


def _measure(step, repeats: int) -> tuple[float, int, float, float]:
    """(median step seconds, max per-rank peak step bytes, first loss, first step's seconds: the compile)."""
    import torch.distributed as dist

    from autosp.tools.memory_probe import RssPeak

    t0 = time.perf_counter()
    first = step()
    first_s = time.perf_counter() - t0
    step()
    seconds = median_time(step, repeats, dist.barrier)
    with RssPeak() as rss:
        step()
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, rss.peak)
    return seconds, max(peaks), first, first_s


def run_autosp(seq_len: int, repeats: int, config: dict) -> dict:
    import torch

    import autosp

    ids = _ids(seq_len)
    model = tiny()
    sp = autosp.compile(model, **_options(config))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step() -> float:
        loss = sp(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    seconds, peak, loss, first_s = _measure(step, repeats)
    plan = getattr(sp, "plan", None)
    chosen = "" if plan is None else "; ".join(
        f"{c.strategy}, {c.checkpoint}, MLP x{c.mlp_chunks}" for c in (layer.choice for layer in plan.layers)) \
        + f", loss x{plan.mesh.loss_chunks}"
    return dict(step_s=seconds, peak=peak, loss=loss, plan=chosen, first_s=first_s)


def _register_causal_sdpa() -> str:
    """A mask-free causal attention for transformers: HF then builds no mask, and the AutoSP
    pass finds a plain ``scaled_dot_product_attention`` call."""
    import torch.nn.functional as F
    from transformers import AttentionInterface

    def causal_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        groups = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("bench_causal_sdpa", causal_sdpa)
    return "bench_causal_sdpa"


def _deepspeed_engine():
    import deepspeed
    import torch
    import torch.distributed as dist

    os.environ.update(LOCAL_RANK=str(dist.get_rank()), RANK=str(dist.get_rank()),
                      WORLD_SIZE=str(dist.get_world_size()), LOCAL_WORLD_SIZE=str(dist.get_world_size()))
    deepspeed.init_distributed(dist_backend="gloo")
    sp = dist.get_world_size()
    model = tiny(_register_causal_sdpa())
    ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0},
                 "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
                 "compile": {"deepcompile": True, "passes": ["autosp"]}, "sequence_parallel_size": sp}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-5),
                                      config=ds_config)
    engine.compile()
    return engine, sp


def _deepspeed_step(engine, sp: int, seq_len: int, backward_only: bool = False):
    """One AutoSP step on this length (``backward_only``: forward and backward, the optimizer left
    to the caller, who reads the gradients first)."""
    import torch
    import torch.distributed as dist
    from deepspeed.compile.passes.sp_compile import prepare_autosp_inputs

    ids = _ids(seq_len)
    shifted = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)     # AutoSP shifts inside each shard
    positions = torch.arange(seq_len).unsqueeze(0)

    def step() -> float:
        i, labels, pos, _ = prepare_autosp_inputs(ids.clone(), shifted.clone(), positions.clone())
        loss = engine(input_ids=i, labels=labels, shift_labels=labels, position_ids=pos,
                      num_items_in_batch=seq_len - 1, use_cache=False).loss
        engine.backward(loss * sp)      # the engine averages; the global loss is the sum of shard losses
        if not backward_only:
            engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total.item()
    return step


def run_deepspeed(seq_len: int, repeats: int, config: dict) -> dict:
    engine, sp = _deepspeed_engine()
    seconds, peak, loss, first_s = _measure(_deepspeed_step(engine, sp, seq_len), repeats)
    return dict(step_s=seconds, peak=peak, loss=loss, first_s=first_s)


def _longest_under(make_step, cap_bytes: float, step_tokens: int, max_len: int) -> int:
    """Grow the length while one step's measured peak (after a warm-up step at that length) stays
    under the cap; the longest that did, on every rank (0: not even the first)."""
    import torch
    import torch.distributed as dist

    from autosp.tools.memory_probe import RssPeak

    best = 0
    for seq_len in range(step_tokens, max_len + 1, step_tokens):
        step = make_step(seq_len)
        step()
        with RssPeak() as rss:
            step()
        peak = torch.tensor([float(rss.peak)])
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        if peak.item() > cap_bytes:
            break
        best = seq_len
    return best


def autosp_longest(cap_bytes: float, step_tokens: int, max_len: int, config: dict) -> int:
    import torch

    import autosp

    model = tiny()
    sp = autosp.compile(model, **_options(config))     # one compile serves every length
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def make_step(seq_len: int):
        ids = _ids(seq_len)

        def step() -> None:
            sp(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    return _longest_under(make_step, cap_bytes, step_tokens, max_len)


def deepspeed_longest(cap_bytes: float, step_tokens: int, max_len: int, config: dict) -> int:
    engine, sp = _deepspeed_engine()

    def make_step(seq_len: int):
        return _deepspeed_step(engine, sp, seq_len)

    return _longest_under(make_step, cap_bytes, step_tokens, max_len)


def one_process_loss(seq_len: int) -> float:
    ids = _ids(seq_len)
    return tiny()(input_ids=ids, labels=ids).loss.item()


def measure(system: str, seq_len: int, repeats: int) -> dict:
    if system == "DeepSpeed AutoSP":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        return spawn_gloo(run_deepspeed, 2, threads=1, seq_len=seq_len, repeats=repeats, config={})
    return spawn_gloo(run_autosp, 2, threads=1, seq_len=seq_len, repeats=repeats, config=AUTOSP_CONFIGS[system])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-lens", default="4096,16384", help="comma-separated; empty: skip the side-by-side")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cap-mb", type=float, default=0.0)
    ap.add_argument("--cap-step", type=int, default=4096)
    ap.add_argument("--max-seq-len", type=int, default=65536)
    ap.add_argument("--systems", nargs="*", default=None, help="a subset of the systems, by name")
    ap.add_argument("--cap-systems", nargs="*", default=None, help="the systems of the cap search (default: all)")
    args = ap.parse_args()
    os.environ["DS_ACCELERATOR"] = "cpu"
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:
        print("note: set MALLOC_MMAP_THRESHOLD_=65536 for a stable steady state")
    systems = ["DeepSpeed AutoSP", *AUTOSP_CONFIGS]
    if args.systems:
        unknown = set(args.systems) - set(systems)
        if unknown:
            raise SystemExit(f"unknown systems {sorted(unknown)}; known: {systems}")
        systems = ["DeepSpeed AutoSP", *[s for s in systems if s in args.systems and s != "DeepSpeed AutoSP"]]
    t0 = time.perf_counter()
    print("tiny Llama (hidden 256, 8 heads, 4 KV heads, 2 layers, vocabulary 1000), batch 1, 2 gloo ranks, "
          "1 thread each, full AdamW step\n")
    print("| S | system | step (s) | vs AutoSP | peak step memory / rank | vs AutoSP | first loss (1 process) "
          "| first step (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for seq_len in [int(s) for s in args.seq_lens.split(",") if s]:
        single = one_process_loss(seq_len)
        rows = {s: measure(s, seq_len, args.repeats) for s in systems}
        base = rows["DeepSpeed AutoSP"]
        for s, r in rows.items():
            print(f"| {seq_len} | {s} | {r['step_s']:.2f} | {r['step_s'] / base['step_s']:.2f}x | "
                  f"{r['peak'] / 2**20:.0f} MB | {r['peak'] / base['peak']:.2f}x | {r['loss']:.5f} ({single:.5f}) | "
                  f"{r['first_s']:.1f} |", flush=True)
        for s, r in rows.items():
            if r.get("plan"):
                print(f"  ({s} at {seq_len}: the planner chose {r['plan']})")
    if args.cap_mb:
        print(f"\nlongest sequence under {args.cap_mb:.0f} MB per rank (steps of {args.cap_step} tokens):")
        longest = {}
        for s in (["DeepSpeed AutoSP", *[x for x in args.cap_systems if x != "DeepSpeed AutoSP"]]
                  if args.cap_systems else systems):
            kw = dict(cap_bytes=args.cap_mb * 2**20, step_tokens=args.cap_step, max_len=args.max_seq_len)
            if s == "DeepSpeed AutoSP":
                longest[s] = spawn_gloo(deepspeed_longest, 2, threads=1, config={}, **kw)
            else:
                longest[s] = spawn_gloo(autosp_longest, 2, threads=1, config=AUTOSP_CONFIGS[s], **kw)
            ratio = longest[s] / longest["DeepSpeed AutoSP"] if longest["DeepSpeed AutoSP"] else float("inf")
            print(f"  {s}: {longest[s]} tokens ({ratio:.2f}x AutoSP's)", flush=True)
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
