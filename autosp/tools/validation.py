"""Predicted against measured: step time and per-rank peak memory on this machine.

Used by ``bench/costmodel_vs_measured.py`` (the full grid) and the tests (a
small one). Measured time: median of timed forward+backward steps after a
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


def measure_step(model, seq_len: int, repeats: int = 1, barrier=None) -> dict[str, float]:
    import torch

    from autosp.tools.memory_probe import step_peak

    ids = torch.randint(0, 2048, (1, seq_len), generator=torch.Generator().manual_seed(seq_len))

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
            m = measure_step(autosp.compile(tiny_model(), strategy=st), s, repeats, dist.barrier)
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
