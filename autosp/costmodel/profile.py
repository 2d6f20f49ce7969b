"""Hardware profiles: versioned JSON tables of op and collective times (see profiles/README.md).

``load_profile("h100-sxm")`` finds a profile shipped inside the package (also from
an installed wheel); ``load_profile("my.json")`` reads a file. Malformed or
incomplete profiles are refused with one line naming the file and the key.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from autosp.graph.ops import attention_flops
from autosp.costmodel.interp import AlphaBeta, LogLogTable
from autosp.errors import AutospError

SCHEMA = "autosp.profile/1"
COLLECTIVES = ("all_to_all", "all_gather", "reduce_scatter", "all_reduce", "send_recv")
# Bytes each rank moves per byte of its buffer in the bandwidth-optimal algorithm (the
# bus-bandwidth convention of nccl-tests): carries a table measured at one group size over
# to another, and builds the published profiles.
BYTES_MOVED = {
    "all_to_all": lambda p: (p - 1) / p,
    "all_gather": lambda p: (p - 1),          # buffer = one shard
    "reduce_scatter": lambda p: (p - 1) / p,  # buffer = the full input
    "all_reduce": lambda p: 2 * (p - 1) / p,
    "send_recv": lambda p: 1.0,
}


def shipped_profiles() -> list[str]:
    root = resources.files("autosp.profiles")
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".json"))


def _read(name_or_path: str) -> tuple[dict, str]:
    if os.path.exists(name_or_path):
        path = name_or_path
        text = open(path).read()
    else:
        res = resources.files("autosp.profiles") / f"{name_or_path}.json"
        if not res.is_file():
            raise AutospError(f"profile '{name_or_path}' not found: no such file and no shipped profile of that "
                              f"name; use one of {', '.join(shipped_profiles())} or a path to a profile JSON")
        path = f"autosp/profiles/{name_or_path}.json"
        text = res.read_text()
    try:
        return json.loads(text), path
    except json.JSONDecodeError as e:
        raise AutospError(f"profile {path} is not valid JSON ({e.msg} at line {e.lineno}); fix or re-measure it "
                          "with `autosp profile`") from None


def _get(data: dict, path: str, key: str) -> Any:
    cur: Any = data
    for part in key.split("."):
        if not isinstance(cur, dict) or part not in cur:
            raise AutospError(f"profile {path} has no key '{key}'; re-measure it with `autosp profile` or add it")
        cur = cur[part]
    return cur


@dataclass
class HardwareProfile:
    name: str
    path: str
    data: dict
    memory_bytes: float = 0.0
    devices_per_node: int = 1
    op_overhead_s: float = 0.0
    _tables: dict = field(default_factory=dict, init=False, repr=False)    # a copy (other data) starts empty

    @property
    def source(self) -> dict:
        return self.data.get("source", {})

    @property
    def runtime_reserved_bytes(self) -> float:
        """Device memory a training process holds outside PyTorch's allocator (the CUDA context,
        NCCL's communicator buffers), which no tensor can use (0 where the profile does not say)."""
        return float(self.data.get("runtime_reserved_bytes", 0.0))

    @property
    def tensor_memory_bytes(self) -> float:
        """The memory a step's tensors may use when no limit is given: the device's, less the runtime's."""
        return self.memory_bytes - self.runtime_reserved_bytes

    # -------------------------------------------------------------- host memory (offload)
    @property
    def host_memory_bytes(self) -> float:
        """Host memory per node, shared by its devices (0: not in the profile, nothing offloads)."""
        return float(self.data.get("host", {}).get("memory_bytes_per_node", 0.0))

    def host_copy_time(self, nbytes: float) -> float:
        """One copy of ``nbytes`` between a device and pinned host memory (either way)."""
        host = self.data.get("host", {})
        if not host.get("link_bytes_per_s"):
            raise AutospError(f"profile {self.path} has no 'host' section: offload cannot be costed; measure it "
                              "(autosp profile on the GPU) or add the device-host link's bandwidth by hand")
        return float(host.get("latency_s", 0.0)) + nbytes / float(host["link_bytes_per_s"])

    def host_optimizer_time(self, params: float) -> float:
        """One optimizer step (AdamW, fp32) over ``params`` parameters on the host, per rank (0 where the
        profile has no rate: then the planner never steps there)."""
        rate = self.data.get("host", {}).get("optimizer_params_per_s")
        return params / float(rate) if rate else 0.0

    @property
    def steps_on_host(self) -> bool:
        """Whether optimizer states may live and step in host memory: the profile has host memory and a
        host step rate to cost them."""
        return bool(self.host_memory_bytes and self.data.get("host", {}).get("optimizer_params_per_s"))

    # -------------------------------------------------------------- compute
    def _table(self, key: str, points: list) -> LogLogTable:
        if key not in self._tables:
            if not points:
                raise AutospError(f"profile {self.path} has an empty table '{key}'; re-measure it")
            self._tables[key] = LogLogTable(points, f"{self.name}:{key}")
        return self._tables[key]

    def _dtype_table(self, kind: str, dtype: str) -> LogLogTable:
        tables = _get(self.data, self.path, f"compute.{kind}")
        if dtype not in tables:
            if not tables:
                raise AutospError(f"profile {self.path} has no key 'compute.{kind}.{dtype}'")
            dtype = "bfloat16" if "bfloat16" in tables else next(iter(tables))
        key = f"compute.{kind}.{dtype}"
        if key in self._tables:         # the planner looks tables up hundreds of thousands of times
            return self._tables[key]
        return self._table(key, [(_row_flops(kind, r), r["seconds"]) for r in tables[dtype]])

    def matmul_time(self, flops: float, dtype: str) -> float:
        return self._dtype_table("matmul", dtype)(flops) if flops > 0 else 0.0

    def attention_time(self, flops: float, dtype: str, backward: bool = False) -> float:
        """Fused attention; ``flops`` in the convention of autosp.graph.ops (causal halved)."""
        if flops <= 0:
            return 0.0
        if backward and self.data["compute"].get("attention_backward"):
            return self._dtype_table("attention_backward", dtype)(flops)
        return self._dtype_table("attention", dtype)(flops / (2 if backward else 1)) * (2 if backward else 1)

    def attention_call_time(self, heads: float, q_len: float, kv_len: float, head_dim: float, causal: bool,
                            dtype: str, backward: bool = False) -> float:
        """One fused attention call of this shape (batch folded into ``heads``).

        Tables with shaped rows are interpolated in the attended area (q_len x kv_len, halved
        when causal) and scaled by heads from the nearest measured head count: kernels are not
        linear in heads on every device (a GPU's few-head call leaves SMs idle). A profile
        measured with one thread per device (``threads_per_device == 1``: every CPU
        profile) runs a call's heads one after another, so its head counts measure one
        per-head time, and their mean is taken: rows timed minutes apart differ by drift (the
        shipped cpu-gloo profile: 2 heads 11% dearer per head than 8 at head dim 96, where a
        re-measurement side by side found them within 5%), and the nearest row alone would
        decide a chunked schedule's price by that noise. Across head dims the time is affine
        (a per-score part and a per-score-per-dim part): with rows at two or more head dims it
        is interpolated (or extrapolated) linearly between the two nearest, with one it scales
        with the head dim. Tables of FLOP-keyed rows (published profiles) fall back to
        :meth:`attention_time`.
        """
        kind = "attention_backward" if backward and self.data["compute"].get("attention_backward") else "attention"
        tables = self.data["compute"][kind]
        rows = tables.get(dtype) or next(iter(tables.values()), [])
        shaped = [r for r in rows if "heads" in r]
        area = q_len * kv_len * (0.5 if causal else 1.0)
        if not shaped:
            flops = 4.0 * heads * area * head_dim * (2 if backward else 1)
            return self.attention_time(flops, dtype, backward)
        import math

        target = max(heads, 1e-9)
        counts = sorted({r["batch"] * r["heads"] for r in shaped})
        if self.data.get("threads_per_device") != 1:
            counts = [min(counts, key=lambda h: abs(math.log(h / target)))]
        per_head = [self._attention_per_head(kind, dtype, h0, [r for r in shaped if r["batch"] * r["heads"] == h0],
                                             area, head_dim) for h0 in counts]
        return sum(per_head) / len(per_head) * target

    def _attention_per_head(self, kind: str, dtype: str, h0: int, sel: list[dict], area: float,
                            head_dim: float) -> float:
        """Seconds per head of a call at the rows' head count ``h0``, interpolated in area and head dim."""
        dims = sorted({r["head_dim"] for r in sel}, key=lambda d: (abs(d - head_dim), d))[:2]

        def at(d: int) -> float:
            key = f"{kind}.{dtype}.shape.{h0}.{d}"
            if key not in self._tables:
                pts = [(r["q_len"] * r["kv_len"] * (0.5 if r.get("causal") else 1.0), r["seconds"])
                       for r in sel if r["head_dim"] == d]
                self._tables[key] = LogLogTable(pts, f"{self.name}:{key}")
            return self._tables[key](area)

        if len(dims) == 1:
            t_h0 = at(dims[0]) * head_dim / dims[0]
        else:
            (d1, t1), (d2, t2) = sorted((d, at(d)) for d in dims)
            affine = t1 + (t2 - t1) * (head_dim - d1) / (d2 - d1)
            t_h0 = max(affine, t1 * min(1.0, head_dim / d1) / 4)    # never below a quarter of linear
        return t_h0 / h0

    def concurrency(self) -> tuple[float, float]:
        """(collective slowdown, compute slowdown) while both run at once, as measured
        (``autosp profile``, or for the published Hopper profiles ``bench/gpu_check.py --only
        concurrency``); 1.0 each where the profile says nothing."""
        c = self.data.get("concurrency", {})
        return float(c.get("comm_slowdown", 1.0)), float(c.get("compute_slowdown", 1.0))

    def sync_skew(self, group_size: int, transfer_only: bool = False) -> float:
        """Seconds a blocking collective over ``group_size`` ranks costs after compute beyond its
        table time (``autosp profile``'s sync-skew measurement: ranks arrive at their own pace, and
        ranks sharing a device wait to be scheduled); the nearest measured group size, 0.0 where
        the profile says nothing. ``transfer_only``: its part after the last rank issued (the
        transfer slowed by peers computing on shared devices; 0.0 where not measured)."""
        by_size = self.data.get("sync_skew", {}).get("transfer_seconds" if transfer_only else "seconds", {})
        return float(_nearest_group(by_size, group_size, 0.0))

    def peak_flops(self, dtype: str) -> float:
        """The denominator of MFU: the cited peak, or the best observed matmul rate over its stated
        efficiency."""
        cited = self.source.get("peak_flops")
        if cited:
            return float(cited)
        tables = self.data["compute"]["matmul"]
        rows = tables.get(dtype) or next(iter(tables.values()))
        eff = self.source.get("assumptions", {}).get("efficiency", {}).get("matmul")
        best = max(_row_flops("matmul", r) / r["seconds"] for r in rows)
        return best / eff if eff else best

    def memory_bound_time(self, nbytes: float) -> float:
        rows = _get(self.data, self.path, "compute.memory_bound")
        return self._table("compute.memory_bound", [(r["bytes"], r["seconds"]) for r in rows])(nbytes)

    # -------------------------------------------------------------- communication
    def collective_time(self, name: str, group_size: int, nbytes: float, inter: bool = False) -> float:
        """Seconds for one collective of ``nbytes`` per-rank buffer over ``group_size`` ranks."""
        if group_size <= 1 or nbytes <= 0:
            return 0.0
        where = "inter" if inter and self.devices_per_node < group_size else "intra"
        if where == "inter" and not self.data.get("collectives", {}).get(name, {}).get("inter"):
            where = "intra"        # a one-host profile (e.g. CPU ranks on loopback) has no inter tables
        by_size = _get(self.data, self.path, f"collectives.{name}.{where}")
        if not by_size:
            raise AutospError(f"profile {self.path} has no key 'collectives.{name}.{where}' entries; measure it")
        sizes = sorted(int(k) for k in by_size)
        p0 = group_size if group_size in sizes else min(sizes, key=lambda s: abs(s - group_size))
        key = f"collectives.{name}.{where}.{p0}"
        if key not in self._tables:
            pts = [(r["bytes"], r["seconds"]) for r in by_size[str(p0)]]
            self._tables[key] = (LogLogTable(pts, f"{self.name}:{key}"), AlphaBeta.fit(pts))
        table, fit = self._tables[key]
        scale = BYTES_MOVED[name](group_size) / BYTES_MOVED[name](p0)
        scaled = nbytes * scale
        largest = table.points[-1][0]
        return fit(scaled) if scaled > largest else table(scaled)


def _row_flops(kind: str, r: dict) -> float:
    if "flops" in r:
        return float(r["flops"])
    if kind == "matmul":
        return 2.0 * r["m"] * r["n"] * r["k"] * r.get("batch", 1)
    q = (r["batch"], r["heads"], r["q_len"], r["head_dim"])
    k = (r["batch"], r["heads"], r["kv_len"], r["head_dim"])
    return float(attention_flops(q, k, bool(r.get("causal", False)), bool(r.get("backward", False))))


def load_profile(name_or_path: str) -> HardwareProfile:
    """A shipped profile by name (``autosp.costmodel.profile.shipped_profiles()``) or a JSON file."""
    data, path = _read(name_or_path)
    if not isinstance(data, dict):
        raise AutospError(f"profile {path} must hold a JSON object, not {type(data).__name__}")
    schema = _get(data, path, "schema")
    if schema != SCHEMA:
        raise AutospError(f"profile {path} has schema '{schema}', this autosp reads '{SCHEMA}'; re-measure it")
    for key in ("compute.matmul", "compute.attention", "compute.memory_bound", "collectives", "memory_bytes",
                "devices_per_node"):
        _get(data, path, key)
    return HardwareProfile(name=data.get("name", os.path.basename(path)), path=path, data=data,
                           memory_bytes=float(data["memory_bytes"]), devices_per_node=int(data["devices_per_node"]),
                           op_overhead_s=float(data.get("op_overhead_s", 0.0)))


def _nearest_group(by_size: dict[str, Any], group_size: int, default: float) -> Any:
    """The value measured at the group size nearest ``group_size`` (the larger on a tie);
    ``default`` for one rank or where nothing was measured."""
    if group_size <= 1 or not by_size:
        return default
    return by_size[str(min((int(k) for k in by_size), key=lambda s: (abs(s - group_size), -s)))]
