"""What the compiled graphs observe as they run: the tokens each rank holds at each attention op.

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

import torch
from torch import Tensor
from torch.fx.node import has_side_effect

# by (SP group, attention op index): the sequence length of that op's output (its queries' tokens) on
# this rank, the last time it ran (an int read off the tensor's shape: no sync)
ATTENTION_TOKENS: dict[tuple[str, int], int] = {}


@torch.library.custom_op("autosp::observe_tokens", mutates_args=())
def observe_tokens(q: Tensor, seq_dim: int, index: int, group_name: str) -> None:
    """Record ``q.shape[seq_dim]``, the tokens this rank holds at attention op ``index``."""
    ATTENTION_TOKENS[(group_name, index)] = int(q.shape[seq_dim])


@observe_tokens.register_fake
def _(q: Tensor, seq_dim: int, index: int, group_name: str) -> None:
    return None


has_side_effect(torch.ops.autosp.observe_tokens.default)
