"""Long-context check for one GPU (``python bench/gpu_check.py --only offload``): does a step with
Llama-3-8B's layer shapes take the memory and time the planner predicts, with offload on and off?

The model: a few full-size Llama-3-8B decoder layers (hidden 4096, MLP 14336, 32 heads, 8 KV
heads) and its 128,256-word head, bf16, through Inductor, on one process (SP degree 1) at
``--tokens`` per rank: what one rank of an SP plan holds (Ulysses' gathered heads hold as many
bytes: S x H/P x d = S/P x H x d). Every layer fully checkpointed, its MLP and the loss in token
chunks, its saved tensors offloaded or kept (offloaded: the optimizer states too, stepped in host
memory by ``model.optimizer(AdamW)``). Per setting: the measured peak device memory
(``torch.cuda.max_memory_allocated``) and step time against the planner's prediction for that
very configuration (``autosp.plan`` at world size 1 with the decisions fixed), and the measured
device <-> host copy bandwidth (pinned memory), which the GPU profiles' ``host`` section carries.

``--dry`` runs the same code on CPU with a tiny model (the suite runs it): peaks from the memory
probe, which counts host memory apart.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch


def _model(dry: bool, layers: int) -> Any:
    import transformers

    if dry:
        cfg = dict(hidden_size=128, intermediate_size=448, num_attention_heads=8, num_key_value_heads=2,
                   vocab_size=1024)
    else:
        cfg = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                   vocab_size=128256, rope_theta=500000.0)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=layers, attn_implementation="sdpa", **cfg)
    return transformers.AutoModelForCausalLM.from_config(config)


def host_bandwidth(dry: bool, nbytes: int = 1 << 30) -> dict[str, float]:
    """Bytes per second of one copy to pinned host memory and back (CPU: a clone each way)."""
    if dry:
        x = torch.empty(nbytes // 16, dtype=torch.uint8)
        t0 = time.perf_counter()
        y = x.clone()
        d2h = time.perf_counter() - t0
        t0 = time.perf_counter()
        y.clone()
        return {"d2h": x.numel() / d2h, "h2d": x.numel() / (time.perf_counter() - t0)}
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {}
    for name, (dst, src) in {"d2h": (host, dev), "h2d": (dev, host)}.items():
        dst.copy_(src, non_blocking=True)          # warm
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        end.record()
        torch.cuda.synchronize()
        out[name] = 3 * nbytes / (start.elapsed_time(end) / 1e3)
    return out


def _step(sp: Any, ids: torch.Tensor, opt: Any, dry: bool) -> tuple[float, int, int, float]:
    """One training step: (seconds, peak device bytes, peak host bytes) of its forward + backward,
    and the seconds of its optimizer step."""
    from autosp.tools.memory_probe import step_memory

    if dry:
        t0 = time.perf_counter()
        _, probe = step_memory(sp, lambda: sp(input_ids=ids, labels=ids).loss)
        seconds, peak, host = time.perf_counter() - t0, probe.peak, probe.host_peak
    else:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        sp(input_ids=ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
        seconds, peak, host = time.perf_counter() - t0, torch.cuda.max_memory_allocated(), 0
    t0 = time.perf_counter()
    opt.step()
    if not dry:
        torch.cuda.synchronize()
    stepped = time.perf_counter() - t0
    opt.zero_grad(set_to_none=True)
    return seconds, peak, host, stepped


def _host_states(opt: Any) -> int:
    """Bytes of host memory an optimizer stepped there holds: its fp32 masters and their states."""
    from autosp.transform.host_optimizer import HostOptimizer

    if not isinstance(opt, HostOptimizer) or not opt.on_host:
        return 0
    states = [v for st in opt.inner.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()]
    return sum(t.numel() * t.element_size() for t in opt.masters + states)


def offload_check(dry: bool = False, tokens: int = 131072, layers: int = 4, chunks: int = 8) -> dict[str, Any]:
    """Measured against predicted, offload off and on (see the module's docstring)."""
    import torch.distributed as dist

    import autosp
    from autosp.decisions import MeshChoice
    from autosp.graph import capture

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        from autosp.tools.launch import free_port

        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo" if dry else "nccl", rank=0, world_size=1)
    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16
    from autosp.costmodel.profile import load_profile
    from autosp.costmodel.profiler import outside_allocator_bytes

    profile = load_profile("cpu-gloo" if dry else "h200-sxm-measured")
    if dry:     # on CPU host and device share the RAM (no host memory to plan into): a forced offload
        profile.data["host"] = {**profile.data["host"], "memory_bytes_per_node": 1e12}
    compiler = "aot_eager" if dry else "inductor"
    graph = capture(_model(dry, layers), seq_len=4096, dtype=str(dtype).removeprefix("torch."))
    out: dict[str, Any] = {"device": "cpu" if dry else torch.cuda.get_device_name(), "tokens": tokens,
                           "layers": layers, "chunks": chunks, "compiler": compiler, "profile": profile.name,
                           "host_bandwidth": host_bandwidth(dry)}
    ids = torch.randint(0, 1000, (1, tokens), device=device)
    for offload in (False, True):
        torch._dynamo.reset()
        model = _model(dry, layers).to(device=device, dtype=dtype)
        # offloaded: the checkpoints, and the optimizer's states stepped in host memory
        decisions = autosp.Decisions.of(strategy="ulysses", checkpoint="full", mlp_chunks=chunks, offload=offload,
                                        mesh=MeshChoice(loss_chunks=chunks, host_optimizer=offload))
        sp = autosp.compile(model, plan=decisions, runtime=autosp.Runtime(compiler=compiler))
        opt = sp.optimizer(torch.optim.AdamW, lr=1e-5)
        _step(sp, ids, opt, dry)                          # compiles; the optimizer's states exist after it
        seconds, peak, host, stepped = _step(sp, ids, opt, dry)
        pred = autosp.plan(autosp.Problem.of(graph=graph, seq_len=tokens, world_size=1, profile=profile,
                                             memory_limit=float("inf"), checkpoints=("full",), mlp_chunks=(chunks,),
                                             loss_chunks=(chunks,), offloads=(offload,),
                                             dtype=str(dtype).removeprefix("torch."), compiler=compiler,
                                             host_optimizers=(offload,)))
        copies = sp.report().as_dict()["collectives"]
        states = pred.predicted.host_optimizer_bytes
        out["offload" if offload else "kept"] = {
            "step_s": seconds, "predicted_step_s": pred.predicted.total_s,
            # the probe (dry) sees the step's new tensors only: not the parameters and optimizer states
            "peak_bytes": peak, "predicted_peak_bytes": pred.predicted.peak_bytes - (
                pred.predicted.memory.parameters + pred.predicted.memory.optimizer if dry else 0.0),
            "host_peak_bytes": host, "predicted_host_bytes": pred.predicted.host_bytes - states,
            "optimizer_host_bytes": _host_states(opt), "predicted_optimizer_host_bytes": states,
            "optimizer_step_s": stepped, "predicted_optimizer_step_s": pred.predicted.host_optimizer_step_s,
            "host_optimizer": pred.mesh.host_optimizer,
            "offloaded_bytes": copies.get("host_offload", {}).get("bytes", 0),
            # the CUDA context and NCCL's buffers (one rank): the profiles' runtime_reserved_bytes
            "outside_allocator_bytes": None if dry else outside_allocator_bytes(device),
            "decisions": [vars(layer.choice) for layer in pred.layers]}
        del sp, model, opt
    return out


def main(out_dir: str, dry: bool, tokens: int | None = None) -> dict[str, Any]:
    small = {"tokens": 256, "layers": 2, "chunks": 2} if dry else {}      # the suite's: seconds, not minutes
    res = offload_check(dry=dry, **{**small, **({"tokens": tokens} if tokens else {})})
    with open(os.path.join(out_dir, "offload.json"), "w") as f:
        json.dump(res, f, indent=1)
    bw = res["host_bandwidth"]
    print(f"host copies: {bw['d2h'] / 1e9:.1f} GB/s to the host, {bw['h2d'] / 1e9:.1f} GB/s back")
    for name in ("kept", "offload"):
        r = res[name]
        print(f"{name:8s} peak {r['peak_bytes'] / 2**20:9.1f} MiB (predicted {r['predicted_peak_bytes'] / 2**20:9.1f}), "
              f"host {r['host_peak_bytes'] / 2**20:8.1f} MiB (predicted {r['predicted_host_bytes'] / 2**20:8.1f}), "
              f"step {r['step_s']:8.3f} s (predicted {r['predicted_step_s']:8.3f}), "
              f"offloaded {r['offloaded_bytes'] / 2**20:.1f} MiB, optimizer on the host "
              f"{r['optimizer_host_bytes'] / 2**20:.1f} MiB (predicted {r['predicted_optimizer_host_bytes'] / 2**20:.1f}), "
              f"its step {r['optimizer_step_s']:.3f} s (predicted {r['predicted_optimizer_step_s']:.3f})")
    return res
