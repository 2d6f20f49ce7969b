"""The sync skew of a profile: what a collective costs when ranks arrive from their own compute.

``autosp profile`` times every collective after a barrier, every rank entering together; in a
training step they arrive at their own pace, and where ranks share devices (4 processes on 2
cores) each waits to be scheduled. :func:`measure_sync_skew` measures the difference, per group
size; :meth:`autosp.costmodel.profile.HardwareProfile.sync_skew` reads it and
:func:`autosp.costmodel.predict.transfer_times` charges it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from autosp.tools.launch import median_time


def measure_sync_skew(device: torch.device, sync: Callable[[], None], groups: list[tuple[int, Any]],
                      repeats: int = 15, pieces: int = 16) -> dict[str, Any]:
    """What a blocking collective costs right after compute beyond its time alone, per group size.

    The collective tables time collectives that every rank enters together (after a barrier).
    In a step the ranks arrive from their own compute, and where they share devices (4
    processes on 2 cores) the OS runs them in turns: the collective waits for the last one
    scheduled and then for each to be woken. Per group of ``p`` ranks (``groups``: (p, group)),
    ``pieces`` x (a matmul, a 4 KiB all-to-all), each rank timing its own waits in the
    all-to-alls, for matmuls of about 4, 16 and 64 ms on a CPU core (the compute a step runs
    between two collectives):
        skew(p) = median over matmul sizes of (min over ranks of the mean wait) - t_all_to_all
    The least-waiting rank is the slowest one: its waits lie on the step's critical path, while
    a faster rank's also hold its lead, which the step does not pay. The cost model adds the
    skew to every attention transfer, hidden where compute runs beside it
    (:func:`autosp.costmodel.predict.transfer_times`).
    """
    import statistics
    import time

    rank = dist.get_rank()
    rows = (2048, 8192, 32768) if device.type == "cpu" else (8192, 32768, 131072)
    seconds: dict[str, float] = {}
    for p, pg in sorted(groups, key=lambda g: g[0]):
        if pg is not None and rank >= p:           # not in this group: wait for its members
            dist.barrier()
            continue
        x = torch.zeros(1024 // p * p, device=device)
        y = torch.empty_like(x)
        coll = lambda: dist.all_to_all_single(y, x, group=pg)  # noqa: E731
        start = lambda: (sync(), dist.barrier(group=pg))  # noqa: E731
        t_coll = median_time(coll, max(repeats, 15), barrier=start, sync=sync)
        extra = []
        for m in rows:
            a, b = torch.randn(m, 288, device=device), torch.randn(288, 288, device=device)
            waits = []
            for _ in range(max(3, repeats // 5)):
                start()
                for _ in range(pieces):
                    a @ b
                    sync()
                    t0 = time.perf_counter()
                    coll()
                    waits.append(time.perf_counter() - t0)
            mine = torch.tensor([statistics.fmean(waits)], dtype=torch.float64, device=device)
            dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=pg)
            extra.append(mine.item() - t_coll)
        seconds[str(p)] = max(0.0, statistics.median(extra))
        dist.barrier()
    return {"seconds": seconds,
            "how": f"{pieces} x (matmul of {'/'.join(map(str, rows))} x 288 x 288, 4 KiB all-to-all), each rank "
                   "timing its waits; the least-waiting rank's mean wait less the all-to-all alone, "
                   f"median over matmul sizes, {max(3, repeats // 5)} runs each"}
