"""The planner's choices where the answer changes: regret of the ILP's pick against fixed strategies.

    python bench/planner_regret.py [--repeats 3] [--only 0 5 ...]

A grid of tiny Llama variants (2 layers, fp32, batch 1, one thread per rank) on 2 and 4 gloo ranks:
short and long sequences, heads the SP degree does not divide (Ulysses illegal), GQA and MHA. For
each configuration every legal strategy is measured (compiled and warmed up first, then timed in
interleaved rounds, median), and the ILP plans it on ``cpu-gloo`` (``autosp.plan``: its own pick
over every strategy, layout and head-group count; no memory cap). Regret = measured step of a
choice / measured step of the fastest. Baselines: "always Ulysses" (ring where the heads do not
split, as a hand-written setup would fall back) and "always ring". Prints the table, then median
and worst regret of each.

Memory-capped configurations (:data:`CAPPED`): a per-rank limit on parameters + gradients +
optimizer states + the step's activations. The ILP plans strategy, checkpointing and MLP and
loss tiling under it (``memory_limit``); every strategy in :data:`CAPPED_STRATEGIES` runs with
every decision in :data:`DECISIONS` through ``aot_eager`` (the memory probe cannot see inside
Inductor), each one's per-rank step peak measured (``autosp.tools.memory_probe``) and added to its
model states; the fastest that fits is the best. A pick that does not fit counts as regret
infinity. The baselines under a cap check nothing: Ulysses (or ring) with full checkpointing, as
a hand-written setup fits a limit.
"""

from __future__ import annotations

import argparse
import statistics

from autosp.tools.launch import interleaved_times, spawn_gloo

#        ranks, seq,  heads, kv, hidden
GRID = [(2, 2048, 2, 1, 256), (2, 2048, 8, 4, 256), (2, 2048, 3, 1, 192), (2, 4096, 8, 8, 256),
        (2, 8192, 2, 1, 256), (2, 8192, 4, 2, 256), (2, 8192, 8, 4, 256), (2, 8192, 3, 1, 192),
        (4, 4096, 2, 1, 256), (4, 4096, 8, 4, 256), (4, 8192, 4, 4, 256), (4, 8192, 8, 2, 256)]
CANDIDATES = ["ulysses", "ulysses:c2", "ring", "zigzag_ring", "allgather_kv", "hybrid:2x2"]
#          ranks, seq,  heads, kv, hidden, per-rank limit (MiB): tight enough that checkpointing decides
CAPPED = [(2, 8192, 8, 4, 256, 260), (2, 8192, 8, 4, 256, 200), (2, 8192, 3, 1, 192, 150)]
CAPPED_STRATEGIES = ["ulysses", "zigzag_ring", "allgather_kv"]
DECISIONS = ["none/1/1", "selective/1/1", "full/1/1", "selective/8/8", "full/8/8"]   # checkpoint/MLP/loss


def config(heads: int, kv: int, hidden: int):
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=2,
                                   num_attention_heads=heads, num_key_value_heads=kv, vocab_size=2048,
                                   max_position_embeddings=65536)
    cfg._attn_implementation = "sdpa"
    return cfg


def legal(world: int, seq: int, heads: int, kv: int) -> list[str]:
    from autosp.strategies import AttentionShape, SPMesh, resolve

    shape = AttentionShape(heads=heads, kv_heads=kv, head_dim=32, seq_len=seq, causal=True)
    out = []
    for spec in CANDIDATES:
        st = resolve(spec)
        if st.illegal(shape, SPMesh(world, st.layout or "contiguous")) is None:
            out.append(spec)
    return out


def parse(spec: str) -> tuple[str, str | None, dict]:
    """``STRATEGY[@LAYOUT][+CHECKPOINT/MLP/LOSS]`` -> (strategy, layout, memory decisions)."""
    head, _, decided = spec.partition("+")
    strategy, _, layout = head.partition("@")          # SPEC@LAYOUT: the plan's layout
    ck, mlp, loss = (decided or "none/1/1").split("/")
    return strategy, layout or None, dict(checkpoint=ck, mlp_chunks=int(mlp), loss_chunks=int(loss))


def measure(cases: list[tuple], repeats: int, compiler: str | None = None, probe: bool = False) -> list[dict]:
    import torch
    import torch.distributed as dist
    import transformers

    import autosp
    from autosp.tools.memory_probe import step_peak

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    # up to 16 models of one class alive at once, each compiled for its own instance
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 1024
    rows = []
    for (seq, heads, kv, hidden, specs) in cases:
        ids = torch.randint(0, 2048, (1, seq), generator=torch.Generator().manual_seed(0))
        models, peaks = {}, {}
        for spec in specs:
            torch._dynamo.reset()
            torch.manual_seed(0)
            strategy, layout, decided = parse(spec)
            loss = decided.pop("loss_chunks")
            chosen = autosp.Decisions.of(strategy=strategy, **decided,
                                         mesh=autosp.MeshChoice(layout=layout, loss_chunks=loss))
            models[spec] = autosp.compile(transformers.AutoModelForCausalLM.from_config(config(heads, kv, hidden)),
                                          plan=chosen, runtime=autosp.Runtime(compiler=compiler))

        def step(spec: str) -> None:
            models[spec](input_ids=ids, labels=ids).loss.backward()
            for p in models[spec].parameters():
                p.grad = None

        times = interleaved_times(specs, step, repeats, dist.barrier)
        if probe:
            for spec in specs:
                _, peak = step_peak(models[spec], lambda: models[spec](input_ids=ids, labels=ids).loss)
                models[spec].zero_grad(set_to_none=True)
                peaks[spec] = peak
        rows.append({"seq": seq, "heads": heads, "kv": kv, "hidden": hidden,
                     "times": {s: statistics.median(t) for s, t in times.items()}, "peaks": peaks})
        del models
    return rows


def planned(world: int, seq: int, heads: int, kv: int, hidden: int, cap_mib: float | None = None) -> str:
    from autosp.graph import capture
    from autosp.graph.catalog import ModelSource
    from autosp.planner.problem import Problem
    from autosp.planner.search import plan
    from autosp.strategies import resolve

    g = capture(ModelSource(f"tiny-h{heads}-kv{kv}-d{hidden}", hf_config=config(heads, kv, hidden)), seq_len=seq,
                dtype="float32")
    if cap_mib is None:
        p = plan(Problem.of(graph=g, seq_len=seq, world_size=world, profile="cpu-gloo", sp_degrees=(world,),
                            checkpoints=("none",), memory_limit=float("inf"),
                            devices_per_node=world))   # as the launch says
    else:
        p = plan(Problem.of(graph=g, seq_len=seq, world_size=world, profile="cpu-gloo", sp_degrees=(world,),
                            memory_limit=cap_mib * 2**20, devices_per_node=world,
                            strategies=tuple(CAPPED_STRATEGIES)))
    layer = p.layers[0]
    spec = layer.choice.strategy
    # the plan's token layout is part of the pick (all-gather-KV may be planned on zigzag)
    own = resolve(spec).layout or "contiguous"
    spec = spec if p.mesh.layout == own else f"{spec}@{p.mesh.layout}"
    if cap_mib is not None:
        spec += f"+{layer.choice.checkpoint}/{layer.choice.mlp_chunks}/{p.mesh.loss_chunks}"
    return spec


def states_mib(world: int, heads: int, kv: int, hidden: int) -> float:
    """Parameters + gradients + AdamW's two states per rank (replicated: no ZeRO), as the planner
    counts them (:func:`autosp.costmodel.memory.model_states`; no length dependence: a short
    capture)."""
    from autosp.costmodel.memory import model_states
    from autosp.graph import capture
    from autosp.graph.catalog import ModelSource

    g = capture(ModelSource(f"tiny-h{heads}-kv{kv}-d{hidden}", hf_config=config(heads, kv, hidden)), seq_len=64,
                dtype="float32")
    return sum(model_states(g, world, 0).values()) / 2**20


def capped_rows(repeats: int, only: list[int] | None) -> list[dict]:
    grid = [g for i, g in enumerate(CAPPED) if not only or i in only]
    out = []
    for world in sorted({g[0] for g in grid}):
        cases, picks = [], {}
        for g in grid:
            if g[0] != world:
                continue
            picks[g] = planned(*g)
            specs = [f"{st}+{d}" for st in legal(world, *g[1:4]) if st in CAPPED_STRATEGIES for d in DECISIONS]
            specs += [picks[g]] * (picks[g] not in specs)
            cases.append((*g[1:5], specs))
        measured = spawn_gloo(measure, world, threads=1, cases=cases, repeats=repeats, compiler="aot_eager",
                              probe=True)
        for g, r in zip([g for g in grid if g[0] == world], measured):
            out.append({"world": world, "cap": g[5], "pick": picks[g], "states": states_mib(g[0], *g[2:5]), **r})
    return out


def print_capped(rows: list[dict], regrets: dict[str, list[float]]) -> None:
    print("\nmemory-capped (per-rank limit on model states + step activations; aot_eager; each decision's "
          "measured peak)")
    print("| ranks | seq | heads / KV | limit (MiB) | fits: measured step (s), peak (MiB) | fastest that fits | "
          "ILP pick | its peak (MiB) | regret | Ulysses + full | ring + full |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        t, total = r["times"], {s: r["states"] + b / 2**20 for s, b in r["peaks"].items()}
        fits = {s: v for s, v in t.items() if total[s] <= r["cap"]}
        best = min(fits.values()) if fits else float("nan")
        fastest = min(fits, key=fits.get) if fits else "none"

        def regret(spec: str | None) -> float:
            return t[spec] / best if spec in fits else float("inf")

        uly = next((s for s in t if s.startswith("ulysses+full/1/1")), None) or "zigzag_ring+full/1/1"
        ring = "zigzag_ring+full/1/1"
        for name, spec in (("ILP", r["pick"]), ("always Ulysses", uly), ("always ring", ring)):
            regrets[name].append(regret(spec))
        cells = ", ".join(f"{s} {v:.3f} / {total[s]:.0f}" for s, v in sorted(fits.items(), key=lambda kv: kv[1]))
        print(f"| {r['world']} | {r['seq']} | {r['heads']} / {r['kv']} | {r['cap']} | {cells} | {fastest} | "
              f"{r['pick']} | {total[r['pick']]:.0f} | {regret(r['pick']):.3f} | {regret(uly):.3f} | "
              f"{regret(ring):.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", type=int, nargs="*", help="indices into the grid")
    ap.add_argument("--capped", type=int, nargs="*", default=None,
                    help="indices into the memory-capped grid (default: all; none given: skip it)")
    ap.add_argument("--no-uncapped", action="store_true", help="only the memory-capped grid")
    ap.add_argument("--picks", action="store_true",
                    help="print the ILP's pick per configuration and stop (seconds; to re-read a recorded run)")
    args = ap.parse_args()
    grid = [] if args.no_uncapped else [g for i, g in enumerate(GRID) if not args.only or i in args.only]
    picks = {g: planned(*g) for g in grid}          # the ILP's own choice, measured with the rest
    if args.picks:
        for g, pick in picks.items():
            print(f"ranks {g[0]}, seq {g[1]}, heads / KV {g[2]} / {g[3]}, hidden {g[4]}: {pick}")
        return
    rows = []
    for world in sorted({g[0] for g in grid}):
        cases = []
        for g in grid:
            if g[0] == world:
                specs = legal(*g[:4])
                cases.append((*g[1:], specs + [picks[g]] * (picks[g] not in specs)))
        for r in spawn_gloo(measure, world, threads=1, cases=cases, repeats=args.repeats):
            rows.append({"world": world, **r})
    print(f"tiny Llama variants, 2 layers, fp32, one thread per rank, median of {args.repeats} interleaved steps")
    print("| ranks | seq | heads / KV | hidden | measured step (s) per strategy | fastest | ILP pick | regret "
          "| always Ulysses | always ring |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    regrets: dict[str, list[float]] = {"ILP": [], "always Ulysses": [], "always ring": []}
    for r in rows:
        t = r["times"]
        best = min(t.values())
        fastest = min(t, key=t.get)
        pick = picks[(r["world"], r["seq"], r["heads"], r["kv"], r["hidden"])]
        ulysses = "ulysses" if "ulysses" in t else "ring"
        mine = t[pick]
        for name, choice in (("ILP", mine), ("always Ulysses", t[ulysses]), ("always ring", t["ring"])):
            regrets[name].append(choice / best)
        cells = ", ".join(f"{s} {v:.3f}" for s, v in t.items())
        print(f"| {r['world']} | {r['seq']} | {r['heads']} / {r['kv']} | {r['hidden']} | {cells} | {fastest} | "
              f"{pick} | {mine / best:.3f} | {t[ulysses] / best:.3f} | {t['ring'] / best:.3f} |")
    if args.capped is None or args.capped:
        print_capped(capped_rows(args.repeats, args.capped), regrets)
    print()
    for name, rs in regrets.items():
        print(f"{name}: median regret {statistics.median(rs):.3f}, worst {max(rs):.3f} over {len(rs)} configurations")


if __name__ == "__main__":
    main()
