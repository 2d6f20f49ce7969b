"""Packing documents into rows: no token lost or duplicated, documents whole unless the user
lets long ones be cut, rows within the window, and the batch's labels and positions right."""

import math
import random

import pytest
import torch

from autosp.data import collate, pack
from autosp.errors import AutospError


def _documents(n: int = 300, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)          # long-tailed lengths, as real long-context data
    return [[rng.randrange(1000) for _ in range(min(int(rng.lognormvariate(5.0, 1.2)) + 1, 4000))]
            for _ in range(n)]


def test_every_token_lands_once_and_documents_stay_whole():
    docs = _documents()
    window = 4096
    rows = pack(docs, window)
    assert all(len(r.tokens) <= window for r in rows)
    rebuilt: dict[int, list[int]] = {}
    for r in rows:
        at = 0
        for (d, off), n in zip(r.sources, r.lengths):
            assert off == 0 and d not in rebuilt            # whole: one piece per document
            rebuilt[d] = r.tokens[at:at + n]
            at += n
        assert at == len(r.tokens)
    assert rebuilt == {d: doc for d, doc in enumerate(docs) if doc}
    total = sum(map(len, docs))
    # best fit, longest first: within a few rows of the bound no packing can beat
    assert math.ceil(total / window) <= len(rows) <= math.ceil(total / window) * 1.1 + 1, (len(rows), total)


def test_a_document_longer_than_the_window_is_refused_or_cut_as_asked():
    docs = [list(range(6)), list(range(25))]
    with pytest.raises(AutospError, match="document 1 has 25 tokens, more than the window of 8; pass split_long=True"):
        pack(docs, 8)
    rows = pack(docs, 8, split_long=True)
    pieces = sorted((d, off, n) for r in rows for (d, off), n in zip(r.sources, r.lengths))
    assert pieces == [(0, 0, 6), (1, 0, 8), (1, 8, 8), (1, 16, 8), (1, 24, 1)]
    assert sorted(t for r in rows for t in r.tokens) == sorted(docs[0] + docs[1])


def test_the_batch_restarts_positions_and_trains_no_document_on_the_next():
    rows = pack([[5, 6, 7], [8, 9], [1, 2, 3, 4]], window=6)
    batch = collate(rows, pad_id=0, length=6)
    assert [r.lengths for r in rows] == [[4, 2], [3]]
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 8, 9], [5, 6, 7, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 1, 2]]
    assert batch["labels"].tolist() == [[-100, 2, 3, 4, -100, 9], [-100, 6, 7, -100, -100, -100]]
    assert rows[0].cu_seqlens == [0, 4, 6]
    with pytest.raises(AutospError, match="more than length=5"):
        collate(rows, pad_id=0, length=5)
    with pytest.raises(AutospError, match="window must be a positive number"):
        pack([[1]], 0)
    assert pack([torch.tensor([1, 2])], 4)[0].tokens == [1, 2]
