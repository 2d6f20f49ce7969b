"""A pool of gloo worker processes, started once per test module, running many cases.

Each case is a function in :mod:`dist_cases` called on every rank; what rank 0
returns comes back to the test (exceptions come back as text). Every wait is
bounded: a hang fails the test within ``timeout`` seconds and the pool is torn
down, instead of stalling CI.
"""

from __future__ import annotations

import gc
import os
import queue
import traceback
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

from autosp.options import COMPILERS
from autosp.tools.launch import free_port


def _worker(rank: int, world: int, port: int, inbox: Any, outbox: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      TRANSFORMERS_VERBOSITY="error")
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    import dist_cases

    # Compiling allocates millions of short-lived objects: with the imported modules' objects
    # frozen out of the collector's scans and collections rarer, a 2-layer Llama compiles through
    # AOTAutograd about 7% faster (3.35 s -> 3.13 s on this 2-core machine).
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)

    while True:
        msg = inbox.get()
        if msg is None:
            break
        name, kwargs = msg
        torch._dynamo.reset()        # each case compiles fresh models: no recompile-limit carry-over
        try:
            result = ("ok", getattr(dist_cases, name)(**kwargs))
        except Exception as e:  # noqa: BLE001 - sent back to the test as text
            result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        outbox.put((rank, result))
    dist.destroy_process_group()
    # Skip the interpreter's teardown (seconds once many models were compiled); the results are sent.
    outbox.close()
    outbox.join_thread()
    os._exit(0)


# test id -> the compilers that ran its cases, read from what the cases return (a report's
# "compiler"): the suite's summary counts the multi-process tests by compiler (tests/conftest.py)
COMPILED: dict[str, set[str]] = {}


def _compilers_in(value: Any, depth: int = 0) -> set[str]:
    if depth > 4:
        return set()
    if isinstance(value, dict):
        found = {value["compiler"]} if value.get("compiler") in COMPILERS else set()
        return found.union(*(_compilers_in(v, depth + 1) for v in value.values()))
    if isinstance(value, (list, tuple)):
        return set().union(*(_compilers_in(v, depth + 1) for v in value[:16]))
    return set()


class Pool:
    def __init__(self, world: int):
        """``world`` gloo processes, compiling with $AUTOSP_COMPILER (tests/conftest.py) where a case names none."""
        ctx = mp.get_context("spawn")
        self.world = world
        port = free_port()
        self.inboxes = [ctx.Queue() for _ in range(world)]
        self.outbox = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, args=(r, world, port, self.inboxes[r], self.outbox), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def run(self, case: str, timeout: float = 240, **kwargs: Any) -> list[tuple[str, Any]]:
        """Run ``case`` on all ranks; returns ``[(status, value)]`` by rank."""
        for q in self.inboxes:
            q.put((case, kwargs))
        results: dict[int, Any] = {}
        try:
            while len(results) < self.world:
                rank, res = self.outbox.get(timeout=timeout)
                results[rank] = res
        except queue.Empty:
            self.close(force=True)
            raise TimeoutError(f"case {case} did not finish within {timeout}s on ranks "
                               f"{sorted(set(range(self.world)) - set(results))}") from None
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
        if test and results[0][0] == "ok":
            COMPILED.setdefault(test, set()).update(_compilers_in(results[0][1]))
        return [results[r] for r in range(self.world)]

    def close(self, force: bool = False) -> None:
        if not force:
            for q in self.inboxes:
                q.put(None)
            for p in self.procs:
                p.join(timeout=20)
        for p in self.procs:
            if p.is_alive():
                p.kill()
