"""A Hugging Face Trainer script as a user writes it, run as one process (``plain``: the Trainer)
or under torchrun with ``AutospTrainer`` (``autosp``): a small Llama, 3 optimizer steps of 2
accumulated micro-batches. Writes the logged losses and, under autosp, what ran to ``OUT/ROLE-RANK.json``.

    python tests/hf_trainer_job.py OUT plain
    torchrun --nproc-per-node 2 tests/hf_trainer_job.py OUT autosp
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import transformers


def main(out_dir: str, role: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    transformers.set_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, attn_implementation="sdpa")
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids.clone()} for ids in torch.randint(0, 128, (12, 64), generator=g)]
    args = transformers.TrainingArguments(output_dir=out_dir, per_device_train_batch_size=2,
                                          gradient_accumulation_steps=2, max_steps=3, logging_steps=1,
                                          learning_rate=1e-3, use_cpu=True, report_to=[], save_strategy="no",
                                          seed=0, disable_tqdm=True)
    if role == "autosp":
        from autosp.hf import AutospTrainer                                # <- added
        trainer = AutospTrainer(model=model, args=args, train_dataset=data)  # <- Trainer -> AutospTrainer
    else:
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    out = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h], "world": args.world_size}
    if role == "autosp":
        import torch.distributed as dist

        sp = trainer.sp_model
        rep = sp.report().as_dict()
        out.update(rank=dist.get_rank(), strategies=[a["strategy"] for a in rep["attention"]],
                   planned=[c.strategy for c in sp.plan.per_layer()] if sp.plan is not None else None,
                   tokens_per_rank=[a["tokens_per_rank"] for a in rep["attention"]],
                   collectives={k: c["calls"] for k, c in rep["collectives"].items()},
                   wrapped=type(trainer.model_wrapped).__name__,
                   model=type(trainer.model).__name__)
    with open(os.path.join(out_dir, f"{role}-{out.get('rank', 0)}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
