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


def measure(cases: list[tuple], repeats: int) -> list[dict]:
    import torch
    import torch.distributed as dist
    import transformers

    import autosp

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    rows = []
    for (seq, heads, kv, hidden, specs) in cases:
        ids = torch.randint(0, 2048, (1, seq), generator=torch.Generator().manual_seed(0))
        models = {}
        for spec in specs:
            torch._dynamo.reset()
            torch.manual_seed(0)
            strategy, _, layout = spec.partition("@")          # SPEC@LAYOUT: the plan's layout
            models[spec] = autosp.compile(transformers.AutoModelForCausalLM.from_config(config(heads, kv, hidden)),
                                          strategy=strategy, layout=layout or None)

        def step(spec: str) -> None:
            models[spec](input_ids=ids, labels=ids).loss.backward()
            for p in models[spec].parameters():
                p.grad = None

        times = interleaved_times(specs, step, repeats, dist.barrier)
        rows.append({"seq": seq, "heads": heads, "kv": kv, "hidden": hidden,
                     "times": {s: statistics.median(t) for s, t in times.items()}})
        del models
    return rows


def planned(world: int, seq: int, heads: int, kv: int, hidden: int) -> str:
    from autosp.graph import capture
    from autosp.graph.catalog import ModelSource
    from autosp.planner.search import plan
    from autosp.strategies import resolve

    g = capture(ModelSource(f"tiny-h{heads}-kv{kv}-d{hidden}", hf_config=config(heads, kv, hidden)), seq_len=seq,
                dtype="float32")
    p = plan(None, graph=g, seq_len=seq, world_size=world, profile="cpu-gloo", sp_degrees=(world,),
             checkpoints=("none",), memory_limit=float("inf"), devices_per_node=world)   # as the launch says
    spec = p.layers[0]["strategy"]
    # the plan's token layout is part of the pick (all-gather-KV may be planned on zigzag)
    own = resolve(spec).layout or "contiguous"
    return spec if p.layout == own else f"{spec}@{p.layout}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", type=int, nargs="*", help="indices into the grid")
    args = ap.parse_args()
    grid = [g for i, g in enumerate(GRID) if not args.only or i in args.only]
    picks = {g: planned(*g) for g in grid}          # the ILP's own choice, measured with the rest
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
    print()
    for name, rs in regrets.items():
        print(f"{name}: median regret {statistics.median(rs):.3f}, worst {max(rs):.3f} over {len(rs)} configurations")


if __name__ == "__main__":
    main()
