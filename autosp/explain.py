"""``autosp explain``: run one SP training step of a model and print what autosp did.

    autosp explain --model tiny --seq-len 4096 --nproc 2 [--strategy ring] [--checkpoint full]

Spawns ``--nproc`` gloo processes on this machine (CPU), builds the model from its
config with random weights (no download), runs one forward and backward under
``autosp.compile`` and prints rank 0's :meth:`SequenceParallel.report`: the strategy,
tokens and heads per rank of every attention op, and the collectives the step issued.
"""

from __future__ import annotations

from typing import Any

from autosp.tools.launch import spawn_gloo


def _step(model: str, seq_len: int, batch_size: int, strategy: str, checkpoint: str, compiler: str | None) -> dict:
    import torch
    import transformers

    import autosp
    from autosp.graph.catalog import resolve

    transformers.logging.set_verbosity_error()
    src = resolve(model)
    if not src.is_hf:
        from autosp.errors import AutospError

        raise AutospError(f"autosp explain builds Hugging Face configs; '{model}' is a factory: call "
                          "autosp.compile(...) in your script and print sp.report()")
    torch.manual_seed(0)
    module = transformers.AutoModelForCausalLM.from_config(src.hf_config)
    fixed = None if checkpoint == "none" else checkpoint           # "none": the planner may still choose
    chosen = autosp.Auto(checkpoint=fixed) if strategy == "auto" else \
        autosp.Decisions.of(strategy=strategy, checkpoint=checkpoint)
    sp = autosp.compile(module, plan=chosen, runtime=autosp.Runtime(compiler=compiler))
    ids = torch.randint(0, src.hf_config.vocab_size, (batch_size, seq_len), generator=torch.Generator().manual_seed(0))
    sp(input_ids=ids, labels=ids).loss.backward()
    return sp.report().as_dict()


def explain(model: str, seq_len: int, nproc: int = 2, batch_size: int = 1, strategy: str = "auto",
            checkpoint: str = "none", compiler: str | None = None) -> Any:
    """Rank 0's report of one step, as an :class:`autosp.transform.report.SPReport`."""
    from autosp.transform.report import AttentionRow, SPReport

    doc = spawn_gloo(_step, nproc, threads=1, timeout=900, model=model, seq_len=seq_len, batch_size=batch_size,
                     strategy=strategy, checkpoint=checkpoint, compiler=compiler)
    rows = [AttentionRow(**r) for r in doc.pop("attention")]
    doc.pop("work_balance", None)             # derived from work_per_rank
    return SPReport(attention=rows, **doc)
