"""Predicted against measured: step time and per-rank peak memory on this machine.

Used by ``bench/costmodel_vs_measured.py`` (the bench's tiny Llama),
``bench/costmodel_heldout.py`` (three model shapes no profile row was measured at:
:data:`HELD_OUT`) and the tests (a small grid). Measured time: median of timed forward+backward steps after a
warm-up step, one CPU thread per rank. Measured memory: peak bytes of tensors
allocated during one step (``autosp.tools.memory_probe``; parameters and
inputs exist before the step), the same quantity as the prediction's
``step_peak``.
"""

from __future__ import annotations

from typing import Any

from autosp.tools.launch import median_time


def tiny_model():
    import torch
    import transformers

    from autosp.graph.catalog import hf_config

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(hf_config("tiny"))


# Held-out shapes: hidden sizes, head counts, head dims (48, 64, 80), GQA ratios (2, 1, 4: GQA,
# MHA, MQA), MLP ratios and vocabularies that neither the CPU profile's grid
# (autosp.costmodel.profiler) nor any test or bench model has.
HELD_OUT: dict[str, dict[str, int]] = {
    "heldout-a": dict(hidden_size=192, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=3000),
    "heldout-b": dict(hidden_size=384, intermediate_size=1536, num_attention_heads=6, num_key_value_heads=6,
                      vocab_size=1500),
    "heldout-c": dict(hidden_size=320, intermediate_size=864, num_attention_heads=4, num_key_value_heads=1,
                      vocab_size=5000),
}


def held_out_config(name: str):
    import transformers

    if name not in HELD_OUT:
        raise ValueError(f"unknown held-out model '{name}'; use one of {', '.join(HELD_OUT)}")
    cfg = transformers.LlamaConfig(num_hidden_layers=2, max_position_embeddings=65536, rope_theta=10000.0,
                                   **HELD_OUT[name])
    cfg._attn_implementation = "sdpa"
    return cfg


def held_out_model(name: str):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(held_out_config(name))


def measure_step(model, seq_len: int, repeats: int = 1, barrier=None, vocab: int = 2048) -> dict[str, float]:
    import torch

    from autosp.tools.memory_probe import step_peak

    ids = torch.randint(0, vocab, (1, seq_len), generator=torch.Generator().manual_seed(seq_len))

    def forward() -> torch.Tensor:
        return model(input_ids=ids, labels=ids).loss

    def step(measure_memory: bool = False) -> tuple[float, int]:
        if measure_memory:
            loss, peak = step_peak(model, forward)
        else:
            loss, peak = forward(), 0
            loss.backward()
        for p in model.parameters():
            p.grad = None
        return loss.item(), peak

    step()                                           # warm-up (and compile)
    seconds = median_time(step, repeats, barrier) if repeats else 0.0     # 0: memory only
    loss, peak = step(measure_memory=True)
    return {"time": seconds, "peak": peak, "loss": loss}


def measured_sp(seq_lens: list[int], strategies: list[str], repeats: int = 1) -> list[dict[str, Any]]:
    """On every rank of an initialised gloo group; rank 0's numbers are returned."""
    import torch
    import torch.distributed as dist

    import autosp

    torch.set_num_threads(1)
    rows = []
    for s in seq_lens:
        for st in strategies:
            torch._dynamo.reset()
            m = measure_step(autosp.compile(tiny_model(), plan=st), s, repeats, dist.barrier)
            rows.append(dict(sp=dist.get_world_size(), seq_len=s, strategy=st, **m))
    return rows


def measured_single(seq_lens: list[int], repeats: int = 1) -> list[dict[str, Any]]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)            # one core = one device, as the profile was measured
    try:
        return [dict(sp=1, seq_len=s, strategy="single", **measure_step(tiny_model(), s, repeats))
                for s in seq_lens]
    finally:
        torch.set_num_threads(threads)


def predicted(rows: list[dict[str, Any]], profile: str = "cpu-gloo") -> list[dict[str, Any]]:
    from autosp.costmodel import load_profile, predict
    from autosp.graph import capture

    prof = load_profile(profile)
    graphs: dict[int, Any] = {}
    out = []
    for r in rows:
        s = r["seq_len"]
        if s not in graphs:
            graphs[s] = capture("tiny", seq_len=s, dtype="float32")
        p = predict(graphs[s], prof, sp=r["sp"], strategy=r["strategy"], devices_per_node=r["sp"])  # all local
        out.append({**r, "pred_time": p.total_s, "pred_peak": p.memory["step_peak"]})
    return out


def runs_here(name: str, strategy: str, sp: int, seq_len: int) -> bool:
    """Whether ``strategy`` can run held-out model ``name``'s attention at SP degree ``sp``."""
    from autosp.strategies import AttentionShape, SPMesh, resolve

    c = HELD_OUT[name]
    shape = AttentionShape(heads=c["num_attention_heads"], kv_heads=c["num_key_value_heads"],
                           head_dim=c["hidden_size"] // c["num_attention_heads"], seq_len=seq_len, causal=True)
    st = resolve(strategy)
    return st.refuses(shape, SPMesh(sp, st.layout or "contiguous")) is None


def measured_held_out(models: list[str], seq_lens: list[int], strategies: list[str], repeats: int = 5,
                      compiler: str = "aot_eager", progress: bool = True) -> list[dict[str, Any]]:
    """On every rank of an initialised gloo group (one thread each): every held-out model, length
    and strategy the SP degree allows, through ``autosp.compile`` with no checkpointing or tiling
    (one rank runs attention as it is). Rank 0's numbers are returned."""
    import time

    import torch
    import torch.distributed as dist

    import autosp

    torch.set_num_threads(1)
    world = dist.get_world_size()
    rows = []
    for name in models:
        vocab = HELD_OUT[name]["vocab_size"]
        for s in seq_lens:
            for st in (strategies if world > 1 else ["auto"]):
                if world > 1 and not runs_here(name, st, world, s):
                    continue                # e.g. heads the SP degree does not divide
                torch._dynamo.reset()
                t0 = time.perf_counter()
                sp = autosp.compile(held_out_model(name), plan=st, runtime=autosp.Runtime(compiler=compiler))
                m = measure_step(sp, s, repeats, dist.barrier, vocab)
                ran = sorted({r["strategy"] for r in sp.report().as_dict()["attention"]}) if world > 1 else ["single"]
                rows.append(dict(model=name, sp=world, seq_len=s, strategy=st if world > 1 else "single",
                                 ran=",".join(ran), **m))
                if progress and dist.get_rank() == 0:
                    print(f"  SP {world} {name} {s} {rows[-1]['strategy']}: {m['time']:.3f} s, "
                          f"{m['peak'] / 2**20:.1f} MiB ({time.perf_counter() - t0:.0f} s)", flush=True)
    return rows


def predicted_held_out(rows: list[dict[str, Any]], profile: str = "cpu-gloo") -> list[dict[str, Any]]:
    """The cost model's step time (:func:`autosp.costmodel.predict`) and compiled step peak
    (:func:`autosp.costmodel.predict.step_peak`, no checkpointing) for each measured row."""
    from autosp.costmodel import load_profile, predict
    from autosp.costmodel.predict import step_peak
    from autosp.graph import capture
    from autosp.graph.catalog import ModelSource

    prof = load_profile(profile)
    graphs: dict[tuple[str, int], Any] = {}
    out = []
    for r in rows:
        key = (r["model"], r["seq_len"])
        if key not in graphs:
            graphs[key] = capture(ModelSource(r["model"], hf_config=held_out_config(r["model"])),
                                  seq_len=r["seq_len"], dtype="float32")
        g = graphs[key]
        st = "ulysses" if r["sp"] == 1 else r["strategy"]
        p = predict(g, prof, sp=r["sp"], strategy=st, devices_per_node=r["sp"])     # all ranks local
        peak = step_peak(g, prof, sp=r["sp"], strategy=st, seq_len=r["seq_len"])
        out.append({**r, "pred_time": p.total_s, "pred_peak": peak})
    return out
