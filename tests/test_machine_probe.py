"""The machine probe that `bench goodput` reads before, between and after its runs."""

from __future__ import annotations

import logging

import pytest
import torch

from moshray.jobs.examples.lm.model import ModelConfig
from moshray.jobs.bench.machine_probe import drift, probe, report_line, step_ms

TINY = ModelConfig(seq_len=8, d_model=16, n_layers=1, n_heads=2, d_ff=32)


def test_drift_is_the_slowest_reading_over_the_fastest():
    assert drift([40.0, 50.0, 44.0]) == pytest.approx(1.25)
    assert drift([40.0, None, 40.0]) == pytest.approx(1.0)  # a failed probe is left out
    assert drift([40.0]) is None and drift([None, 41.0]) is None and drift([]) is None
    with pytest.raises(ValueError, match="positive"):
        drift([0.0, 40.0])


def test_a_step_is_timed_on_one_thread_and_the_thread_count_restored():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ms = step_ms(TINY, batch_size=2, steps=3, warmup=1)
        assert ms > 0
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="steps >= 1"):
        step_ms(TINY, batch_size=2, steps=0)


def test_a_failed_probe_is_logged_and_reads_none(caplog):
    with caplog.at_level(logging.WARNING, logger="moshray.machine_probe"):
        assert probe(object(), batch_size=2) is None  # not a ModelConfig
    assert "machine probe failed" in caplog.text


def test_the_report_line_names_each_reading_and_the_drift():
    line = report_line({"start": 43.25, "after_calibrations": None, "end": 51.9})
    assert "start 43.2" in line and "after calibrations -" in line and "end 51.9" in line
    assert "drift 1.20x" in line
    assert "drift -" in report_line({"start": 43.0})
