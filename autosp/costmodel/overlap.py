"""How much of an attention op's transfers its compute hides: the overlap formulas.

A strategy declares its transfers (:class:`autosp.strategies.base.Transfer`) and how each
overlaps; :func:`transfer_times` prices them against the profile (t = the collective table's
time). K is the phase's attention kernel time, s_comm >= 1 the profile's measured slowdown of a
collective while the device computes, s_compute that of the compute beside it, skew the
profile's sync skew.

Blocking, or declared to overlap n steps (beside 1/n of the phase's kernels):
    exposed = count * max(0, t - K / n)            (n = 0: count * t)
each t including the sync skew: the ranks reach it from their own compute, not together as the
tables time it.

Beside a share f of the phase's kernels (all-gather-KV's gather and reduce-scatter beside the
own block; a = their summed time):
    exposed = max(0, s_comm * a - f * K) + (s_compute - 1) * min(f * K, s_comm * a)

Pipelined in k head groups (chunked Ulysses), a = one group's transfers (its inputs in and its
output back):
    exposed = a + 2 * skew + (k - 1) * max(0, s_comm * a - K / k)
              + (s_compute - 1) * min((k - 1) / k * K, (k - 1) * s_comm * a)
the first group's inputs and the last group's output wait in full, each wait once for the ranks
to meet; every other group's moves beside one group's kernel, and so does the ranks' lag (issued
before a kernel, waited for after it: the timeline of ``bench/overlap.py`` shows the lag shrink
with the transfer, 0.19 -> 0.06 s a step on 4 ranks at k = 2); the kernels beside transfers slow
by s_compute.

Where the first group's inputs are issued where the graph makes them (``lead``), input i issued
w_i seconds of the layer's forward compute before the attention
(:func:`autosp.costmodel.predict.made_before`) and moving t_i, one after another on the link,
the attention waits for them
    wait = max(0, max_i (sum over j issued no earlier than i of t_j) - w_i)
in place of their sum in a; the part hidden (sum t_i - wait) slows that compute by s_compute.

The backward runs the same pipeline in reverse (a = one group's output gradient in and its dQ,
dK, dV back): the last group's output gradient and the first group's dQ, dK, dV wait in full.
"""

from __future__ import annotations

from autosp.costmodel.profile import HardwareProfile
from autosp.strategies import AttentionCost


def transfer_times(profile: HardwareProfile, cost: AttentionCost, t_fwd: float, t_bwd: float,
                   made_before: dict[str, float] | None = None) -> tuple[float, float]:
    """(communication, exposed communication) of one attention op's transfers (the module
    docstring's formulas). ``made_before``: per input ("q", "k", "v") the forward compute seconds
    between where the graph makes it and the attention
    (:func:`autosp.costmodel.predict.made_before`)."""
    comm = exposed = 0.0
    group: dict[tuple[str, int], float] = {}           # (phase, k) -> one pipelined group's transfer time
    meet: dict[tuple[str, int], float] = {}            # (phase, k) -> the sync skew of one of its waits
    side: dict[tuple[str, float], float] = {}          # (phase, f) -> transfers beside that share of kernels
    leads: dict[tuple[str, int], list[tuple[float, float]]] = {}   # (phase, k) -> (window, transfer) per input
    for tr in cost.transfers:
        table = profile.collective_time(tr.collective, tr.group, tr.nbytes, tr.inter)
        kernel = t_fwd if tr.phase == "fwd" else t_bwd
        if tr.pipeline:
            comm += tr.pipeline * tr.count * table
            group[(tr.phase, tr.pipeline)] = group.get((tr.phase, tr.pipeline), 0.0) + tr.count * table
            meet[(tr.phase, tr.pipeline)] = profile.sync_skew(tr.group)
            if tr.lead:
                window = (made_before or {}).get(tr.lead, 0.0)
                leads.setdefault((tr.phase, tr.pipeline), []).extend([(window, table)] * tr.count)
            continue
        # the ranks meet at every collective from their own compute, not together as the tables
        # time it: the profile's sync skew, hidden like the rest where compute runs beside it
        t = table + profile.sync_skew(tr.group)
        if tr.beside:
            comm += tr.count * t
            side[(tr.phase, tr.beside)] = side.get((tr.phase, tr.beside), 0.0) + tr.count * t
            continue
        comm += tr.count * t
        exposed += tr.count * (max(0.0, t - kernel / tr.overlap_steps) if tr.overlap_steps else t)
    s_comm, s_compute = profile.concurrency()
    for (phase, k), a in group.items():
        kernel = t_fwd if phase == "fwd" else t_bwd
        comm += 2 * meet[(phase, k)]
        lead = leads.get((phase, k), [])
        waited, early = first_inputs_exposed(lead), sum(t for _, t in lead)
        exposed += a - early + waited + 2 * meet[(phase, k)] + (k - 1) * max(0.0, s_comm * a - kernel / k)
        exposed += (s_compute - 1) * (min((k - 1) / k * kernel, (k - 1) * s_comm * a) + early - waited)
    for (phase, f), a in side.items():
        hidden_by = f * (t_fwd if phase == "fwd" else t_bwd)
        exposed += max(0.0, s_comm * a - hidden_by) + (s_compute - 1) * min(hidden_by, s_comm * a)
    return comm, exposed


def first_inputs_exposed(lead: list[tuple[float, float]]) -> float:
    """What the attention waits of the first group's inputs, each issued ``window`` seconds of
    compute before it and moving ``transfer`` seconds, one after another in issue order:
        max(0, max_i (sum over j issued no earlier than i of t_j) - w_i)."""
    worst, after = 0.0, 0.0
    for window, t in sorted(lead):                  # the last made first: a suffix sum in issue order
        after += t
        worst = max(worst, after - window)
    return worst
