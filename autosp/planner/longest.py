"""The longest sequence a world fits, and what would fit where nothing does.

Both search the space :func:`autosp.planner.search.plan` searches, with the same feasibility (the
ILP's memory constraints under :func:`autosp.planner.search.build_candidates`' options), so that a
length found to fit is one ``plan`` plans, and one step longer is refused.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

from autosp.costmodel.offload import host_budget
from autosp.costmodel.profile import HardwareProfile, load_profile
from autosp.decisions import HOST_OPTIMIZERS, OFFLOADS
from autosp.errors import AutospError
from autosp.graph import OpGraph, capture
from autosp.planner.ilp import solve
from autosp.planner.plan import Plan
from autosp.planner.search import MEMORY_MARGIN, _budget, build_candidates, counts_fusion, plan


def _fits(g: OpGraph, prof: HardwareProfile, world: int, dpn: int, zero_stage: int, seq_len: int,
          limit: float, margin: float = MEMORY_MARGIN, offloads: tuple[bool, ...] = OFFLOADS,
          fused: bool = True, host_optimizers: tuple[bool, ...] = HOST_OPTIMIZERS) -> bool:
    """Whether some plan fits: the same space ``plan`` searches (a length found to fit is planned)."""
    cands, _ = build_candidates(g, prof, world, dpn, zero_stage, seq_len, offloads=offloads, fused=fused,
                                host_optimizers=host_optimizers)
    return bool(cands) and solve(cands, limit, host_limit=host_budget(prof, world, dpn, margin)) is not None


def _longest_fitting(fits: Callable[[int], bool], step: int, upper: int) -> int:
    """The largest multiple of ``step`` up to ``upper`` that fits (fitting is monotone in length), or 0."""
    lo, hi, best = 1, upper // step, 0
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(mid * step):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best * step


def _infeasible_hint(g: OpGraph, prof: HardwareProfile, world: int, dpn: int, zero_stage: int, seq_len: int,
                     limit: float, margin: float, offloads: tuple[bool, ...] = OFFLOADS, fused: bool = True,
                     host_optimizers: tuple[bool, ...] = HOST_OPTIMIZERS) -> str:
    """One line: what did not fit, and the nearest change that fits (offload or the optimizer on the
    host where they were left out, a higher ZeRO stage, more devices, a shorter sequence), each tried
    in the space the caller chose."""
    size = f"{limit / 2 ** 30:.1f} GiB" if limit >= 2 ** 30 else f"{limit / 2 ** 20:.0f} MiB"
    kept = f" ({margin:.0%} of it kept free for the memory model's error)" if margin else ""
    host = "" if True in offloads or not prof.host_memory_bytes else ", without offload"
    stepped = "" if True in host_optimizers or not prof.steps_on_host else ", the optimizer on the device"
    head = (f"no plan fits {g.model_name} at {seq_len} tokens on {world} devices within {size} each{kept}, "
            f"with any checkpointing and MLP / loss tiling{host}{stepped}")
    limit = _budget(limit, margin)

    def fits(z: int = zero_stage, w: int = world, s: int = seq_len, off: tuple[bool, ...] = offloads,
             opt: tuple[bool, ...] = host_optimizers) -> bool:
        return _fits(g, prof, w, dpn, z, s, limit, margin, off, fused, opt)

    if host and fits(off=OFFLOADS):
        return (f"{head}; offloading checkpoints to host memory fits (drop --no-offload; at the first call "
                f"autosp.Auto(offload=None))")
    if stepped and fits(opt=HOST_OPTIMIZERS):
        return (f"{head}; stepping the optimizer on the host fits (drop --no-host-optimizer; at the first call "
                f"autosp.Auto(host_optimizer=None))")
    for z in range(zero_stage + 1, 4):
        if fits(z=z):
            return f"{head} with ZeRO stage {zero_stage}; ZeRO stage {z} fits (--zero-stage {z})"
    for w in (2 ** i for i in range(0, 13)):
        if w > world and fits(z=max(zero_stage, 3 if zero_stage else 0), w=w):
            return f"{head}; the smallest power-of-two world that fits is {w} devices"
    longest = _longest_fitting(lambda s: fits(s=s), 2 * world, seq_len)
    if longest:
        return f"{head}; the longest sequence that fits is about {longest} tokens"
    return f"{head}, on up to 4096 devices or at any length; raise the memory limit or the ZeRO stage"


def max_seq_len(model: Any, *, world_size: int, batch_size: int = 1, devices_per_node: int | None = None,
                profile: str | HardwareProfile = "h100-sxm", memory_limit: float | None = None, zero_stage: int = 0,
                dtype: str = "bfloat16", graph: OpGraph | None = None, upper: int = 1 << 26,
                memory_margin: float = MEMORY_MARGIN, offloads: tuple[bool, ...] = OFFLOADS,
                compiler: str = "inductor",
                host_optimizers: tuple[bool, ...] = HOST_OPTIMIZERS) -> tuple[int, Plan]:
    """The longest sequence (a multiple of 2 x world size) with a plan that fits, and that plan
    (``compiler``: what will run the step, see :func:`plan`)."""
    fused = counts_fusion(compiler)
    prof = profile if isinstance(profile, HardwareProfile) else load_profile(profile)
    dpn = devices_per_node or prof.devices_per_node
    limit = memory_limit or prof.tensor_memory_bytes
    step = 2 * world_size
    g = graph if graph is not None else capture(model, seq_len=step * 64, batch_size=batch_size, dtype=dtype)
    with warnings.catch_warnings():             # probes far beyond any answer extrapolate tables
        warnings.simplefilter("ignore")         # sizes are symbolic: no re-capture per probe
        budget = _budget(limit, memory_margin)
        s = _longest_fitting(lambda s: _fits(g, prof, world_size, dpn, zero_stage, s, budget, memory_margin,
                                             offloads, fused, host_optimizers), step, upper)
    if not s:
        raise AutospError(_infeasible_hint(g, prof, world_size, dpn, zero_stage, step, limit, memory_margin, offloads,
                                           fused, host_optimizers))
    return s, plan(model, seq_len=s, batch_size=batch_size, world_size=world_size, devices_per_node=dpn,
                   profile=prof, memory_limit=memory_limit, zero_stage=zero_stage, dtype=dtype, graph=g,
                   memory_margin=memory_margin, offloads=offloads, compiler=compiler, host_optimizers=host_optimizers)
