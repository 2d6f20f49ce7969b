"""``autosp.compile`` refuses bad arguments with one line naming the fix, before any process group exists."""

import pytest
import torch

import autosp
from autosp.errors import AutospError


def test_unknown_compiler_lists_the_known_ones():
    with pytest.raises(AutospError, match="unknown compiler 'tvm'; use one of inductor, aot_eager, eager"):
        autosp.compile(torch.nn.Linear(2, 2), compiler="tvm", strategy="ulysses")


def test_unknown_strategy_lists_the_registered_ones():
    with pytest.raises(AutospError, match="unknown strategy 'magic'; use one of auto, .*ulysses.*hybrid:UxR"):
        autosp.compile(torch.nn.Linear(2, 2), strategy="magic")


def test_a_layout_the_strategy_cannot_use_is_refused():
    with pytest.raises(AutospError, match="need layout='zigzag'"):
        autosp.compile(torch.nn.Linear(2, 2), strategy="zigzag_ring", layout="contiguous")
