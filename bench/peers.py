"""autosp beside every peer in one run: ALST, DeepSpeed AutoSP, PyTorch context parallel, a
hand-written Ulysses.

    DS_ACCELERATOR=cpu MALLOC_MMAP_THRESHOLD_=65536 python bench/peers.py \
        [--cases 2x4096,2x16384,4x16384] [--rounds 2] [--repeats 3] \
        [--cap-mb 256 --cap-step 8192 --max-seq-len 49152] [--plot docs/figures/peers.png] \
        [--where TOKENS] [--systems NAME ...] [--json FILE]

One model for everyone: the tiny Llama of ``vs_deepspeed_autosp.py`` (hidden 256, 8 heads, 4 KV
heads, 2 layers, vocabulary 1000, fp32, random weights from one seed), batch 1, a full AdamW step
(forward, backward, gradient reduction, optimizer), one thread per rank, each system in its own
spawned gloo processes. Measured the same way for all: the first step's loss and every gradient
against one process on the same batch (relative error of the gradient norm, the worst
parameter); then the median step after one warm-up step; the per-rank peak resident memory of one
step above the steady state (``RssPeak``). Rounds alternate the order of the systems; the table
gives the median over rounds of each round's median.

Each peer runs its own documented recipe:

- **autosp**: ``autosp.compile(model)``, the shortest call (the planner chooses; Inductor),
  ``plan="ulysses"`` (a fixed strategy), and Ulysses with full checkpointing and the MLP and loss
  in 8 chunks (memory decisions named).
- **ALST** (DeepSpeed's ``ulysses_sp``, as ArcticTraining and the HF Trainer run it): the
  ``sdpa`` core wrapped by ``UlyssesSPAttentionHF.register_with_transformers``, its ``mpu``
  given to ``deepspeed.initialize`` with ZeRO 3, each layer's MLP through ``TiledMLP`` (shards:
  ceil(tokens / hidden), the docstring's rule), the LM head and loss through
  ``TiledFusedLogitsLoss`` (shards of about 1 GiB of fp32 logits), gradient checkpointing, the
  batch sliced per rank with pre-shifted labels, and the per-rank losses weighted by their
  labelled tokens across the SP group.
- **DeepSpeed AutoSP**: deepcompile with its ``autosp`` pass (the recipe of
  ``vs_deepspeed_autosp.py``).
- **PyTorch context parallel**: ``torch.distributed.tensor.experimental.context_parallel`` over a
  1-D device mesh, its ring rotation, the batch buffers sharded in place. On CPU with torch 2.13
  its SDPA dispatch has no CPU rule and the row gives that error; ``bench/gpu_check.py --only
  peers`` measures it on a lent GPU.
- **hand-written Ulysses**: the ``ulysses_vs_handwritten.py`` baseline (q/k/v all-to-all around
  SDPA, the summed loss all-reduced).

``--cap-mb``: the longest sequence each trains under that per-rank step-memory cap, in one launch
per system, growing by ``--cap-step`` while one step's peak (after a warm-up at that length) stays
under it. autosp's shortest call is given the cap as its memory limit (``autosp.compile(model,
memory_limit=...)``: the cap plus the parameters and AdamW's moments, which the steady state holds
and the limit counts), which is how a user asks it to fit; the peers have no such knob and run
their recipe. ``--where TOKENS``: each system's step on rank 0 under the profiler, attention's
kernels apart.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from autosp.tools.launch import median_time, spawn_gloo  # noqa: E402
from peer_systems import DEVICE_VAR, GRAD_TOL, LOSS_TOL, ON_ONE_GPU, SYSTEMS, Autosp, Peer, _device  # noqa: E402
from vs_deepspeed_autosp import VOCAB, _ids, tiny  # noqa: E402

def reference(seq_len: int) -> tuple[float, dict]:
    """One process: the loss and every gradient of the first step on the same batch."""
    model = tiny()
    ids = _ids(seq_len)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}      # on the CPU


def _errors(loss: float, grads: dict, ref: tuple[float, dict]) -> dict:
    """The loss's relative error, the worst parameter's gradient error, and every parameter off."""
    ref_loss, ref_grads = ref
    errs = {}
    for n, g in ref_grads.items():
        mine = grads.get(n)
        errs[n] = float("inf") if mine is None else ((mine.cpu() - g).norm() / g.norm().clamp(min=1e-30)).item()
    worst = max(errs, key=errs.get)
    return {"loss_err": abs(loss - ref_loss) / abs(ref_loss), "grad_err": errs[worst], "worst": worst,
            "off": {n: e for n, e in errs.items() if e > GRAD_TOL}}


def run_peer(system: str, seq_len: int, repeats: int, ref: tuple[float, dict] | None) -> dict:
    """On each rank: the first step against one process, then the timed steps and the peak."""
    import torch.distributed as dist

    peer = SYSTEMS[system]()
    peer.batch(seq_len)
    t0 = time.perf_counter()
    loss = peer.forward_backward()
    out = _errors(loss, peer.grads(), ref) if ref is not None else {}
    peer.finish()
    out["first_s"] = time.perf_counter() - t0
    out["loss"] = loss
    if repeats:
        peer.step()
        out["step_s"] = median_time(peer.step, repeats, dist.barrier, sync=_sync())
        peaks = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, _step_peak(peer))
        out["peak"] = max(peaks)
    out["chose"] = peer.chose() if isinstance(peer, Autosp) else ""
    return out


def _sync():
    import torch

    return torch.cuda.synchronize if _device() == "cuda" else None


def _step_peak(peer: Peer) -> int:
    """Bytes one step needs above the steady state: the allocator's peak on a GPU, the resident
    set's on the CPU."""
    import torch

    from autosp.tools.memory_probe import RssPeak

    if _device() == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        peer.step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    with RssPeak() as rss:
        peer.step()
    return rss.peak


def longest_under(system: str, cap_bytes: float, step_tokens: int, max_len: int) -> int:
    """Grow the length while one step's measured peak stays under the cap on every rank (autosp, given
    the cap as its limit, refuses the first length no plan fits: the one before is its longest)."""
    import torch
    import torch.distributed as dist

    from autosp.errors import AutospError

    peer = SYSTEMS[system](cap=cap_bytes)
    best = 0
    for seq_len in range(step_tokens, max_len + 1, step_tokens):
        peer.batch(seq_len)
        try:
            peer.step()
        except AutospError:             # autosp given the cap: no plan fits it (every rank says so)
            break
        peak = torch.tensor([float(_step_peak(peer))])
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        if peak.item() > cap_bytes:
            break
        best = seq_len
    return best


def where_time(system: str, seq_len: int, top: int = 6) -> dict:
    """Rank 0's step under the profiler (after two warm-up steps): its seconds, and the ops that took
    the most of them (self time), attention's kernels summed apart."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    peer = SYSTEMS[system]()
    peer.batch(seq_len)
    peer.step()
    peer.step()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        peer.step()
    rows = sorted(((e.key, e.self_cpu_time_total / 1e6) for e in prof.key_averages()), key=lambda r: -r[1])
    total = sum(t for _, t in rows)
    attention = sum(t for k, t in rows if "scaled_dot_product" in k or "flash_attention" in k)
    return {"total_s": total, "attention_s": attention, "top": rows[:top]}


def measure(system: str, world: int, seq_len: int, repeats: int, ref) -> dict:
    """One launch; a failure becomes the row's one-line error (the first line of the rank's)."""
    try:
        return spawn_gloo(run_peer, world, threads=1, system=system, seq_len=seq_len, repeats=repeats, ref=ref)
    except Exception as e:  # noqa: BLE001 - a peer that cannot run is a row of the table
        return {"error": str(e).strip().splitlines()[0][:240]}


def check_together(systems: list[str], seq_len: int, ref: tuple[float, dict]) -> list[dict]:
    """On each rank: each system's first step against one process, one after another in the same
    processes (exactness only; a launch per system costs seconds). A failing system must fail on
    every rank alike, or the ranks fall out of step: run those in a launch of their own."""
    import gc

    out = []
    for system in systems:
        peer = SYSTEMS[system]()
        peer.batch(seq_len)
        t0 = time.perf_counter()
        loss = peer.forward_backward()
        out.append({**_errors(loss, peer.grads(), ref), "first_s": time.perf_counter() - t0, "loss": loss,
                    "chose": peer.chose() if isinstance(peer, Autosp) else ""})
        del peer
        gc.collect()
    return out


def exact(row: dict) -> bool:
    return row.get("loss_err", 1.0) <= LOSS_TOL and row.get("grad_err", 1.0) <= GRAD_TOL


def compare(cases: list[tuple[int, int]], systems: list[str], rounds: int, repeats: int) -> list[dict]:
    rows = []
    for world, seq_len in cases:
        ref = reference(seq_len)
        runs: dict[str, list[dict]] = {s: [] for s in systems}
        for r in range(rounds):
            for s in (systems if r % 2 == 0 else systems[::-1]):
                if runs[s] and "error" in runs[s][0]:
                    continue                       # a peer that cannot run is not retried
                runs[s].append(measure(s, world, seq_len, repeats, ref if r == 0 else None))
        case = []
        for s in systems:
            first = runs[s][0]
            row = {"system": s, "world": world, "seq_len": seq_len, **first}
            if "error" not in first and repeats:
                row["step_s"] = statistics.median(x["step_s"] for x in runs[s])
                row["peak"] = max(x["peak"] for x in runs[s])
            case.append(row)
        rows += case
        for row in case:
            print(_line(row, rows), flush=True)
    return rows


def _baseline(rows: list[dict], row: dict, name: str) -> dict | None:
    return next((x for x in rows if x["system"] == name and x["world"] == row["world"]
                 and x["seq_len"] == row["seq_len"] and "error" not in x), None)


def _ratio(row: dict, base: dict | None, key: str) -> str:
    return "—" if base is None or "error" in row else f"{row[key] / base[key]:.2f}x"


HEADER = ("| ranks | S | system | step (s) | vs DeepSpeed AutoSP | vs ALST | peak step memory / rank "
          "| vs best peer | loss / grad error vs 1 process | first step (s) |\n|---|---|---|---|---|---|---|---|---|---|")


def _line(row: dict, rows: list[dict]) -> str:
    if "error" in row:
        return f"| {row['world']} | {row['seq_len']} | {row['system']} | does not run: {row['error']} |||||||"
    mark = "" if exact(row) else f" **not exact** ({row['worst']})"
    if "step_s" not in row:             # exactness only
        return f"| {row['world']} | {row['seq_len']} | {row['system']} | | | | | | {row['loss_err']:.1e} / " \
               f"{row['grad_err']:.1e}{mark} | {row['first_s']:.1f} |"
    ds, alst = _baseline(rows, row, "DeepSpeed AutoSP"), _baseline(rows, row, "ALST")
    peers = [x for x in rows if x["world"] == row["world"] and x["seq_len"] == row["seq_len"] and "error" not in x
             and not x["system"].startswith("autosp") and exact(x)]
    best = min(peers, key=lambda x: x["peak"]) if peers else None
    return (f"| {row['world']} | {row['seq_len']} | {row['system']} | {row['step_s']:.3f} | {_ratio(row, ds, 'step_s')} "
            f"| {_ratio(row, alst, 'step_s')} | {row['peak'] / 2**20:.0f} MB | {_ratio(row, best, 'peak')} "
            f"| {row['loss_err']:.1e} / {row['grad_err']:.1e}{mark} | {row['first_s']:.1f} |")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    for s in dict.fromkeys(r["system"] for r in rows):
        pts = sorted((r["seq_len"], r["step_s"], r["peak"]) for r in rows
                     if r["system"] == s and r["world"] == 2 and "error" not in r)
        if pts:
            ax_t.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s)
            ax_m.plot([p[0] for p in pts], [p[2] / 2**20 for p in pts], marker="o", label=s)
    ax_t.set(xlabel="sequence length (tokens)", ylabel="step (s)", title="step time, 2 ranks")
    ax_m.set(xlabel="sequence length (tokens)", ylabel="peak step memory / rank (MB)", title="memory, 2 ranks")
    ax_t.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def gpu_check(out_dir: str, dry: bool) -> list[dict]:
    """``bench/gpu_check.py --only peers``: the systems that run with both ranks on one GPU (over
    gloo; DeepSpeed's engine wants a device per rank) at 4096 and 16384 tokens, written to
    OUT/peers.json. ``dry``: the smallest case on the CPU, every system, exactness only (the suite
    runs it)."""
    os.environ[DEVICE_VAR] = "cpu" if dry else "cuda"
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # dry: every peer, and autosp's shortest call (its fixed decisions are the suite's own business)
    systems = [s for s in SYSTEMS if not s.startswith("autosp,")] if dry else list(ON_ONE_GPU)
    cases, repeats = [(2, 4096), (2, 16384)], 3
    print(HEADER)
    if dry:
        # one launch for the peers that share processes; DeepSpeed AutoSP alone (its compile pass
        # patches torch, and ALST's sequence-parallel groups, left in DeepSpeed's state, leave its
        # gradients at zero), and context parallel alone (it fails on one rank while the other
        # waits in a collective)
        ref = reference(256)
        apart = ("PyTorch context_parallel", "DeepSpeed AutoSP")
        together = [s for s in systems if s not in apart]
        found = spawn_gloo(check_together, 2, threads=1, systems=together, seq_len=256, ref=ref)
        rows = [{"system": s, "world": 2, "seq_len": 256, **r} for s, r in zip(together, found)]
        rows += [{"system": s, "world": 2, "seq_len": 256, **measure(s, 2, 256, 0, ref)} for s in apart]
        for row in rows:
            print(_line(row, rows), flush=True)
    else:
        rows = compare(cases, systems, rounds=1, repeats=repeats)
    with open(os.path.join(out_dir, "peers.json"), "w") as f:
        json.dump({"device": os.environ[DEVICE_VAR], "rows": rows}, f, indent=1)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="2x4096,2x16384,4x16384", help="RANKSxTOKENS, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per launch (0: exactness only)")
    ap.add_argument("--systems", nargs="*", default=None, help=f"a subset of: {', '.join(SYSTEMS)}")
    ap.add_argument("--cap-mb", type=float, default=0.0)
    ap.add_argument("--cap-step", type=int, default=4096)
    ap.add_argument("--max-seq-len", type=int, default=65536)
    ap.add_argument("--plot", default="", help="write the step-time and memory plot here (PNG)")
    ap.add_argument("--json", default="", help="write every row here")
    ap.add_argument("--where", type=int, default=0, metavar="TOKENS",
                    help="also: where each system's step time goes at this length (rank 0 of 2, under the profiler)")
    args = ap.parse_args(argv)
    os.environ["DS_ACCELERATOR"] = "cpu"
    systems = args.systems or list(SYSTEMS)
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems {sorted(unknown)}; known: {list(SYSTEMS)}")
    try:
        cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",") if c]
    except ValueError:
        raise SystemExit(f"--cases {args.cases!r}: write RANKSxTOKENS, e.g. 2x4096,4x16384") from None
    t0 = time.perf_counter()
    print(f"tiny Llama (hidden 256, 8 heads, 4 KV heads, 2 layers, vocabulary {VOCAB}), batch 1, 1 thread per rank, "
          f"full AdamW step; {args.rounds} rounds of {args.repeats} steps\n\n{HEADER}")
    rows = compare(cases, systems, args.rounds, args.repeats)
    for r in rows:
        if r.get("chose"):
            print(f"  ({r['system']}, {r['world']} ranks, S={r['seq_len']}: the planner chose {r['chose']})")
    if args.where:
        seq_len = args.where
        print(f"\nwhere the step goes, rank 0 of 2, S={seq_len} (profiler self time):")
        for s in systems:
            try:
                w = spawn_gloo(where_time, 2, threads=1, system=s, seq_len=seq_len)
            except Exception as e:  # noqa: BLE001
                print(f"  {s}: does not run ({str(e).strip().splitlines()[0][:120]})")
                continue
            tops = ", ".join(f"{k} {t:.3f}" for k, t in w["top"])
            print(f"  {s}: {w['total_s']:.3f} s, attention kernels {w['attention_s']:.3f} s "
                  f"({w['attention_s'] / w['total_s']:.0%}); top: {tops}", flush=True)
    longest = {}
    if args.cap_mb:
        print(f"\nlongest sequence under {args.cap_mb:.0f} MB per rank, 2 ranks (steps of {args.cap_step} tokens):")
        for s in systems:
            try:
                longest[s] = spawn_gloo(longest_under, 2, threads=1, system=s, cap_bytes=args.cap_mb * 2**20,
                                        step_tokens=args.cap_step, max_len=args.max_seq_len)
                print(f"  {s}: {longest[s]} tokens", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"  {s}: does not run ({str(e).strip().splitlines()[0][:160]})", flush=True)
    if args.plot:
        plot(rows, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "longest": longest, "cap_mb": args.cap_mb}, f, indent=1)
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
