"""Run a function on N local gloo processes (demo, benchmarks); the step timers live in
:mod:`autosp.timing` (re-exported here).

A measurement tool: never imported by the training runtime."""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from typing import Any, Callable

from autosp.timing import interleaved_times, median_time  # noqa: F401 - re-exported for the benches


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable, kwargs: dict, threads: int | None, out: Any,
           backend: str = "gloo") -> None:
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TRANSFORMERS_VERBOSITY="error")
    torch.set_num_threads(threads or max(1, (os.cpu_count() or 2) // world))
    if backend == "nccl":               # one device per rank
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        try:
            res = fn(**kwargs)
        except Exception as e:  # noqa: BLE001 - handed to the caller, who re-raises it
            from autosp.errors import AutospError

            res = e if isinstance(e, AutospError) else RuntimeError(f"rank {rank}: {type(e).__name__}: {e}")
            out.put(res)                # every rank's error: the root cause may be another rank's
        else:
            if rank == 0:
                out.put(res)
    finally:
        dist.destroy_process_group()


def _root_cause(first: BaseException, out: Any, wait: float = 5.0) -> BaseException:
    """Of the ranks' errors, the one that is not a peer's lost connection: a rank that raises
    closes its sockets and the others then fail in their collectives, often first."""
    import queue

    errors = [first]
    deadline = time.monotonic() + wait
    while "Connection closed by peer" in str(errors[-1]) and time.monotonic() < deadline:
        try:
            errors.append(out.get(timeout=max(0.0, deadline - time.monotonic())))
        except queue.Empty:
            break
    return next((e for e in errors if isinstance(e, BaseException) and "Connection closed by peer" not in str(e)),
                first)


def spawn_gloo(fn: Callable, world: int, threads: int | None = None, timeout: float = 3600, backend: str = "gloo",
               **kwargs: Any) -> Any:
    """Run ``fn(**kwargs)`` on ``world`` spawned gloo ranks (``backend``: another, e.g. NCCL on a machine
    with a GPU per rank); returns rank 0's result (or raises its error).

    ``fn`` must be importable by name (a module-level function). ``threads`` per rank
    defaults to an even share of the cores.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, kwargs, threads, out, backend))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        res = out.get(timeout=timeout)
        if isinstance(res, BaseException):      # a rank failed: its error, not a timeout
            raise _root_cause(res, out)
        return res
    finally:
        for p in procs:
            p.join(timeout=120)
            if p.is_alive():
                p.kill()
