"""What the compiled graphs observe as they run, in one typed channel per process group
(:class:`Observed`): the tokens each rank holds at each attention op, and the labelled tokens
its loss covered (:func:`autosp.transform.loss.all_reduce_count`). Custom ops inside compiled
graphs reach no Python object of the wrapper, so they write here, by group name; the wrapper
clears its groups' entries as each step begins and ``report()`` reads them.

``report().attention[i].tokens_per_rank`` is read from here, not computed from the padded length:
the sharding pass (:mod:`autosp.transform.sharding`) puts :func:`observe_tokens` on each attention
op's output, which every strategy returns as this rank's tokens, and it records their sequence
length whenever the graph runs (eager, AOTAutograd or Inductor: the op has a side effect, so no pass
removes it). A rank that held the whole sequence, or another share than its own, shows there.
Why on the output: put on the queries, before the attention, Inductor scheduled a fully
checkpointed layer's offload of its input ahead of the attention (the copy order
``tests/test_sp_2proc.py`` pins); after it, the schedule is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.fx.node import has_side_effect


@dataclass
class Observed:
    """What the graphs run over one group observed in the current step."""

    # attention op index -> the sequence length of its output (its queries' tokens) on this rank,
    # the last time it ran (an int read off the tensor's shape: no sync)
    attention_tokens: dict[int, int] = field(default_factory=dict)
    # this rank's labelled tokens in the last loss made global over the group, as the loss computed
    # it (a tensor: read with .item() only when a report asks, never a sync per step)
    loss_tokens: Tensor | None = None


OBSERVED: dict[str, Observed] = {}


def observed(group_name: str) -> Observed:
    """The group's observations (empty where nothing ran over it yet)."""
    return OBSERVED.setdefault(group_name, Observed())


def new_step(*group_names: str) -> None:
    """Forget the groups' observations: what a report then reads is this step's, or nothing."""
    for name in group_names:
        OBSERVED[name] = Observed()


@torch.library.custom_op("autosp::observe_tokens", mutates_args=())
def observe_tokens(q: Tensor, seq_dim: int, index: int, group_name: str) -> None:
    """Record ``q.shape[seq_dim]``, the tokens this rank holds at attention op ``index``."""
    observed(group_name).attention_tokens[index] = int(q.shape[seq_dim])


@observe_tokens.register_fake
def _(q: Tensor, seq_dim: int, index: int, group_name: str) -> None:
    return None


has_side_effect(torch.ops.autosp.observe_tokens.default)
