"""A plain training loop; one line turns on sequence parallelism.

    python examples/train_tiny.py                              # one process
    torchrun --nproc-per-node 2 examples/train_tiny.py         # SP over 2 CPU processes (gloo)

Both print the same per-step losses: every rank passes the same full batch and
autosp slices the tokens inside the graph.
"""

import argparse
import os

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import autosp
from autosp.graph.catalog import hf_config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=1)
    args = parser.parse_args()

    if "RANK" in os.environ:                       # launched by torchrun
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = torch.device("cuda", rank % torch.cuda.device_count()) if torch.cuda.is_available() else "cpu"

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config("tiny")).to(device)
    model = autosp.compile(model)                  # <- the one line
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    gen = torch.Generator().manual_seed(1234)
    for step in range(args.steps):
        ids = torch.randint(0, 2048, (args.batch_size, args.seq_len), generator=gen).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
