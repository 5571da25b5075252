"""The driver's waits on a move of the job's state (jobs/controller/driver_calls.py): bounded
by the bytes that move and the rate measured, never by a constant. No Ray."""

from __future__ import annotations

from moshray.jobs.controller.driver_calls import MoveBounds, move_verdict

BOUNDS = MoveBounds(start_s=120.0, stall_s=60.0, margin=2.0, slack_s=30.0)
GB = 1_000_000_000


def progress(done: int, total: int, since_s: float, idle_s: float = 0.0) -> dict:
    return {"done": done, "total": total, "since_s": since_s, "idle_s": idle_s}


def test_a_save_is_waited_on_while_its_bytes_move_however_long_it_takes():
    # 8 GB at 20 MB/s: 400 s, far over any fixed minute, and still moving
    assert move_verdict(progress(6 * GB, 8 * GB, 300.0), 301.0, BOUNDS) is None
    # serializing (size not known yet), within the start bound
    assert move_verdict(progress(0, 0, 100.0), 100.0, BOUNDS) is None
    assert move_verdict(None, 5.0, BOUNDS) is None  # not asked yet, or answering late


def test_a_save_that_stops_moving_or_outruns_the_measured_rate_ends_with_its_figures():
    stalled = move_verdict(progress(3 * GB, 8 * GB, 200.0, idle_s=61.0), 201.0, BOUNDS)
    assert stalled == "no byte moved for 61 s (3.0 GB of 8.0 GB written)"
    never_sized = move_verdict(progress(0, 0, 121.0), 121.0, BOUNDS)
    assert never_sized == "the state was not serialized and sized within 120 s"
    assert move_verdict(None, 121.0, BOUNDS) == never_sized
    # the last save ran at 20 MB/s: 8 GB is ~400 s, bound 2 x 400 + 30 = 830 s
    measured = MoveBounds(rate=20e6)
    assert move_verdict(progress(7 * GB, 8 * GB, 800.0), 800.0, measured) is None
    slow = move_verdict(progress(7 * GB, 8 * GB, 831.0), 831.0, measured)
    assert slow == ("8.0 GB at the 20.0 MB/s the last save measured takes ~400 s; its bound "
                    "of 830 s (2x + 30 s) passed with 7.0 GB written")
    # no rate measured yet: the first save is bounded by the stall rule alone
    assert move_verdict(progress(7 * GB, 8 * GB, 5000.0), 5000.0, BOUNDS) is None


def test_a_callers_own_deadline_ends_the_wait():
    stopping = MoveBounds(limit_s=10.0)
    assert move_verdict(progress(GB, 8 * GB, 9.0), 9.0, stopping) is None
    assert move_verdict(progress(GB, 8 * GB, 11.0), 11.0, stopping) == \
        "the caller's limit of 10 s passed"
