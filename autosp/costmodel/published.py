"""Profiles built from published hardware figures (not measured): h100-sxm, h200-sxm, a100-sxm.

    python -m autosp.costmodel.published      # rewrites autosp/profiles/{h100,h200,a100}-sxm.json

Figures (cited in each file's ``source``):
  dense bf16 peak   H100/H200 SXM ~989 TFLOP/s, A100 SXM 312 TFLOP/s (NVIDIA datasheets)
  HBM bandwidth     H100 3.35 TB/s, H200 4.8 TB/s, A100 2.0 TB/s (datasheets)
  memory            what CUDA gives a process (torch.cuda.get_device_properties().total_memory),
                    not the datasheets' decimal "80 GB" / "141 GB": those name HBM sold in GiB.
                    NVML reports 81,559 MiB on an H100 80GB, 143,771 MiB on an H200, 81,920 MiB
                    on an A100 80GB (Modal, "Why does an NVIDIA H100 80GB card offer 85.52 GB?");
                    PyTorch's own out-of-memory messages report total capacities of 79.10-79.18 GiB
                    on H100 80GB HBM3, 79.15 GiB on A100 80GB and 139.80-139.81 GiB on H200, and
                    this project measured 139.80 GiB on an H200 (profiles/h200-sxm-measured.json).
                    The lowest seen is used: 79.10 GiB (H100), 79.15 GiB (A100), 139.80 GiB (H200).
  runtime memory    what a training process holds outside PyTorch's allocator, which no tensor can
                    use: 4.34 GB on 8 x H100 after one all_to_all_single, the CUDA context's
                    1.06 GB included (NCCL maintainers, NVIDIA/nccl issue 1685: 32 channels per
                    pair of GPUs); the same figure is used for the H200 and A100 until measured
                    (``autosp profile`` measures it).
  NVLink            ~370 GB/s bus bandwidth for all-gather / reduce-scatter / all-to-all-class
                    collectives, ~480 GB/s for NVLS all-reduce on H100/H200 (nccl-tests, NCCL
                    maintainers); A100 NVLink3 ~230 GB/s (nccl-tests class figure)
  InfiniBand NDR    ~48 GB/s per NIC, one NIC per GPU (nccl-tests)
Assumptions (stated, not published): large bf16 GEMMs reach 75% of dense peak,
fused attention 55% forward / 45% backward, memory-bound kernels 80% of HBM
bandwidth, a 5 us launch floor per kernel, collective latency 10 us inside a node
and 20 us across nodes. Times at each table point follow
``t = floor + work / (peak * efficiency)``.

Concurrency (measured, not published; H100/H200 only): NCCL runs a collective as a kernel
of one thread block per channel, so a collective beside compute takes SMs and HBM bandwidth
from it. ``bench/gpu_check.py --only concurrency`` measured that on one H200 with a stand-in,
a copy kernel on 16 blocks (~820 GB/s read + written, about the HBM traffic of an NVLink
all-to-all at ~370 GB/s bus bandwidth) issued before the compute on a second stream: a bf16
8192^3 matmul ran 1.26x slower beside it and a flash-attention forward+backward 1.11x; the
copy ran 1.16x / 1.12x slower (two runs, 2026-12-04, each within 0.03 of the other). The
profiles carry the means: compute 1.19x, collective 1.14x. The H100 shares the H200's SMs;
the A100 was not measured and keeps 1.0.
"""

from __future__ import annotations

import json
import os

from autosp.costmodel.profile import BYTES_MOVED, SCHEMA

GIB = 2 ** 30
GPUS = {
    "h100-sxm": dict(peak=989e12, hbm=3.35e12, mem=int(79.10 * GIB), nvlink=370e9, nvls=480e9, label="NVIDIA H100 SXM",
                     pcie=50e9, pcie_label="PCIe Gen5 x16", host_mem=2e12, system="DGX H100", datasheet_mem="80 GB",
                     optimizer=1e9, optimizer_how="estimated from DGX H100's DRAM (2 sockets of 8-channel DDR5-4800, "
                     "about 600 GB/s) shared by 8 ranks, an AdamW step moving about 32 bytes per parameter, at half "
                     "of that bandwidth"),
    "h200-sxm": dict(peak=989e12, hbm=4.8e12, mem=int(139.80 * GIB), nvlink=370e9, nvls=480e9, label="NVIDIA H200 SXM",
                     pcie=50e9, pcie_label="PCIe Gen5 x16", host_mem=2e12, system="DGX H200", datasheet_mem="141 GB",
                     optimizer=1e9, optimizer_how="estimated as for DGX H100 (same host: 2 sockets of DDR5-4800 "
                     "shared by 8 ranks, about 32 bytes moved per parameter, half the bandwidth)"),
    "a100-sxm": dict(peak=312e12, hbm=2.0e12, mem=int(79.15 * GIB), nvlink=230e9, nvls=230e9, label="NVIDIA A100 SXM",
                     pcie=25e9, pcie_label="PCIe Gen4 x16", host_mem=2e12, system="DGX A100 (80 GB GPUs)",
                     datasheet_mem="80 GB", optimizer=0.6e9, optimizer_how="estimated from DGX A100's DRAM "
                     "(2 sockets of 8-channel DDR4-3200, about 400 GB/s) shared by 8 ranks, about 32 bytes moved per "
                     "parameter, at half of that bandwidth"),
}
IB = 48e9
RUNTIME_RESERVED = 4.34e9
EFF = dict(matmul=0.75, attention=0.55, attention_backward=0.45, memory=0.80)
FLOOR, LAT_INTRA, LAT_INTER = 5e-6, 10e-6, 20e-6
HOPPER_CONCURRENCY = {
    "comm_slowdown": 1.14, "compute_slowdown": 1.19,
    "how": "measured on one H200 (bench/gpu_check.py --only concurrency, 2026-12-04, two runs): a 16-block copy "
           "kernel standing in for an NCCL collective's kernel, issued first on a second stream; compute = mean of "
           "a bf16 matmul (1.26x) and a flash-attention forward+backward (1.11x), collective = mean of the copy "
           "beside each (1.16x, 1.12x)",
}


def build(name: str) -> dict:
    g = GPUS[name]
    flops_pts = [10.0 ** e for e in range(8, 21)]
    fp32_peak = g["peak"] / 2 if name != "a100-sxm" else 156e12     # TF32 tensor-core rate
    compute = {
        "matmul": {dt: [dict(flops=f, seconds=FLOOR + f / (pk * EFF["matmul"])) for f in flops_pts]
                   for dt, pk in (("bfloat16", g["peak"]), ("float32", fp32_peak))},
        "attention": {dt: [dict(flops=f, seconds=FLOOR + f / (pk * EFF["attention"])) for f in flops_pts]
                      for dt, pk in (("bfloat16", g["peak"]), ("float32", fp32_peak))},
        "attention_backward": {dt: [dict(flops=f, seconds=FLOOR + f / (pk * EFF["attention_backward"]))
                                    for f in flops_pts] for dt, pk in (("bfloat16", g["peak"]), ("float32", fp32_peak))},
        "memory_bound": [dict(bytes=b, seconds=FLOOR + b / (g["hbm"] * EFF["memory"]))
                         for b in (2.0 ** e for e in range(12, 49, 2))],
    }
    coll: dict = {}
    sizes = [2.0 ** e for e in range(12, 35, 2)]
    for op, moved in BYTES_MOVED.items():
        bw = g["nvls"] if op == "all_reduce" else g["nvlink"]
        intra = {str(p): [dict(bytes=b, seconds=LAT_INTRA + b * moved(p) / bw) for b in sizes] for p in (2, 4, 8)}
        inter = {str(p): [dict(bytes=b, seconds=LAT_INTER + b * moved(p) / IB) for b in sizes]
                 for p in (16, 32, 64, 128)}
        coll[op] = {"intra": intra, "inter": inter}
    return {
        "schema": SCHEMA,
        "name": name,
        "source": {
            "kind": "published",
            "device": g["label"],
            "citations": [
                f"{g['label']} datasheet: dense bf16 {g['peak'] / 1e12:.0f} TFLOP/s, HBM {g['hbm'] / 1e12:.2f} TB/s, "
                f"{g['datasheet_mem']} (CUDA gives a process {g['mem'] / GIB:.2f} GiB: see "
                "autosp.costmodel.published)",
                f"nccl-tests bus bandwidth: ~{g['nvlink'] / 1e9:.0f} GB/s all-gather/all-to-all class, "
                f"~{g['nvls'] / 1e9:.0f} GB/s all-reduce inside a node",
                "nccl-tests InfiniBand NDR 400G: 46-49 GB/s per NIC (48 used), one NIC per GPU",
                f"runtime memory outside PyTorch's allocator: {RUNTIME_RESERVED / 1e9:.2f} GB on 8 x H100 after "
                "one all_to_all_single, CUDA context included (NVIDIA/nccl issue 1685)",
            ],
            "assumptions": {"efficiency": EFF, "kernel_floor_s": FLOOR, "latency_intra_s": LAT_INTRA,
                            "latency_inter_s": LAT_INTER},
            "how": "python -m autosp.costmodel.published",
        },
        "memory_bytes": g["mem"],
        "runtime_reserved_bytes": RUNTIME_RESERVED,
        "devices_per_node": 8,
        "op_overhead_s": 0.0,
        "compute": compute,
        "collectives": coll,
        **({"concurrency": HOPPER_CONCURRENCY} if name != "a100-sxm" else {}),
        "host": host_section(g),
    }


def host_section(g: dict) -> dict:
    """Device <-> host copies (pinned memory, each way, per GPU), the node's host memory and the
    rate one rank's optimizer steps there."""
    return {"link_bytes_per_s": g["pcie"], "memory_bytes_per_node": g["host_mem"], "latency_s": LAT_INTRA,
            "optimizer_params_per_s": g["optimizer"],
            "how": f"published: {g['pcie_label']} per GPU, {g['pcie_label'].split()[1]} pinned copies measured at "
                   f"about {g['pcie'] / 1e9:.0f} GB/s each way (CUDA bandwidthTest class); {g['system']}: "
                   f"{g['host_mem'] / 1e12:.0f} TB of host memory per node; optimizer on the host (AdamW, fp32, "
                   f"per rank): {g['optimizer_how']}: {g['optimizer'] / 1e9:.1f}e9 parameters/s"}


def main() -> None:
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "profiles")
    for name in GPUS:
        with open(os.path.join(root, f"{name}.json"), "w") as f:
            json.dump(build(name), f, indent=1)
        print(f"wrote {name}.json")


if __name__ == "__main__":
    main()
