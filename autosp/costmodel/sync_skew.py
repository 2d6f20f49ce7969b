"""The sync skew of a profile: what a collective costs when ranks arrive from their own compute.

``autosp profile`` times every collective after a barrier, every rank entering together; in a
training step they arrive at their own pace, and where ranks share devices (4 processes on 2
cores) each waits to be scheduled. :func:`measure_sync_skew` measures the difference, per group
size; :meth:`autosp.costmodel.profile.HardwareProfile.sync_skew` reads it and
:func:`autosp.costmodel.overlap.transfer_times` charges it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from autosp.timing import median_time


def measure_sync_skew(device: torch.device, sync: Callable[[], None], groups: list[tuple[int, Any]],
                      repeats: int = 15, pieces: int = 16, long_rows: int | None = None) -> dict[str, Any]:
    """What a blocking collective costs right after compute beyond its time alone, per group size.

    The collective tables time collectives that every rank enters together (after a barrier).
    In a step the ranks arrive from their own compute, and where they share devices (4
    processes on 2 cores) the OS runs them in turns: the collective waits for the last one
    scheduled and then for each to be woken. Per group of ``p`` ranks (``groups``: (p, group)),
    ``pieces`` x (a matmul, a 4 KiB all-to-all) against the matmuls alone and the all-to-all
    alone, for matmuls of about 1, 4 and 16 ms on a CPU core:
        skew(p) = max(0, median over matmul sizes of (t_loop - t_matmuls) / pieces - t_all_to_all)
    The cost model adds it to every attention transfer, hidden where compute runs beside it
    (:func:`autosp.costmodel.overlap.transfer_times`).

    Its two parts, from every call's issue and return times on every rank (one host's monotonic
    clock; left out where a group spans hosts): the peers' lag (a rank waiting for the last to
    issue) and the transfer after the last rank issued. Where ranks share devices the transfer
    itself is slower than alone: a rank that has its data computes again and holds a core a
    peer still receiving waits for, up to the scheduler's time slice. So the transfer part grows
    with the compute between collectives and levels off (4 ranks on 2 cores, 4 KiB all-to-alls
    after matmuls of 288 x 288 by 0 / 512 / 2048 / 8192 / 32768 rows: 0.6 / 0.9 / 2.4 / 3.4 / 4.0
    ms, medians of three measurements, the last 3.8-4.2 ms; the median over 512-8192 rows, less
    the collective alone, came out -0.7 to 2.0 ms in four measurements); an attention step
    computes far longer between its collectives than the first points, so the part is measured
    where it has levelled off, after ``long_rows`` x 288 x 288 matmuls:
        transfer(p) = max(0, T_loop(long_rows) - T_alone),
    T = median over calls of the mean over ranks of (return - the last rank's issue). It is what
    a timeline that splits waits this way counts as transfer (``bench/overlap.py``). It is
    measured apart from skew(p), not bounded by it: skew(p) subtracts a collective alone that
    ranks sharing cores also wait to be scheduled for (at 4 ranks on 2 cores it came out 0.0-3.9
    ms in four measurements).

    The loop's wall time is the step's cost. The seconds a rank spends blocked are not: where
    ranks share cores, a waiting rank lets the other on its core run. Costed from the
    least-waiting rank's blocked time instead (after 4-64 ms matmuls: 12.4 ms at 4 ranks), the
    held-out SP-4 step predictions (``bench/costmodel_heldout.py --rows``) had a mean error of
    11.6% instead of 9.7%.
    """

    rank = dist.get_rank()
    rows = (512, 2048, 8192) if device.type == "cpu" else (8192, 32768, 131072)
    long_rows = long_rows or (32768 if device.type == "cpu" else 524288)
    seconds: dict[str, float] = {}
    transfer: dict[str, float] = {}
    for p, pg in sorted(groups, key=lambda g: g[0]):
        if pg is not None and rank >= p:           # not in this group: wait for its members
            dist.barrier()
            continue
        x = torch.zeros(1024 // p * p, device=device)
        y = torch.empty_like(x)
        stamps: list[tuple[float, float]] = []

        def coll() -> None:
            t0 = time.perf_counter()
            dist.all_to_all_single(y, x, group=pg)
            stamps.append((t0, time.perf_counter()))

        start = lambda: (sync(), dist.barrier(group=pg))  # noqa: E731
        t_coll = median_time(coll, max(repeats, 15), barrier=start, sync=sync)
        transfer_alone = _transfer(stamps, pg)

        def blocking(a: torch.Tensor, b: torch.Tensor) -> None:
            for _ in range(pieces):
                a @ b
                sync()
                coll()

        extra = []
        for m in rows:
            a, b = torch.randn(m, 288, device=device), torch.randn(288, 288, device=device)

            def alone() -> None:
                for _ in range(pieces):
                    a @ b
                sync()

            t_alone = median_time(alone, repeats, barrier=start, sync=sync)
            t_loop = median_time(lambda: blocking(a, b), repeats, barrier=start, sync=sync)
            extra.append((t_loop - t_alone) / pieces - t_coll)
        seconds[str(p)] = max(0.0, statistics.median(extra))
        if transfer_alone is not None:      # one host: the transfer part, after long compute
            a, b = torch.randn(long_rows, 288, device=device), torch.randn(288, 288, device=device)
            stamps.clear()
            for _ in range(max(3, repeats // 3)):
                start()
                blocking(a, b)
            transfer[str(p)] = max(0.0, _transfer(stamps, pg) - transfer_alone)
        dist.barrier()
    return {"seconds": seconds, "transfer_seconds": transfer,
            "how": f"{pieces} x (matmul of {'/'.join(map(str, rows))} x 288 x 288, 4 KiB all-to-all) against "
                   f"each alone, median over matmul sizes of {repeats} runs each; transfer_seconds: the part "
                   f"after the last rank issued, after {long_rows}-row matmuls, over one alone"}


def _transfer(stamps: list[tuple[float, float]], group: Any) -> float | None:
    """Median over calls of the mean over the group's ranks of (return - the last rank's issue):
    ``stamps`` holds this rank's (issue, return) per call, every rank the same calls. None where
    the group spans hosts (their clocks do not compare)."""
    import platform

    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, (platform.node(), stamps), group=group)
    if len({host for host, _ in every}) > 1:
        return None
    calls = [s for _, s in every]
    per_call = []
    for i in range(min(len(s) for s in calls)):
        last = max(s[i][0] for s in calls)
        per_call.append(sum(max(0.0, s[i][1] - last) for s in calls) / len(calls))
    return statistics.median(per_call)
