"""`moshray bench overlap`'s figures (pure) and the overlap setting's resolution."""

import pytest

from moshray.jobs.bench.overlap import compare, loss_at, steady_rate
from moshray.jobs.config import ConfigError, load_config, parse_set

# history rows: epoch, at_s, samples, loss, peers
SYNC = [(1, 10.0, 32, 5.0, 2), (2, 12.0, 32, 4.0, 2), (3, 14.0, 32, 3.0, 2),
        (4, 16.0, 32, 2.0, 2)]
OVER = [(1, 10.0, 32, 5.0, 2), (2, 11.0, 32, 4.5, 2), (3, 12.0, 32, 3.5, 2)]


def test_steady_rate_leaves_the_first_step_out():
    assert steady_rate(SYNC) == 96 / 6.0
    assert steady_rate(SYNC[:1]) is None


def test_loss_at_equal_samples_averages_the_steps_trained_by_then():
    assert loss_at(SYNC, 64, window=2) == 4.5  # steps 1 and 2 hold the first 64 samples
    assert loss_at(SYNC, float("inf"), window=2) == 2.5
    assert loss_at([(1, 1.0, 8, None, 1)], 8) is None


def test_compare_reports_speedup_and_loss_delta_side_by_side():
    fig = compare({"off": {"summary": {"steps": 4, "samples": 128,
                                       "replicas_consistent": True}, "history": SYNC},
                   "on": {"summary": {"steps": 3, "samples": 96,
                                      "replicas_consistent": True}, "history": OVER}})
    assert fig["equal_samples"] == 96
    assert fig["speedup"] == pytest.approx((64 / 2.0) / (96 / 6.0))
    assert fig["loss_delta_at_equal_samples"] == pytest.approx(
        (5.0 + 4.5 + 3.5) / 3 - (5.0 + 4.0 + 3.0) / 3)


def test_overlap_is_on_for_gpus_by_default_and_refused_with_local_sgd():
    t = load_config(None, {}).training
    assert t.overlap == "auto" and t.overlaps(cuda=True) and not t.overlaps(cuda=False)
    on = load_config(None, parse_set(["training.overlap=on"])).training
    assert on.overlaps(cuda=False)
    with pytest.raises(ConfigError, match="training.overlap"):
        load_config(None, parse_set(["training.overlap=on", "training.mode=local_sgd"]))
    with pytest.raises(ConfigError, match="training.overlap"):
        load_config(None, parse_set(["training.overlap=sometimes"]))
