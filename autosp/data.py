"""Packing documents into sequences for long-context training: the data side of SP.

    rows = autosp.data.pack(documents, window=131072)          # lists of token ids, any lengths
    batch = autosp.data.collate(rows[:2], pad_id=0)            # input_ids, labels, position_ids [B, window]
    loss = model(**batch, use_cache=False).loss                # documents never attend to each other

Each packed row holds whole documents (best fit, longest first: the fewest rows for the lengths
given), their position ids restart at 0 at each document (how transformers, and autosp's masks
and planner, see packed documents), and the first token of every document is not a target, so
no document is trained to predict the next one. A document longer than the window is refused,
or split into window-long pieces with ``split_long=True``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from autosp.errors import AutospError


@dataclass
class PackedRow:
    """One packed sequence: the token ids of its documents, concatenated, and where each came from."""

    tokens: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)         # per document (or piece), in row order
    sources: list[tuple[int, int]] = field(default_factory=list)   # (document index, offset of the piece)

    @property
    def position_ids(self) -> list[int]:
        return [i for n in self.lengths for i in range(n)]

    @property
    def cu_seqlens(self) -> list[int]:
        out = [0]
        for n in self.lengths:
            out.append(out[-1] + n)
        return out


def pack(documents: Iterable[Sequence[int] | torch.Tensor], window: int, *,
         split_long: bool = False) -> list[PackedRow]:
    """Pack ``documents`` (token id sequences) into rows of at most ``window`` tokens.

    Args:
        documents: the documents, each a sequence (or 1-D tensor) of token ids.
        window: the most tokens a row holds (the training sequence length).
        split_long: a document longer than ``window`` is cut into window-long pieces (each packed as a
            document of its own) instead of refused.

    Returns:
        The rows, each a :class:`PackedRow`; every token of every document is in exactly one row.
    """
    if not isinstance(window, int) or window < 1:
        raise AutospError(f"window must be a positive number of tokens, got {window!r}")
    pieces: list[tuple[int, int, list[int]]] = []        # (document, offset, tokens)
    for d, doc in enumerate(documents):
        tokens = doc.tolist() if isinstance(doc, torch.Tensor) else list(doc)
        if not tokens:
            continue
        if len(tokens) > window and not split_long:
            raise AutospError(f"document {d} has {len(tokens)} tokens, more than the window of {window}; "
                              "pass split_long=True to cut it into window-long pieces, or raise the window")
        for off in range(0, len(tokens), window):
            pieces.append((d, off, tokens[off:off + window]))
    # best fit, longest first: each piece into the fullest row it still fits
    pieces.sort(key=lambda p: (-len(p[2]), p[0], p[1]))
    rows: list[PackedRow] = []
    free: list[tuple[int, int]] = []                      # (room left, row index), sorted
    for d, off, tokens in pieces:
        at = bisect.bisect_left(free, (len(tokens), -1))
        if at == len(free):
            rows.append(PackedRow())
            room, r = window, len(rows) - 1
        else:
            room, r = free.pop(at)
        row = rows[r]
        row.tokens += tokens
        row.lengths.append(len(tokens))
        row.sources.append((d, off))
        if room - len(tokens):
            bisect.insort(free, (room - len(tokens), r))
    return rows


def collate(rows: Sequence[PackedRow], pad_id: int, length: int | None = None,
            ignore_index: int = -100) -> dict[str, torch.Tensor]:
    """A batch of packed rows, padded to ``length`` (default the longest row): ``input_ids``,
    ``labels`` (each document's first token and the padding are not targets) and
    ``position_ids`` (restarting per document; the padding counts on as a document of its own)."""
    length = length or max(len(r.tokens) for r in rows)
    if any(len(r.tokens) > length for r in rows):
        raise AutospError(f"a row holds {max(len(r.tokens) for r in rows)} tokens, more than length={length}")
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), length), ignore_index, dtype=torch.long)
    pos = torch.zeros((len(rows), length), dtype=torch.long)
    for b, row in enumerate(rows):
        n = len(row.tokens)
        ids[b, :n] = torch.tensor(row.tokens, dtype=torch.long)
        labels[b, :n] = ids[b, :n]
        labels[b, torch.tensor(row.cu_seqlens[:-1], dtype=torch.long)] = ignore_index   # no cross-document target
        pos[b, :n] = torch.tensor(row.position_ids, dtype=torch.long)
        pos[b, n:] = torch.arange(length - n)
    return {"input_ids": ids, "labels": labels, "position_ids": pos}
