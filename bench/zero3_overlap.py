"""ZeRO 3's parameter gathers and gradient reduce-scatters overlapped with compute, against the
same collectives blocking (``autosp.compile(..., zero=3, runtime=autosp.Runtime(overlap=False))``).

    python bench/zero3_overlap.py [--meshes 1x2 2x2] [--seq-len 2048] [--repeats 5] [--compiler inductor]

A Llama whose parameters weigh as much as its activations (hidden 512, MLP 2048, 4 blocks, 8 heads,
4 KV heads, vocabulary 8000, fp32, random weights; 21 M parameters, 84 MB), batch 1 per data-parallel
row, on a DP x SP mesh of gloo ranks with one thread each, Ulysses. For each form: the median step
time and the *exposed* ZeRO communication per step: the seconds the compute thread was blocked in
the gathers and reduce-scatters (``sp.report()``'s ``blocked_s``), of the rank that waited most and
of the one that waited least. Next to them, the cost model's prediction of the step and of the
exposed communication (profile ``cpu-gloo``, with its measured concurrency slowdowns). The forms
run interleaved (one step of each per round); their losses must agree.
"""

from __future__ import annotations

import argparse

from autosp.tools.launch import interleaved_times, spawn_gloo

FORMS = {"overlapped": True, "blocking": False}


def config() -> dict:
    return dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4, vocab_size=8000, attn_implementation="sdpa")


def model():
    import torch
    import transformers

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**config()))


def measure(rows: int, seq_len: int, repeats: int, compiler: str) -> list[dict]:
    import statistics

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autosp

    torch.set_num_threads(1)
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (rows, world // rows), mesh_dim_names=("dp", "sp"))
    row = mesh.get_local_rank("dp")
    ids = torch.randint(0, config()["vocab_size"], (rows, seq_len), generator=torch.Generator().manual_seed(0))[row:row + 1]
    models, waited, losses, counts = {}, {f: [] for f in FORMS}, {}, {}
    for form, overlap in FORMS.items():
        torch._dynamo.reset()
        models[form] = autosp.compile(model(), plan="ulysses", mesh=mesh, zero=3,
                                      runtime=autosp.Runtime(compiler=compiler, overlap=overlap))

    def step(form: str) -> None:
        sp = models[form]
        loss = sp(input_ids=ids, labels=ids).loss
        loss.backward()
        for p in sp.parameters():
            p.grad = None
        losses[form] = loss.item()
        rep = sp.report()
        mine = sum(rep.collectives.get(k, {}).get("blocked_s", 0.0) for k in ("param_all_gather", "grad_reduce_scatter"))
        every = [None] * world
        dist.all_gather_object(every, mine)
        waited[form].append(every)
        counts[form] = (rep.param_gathers, rep.param_prefetched)

    times = interleaved_times(list(FORMS), step, repeats, dist.barrier)
    return [dict(form=f, time=statistics.median(times[f]),
                 exposed=statistics.median(max(w) for w in waited[f][-repeats:]),
                 least=statistics.median(min(w) for w in waited[f][-repeats:]),
                 loss=losses[f], gathers=counts[f]) for f in FORMS]


def predicted(rows: int, sp: int, seq_len: int) -> dict[str, tuple[float, float, float]]:
    from autosp.costmodel.predict import predict
    from autosp.costmodel.profile import load_profile
    from autosp.graph import capture

    prof = load_profile("cpu-gloo")
    g = capture(model(), seq_len=seq_len, batch_size=1, dtype="float32")
    out = {}
    for form, overlap in FORMS.items():
        p = predict(g, prof, sp=sp, dp=rows, strategy="ulysses", seq_len=seq_len, zero_stage=3,
                    devices_per_node=rows * sp, overlap=overlap)
        out[form] = (p.total_s, p.gradient_exposed_s, p.gradient_comm_s)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--meshes", nargs="+", default=["1x2", "2x2"], help="DPxSP")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--compiler", default="inductor")
    args = ap.parse_args()
    print(f"Llama 21M parameters, S = {args.seq_len} per DP row, Ulysses, ZeRO 3, {args.compiler}, one thread per "
          f"rank, median of {args.repeats} interleaved steps; exposed = seconds a rank's compute waited on the "
          "parameter gathers and gradient reduce-scatters per step")
    print("| mesh (DP x SP) | form | gathers per forward (prefetched) | step (s) | exposed, most-waiting rank (s) "
          "| exposed, least-waiting rank (s) | step / blocking | exposed / blocking (most, least) "
          "| predicted step (s) | predicted exposed (s) | predicted ZeRO communication (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for spec in args.meshes:
        rows, sp = (int(x) for x in spec.split("x"))
        res = spawn_gloo(measure, rows * sp, threads=1, rows=rows, seq_len=args.seq_len, repeats=args.repeats,
                         compiler=args.compiler)
        assert len({round(r["loss"], 5) for r in res}) == 1, f"the forms disagree on the loss: {res}"
        pred = predicted(rows, sp, args.seq_len)
        base = next(r for r in res if r["form"] == "blocking")
        for r in res:
            pt, pe, pc = pred[r["form"]]
            print(f"| {rows} x {sp} | {r['form']} | {r['gathers'][0]} ({r['gathers'][1]}) | {r['time']:.3f} | "
                  f"{r['exposed']:.3f} | {r['least']:.3f} | {r['time'] / base['time']:.2f}x | "
                  f"{r['exposed'] / base['exposed']:.2f}x, {r['least'] / max(base['least'], 1e-9):.2f}x | "
                  f"{pt:.3f} | {pe:.3f} | {pc:.3f} |")


if __name__ == "__main__":
    main()
