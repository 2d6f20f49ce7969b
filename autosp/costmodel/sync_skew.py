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
    ``pieces`` x (a matmul, a 4 KiB all-to-all) against the matmuls alone and the all-to-all
    alone, for matmuls of about 1, 4 and 16 ms on a CPU core:
        skew(p) = max(0, median over matmul sizes of (t_loop - t_matmuls) / pieces - t_all_to_all)
    The cost model adds it to every attention transfer, hidden where compute runs beside it
    (:func:`autosp.costmodel.predict.transfer_times`).

    The loop's wall time is the step's cost. The seconds a rank spends blocked are not: where
    ranks share cores, a waiting rank lets the other on its core run. Costed from the
    least-waiting rank's blocked time instead (after 4-64 ms matmuls: 12.4 ms at 4 ranks), the
    held-out SP-4 step predictions (``bench/costmodel_heldout.py --rows``) had a mean error of
    11.6% instead of 9.7%.
    """
    import statistics

    rank = dist.get_rank()
    rows = (512, 2048, 8192) if device.type == "cpu" else (8192, 32768, 131072)
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

            def alone() -> None:
                for _ in range(pieces):
                    a @ b
                sync()

            def blocking() -> None:
                for _ in range(pieces):
                    a @ b
                    sync()
                    coll()

            t_alone = median_time(alone, repeats, barrier=start, sync=sync)
            t_loop = median_time(blocking, repeats, barrier=start, sync=sync)
            extra.append((t_loop - t_alone) / pieces - t_coll)
        seconds[str(p)] = max(0.0, statistics.median(extra))
        dist.barrier()
    return {"seconds": seconds,
            "how": f"{pieces} x (matmul of {'/'.join(map(str, rows))} x 288 x 288, 4 KiB all-to-all) against "
                   f"each alone, median over matmul sizes of {repeats} runs each"}
