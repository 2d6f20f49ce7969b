"""A training job that survives a rank killed mid-backward (run by tests/test_fault.py under torchrun).

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 tests/fault_job.py OUT STEPS EVERY [KILL_STEP]

Each step's batch is a function of the step alone, so a resumed job sees the data the
uninterrupted one saw. Every EVERY steps the job saves ``autosp.checkpoint`` (model, AdamW
states, the step); at start it resumes from the newest complete one. With KILL_STEP, rank 1 of
the first attempt kills itself (SIGKILL) inside that step's backward; torchrun then stops the
other rank and starts both again. Each rank appends one JSON line per finished step to
OUT/rank{r}.jsonl (attempt, step, loss), and at the end OUT/final.pt holds the parameters.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys

import torch
import torch.distributed as dist


def main(out: str, steps: int, every: int, kill_step: int | None) -> None:
    import autosp
    import autosp.checkpoint as ckpt
    from autosp.tools.validation import tiny_model

    import faulthandler

    faulthandler.dump_traceback_later(60, exit=True)       # a hang prints where, and fails the job
    rank, attempt = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # A store of its own per attempt: the restarted workers reach torchrun's store at the same
    # address, where the killed attempt's keys (its ranks' gloo addresses) are still set; read
    # before a new rank writes its own, they send the new group to a dead peer (a hang or a refused
    # connection, seen here about one restart in two).
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt-{attempt}", store), rank=rank,
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model = tiny_model()
    sp = autosp.compile(model, plan="ulysses")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    root = os.path.join(out, "ckpt")
    start = 0
    path = ckpt.latest(root)
    if path is not None:
        start = ckpt.load(sp, opt, path)["step"] + 1
    log = open(os.path.join(out, f"rank{rank}.jsonl"), "a")
    for step in range(start, steps):
        g = torch.Generator().manual_seed(1000 + step)            # the batch is the step's alone
        ids = torch.randint(0, model.config.vocab_size, (1, 64), generator=g)
        loss = sp(input_ids=ids, labels=ids).loss
        if attempt == 0 and step == kill_step and rank == 1:
            # dies inside the backward, after some gradients exist and before the optimizer step
            model.model.embed_tokens.weight.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGKILL))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        log.write(json.dumps({"attempt": attempt, "step": step, "loss": loss.item()}) + "\n")
        log.flush()
        if step % every == every - 1:
            ckpt.save(sp, opt, os.path.join(root, f"step-{step}"), step=step)
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(out, "final.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else None)
