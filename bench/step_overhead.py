"""What autosp's wrapper costs each step beside the compiled graphs, measured apart.

    python bench/step_overhead.py [--seq-len 4096] [--repeats 20] [--compiler inductor]

The tiny Llama of the peer benchmark (``bench/vs_deepspeed_autosp.py``: hidden 256, 8 heads,
4 KV heads, 2 layers, vocabulary 1000, fp32), batch 1, 2 gloo ranks with one thread each,
``autosp.compile(model, plan="ulysses")``. Per step, medians over ``--repeats`` (a barrier
before each):

* ``step``: a training step (forward, backward; no optimizer), as users run it;
* ``step without observation ops``: the same, from a model compiled with the sharding pass's
  ``autosp::observe_tokens`` replaced by a Python no-op (traced away: no op left in the graph);
* ``wrapper``: ``sp(...)`` with the compiled graphs replaced by a stub returning the last step's
  output: what the wrapper does in Python around them (argument binding, the batch-shape check,
  padding, positions, this step's observations cleared, the collective tally's snapshot); the
  check's all-gather starts as the step begins and is waited for before the graphs run
  (:class:`autosp.transform.first_call.BatchCheck`); ``..., waited for at once``: the same with
  the check blocking where it starts, as it ran before (rounds alternated between the two);
* ``batch-shape check``: :class:`autosp.transform.first_call.BatchCheck` started and waited for alone, the one
  collective the wrapper issues every step.

Each figure is also given as a share of ``step``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import types
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

from autosp.timing import interleaved_times, median_time  # noqa: E402
from autosp.tools.launch import spawn_gloo  # noqa: E402


def _measure(seq_len: int, repeats: int, compiler: str) -> dict:
    import torch
    import torch.distributed as dist

    import autosp
    import autosp.transform.sharding as sharding
    from autosp.transform.first_call import BatchCheck
    from vs_deepspeed_autosp import _ids, tiny

    ids = _ids(seq_len)
    runtime = autosp.Runtime(compiler=compiler)
    out: dict[str, float] = {}

    def train(sp):
        def step() -> None:
            sp(input_ids=ids, labels=ids).loss.backward()
            for p in sp.module.parameters():
                p.grad = None
        return step

    torch._dynamo.reset()
    sp = autosp.compile(tiny(), plan="ulysses", runtime=runtime)
    step = train(sp)
    step(), step()
    assert sp.report().attention[0].tokens_per_rank == seq_len // 2      # the ops observed

    # the same model compiled with the observation op traced away
    observe = sharding.observe_tokens
    sharding.observe_tokens = types.SimpleNamespace(_opoverload=lambda *a: None)     # traced away
    try:
        torch._dynamo.reset()
        bare = autosp.compile(tiny(), plan="ulysses", runtime=runtime)
        bare_step = train(bare)
        bare_step(), bare_step()
        assert bare.report().attention[0].tokens_per_rank == 0            # none left in the graph
    finally:
        sharding.observe_tokens = observe
    # rounds alternated between the two models, so both see the same machine
    steps = {"step": step, "step without observation ops": bare_step}
    times = interleaved_times(list(steps), lambda name: steps[name](), repeats, dist.barrier)
    out.update({name: statistics.median(t) for name, t in times.items()})

    # the wrapper alone: its compiled graphs replaced by a stub returning the last output
    last = sp(input_ids=ids, labels=ids)
    variant = sp._active
    object.__setattr__(sp, "_active", type(variant)(variant.config, variant.state, lambda *a, **k: last))
    start = BatchCheck.start

    def waited_at_once(*a: Any) -> BatchCheck:      # the check as it ran before: blocking where it starts
        check = start(*a)
        check.wait()
        return check

    wrappers = {"wrapper": start, "wrapper, the batch-shape check waited for at once": waited_at_once}

    def call(name: str) -> None:
        BatchCheck.start = wrappers[name]
        try:
            with torch.no_grad():
                sp(input_ids=ids, labels=ids)
        finally:
            BatchCheck.start = start

    times = interleaved_times(list(wrappers), call, repeats, dist.barrier)
    out.update({name: statistics.median(t) for name, t in times.items()})
    object.__setattr__(sp, "_active", variant)
    named = {"input_ids": ids, "labels": ids}
    out["batch-shape check"] = median_time(lambda: BatchCheck.start(sp.group, named, seq_len).wait(), repeats,
                                           dist.barrier)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--compiler", default="inductor", choices=("inductor", "aot_eager", "eager"))
    args = ap.parse_args()
    r = spawn_gloo(_measure, 2, threads=1, seq_len=args.seq_len, repeats=args.repeats, compiler=args.compiler)
    print(f"tiny Llama, {args.seq_len} tokens, 2 gloo ranks x 1 thread, Ulysses, {args.compiler}; "
          f"medians of {args.repeats}, rank 0\n")
    print("| what | seconds | share of the step |")
    print("|---|---|---|")
    for k, v in r.items():
        print(f"| {k} | {v:.6f} | {v / r['step']:.2%} |")


if __name__ == "__main__":
    main()
