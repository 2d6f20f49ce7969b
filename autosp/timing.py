"""Robust wall-clock timing of steps: a leaf that the profiler (costmodel) and the measurement
tools share, so that neither imports the other's layer."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable


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
