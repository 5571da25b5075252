"""`goodput_gap`: when a system's samples went missing against its own rates (pure)."""

from __future__ import annotations

import json

import pytest

from moshray.autoscaler.traces import NodeEvent
import moshray.jobs.bench.goodput_curves as gc
import moshray.jobs.bench.goodput_rates as gr
from moshray.jobs.bench.goodput_curves import Progress
from moshray.jobs.bench.goodput_gap import CLASSES, gap_split
from moshray.jobs.controller.replica_states import replica_starts

RATES = {1: 6.0, 2: 10.0}


def linear_curve(start_s: float, end_s: float, rate: float, every_s: float = 1.0):
    """A useful curve gaining ``rate`` samples/s in steps every ``every_s`` from ``start_s``."""
    curve, t, total = [(0.0, 0.0)], start_s, 0.0
    while t <= end_s + 1e-9:
        total += rate * every_s
        curve.append((t, total))
        t += every_s
    return curve


def test_slices_before_the_first_step_are_startup_and_the_rest_steady():
    events = [NodeEvent(0.0, "add", 0), NodeEvent(0.0, "add", 1)]
    curve = linear_curve(5.0, 60.0, 10.0)  # steps every second from 5 s, 10 samples each
    split = gap_split(curve, events, RATES, 60.0, window_s=20.0)
    start, steady = split.parts["startup"], split.parts["steady"]
    assert (start.slices, steady.slices, split.parts["node_events"].slices) == (1, 2, 0)
    assert start.expected == pytest.approx(200.0) and start.samples == pytest.approx(160.0)
    assert start.missing == pytest.approx(40.0)  # the 4 s before the first step
    assert steady.expected == pytest.approx(400.0) and steady.missing == pytest.approx(0.0)


def test_a_node_event_marks_its_slice_and_the_next():
    # 2 nodes; one removed at 30 s (rate 10 -> 6); training at 10/s, then 3/s after the loss
    events = [NodeEvent(0.0, "add", 0), NodeEvent(0.0, "add", 1), NodeEvent(30.0, "remove", 1)]
    curve = linear_curve(1.0, 30.0, 10.0) + [
        (t, 300.0 + 3.0 * (t - 30.0)) for t in range(31, 101)]
    split = gap_split(curve, events, RATES, 100.0, window_s=20.0)
    assert {n: split.parts[n].slices for n in CLASSES} == {
        "startup": 1, "node_events": 2, "steady": 2}
    events_part = split.parts["node_events"]  # 20-60 s: 10 s at 10/s, then 30 s at 6/s
    assert events_part.expected == pytest.approx(10 * 10.0 + 30 * 6.0)
    assert events_part.samples == pytest.approx(100.0 + 30 * 3.0)
    assert split.parts["steady"].expected == pytest.approx(40 * 6.0)  # 60-100 s
    assert split.parts["steady"].missing == pytest.approx(40 * 3.0)


def test_the_parts_add_up_to_failure_free_minus_useful_samples():
    events = [NodeEvent(0.0, "add", 0), NodeEvent(0.0, "add", 1), NodeEvent(12.5, "remove", 1),
              NodeEvent(47.0, "add", 2), NodeEvent(90.0, "remove", 0)]
    records = [Progress(float(t), t, 8 if t % 3 else 16, None) for t in range(3, 110)]
    duration = 110.0
    result = gc.summarize("x", records, duration, 2.0, rewinds=[(0.0, 0), (70.0, 40)])
    seconds = gr.count_seconds(events, duration)
    cmp = gr.compare_rates(RATES, RATES, seconds)
    split = gap_split(result.curve, events, cmp.own["moshray"], duration, window_s=15.0)
    assert split.missing == pytest.approx(cmp.failure_free["moshray"] - result.samples)
    assert sum(p.slices for p in split.parts.values()) == 8  # 110 s in 15-s slices


def test_a_rollback_makes_its_slice_gain_less_than_nothing():
    # one node; steps 1-24 at 1-24 s, a restart from step 1's checkpoint at 24.5 s, then
    # steps 2-17 at 25-40 s (10 samples each): 200 useful at 20 s, 10 + 160 = 170 at 40 s
    records = [Progress(float(t), t, 10, None) for t in range(1, 25)]
    records += [Progress(float(t), t - 23, 10, None) for t in range(25, 41)]
    result = gc.summarize("x", records, 40.0, 2.0, rewinds=[(0.0, 0), (24.5, 1)])
    split = gap_split(result.curve, [NodeEvent(0.0, "add", 0)], RATES, 40.0, window_s=20.0)
    assert split.parts["steady"].samples == pytest.approx(-30.0)
    assert split.parts["steady"].missing == pytest.approx(20 * 6.0 + 30.0)
    assert split.missing == pytest.approx(40 * 6.0 - result.samples)


def test_a_system_that_never_steps_is_all_startup():
    events = [NodeEvent(0.0, "add", 0), NodeEvent(10.0, "add", 1)]
    split = gap_split([(0.0, 0)], events, RATES, 30.0, window_s=20.0)
    assert split.parts["startup"].slices == 2
    assert split.parts["startup"].missing == pytest.approx(10 * 6.0 + 20 * 10.0)
    assert split.parts["steady"].slices == split.parts["node_events"].slices == 0


def test_json_and_console_line():
    events = [NodeEvent(0.0, "add", 0)]
    split = gap_split(linear_curve(2.0, 40.0, 6.0), events, RATES, 40.0, window_s=20.0)
    out = split.to_json()
    assert json.loads(json.dumps(out)) == out
    assert out["window_s"] == 20.0
    assert set(out) == {"window_s", "missing", *CLASSES, "by_slice"}
    assert out["by_slice"] == [[0.0, "startup", 120.0, 114.0], [20.0, "steady", 120.0, 120.0]]
    assert out["startup"]["ratio"] == pytest.approx(114.0 / 120.0)
    assert out["node_events"]["ratio"] is None  # nothing expected there
    assert split.line() == "start-up 6, after node events 0, steady 0"


def test_a_non_positive_window_is_refused():
    with pytest.raises(ValueError, match="window_s"):
        gap_split([(0.0, 0)], [], RATES, 10.0, window_s=0.0)


def test_replica_starts_counts_joins_that_trained_and_those_gone_first():
    timelines = {
        "r0": [("starting", 0.0), ("syncing", 9.0), ("training", 10.0)],
        "r1": [("starting", 1.0), ("syncing", 14.0), ("training", 15.0), ("gone", 80.0)],
        "r2": [("starting", 20.0), ("gone", 23.5)],  # its node lived shorter than a join
        "r3": [("starting", 30.0), ("leaving", 31.0), ("gone", 32.0)],
        "r4": [("starting", 95.0)],  # still starting at the end
    }
    starts = replica_starts(timelines)
    assert (starts.started, starts.trained, starts.gone_untrained) == (5, 2, 2)
    assert sorted(starts.to_training_s) == [10.0, 14.0]
    assert starts.gone_untrained_s == pytest.approx(3.5 + 2.0)
    j = json.loads(json.dumps(starts.to_json()))
    assert j["to_training_median_s"] == 12.0 and j["to_training_max_s"] == 14.0
    assert j["gone_untrained"] == 2 and j["gone_untrained_s"] == 5.5
    line = starts.line()
    assert line.startswith("5 replicas started, 2 trained (start -> training median 12.0 s, "
                           "max 14.0 s), ")
    assert "2 gone before training (5.5 s of starting)" in line


def test_replica_starts_of_a_run_without_replicas():
    starts = replica_starts({})
    assert starts.to_json() == {"started": 0, "trained": 0, "to_training_median_s": None,
                                "to_training_max_s": None, "gone_untrained": 0,
                                "gone_untrained_s": 0.0}
    assert starts.line() == ("0 replicas started, 0 trained, 0 gone before training "
                             "(0.0 s of starting)")


def test_the_slices_are_kept_and_the_worst_named_in_time_order():
    # 2 nodes, then 1 from 30 s (a removal): 20 samples/s at 2 nodes, 10 at 1
    events = [NodeEvent(0.0, "add", 0), NodeEvent(0.0, "add", 1), NodeEvent(30.0, "remove", 1)]
    curve = [(0.0, 0), (10.0, 0), (20.0, 200), (40.0, 400), (60.0, 590), (80.0, 790)]
    split = gap_split(curve, events, {1: 10.0, 2: 20.0}, 80.0, window_s=20.0)
    assert [(p.start_s, p.end_s, p.kind) for p in split.slices] == [
        (0.0, 20.0, "startup"), (20.0, 40.0, "node_events"), (40.0, 60.0, "node_events"),
        (60.0, 80.0, "steady")]
    assert [p.missing for p in split.slices] == pytest.approx([200.0, 100.0, 10.0, 0.0])
    assert sum(p.missing for p in split.slices) == pytest.approx(split.missing)
    assert [p.start_s for p in split.worst(2)] == [0.0, 20.0]  # the two largest, in order
    assert split.worst_line(2) == ("0-20 s (start-up) 200 of 400 missing; "
                                   "20-40 s (after node events) 100 of 300 missing")
    assert gap_split([(0.0, 0), (20.0, 500)], events[:2], {2: 20.0}, 20.0).worst_line() == (
        "none")  # above its rates everywhere
