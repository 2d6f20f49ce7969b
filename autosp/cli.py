"""The ``autosp`` command line: ``autosp inspect``, ``autosp demo`` (more subcommands follow).

Errors a user can cause are printed as one line (``autosp: error: ...``) with
exit status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from autosp.errors import AutospError
from autosp.options import COMPILERS


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {v}")
    return v


def _add_model_args(p: argparse.ArgumentParser, seq_required: bool = True) -> None:
    p.add_argument("--model", required=True,
                   help="catalogue name (autosp models), path to a HF config.json, or package.module:factory")
    p.add_argument("--seq-len", type=_positive_int, required=seq_required, help="tokens per sequence")
    p.add_argument("--batch-size", type=_positive_int, default=1)
    p.add_argument("--dtype", default="bfloat16", help="parameter/activation dtype (default bfloat16)")
    p.add_argument("--inputs", default=None,
                   help="input spec for factory models, e.g. 'input_ids:int64[B,S],labels:int64[B,S]'")


def cmd_inspect(args: argparse.Namespace) -> int:
    from autosp.graph import capture
    from autosp.planner.report import inspect_dict, inspect_table

    g = capture(args.model, seq_len=args.seq_len, batch_size=args.batch_size, dtype=args.dtype,
                inputs=args.inputs)
    if args.json:
        json.dump(inspect_dict(g), sys.stdout, indent=2)
        print()
    else:
        from rich.console import Console

        console = Console(width=max(Console().width, 110))
        console.print(inspect_table(g))
        for note in g.notes:
            console.print(f"note: {note}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from autosp.demo import run_demo

    worst = run_demo(args.model, args.seq_len, args.steps, args.train_seq_len)
    print(f"worst relative loss gap between SP and one process: {worst:.1e}")
    return 0 if worst < 1e-5 else 1


def cmd_profile(args: argparse.Namespace) -> int:
    import os

    import torch
    import torch.distributed as dist

    from autosp.costmodel.profiler import measure

    if "RANK" in os.environ and not dist.is_initialized():       # launched by torchrun
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    doc = measure(args.out, quick=args.quick, budget_s=args.budget, only=tuple(args.only) if args.only else None)
    if doc:
        n = sum(len(v) for t in doc["compute"].values() for v in (t.values() if isinstance(t, dict) else [t]))
        c = sum(len(rows) for col in doc["collectives"].values() for rows in col["intra"].values())
        print(f"wrote {args.out}: {n} compute points, {c} collective points")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def _documents(text: str | None) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        docs = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise AutospError(f"--documents takes comma-separated token counts, e.g. 1024,4096,2048; got '{text}'") \
            from None
    if any(d <= 0 for d in docs):
        raise AutospError(f"--documents lengths must be positive, got {text}")
    return docs


def _tp(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise AutospError(f"--tp takes a TP degree (1, 2, 4, 8) or auto, got '{text}'") from None


def cmd_plan(args: argparse.Namespace) -> int:
    from autosp.planner.report import plan_table
    from autosp.planner.problem import Problem
    from autosp.planner.search import plan

    if args.max_seq_len and args.no_overlap:
        raise AutospError("--no-overlap plans one sequence length; drop it with --max-seq-len, or give "
                          "--seq-len N instead")
    if not args.max_seq_len and args.seq_len is None:
        raise AutospError("give --seq-len N, or --max-seq-len to find the longest that fits")
    problem = Problem.of(args.model, seq_len=None if args.max_seq_len else args.seq_len, batch_size=args.batch_size,
                         world_size=args.world_size, devices_per_node=args.devices_per_node, profile=args.profile,
                         memory_limit=args.memory_limit * 2 ** 30 if args.memory_limit else None,
                         zero_stage=args.zero_stage, dtype=args.dtype, compiler=args.compiler,
                         documents=None if args.max_seq_len else _documents(args.documents),
                         offloads=(False,) if args.no_offload else (False, True),
                         host_optimizers=(False,) if args.no_host_optimizer else (False, True),
                         overlap=not args.no_overlap, tp_degrees=None if args.tp == "auto" else (_tp(args.tp),),
                         **({} if args.memory_margin is None else {"memory_margin": args.memory_margin}))
    if args.max_seq_len:
        from autosp.planner.longest import max_seq_len

        longest, p = max_seq_len(problem)
        if not args.json:
            print(f"longest sequence that fits: {longest} tokens")
    else:
        p = plan(problem)
    if args.html:
        from autosp.planner.html_report import write_html

        write_html(p, args.html)
    if args.out:
        p.save(args.out)
    if args.json:
        print(p.to_json())
    else:
        from rich.console import Console

        console = Console(width=max(Console().width, 110))
        for item in plan_table(p):
            console.print(item)
        if args.out:
            console.print(f"plan written to {args.out}")
        if args.html:
            console.print(f"report written to {args.html}")
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from autosp.explain import explain

    rep = explain(args.model, args.seq_len, nproc=args.nproc, batch_size=args.batch_size, strategy=args.strategy,
                  checkpoint=args.checkpoint, compiler=args.compiler)
    if args.json:
        print(json.dumps(rep.as_dict(), indent=2))
    else:
        from rich.console import Console

        Console(width=max(Console().width, 120)).print(rep)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from autosp.graph.catalog import CATALOG

    for name, (cls, kw) in sorted(CATALOG.items()):
        print(f"{name:16s} {cls}")
    return 0


def _quiet_libraries() -> None:
    """Library chatter (e.g. transformers' config notices) would bury the one-line answers."""
    try:
        import transformers

        transformers.logging.set_verbosity_error()
    except ImportError:
        pass


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autosp", description="Automatic sequence parallelism: capture, cost, plan, apply.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="per-layer FLOPs, parameters and saved activations of one training step")
    _add_model_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("demo", help="the main job on defaults: inspect a real model, then a real SP run on CPU")
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--seq-len", type=_positive_int, default=131072)
    p.add_argument("--steps", type=_positive_int, default=3)
    p.add_argument("--train-seq-len", type=_positive_int, default=1024)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("profile", help="measure a hardware profile here (run under torchrun for collectives)")
    p.add_argument("--out", required=True, help="where to write the profile JSON")
    p.add_argument("--quick", action="store_true", help="fewer points, about a minute on a 2-core CPU")
    p.add_argument("--budget", type=float, default=None, help="stop measuring after this many seconds")
    p.add_argument("--only", nargs="+",
                   choices=("compute", "collectives", "concurrency", "sync_skew"),
                   help="measure these sections only; an existing --out keeps the others")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("plan", help="choose SP/DP split, strategies and checkpointing with the ILP")
    _add_model_args(p, seq_required=False)
    p.add_argument("--world-size", type=_positive_int, default=8)
    p.add_argument("--devices-per-node", type=_positive_int, default=None,
                   help="default: the profile's (8 for the GPU profiles)")
    p.add_argument("--profile", default="h100-sxm", help="shipped profile name or a profile JSON path")
    p.add_argument("--memory-limit", type=float, default=None,
                   help="GiB per device for the step's tensors (default: the profile's device memory less what "
                        "the CUDA context and NCCL hold outside the allocator)")
    p.add_argument("--memory-margin", type=float, default=None,
                   help="share of the limit a plan leaves free for the memory model's error (default 0.05)")
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=0)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--out", default=None, help="write the plan JSON here")
    p.add_argument("--html", default=None, help="write an HTML report with plots here")
    p.add_argument("--max-seq-len", action="store_true", help="find the longest sequence that fits this world")
    p.add_argument("--no-overlap", action="store_true",
                   help="plan with every collective blocking (no pipelined Ulysses, all-gather-KV overlap, prefetched "
                        "ZeRO 3 gathers), to compare with the overlapped plan")
    p.add_argument("--documents", default=None,
                   help="lengths of the documents packed into each sequence, comma-separated (sum = --seq-len)")
    p.add_argument("--no-offload", action="store_true",
                   help="keep every layer's saved tensors on the device (by default the planner may offload them "
                        "to host memory where the profile has it)")
    p.add_argument("--no-host-optimizer", action="store_true",
                   help="keep the optimizer states on the device (by default the planner may keep them, and step "
                        "them, in host memory where the profile has it)")
    p.add_argument("--tp", default="auto",
                   help="the tensor-parallel degree, or auto (default): the planner chooses 1, 2, 4 or 8 inside a "
                        "node (autosp.compile applies the plan on a ('dp', 'sp', 'tp') mesh it builds)")
    p.add_argument("--compiler", default="inductor", choices=COMPILERS,
                   help="what will run the step (default Inductor, autosp's; it fuses pointwise chains, so "
                        "the others need more memory)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("explain", help="run one SP training step on local CPU processes and show what autosp did")
    p.add_argument("--model", required=True, help="catalogue name or path to a HF config.json")
    p.add_argument("--seq-len", type=_positive_int, required=True)
    p.add_argument("--batch-size", type=_positive_int, default=1)
    p.add_argument("--nproc", type=_positive_int, default=2, help="gloo processes (the SP degree)")
    p.add_argument("--strategy", default="auto")
    p.add_argument("--checkpoint", default="none", choices=("none", "selective", "full"))
    p.add_argument("--compiler", default=None, choices=("inductor", "aot_eager", "eager"),
                   help="how each sharded graph runs (default: autosp's, Inductor)")
    p.add_argument("--json", action="store_true", help="the report as JSON")
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("models", help="list the built-in model names")
    p.set_defaults(func=cmd_models)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    _quiet_libraries()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except AutospError as e:
        print(f"autosp: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:          # e.g. `autosp inspect --json | head`
        return 0
    except KeyboardInterrupt:
        print("autosp: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
