"""Run a function on N local gloo processes (demo, benchmarks), and time steps robustly.

A measurement tool: never imported by the training runtime."""

from __future__ import annotations

import os
import socket
import statistics
import time
from datetime import timedelta
from typing import Any, Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable, kwargs: dict, threads: int | None, out: Any) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TRANSFORMERS_VERBOSITY="error")
    torch.set_num_threads(threads or max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        try:
            res = fn(**kwargs)
        except Exception as e:  # noqa: BLE001 - handed to the caller, who re-raises it
            from autosp.errors import AutospError

            res = e if isinstance(e, AutospError) else RuntimeError(f"rank {rank}: {type(e).__name__}: {e}")
        if rank == 0:
            out.put(res)
    finally:
        dist.destroy_process_group()


def spawn_gloo(fn: Callable, world: int, threads: int | None = None, timeout: float = 3600, **kwargs: Any) -> Any:
    """Run ``fn(**kwargs)`` on ``world`` spawned gloo ranks; returns rank 0's result (or raises its error).

    ``fn`` must be importable by name (a module-level function). ``threads`` per rank
    defaults to an even share of the cores.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, kwargs, threads, out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        res = out.get(timeout=timeout)
        if isinstance(res, BaseException):      # rank 0 failed: its error, not a timeout
            raise res
        return res
    finally:
        for p in procs:
            p.join(timeout=120)
            if p.is_alive():
                p.kill()


def interleaved_times(names: list[str], step: Callable[[str], Any], repeats: int,
                      barrier: Callable[[], Any] | None = None, warmup: int = 2) -> dict[str, list[float]]:
    """Wall times of ``step(name)`` for every name: ``warmup`` untimed calls of each (compiling,
    warming the allocator), then ``repeats`` rounds of one timed call of each, so that drift on a
    shared machine falls on every configuration alike. Each call starts after ``barrier``."""
    def call(name: str) -> float:
        if barrier:
            barrier()
        t0 = time.perf_counter()
        step(name)
        return time.perf_counter() - t0

    for name in names:
        for _ in range(warmup):
            call(name)
    times: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(repeats):
        for name in names:
            times[name].append(call(name))
    return times


def median_time(step: Callable[[], Any], repeats: int, barrier: Callable[[], Any] | None = None,
                sync: Callable[[], Any] | None = None, warmup: bool = False) -> float:
    """Median wall time of ``repeats`` calls of ``step``, each after ``barrier`` (ranks start
    together) and closed by ``sync`` (e.g. a device synchronise). ``warmup``: one untimed call
    first; when it takes over half a second, at most 3 repeats keep long points bounded."""
    def timed() -> float:
        if barrier:
            barrier()
        t0 = time.perf_counter()
        step()
        if sync:
            sync()
        return time.perf_counter() - t0

    if warmup and timed() > 0.5:
        repeats = min(repeats, 3)
    return statistics.median(timed() for _ in range(repeats))
