"""Train each sequence of a global batch at its own SP degree (:mod:`autosp.planner.assign`).

    trainer = autosp.MixedDegree(model, time_of=times)        # every rank, after init_process_group
    for batch in loader:                                       # the same global batch on every rank
        loss = trainer.step(batch)                             # forward + backward, gradients summed
        optimizer.step(); optimizer.zero_grad()

``batch`` is a list of sequences, each the model's keyword inputs for one row (``input_ids``,
``labels``, optionally ``position_ids``). The process groups of every degree are formed once, at
construction; the model is compiled once per degree this rank takes part in. Each step the
schedule places every sequence on a group; this rank runs its placements in start order, scaling
each sequence's mean loss by its share of the batch's predicted tokens, so that after one sum of
the gradients over the world they equal one process's on the whole batch (the loss it returns is
that process's loss: the token-weighted mean).
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from autosp.errors import AutospError
from autosp.planner.assign import Assignment, assign

Times = Callable[[dict[str, torch.Tensor], int], "float | None"]


def _tokens(seq: dict[str, torch.Tensor]) -> int:
    """Tokens whose next token is predicted (a causal LM's shifted labels that are not -100)."""
    labels = seq.get("labels")
    if labels is None:
        raise AutospError("each sequence needs labels (the loss is weighted by the tokens it predicts)")
    return int((labels[..., 1:] != -100).sum())


class MixedDegree:
    """``model`` trained with a per-batch SP degree per sequence (module docstring).

    Args:
        model: the model (its parameters are shared by every degree's compiled copy).
        time_of: seconds a sequence takes at an SP degree, None where it does not fit (from the cost
            model: ``bench/per_batch.py`` shows one); the schedule minimises the step's makespan.
        degrees: the SP degrees allowed (divisors of the world size; default: all).
        compile_options: passed to ``autosp.compile`` for each degree above 1 (the plan, compiler).
    """

    def __init__(self, model: nn.Module, time_of: Times, degrees: Sequence[int] | None = None,
                 **compile_options: Any):
        from autosp.front import compile as sp_compile
        from autosp.options import Runtime

        fixed = sorted(set(compile_options) & {"mesh", "zero"})
        if fixed:
            raise AutospError(f"MixedDegree forms its own process group per degree and sums gradients once over "
                              f"the world; it takes no {' or '.join(fixed)} (ZeRO sharding per degree's group would "
                              "split the one model's parameters several ways): leave it out")
        self.model, self.time_of = model, time_of
        self.distributed = dist.is_available() and dist.is_initialized()
        if not self.distributed:
            warnings.warn("torch.distributed is not initialised: MixedDegree runs every sequence on this process "
                          "(SP degree 1); launch with torchrun to place them on groups of ranks", stacklevel=2)
        self.world, self.rank = (dist.get_world_size(), dist.get_rank()) if self.distributed else (1, 0)
        self.degrees = sorted(set(degrees or [k for k in range(1, self.world + 1) if self.world % k == 0]))
        if any(k < 1 or self.world % k for k in self.degrees):
            raise AutospError(f"SP degrees {self.degrees} must divide the world size {self.world}")
        runtime = replace(compile_options.pop("runtime", None) or Runtime(), reduce_grads=False)  # summed here
        self.models: dict[int, nn.Module] = {1: model}
        for k in self.degrees:
            if k == 1:
                continue
            if k == self.world:
                mine = dist.group.WORLD
            else:                       # every rank forms every group, in the same order
                mine = None
                for g in range(self.world // k):
                    pg = dist.new_group(list(range(g * k, (g + 1) * k)))
                    if self.rank // k == g:
                        mine = pg
            self.models[k] = sp_compile(model, mesh=mine, runtime=runtime, **compile_options)
        self.last: Assignment | None = None

    def schedule(self, batch: Sequence[dict[str, torch.Tensor]]) -> Assignment:
        """Each sequence's degree and group for ``batch`` (the same on every rank)."""
        return assign(lambda i, k: self.time_of(batch[i], k), len(batch), self.world, self.degrees)

    def step(self, batch: Sequence[dict[str, torch.Tensor]]) -> torch.Tensor:
        """Forward and backward of the global ``batch``; returns its loss (token-weighted mean)."""
        if not batch:
            raise AutospError("an empty batch: give at least one sequence")
        if self.distributed:
            self._check_same_batch(batch)
        self.last = plan = self.schedule(batch)
        total = sum(_tokens(s) for s in batch)
        mine = plan.of_rank(self.rank)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for p in mine:
            seq = batch[p.sequence]
            out = self.models[p.degree](**seq)
            loss = out.loss if hasattr(out, "loss") else out
            share = _tokens(seq) / total
            (loss * share).backward()
            if self.rank == p.ranks[0]:       # the group's first rank counts its sequence once
                loss_sum += loss.detach().double() * share
        if self.distributed:
            self._sum_gradients()
            dist.all_reduce(loss_sum)
        return loss_sum.float()

    def _check_same_batch(self, batch: Sequence[dict[str, torch.Tensor]]) -> None:
        """Every rank must hold the same global batch (each computes the same schedule from it); a
        batch that differs would leave ranks waiting on collectives the others never call."""
        digest = len(batch)
        for i, seq in enumerate(batch):
            ids = seq.get("input_ids")
            row = (ids.shape[-1], int(ids.long().sum())) if isinstance(ids, torch.Tensor) else (0, 0)
            digest = (digest * 1000003 + (i + 1) * (row[0] * 7919 + row[1])) % (1 << 61)
        here = torch.tensor([digest, -digest], dtype=torch.int64)
        seen = here.clone()
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        if int(seen[0]) != digest or int(seen[1]) != -digest:
            raise AutospError("the global batch differs across ranks (its rows' lengths or token ids); MixedDegree "
                              "places every row on a group itself, so give every rank the same whole batch "
                              "(the same data-loader seed), not a shard of it")

    def _sum_gradients(self) -> None:
        """Each rank's partial gradients summed over the world: one all-reduce per parameter dtype."""
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in self.model.parameters():
            if p.requires_grad:
                by_dtype.setdefault(p.dtype, []).append(p)
        for params in by_dtype.values():
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
            dist.all_reduce(flat)
            offset = 0
            for p in params:
                n = p.numel()
                p.grad = flat[offset:offset + n].view_as(p).clone()
                offset += n
