"""Does the planner's predicted-best strategy win when measured? Tiny Llama, 2 gloo ranks.

    python bench/planner_vs_measured.py

A grid of sequence length x head count (hidden 256, so head_dim = 256/heads). For each
configuration every SP-2 strategy is measured (median step after a warm-up, one thread
per rank) and predicted with the measured cpu-gloo profile; the predicted best counts
as right when it is the measured fastest or within 5% of it.
"""

from __future__ import annotations


from autosp.tools.launch import spawn_gloo as spawn  # noqa: E402

STRATEGIES = ["ulysses", "ring", "zigzag_ring", "allgather_kv"]
GRID = [(s, h) for s in (2048, 8192) for h in (2, 4, 8)]


def _model(heads: int):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                                   num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                                   vocab_size=2048, max_position_embeddings=65536)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg), cfg


def measure(grid: list, repeats: int) -> list[dict]:
    import torch
    import torch.distributed as dist

    import autosp
    from autosp.tools.validation import measure_step

    torch.set_num_threads(1)
    rows = []
    for s, h in grid:
        for st in STRATEGIES:
            torch._dynamo.reset()
            m = measure_step(autosp.compile(_model(h)[0], plan=st), s, repeats, dist.barrier)
            rows.append(dict(seq_len=s, heads=h, strategy=st, time=m["time"]))
    return rows


def main() -> None:
    from autosp.graph.catalog import ModelSource
    from autosp.costmodel.predict import predict
    from autosp.costmodel.profile import load_profile
    from autosp.graph import capture

    rows = spawn(measure, 2, grid=GRID, repeats=2)
    prof = load_profile("cpu-gloo")
    right = 0
    print("| seq | heads | measured (s): " + " / ".join(STRATEGIES) + " | measured fastest | predicted best | ok |")
    print("|---|---|---|---|---|---|")
    for s, h in GRID:
        g = capture(ModelSource(f"tiny-h{h}", hf_config=_model(h)[1]), seq_len=s, dtype="float32")
        meas = {r["strategy"]: r["time"] for r in rows if r["seq_len"] == s and r["heads"] == h}
        pred = {st: predict(g, prof, sp=2, strategy=st).total_s for st in STRATEGIES}
        fastest, best = min(meas, key=meas.get), min(pred, key=pred.get)
        ok = meas[best] <= 1.05 * meas[fastest]
        right += ok
        print(f"| {s} | {h} | " + " / ".join(f"{meas[st]:.2f}" for st in STRATEGIES) +
              f" | {fastest} | {best} | {'yes' if ok else 'no'} |")
    print(f"\npredicted best is measured fastest or within 5%: {right} of {len(GRID)}")


if __name__ == "__main__":
    main()
