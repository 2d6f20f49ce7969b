"""``autosp demo``: the main job on built-in defaults, on any laptop.

1. capture and cost one training step of a real model (default llama3-8b at
   128k tokens) on fake tensors, and plan it for 8 H100s (published profile, ZeRO 3);
2. train the built-in ``tiny`` Llama for a few steps with autosp on 2 CPU
   processes (gloo) and on one process, and print both loss curves side by side.
"""

from __future__ import annotations

from autosp.tools.launch import spawn_gloo


def _train(steps: int, seq_len: int, distributed: bool) -> list[float]:
    import torch
    import transformers

    import autosp
    from autosp.graph.catalog import hf_config

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config("tiny"))
    if distributed:
        model = autosp.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1234)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 2048, (1, seq_len), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def run_demo(model: str = "llama3-8b", seq_len: int = 131072, steps: int = 3, train_seq_len: int = 1024,
             world: int = 2) -> float:
    """Print the inspect table and the SP-vs-single-process losses; returns the worst relative gap."""
    import warnings

    from rich.console import Console
    from rich.table import Table

    from autosp.graph import capture
    from autosp.planner.report import inspect_table, plan_table
    from autosp.planner.problem import Problem
    from autosp.planner.search import plan

    console = Console(width=max(Console().width, 110))
    console.print(f"[bold]1. one training step of {model} at {seq_len} tokens, captured on fake tensors[/bold]")
    graph = capture(model, seq_len=seq_len)
    console.print(inspect_table(graph))
    console.print("\n[bold]   its plan on 8 H100s (published profile, ZeRO 3)[/bold]")
    for item in plan_table(plan(Problem.of(graph=graph, seq_len=seq_len, world_size=8, profile="h100-sxm",
                                           zero_stage=3))):
        console.print(item)

    console.print(f"\n[bold]2. tiny Llama, {steps} AdamW steps at {train_seq_len} tokens: autosp on {world} "
                  "gloo processes vs one process[/bold]")
    sp = spawn_gloo(_train, world, threads=1, timeout=600, steps=steps, seq_len=train_seq_len, distributed=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        single = _train(steps, train_seq_len, distributed=False)
    t = Table()
    for col in ("step", "1 process", f"autosp, SP={world}", "relative gap"):
        t.add_column(col, justify="right")
    worst = 0.0
    for i, (a, b) in enumerate(zip(single, sp)):
        gap = abs(a - b) / abs(a)
        worst = max(worst, gap)
        t.add_row(str(i), f"{a:.6f}", f"{b:.6f}", f"{gap:.1e}")
    console.print(t)
    return worst
