"""``autosp profile``: measure a hardware profile on the machines it runs on.

    torchrun --nproc-per-node 2 -m autosp.cli profile --out my.json [--quick]

Compute (matmul, attention forward/backward, a memory-bound op, the per-op floor) is timed
on the node's devices at once, one rank per device (on CPU: one core, one thread, the first
``cores`` ranks), as SP ranks compute side by side; rank 0's times are kept. Ranks beyond
the devices (4 processes on a 2-core machine) wait meanwhile: what they share is costed by
the cost model's sharing factor. Every rank takes part in the collectives over the whole
group and, when the world has 4+ ranks, over its first 2, and rank 0 and its device peers in
the concurrency measurement: how much an all-to-all and a matmul slow each other down when
they run at once (what an overlapped schedule gets; see :func:`measure_concurrency`), and in
the sync-skew measurement: what a blocking collective costs after compute beyond its time
alone (:func:`measure_sync_skew`). Each
point: warm-up, repeats, median; tables are made monotone when loaded. A time budget bounds
the whole run (``--quick``: about 1 minute on a 2-core CPU); every rank stops at the same
point. ``--only SECTION ...`` measures some sections (compute, collectives, concurrency,
sync_skew) and, where ``--out`` exists, replaces only those in it.

The CPU grid is generic: square and rectangular matmuls at dimensions 112, 288 and 1152 over
128-8192 rows, attention at 2 and 8 heads and head dims 24 and 96 (the cost model
interpolates in head dim between them). No shape is a test or bench model's, so that the
cost model's validation (``bench/costmodel_heldout.py``) runs out of sample.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autosp.costmodel.profile import SCHEMA
from autosp.costmodel.sync_skew import measure_sync_skew
from autosp.errors import AutospError
from autosp.timing import median_time


ALONE = object()          # _timeit's group when no other rank takes the same decisions


def _any_rank(flag: bool, group: Any) -> bool:
    """``flag`` on any rank of ``group`` (None: the world): a decision every rank takes alike,
    else they would part ways at the next barrier."""
    t = torch.tensor([1.0 if flag else 0.0], device="cuda" if torch.cuda.is_available() else "cpu")  # nccl
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item() > 0


def _timeit(fn: Callable[[], Any], repeats: int, sync: Callable[[], None],
            start: Callable[[], None] | None = None, group: Any = ALONE) -> float:
    """Median of ``fn`` closed by ``sync``; each call begins after ``start`` (default ``sync``),
    which is not timed: the devices' ranks start a compute point together, and a barrier's
    latency is no part of a kernel's time. A point whose warm-up call takes over half a second
    gets at most 3 repeats; the ranks of ``group`` (a process group, None: the world) agree on
    that count."""
    begin = start or sync
    begin()
    t0 = time.perf_counter()
    fn()
    sync()
    long = time.perf_counter() - t0 > 0.5
    if group is not ALONE:
        long = _any_rank(long, group)
    return median_time(fn, min(repeats, 3) if long else repeats, barrier=begin, sync=sync)


GENERIC_DIMS = (112, 288, 1152)          # matmul n and k on CPU: no test or bench model has them
FLUSH_BYTES = 64 * 2**20                 # written between memory-bound samples: more than a CPU's caches


def _grids(quick: bool, cuda: bool) -> dict[str, list]:
    if cuda:
        mm = [(m, 4096, 4096) for m in (256, 1024, 4096, 16384)] + [(4096, 14336, 4096), (8192, 8192, 8192)]
        attn = [(1, 32, s, 128) for s in (1024, 2048, 4096, 8192, 16384)]
        mem = [2 ** p for p in range(16, 31, 2)]
        coll = [2 ** p for p in range(12, 31, 3)]
        return {"matmul": mm, "attention": attn, "memory": mem, "collective": coll}
    rows = (128, 1024) if quick else (128, 1024, 8192)
    dims = [(d, d) for d in GENERIC_DIMS] + ([] if quick else [(112, 1152), (1152, 112), (288, 1152), (1152, 288)])
    mm = [(m, n, k) for m in rows for n, k in dims]
    # heads and head dims bracket a model's local ones; kernels are affine in the head dim
    lens = (256, 1024) if quick else (512, 2048, 8192)
    attn = [(1, h, s, d) for h in (2, 8) for d in (24, 96) for s in lens]
    mem = [2 ** p for p in range(12, 27 if quick else 29, 2)]
    coll = [2 ** p for p in range(10, 26, 3)] + ([] if quick else [2 ** 27])
    return {"matmul": mm, "attention": attn, "memory": mem, "collective": coll}


SECTIONS = ("compute", "collectives", "concurrency", "sync_skew")


def measure(out: str, quick: bool = False, budget_s: float | None = None,
            only: tuple[str, ...] | None = None) -> dict:
    from rich.progress import Progress

    unknown = set(only or ()) - set(SECTIONS)
    if unknown:
        raise AutospError(f"unknown profile section(s) {', '.join(sorted(unknown))}; use {', '.join(SECTIONS)}")
    if only and not os.path.exists(out):      # a profile of some sections alone would not load
        raise AutospError(f"--only re-measures sections into an existing profile, and {out} does not exist; "
                          f"measure a whole profile there first (drop --only)")
    sections = set(only or SECTIONS)
    cuda = torch.cuda.is_available()
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(1)             # one CPU device = one core
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dtypes = ["bfloat16", "float32"] if cuda else ["float32"]
    grids = _grids(quick, cuda)
    repeats = 3 if quick else 7
    budget = budget_s or (90.0 if quick else 600.0)
    start = time.perf_counter()
    over = lambda: time.perf_counter() - start > budget  # noqa: E731

    compute: dict[str, Any] = {"matmul": {}, "attention": {}, "attention_backward": {}, "memory_bound": []}
    collectives: dict[str, Any] = {}
    n_tasks = ((len(grids["matmul"]) + 2 * len(grids["attention"])) * len(dtypes) + len(grids["memory"])) * \
        ("compute" in sections) + 5 * len(grids["collective"]) * (2 if world >= 4 else 1) * ("collectives" in sections)
    # The devices compute at once: one rank per CUDA device, on CPU one per core.
    n_dev = world if cuda else min(world, _cores())
    cgroup = dist.new_group(list(range(n_dev))) if distributed and n_dev < world else None
    computes = rank < n_dev
    peers = cgroup if distributed and n_dev > 1 else ALONE       # the ranks that time compute together

    def together() -> None:
        sync()
        if distributed and n_dev > 1:
            dist.barrier(group=cgroup)

    def agreed_over(group: Any = None, on: bool = True) -> bool:
        """The budget, agreed by every rank of ``group``."""
        return _any_rank(over(), group) if distributed and on else over()

    with Progress(disable=rank != 0, transient=False) as bar:
        task = bar.add_task("profiling", total=n_tasks)
        overhead = None
        if computes and "compute" in sections:
            cover = lambda: agreed_over(cgroup, n_dev > 1)  # noqa: E731
            for dt in dtypes:
                dtype = getattr(torch, dt)
                rows = []
                for m, n, k in grids["matmul"]:
                    if cover():
                        break
                    a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
                    rows.append(dict(m=m, n=n, k=k, seconds=_timeit(lambda: a @ b, repeats, sync, together, peers)))
                    bar.advance(task)
                compute["matmul"][dt] = rows
                fwd, bwd = [], []
                for b_, h, s, d in grids["attention"]:
                    if cover():
                        break
                    q, k_, v = (torch.randn(b_, h, s, d, device=device, dtype=dtype, requires_grad=True)
                                for _ in range(3))
                    o = F.scaled_dot_product_attention(q, k_, v, is_causal=True)
                    g = torch.randn_like(o)
                    fwd.append(dict(batch=b_, heads=h, q_len=s, kv_len=s, head_dim=d, causal=True,
                                    seconds=_timeit(lambda: F.scaled_dot_product_attention(q, k_, v, is_causal=True),
                                                    repeats, sync, together, peers)))
                    bar.advance(task)

                    def fb() -> None:
                        out_ = F.scaled_dot_product_attention(q, k_, v, is_causal=True)
                        torch.autograd.grad(out_, (q, k_, v), g)

                    t_fb = _timeit(fb, repeats, sync, together, peers)
                    bwd.append(dict(batch=b_, heads=h, q_len=s, kv_len=s, head_dim=d, causal=True, backward=True,
                                    seconds=max(t_fb - fwd[-1]["seconds"], 1e-9)))
                    bar.advance(task)
                compute["attention"][dt] = fwd
                compute["attention_backward"][dt] = bwd
            # A step's pointwise ops read tensors made long before, not the cache-warm operands
            # of a loop: caches are flushed before each call (on CPU; a GPU's L2 is small).
            scratch = None if cuda else torch.empty(FLUSH_BYTES // 4)

            def cold() -> None:
                if scratch is not None:
                    scratch.fill_(1.0)
                together()

            for nbytes in grids["memory"]:
                if cover():
                    break
                n = nbytes // 12                     # c = a + b in fp32 moves 3 x 4 bytes per element
                a, b = torch.randn(n, device=device), torch.randn(n, device=device)
                t = _timeit(lambda: a + b, repeats, sync, cold, peers)
                compute["memory_bound"].append(dict(bytes=12 * n, seconds=t))
                bar.advance(task)
            tiny = torch.ones(1, device=device)
            overhead = _timeit(lambda: tiny + tiny, 50, sync)
        groups = [(world, None)]
        if distributed and world >= 4:
            groups.append((2, dist.new_group([0, 1])))
        elif distributed and world == 3:
            dist.new_group([0, 1])
        if distributed and "collectives" in sections:
            for p, pg in groups:
                member = pg is None or rank < p
                for name in ("all_to_all", "all_gather", "reduce_scatter", "all_reduce", "send_recv"):
                    rows = []
                    for nbytes in grids["collective"]:
                        if agreed_over():
                            break
                        if member:       # small ones are latency, noisy where ranks share cores: more samples
                            reps = max(repeats, 15) if nbytes <= 2 ** 20 else repeats
                            secs = _time_collective(name, nbytes, p, pg, device, reps, sync)
                            rows.append(dict(bytes=nbytes, seconds=secs))
                        if rank == 0:
                            bar.advance(task)
                    dist.barrier()
                    if rank == 0 and rows:
                        collectives.setdefault(name, {"intra": {}, "inter": {}})["intra"][str(p)] = rows
    # beside the devices' compute, as SP ranks overlap (extra ranks sharing them would skew it)
    concurrency = measure_concurrency(device, sync, cgroup) \
        if distributed and n_dev > 1 and computes and "concurrency" in sections else None
    if concurrency and n_dev < world:
        concurrency["how"] += f"; on ranks 0-{n_dev - 1} of {world} (one per device)"
    skew = measure_sync_skew(device, sync, groups, 5 if quick else 15, 8 if quick else 16, 8192 if quick else None) \
        if distributed and "sync_skew" in sections else None
    if rank != 0:
        return {}
    doc = {
        "schema": SCHEMA,
        "name": out.rsplit("/", 1)[-1].removesuffix(".json"),
        "source": {"kind": "measured", "where": f"{platform.node()} ({_device_name(cuda)}), {world} rank(s)",
                   "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "how": f"autosp profile{' --quick' if quick else ''}: median of {repeats} after warm-up",
                   "torch": torch.__version__},
        "memory_bytes": torch.cuda.get_device_properties(device).total_memory if cuda else _cpu_memory_per_core(),
        # held outside the allocator by now: the CUDA context and the communicators the collectives made
        **({"runtime_reserved_bytes": outside_allocator_bytes(device)} if cuda else {}),
        "devices_per_node": torch.cuda.device_count() if cuda else _cores(),
        "op_overhead_s": overhead,
        **({} if cuda else {"threads_per_device": 1}),     # see HardwareProfile.attention_call_time
        "compute": compute,
        "collectives": collectives,
    }
    if concurrency:
        doc["concurrency"] = concurrency
    if skew:
        doc["sync_skew"] = skew
    if only:
        doc = _merged(out, doc, sections)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    return doc


def outside_allocator_bytes(device: torch.device) -> float:
    """Device memory this process holds outside PyTorch's allocator (see HardwareProfile.runtime_reserved_bytes)."""
    free, total = torch.cuda.mem_get_info(device)
    return float(total - free - torch.cuda.memory_reserved(device))


def _merged(out: str, doc: dict, sections: set[str]) -> dict:
    """``doc``'s ``sections`` written into the existing profile at ``out``, the rest
    kept as measured before; its source says what was re-measured and when."""
    with open(out) as f:
        old = json.load(f)
    keys = {"compute": ("compute", "op_overhead_s", "threads_per_device"), "collectives": ("collectives",),
            "concurrency": ("concurrency",), "sync_skew": ("sync_skew",)}
    for section in sorted(sections):
        for key in keys[section]:
            if key in doc:
                old[key] = doc[key]
    src = old.setdefault("source", {})
    src["updated"] = src.get("updated", []) + [f"{', '.join(sorted(sections))}: {doc['source']['when']}, "
                                               f"{doc['source']['where']}"]
    return old


def _time_collective(name: str, nbytes: int, p: int, pg: Any, device: torch.device, repeats: int,
                     sync: Callable[[], None]) -> float:
    n = max(p, nbytes // 4 // p * p)
    x = torch.randn(n, device=device)
    if name == "all_to_all":
        y = torch.empty_like(x)
        fn = lambda: dist.all_to_all_single(y, x, group=pg)  # noqa: E731
    elif name == "all_gather":
        parts = [torch.empty_like(x) for _ in range(p)]
        fn = lambda: dist.all_gather(parts, x, group=pg)  # noqa: E731
    elif name == "reduce_scatter":
        if device.type == "cuda":
            out = torch.empty(n // p, device=device)
            fn = lambda: dist.reduce_scatter_tensor(out, x, group=pg)  # noqa: E731
        else:                                      # gloo: what autosp runs there (all-reduce)
            fn = lambda: dist.all_reduce(x, group=pg)  # noqa: E731
    elif name == "all_reduce":
        fn = lambda: dist.all_reduce(x, group=pg)  # noqa: E731
    else:
        r = dist.get_rank(pg) if pg is not None else dist.get_rank()
        peer = lambda i: dist.get_global_rank(pg, i) if pg is not None else i  # noqa: E731
        recv = torch.empty_like(x)

        def fn() -> None:
            ops = [dist.P2POp(dist.isend, x, peer((r + 1) % p), pg), dist.P2POp(dist.irecv, recv, peer((r - 1) % p), pg)]
            for req in dist.batch_isend_irecv(ops):
                req.wait()

    return _timeit(lambda: (fn(), dist.barrier(group=pg)), repeats, sync, group=pg)


def measure_concurrency(device: torch.device, sync: Callable[[], None], group: Any = None, repeats: int = 5,
                        pieces: int = 16) -> dict[str, Any]:
    """Slowdowns of a collective and of compute running at once, on every rank of ``group``
    (default: the world).

    Alone: a matmul loop (``pieces`` equal matmuls) and an all-to-all sized to take about as
    long. Together: the all-to-all issued asynchronously, then the loop, checking after each
    piece whether the transfer has finished (its finish time known to one piece). Returns
    ``comm_slowdown`` (its time beside compute over alone) and ``compute_slowdown``, medians.
    """
    import statistics

    n = 384 if device.type == "cpu" else 4096
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)

    def compute() -> None:
        for _ in range(pieces):
            a @ b
        sync()

    t_compute = _timeit(compute, repeats, sync)
    # an all-to-all about as long as the loop: scale a 4 MiB one's time
    x = torch.randn(1 << 20, device=device)
    y = torch.empty_like(x)
    t_small = _timeit(lambda: (dist.all_to_all_single(y, x, group=group), dist.barrier(group=group)), repeats, sync,
                     group=group)
    numel = int(min(1 << 26, max(1 << 16, (1 << 20) * t_compute / max(t_small, 1e-9)))) // 64 * 64
    agreed = torch.tensor([numel], dtype=torch.int64, device=device)
    dist.broadcast(agreed, src=0, group=group)                  # every rank sends the same size
    numel = int(agreed.item())
    x = torch.randn(numel, device=device)
    y = torch.empty_like(x)
    t_comm = _timeit(lambda: (dist.all_to_all_single(y, x, group=group), dist.barrier(group=group)), repeats, sync,
                     group=group)
    comm_ratio, compute_ratio = [], []
    for _ in range(repeats):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        work = dist.all_to_all_single(y, x, group=group, async_op=True)
        done = None
        for _ in range(pieces):
            a @ b
            sync()
            if done is None and work.is_completed():
                done = time.perf_counter() - t0
        t_loop = time.perf_counter() - t0
        work.wait()
        done = done if done is not None else time.perf_counter() - t0
        dist.barrier(group=group)
        comm_ratio.append(done / t_comm)
        compute_ratio.append(t_loop / t_compute)
    return {"comm_slowdown": max(1.0, statistics.median(comm_ratio)),
            "compute_slowdown": max(1.0, statistics.median(compute_ratio)),
            "how": f"{pieces} x {n}^3 matmul ({t_compute * 1e3:.1f} ms alone) beside an all-to-all of "
                   f"{numel * 4 >> 20} MiB ({t_comm * 1e3:.1f} ms alone), median of {repeats}"}


def _device_name(cuda: bool) -> str:
    return torch.cuda.get_device_name() if cuda else (platform.processor() or platform.machine())


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _cpu_memory_per_core() -> float:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total / _cores()
