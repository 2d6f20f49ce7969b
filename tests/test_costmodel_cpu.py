"""The cost model against a measurement in this process (one core, profile cpu-gloo)."""

import pytest

from autosp.tools.validation import measured_single, predicted


def test_single_device_step_memory_and_time():
    (row,) = predicted(measured_single([1024], repeats=2))
    assert row["pred_peak"] == pytest.approx(row["peak"], rel=0.10), row
    # Order of magnitude only (load doubles step times); the accuracy claim lives in the bench.
    assert 1 / 3 < row["pred_time"] / row["time"] < 3, row
