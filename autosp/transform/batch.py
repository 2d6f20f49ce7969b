"""What the SP wrapper does to a batch around the compiled graphs: padding the sequence to
the layout's multiple (labels with -100, masks with 0, positions continuing), trimming
outputs back, and packed documents (``cu_seqlens`` to restarting position ids, and the
document lengths the planner costs)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from autosp.errors import AutospError

_PAD_VALUES = {"labels": -100, "attention_mask": 0}


def documents_of(positions: Any, padded_len: int) -> tuple[int, ...]:
    """Document lengths of a packed batch (position ids restarting at 0), when every row packs the
    same ones; the padding joins the last. ``()``: one sequence per row, or rows that differ."""
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2:
        return ()
    pos = positions.detach().cpu()
    if not bool((pos == pos[:1]).all()):
        return ()
    row = pos[0]
    new_doc = row == 0
    new_doc[1:] |= row[1:] != row[:-1] + 1
    starts = new_doc.nonzero().flatten().tolist()
    if len(starts) <= 1:
        return ()
    bounds = starts + [padded_len]
    return tuple(bounds[i + 1] - bounds[i] for i in range(len(starts)))


def positions_from_cu_seqlens(cu_seqlens: Any, batch: int, seq_len: int) -> torch.Tensor:
    """``[B, S]`` position ids restarting at 0 at each document of ``cu_seqlens`` (flash-attention's
    cumulative lengths over the flattened batch; documents may not cross rows)."""
    cu = torch.as_tensor(cu_seqlens, dtype=torch.long).flatten().cpu()
    total = batch * seq_len
    if cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != total or bool((cu[1:] <= cu[:-1]).any()):
        raise AutospError(f"cu_seqlens must rise strictly from 0 to batch x sequence = {total}, got "
                          f"{cu.tolist()[:8]}{'...' if cu.numel() > 8 else ''}")
    rows = torch.arange(0, total + 1, seq_len)
    if not bool(torch.isin(rows, cu).all()):
        raise AutospError(f"a document in cu_seqlens crosses a row boundary (rows are {seq_len} tokens); each row "
                          "must hold whole documents")
    tokens = torch.arange(total)
    starts = cu[torch.searchsorted(cu, tokens, right=True) - 1]
    return (tokens - starts).view(batch, seq_len)


def pad_seq(t: torch.Tensor, name: str, length: int) -> torch.Tensor:
    extra = length - t.shape[1]
    if extra == 0:
        return t
    if name == "position_ids":       # keep positions increasing past the end
        tail = t[:, -1:] + torch.arange(1, extra + 1, device=t.device, dtype=t.dtype)
        return torch.cat([t, tail.expand(t.shape[0], extra)], dim=1)
    pad = [0, 0] * (t.dim() - 2) + [0, extra]
    return F.pad(t, pad, value=_PAD_VALUES.get(name, 0))


def trim(out: Any, padded_len: int, seq_len: int) -> Any:
    if isinstance(out, torch.Tensor):
        return out.narrow(1, 0, seq_len) if out.dim() >= 2 and out.shape[1] == padded_len else out
    if isinstance(out, tuple):
        return type(out)(trim(x, padded_len, seq_len) for x in out)
    if hasattr(out, "keys") and hasattr(out, "__setitem__"):     # HF ModelOutput / dict
        for k in list(out.keys()):
            out[k] = trim(out[k], padded_len, seq_len)
    return out
