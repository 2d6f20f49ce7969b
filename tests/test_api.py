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


def test_cu_seqlens_to_positions_and_its_errors():
    import torch

    from autosp.errors import AutospError
    from autosp.transform.batch import positions_from_cu_seqlens

    pos = positions_from_cu_seqlens(torch.tensor([0, 3, 8, 10, 16]), batch=2, seq_len=8)
    assert pos.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 0, 1, 2, 3, 4, 5]]
    with pytest.raises(AutospError, match="crosses a row boundary"):
        positions_from_cu_seqlens([0, 5, 12, 16], batch=2, seq_len=8)
    with pytest.raises(AutospError, match="rise strictly from 0"):
        positions_from_cu_seqlens([0, 8, 8, 16], batch=2, seq_len=8)


def test_the_default_compiler_is_inductor_unless_the_environment_names_another(monkeypatch):
    from autosp.transform.backend import default_compiler

    monkeypatch.delenv("AUTOSP_COMPILER", raising=False)
    assert default_compiler() == "inductor"
    assert default_compiler("balanced") == "eager"          # it deals chunks per batch
    monkeypatch.setenv("AUTOSP_COMPILER", "aot_eager")
    assert default_compiler() == "aot_eager" and default_compiler("balanced") == "eager"
    monkeypatch.setenv("AUTOSP_COMPILER", "tvm")
    with pytest.raises(AutospError, match="AUTOSP_COMPILER='tvm' is not a compiler; use one of inductor, aot_eager"):
        autosp.compile(torch.nn.Linear(2, 2), strategy="ulysses")
