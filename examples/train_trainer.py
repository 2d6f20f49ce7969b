"""A Hugging Face Trainer script with sequence parallelism: two lines differ from the plain one.

    python examples/train_trainer.py                           # one process
    torchrun --nproc-per-node 2 examples/train_trainer.py      # SP over 2 CPU processes: the same losses
"""

import torch
import transformers

from autosp.hf import AutospTrainer                 # <- was: from transformers import Trainer

cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=128, attn_implementation="sdpa")
transformers.set_seed(0)
model = transformers.AutoModelForCausalLM.from_config(cfg)
ids = torch.randint(0, 128, (8, 256), generator=torch.Generator().manual_seed(1))
dataset = [{"input_ids": x, "labels": x.clone()} for x in ids]
args = transformers.TrainingArguments(output_dir="out", per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                      max_steps=2, logging_steps=1, use_cpu=not torch.cuda.is_available(),
                                      report_to=[], save_strategy="no", disable_tqdm=True)
trainer = AutospTrainer(model=model, args=args, train_dataset=dataset)   # <- was: Trainer(...)
trainer.train()
