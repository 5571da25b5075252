"""Tests for moshray.autoscaler.traces: parsing, scheduling, replay on a fake clock. No Ray."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from moshray.autoscaler.traces import (
    NodeEvent,
    Trace,
    TraceError,
    TraceReplayer,
    initial_slots,
    live_node_seconds,
    load_trace,
    scale_count,
    schedule,
    with_notices,
)

@pytest.fixture
def aws() -> Trace:
    """The real AWS trace that ships with moshray."""
    from moshray.autoscaler.traces import DEFAULT_TRACE

    return load_trace(DEFAULT_TRACE)


def replay_counts(events, until: float | None = None) -> list[tuple[float, int, frozenset[int]]]:
    """(time, live count, live slots) after each batch of same-time events; checks slot sanity."""
    live: set[int] = set()
    out = []
    i = 0
    while i < len(events):
        t = events[i].at_s
        while i < len(events) and events[i].at_s == t:
            ev = events[i]
            if ev.kind == "add":
                assert ev.slot not in live, f"slot {ev.slot} added twice at {t}"
                live.add(ev.slot)
            else:
                assert ev.slot in live, f"slot {ev.slot} removed while not live at {t}"
                live.remove(ev.slot)
            i += 1
        out.append((t, len(live), frozenset(live)))
    return out


def live_after(events, t: float) -> int:
    n = 0
    for ev in events:
        if ev.at_s > t:
            break
        n += 1 if ev.kind == "add" else -1
    return n


# ----------------------------------------------------------------------- real trace


def test_real_trace_parses(aws: Trace) -> None:
    assert aws.name == "aws-g4dn-xlarge-us-east-1c-2020-11-20"
    assert aws.duration_s == 88194.0
    assert aws.max_count == 12
    assert not aws.per_node
    assert aws.points[:5] == ((0.0, 0), (21529.0, 4), (21556.0, 12), (21637.0, 5), (21725.0, 12))
    assert aws.points[-1] == (88194.0, 7)
    times = [t for t, _ in aws.points]
    assert times == sorted(set(times))
    # step function semantics: a change takes effect at its time and holds until the next
    assert aws.live_at(0) == 0
    assert aws.live_at(21528.9) == 0
    assert aws.live_at(21529) == 4
    assert aws.live_at(21540) == 4
    assert aws.live_at(21556) == 12
    assert aws.live_at(1e9) == 7
    assert aws.first_nonzero_s() == 21529.0


def test_real_trace_schedule_compressed(aws: Trace) -> None:
    start = aws.first_nonzero_s()
    wall = 600.0
    scale = (aws.duration_s - start) / wall  # whole non-empty trace in ~10 wall minutes
    events = schedule(aws, time_scale=scale, max_nodes=4)
    assert events == schedule(aws, time_scale=scale, max_nodes=4)  # deterministic
    assert [e.at_s for e in events] == sorted(e.at_s for e in events)
    assert all(0 <= e.slot < 4 for e in events)
    assert events[-1].at_s == pytest.approx(wall)

    batches = replay_counts(events)
    assert batches[0][0] == 0.0
    assert batches[0][1] == scale_count(4, 12, 4) == 1  # 4 of 12 -> 1 of 4
    for _, n, _ in batches:
        assert 1 <= n <= 4
    # adds minus removes = final live count = scaled final trace count (7 of 12 -> 2)
    adds = sum(e.kind == "add" for e in events)
    removes = sum(e.kind == "remove" for e in events)
    assert adds - removes == scale_count(7, 12, 4) == 2
    # count traces remove LIFO, so live slots are always 0..n-1
    for _, n, slots in batches:
        assert slots == frozenset(range(n))

    # sampled wall times match the scaled trace (avoid sampling exactly on change points)
    for k in range(1, 200):
        w = wall * k / 200 + 1e-6
        expected = scale_count(aws.live_at(start + w * scale), 12, 4)
        assert live_after(events, w) == expected, f"wall {w:.3f}"


def test_schedule_duration_and_start(aws: Trace) -> None:
    full = schedule(aws, time_scale=60.0, max_nodes=4)
    cut = schedule(aws, time_scale=60.0, max_nodes=4, duration_s=120.0)
    assert cut == tuple(e for e in full if e.at_s <= 120.0)
    # start_s=0 replays the leading empty period: min_nodes keeps one node alive there
    from_zero = schedule(aws, time_scale=60.0, max_nodes=4, start_s=0.0)
    assert [e for e in from_zero if e.at_s == 0] == [NodeEvent(0.0, "add", 0)]
    assert from_zero[1].at_s == pytest.approx(21556.0 / 60.0)
    # min_nodes=0 lets the count reach 0
    empty_start = schedule(aws, time_scale=60.0, max_nodes=4, start_s=0.0, min_nodes=0)
    assert empty_start[0].at_s == pytest.approx(21529.0 / 60.0)


def test_live_node_seconds() -> None:
    ev = (
        NodeEvent(0.0, "add", 0),
        NodeEvent(0.0, "add", 1),
        NodeEvent(10.0, "remove", 1),
        NodeEvent(20.0, "add", 1),
        NodeEvent(50.0, "remove", 0),
    )
    # 2*10 + 1*10 + 2*10 (20..30)
    assert live_node_seconds(ev, 30.0) == pytest.approx(50.0)
    assert live_node_seconds(ev, 60.0) == pytest.approx(20 + 10 + 2 * 30 + 10)
    assert live_node_seconds(ev[2:], 10.0, initial=2) == pytest.approx(20.0)


@pytest.mark.parametrize(
    ("count", "max_count", "max_nodes", "min_nodes", "expected"),
    [(12, 12, 4, 1, 4), (0, 12, 4, 1, 1), (0, 12, 4, 0, 0), (5, 12, 4, 1, 2), (6, 12, 4, 1, 2),
     (1, 2, 3, 1, 2), (3, 12, 2, 1, 1), (0, 0, 4, 1, 1), (12, 12, 24, 1, 24)],
)
def test_scale_count(count, max_count, max_nodes, min_nodes, expected) -> None:
    # 5/3 = 1.67 -> 2; 1*3/2 = 1.5 -> 2 (half up); 3*2/12 = 0.5 -> 1
    assert scale_count(count, max_count, max_nodes, min_nodes) == expected


def test_schedule_rejects_bad_args() -> None:
    tr = Trace("t", ((0.0, 1), (10.0, 2)))
    for kwargs in ({"time_scale": 0}, {"max_nodes": 0}, {"min_nodes": 5}, {"duration_s": -1}):
        args = {"time_scale": 1.0, "max_nodes": 2, **kwargs}
        with pytest.raises(ValueError):
            schedule(tr, **args)


# ---------------------------------------------------------------- per-node format


def test_per_node_trace(tmp_path: Path) -> None:
    p = tmp_path / "nodes.csv"
    p.write_text(
        "timestamp_ms,action,node_id\n"
        "0,add,node1\n0,add,node2\n0,add,node3\n"
        "60000,add,node4\n"
        "120000,remove,node2\n"  # the middle node goes: its slot must go, not the last one
        "180000,add,node5\n"
        "240000,remove,node1\n"
        "300000,remove,node3\n"
    )
    tr = load_trace(p)
    assert tr.per_node
    assert tr.points == ((0.0, 3), (60.0, 4), (120.0, 3), (180.0, 4), (240.0, 3), (300.0, 2))
    assert tr.duration_s == 300.0 and tr.max_count == 4

    ev = schedule(tr, time_scale=60.0, max_nodes=4)  # no scaling: one slot per trace node
    assert ev == (
        NodeEvent(0.0, "add", 0),  # node1
        NodeEvent(0.0, "add", 1),  # node2
        NodeEvent(0.0, "add", 2),  # node3
        NodeEvent(1.0, "add", 3),  # node4
        NodeEvent(2.0, "remove", 1),  # node2, not LIFO slot 3
        NodeEvent(3.0, "add", 1),  # node5 reuses the lowest free slot
        NodeEvent(4.0, "remove", 0),  # node1
        NodeEvent(5.0, "remove", 2),  # node3
    )
    assert initial_slots(ev) == (0, 1, 2)


def test_per_node_scaled_and_replacement(tmp_path: Path) -> None:
    p = tmp_path / "nodes.csv"
    # 4 nodes -> 2 slots held by a, b. Removing c (no slot) at 4->3 nodes keeps 2 slots
    # (3*2/4 = 1.5 -> 2); removing a at the same time as adding e swaps a's slot.
    p.write_text(
        "0,add,a\n0,add,b\n0,add,c\n0,add,d\n"
        "1000,remove,c\n"
        "2000,remove,a\n2000,add,e\n"
        "3000,remove,b\n"
    )
    tr = load_trace(p)
    ev = schedule(tr, time_scale=1.0, max_nodes=2)
    assert ev == (
        NodeEvent(0.0, "add", 0),  # a
        NodeEvent(0.0, "add", 1),  # b
        NodeEvent(2.0, "remove", 0),  # a preempted ...
        NodeEvent(2.0, "add", 0),  # ... and its slot refilled (count 3 -> 2 slots)
        NodeEvent(3.0, "remove", 1),  # b: 2 nodes left -> 1 slot
    )
    for t, n, _slots in replay_counts(ev):
        assert n == scale_count(tr.live_at(t), 4, 2)


# ------------------------------------------------------------------------ bad files


@pytest.mark.parametrize(
    ("text", "line", "fragment"),
    [
        ("hello world\n", 1, "unknown header"),
        ("time,foo,bar\n0,add,n\n", 1, "unknown header"),
        ("seconds_since_start,available_instances\n0,1\n5,x\n", 3, "bad row"),
        ("0,1\n-5,2\n", 2, "bad row"),
        ("0,1\n10,2\n5,3\n", 3, "backwards"),
        ("0,1\n10,2.5\n", 2, "bad row"),
        ("0,1\n10,2,3,4\n", 2, "columns"),
        ("0,add,n1\n100,explode,n1\n", 2, "unknown action"),
        ("0,add,n1\n-100,remove,n1\n", 2, "bad time"),
        ("0,add,n1\n100,remove,n2\n", 2, "not live"),
        ("0,add,n1\n100,add,n1\n", 2, "already live"),
        ("0,add,n1\n100,remove\n", 2, "columns"),
        ("# only a comment\n\n", 1, "no data rows"),
        ("1,2,3,4\n", 1, "columns"),
    ],
)
def test_bad_files(tmp_path: Path, text: str, line: int, fragment: str) -> None:
    p = tmp_path / "bad.csv"
    p.write_text(text)
    with pytest.raises(TraceError) as info:
        load_trace(p)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"{p}:{line}: "), msg
    assert fragment in msg
    assert "expected" in msg
    assert isinstance(info.value, ValueError)


def test_count_header_and_comments(tmp_path: Path) -> None:
    p = tmp_path / "c.csv"
    p.write_text("# recorded by hand\nseconds_since_start,available_instances\n0,2\n\n10,2\n10,3\n20,3\n")
    tr = load_trace(p)
    assert tr.points == ((0.0, 2), (10.0, 3), (20.0, 3))  # last row kept as end marker
    assert tr.duration_s == 20.0


# ------------------------------------------------------------------------- replayer


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, dt: float) -> None:
        assert dt > 0
        self.sleeps.append(dt)
        self.now += dt


def test_replayer_applies_in_order_at_times() -> None:
    clock = FakeClock()
    calls: list[tuple[float, str, int]] = []
    ev = (
        NodeEvent(0.0, "add", 0),
        NodeEvent(0.0, "add", 1),
        NodeEvent(1.5, "remove", 1),
        NodeEvent(4.0, "add", 1),
        NodeEvent(4.0, "add", 2),
    )
    r = TraceReplayer(
        ev,
        add_node=lambda s: calls.append((clock.now - 100.0, "add", s)),
        remove_node=lambda s: calls.append((clock.now - 100.0, "remove", s)),
        clock=clock,
        sleep=clock.sleep,
    )
    r.run()
    assert calls == [(0.0, "add", 0), (0.0, "add", 1), (1.5, "remove", 1), (4.0, "add", 1), (4.0, "add", 2)]
    assert [e for _, e in r.history] == list(ev)
    for wall, e in r.history:
        assert wall == pytest.approx(e.at_s)
    assert max(clock.sleeps) <= 0.25  # sleeps are sliced so stop() is noticed
    assert r.errors == ()


def test_replayer_skip_initial_and_survives_errors() -> None:
    clock = FakeClock()
    added: list[int] = []

    def remove(slot: int) -> None:
        raise RuntimeError(f"node {slot} already gone")

    ev = (NodeEvent(0.0, "add", 0), NodeEvent(1.0, "remove", 0), NodeEvent(2.0, "add", 1))
    r = TraceReplayer(ev, added.append, remove, clock=clock, sleep=clock.sleep, skip_initial=True)
    r.run()
    assert added == [1]  # initial slot 0 skipped; the add after the failed removal still ran
    assert [e for _, e in r.history] == list(ev[1:])
    assert len(r.errors) == 1
    assert r.errors[0].event == ev[1]
    assert "already gone" in r.errors[0].error


def test_replayer_stop_event() -> None:
    clock = FakeClock()
    stop = threading.Event()
    added: list[int] = []

    def add(slot: int) -> None:
        added.append(slot)
        if slot == 1:
            stop.set()

    ev = tuple(NodeEvent(float(i), "add", i) for i in range(4))
    r = TraceReplayer(ev, add, lambda s: None, clock=clock, sleep=clock.sleep)
    r.run(stop)
    assert added == [0, 1]


def test_replayer_thread_stop_join() -> None:
    # real clock: a far-future event must not block stop()
    added: list[int] = []
    r = TraceReplayer((NodeEvent(0.0, "add", 0), NodeEvent(3600.0, "add", 1)), added.append, lambda s: None)
    r.start()
    for _ in range(200):
        if added:
            break
        threading.Event().wait(0.01)
    r.stop()
    assert r.join(timeout=2.0)
    assert added == [0]
    with pytest.raises(RuntimeError):
        r.start()


def test_kill_is_a_hard_loss_through_its_own_callable(tmp_path: Path) -> None:
    p = tmp_path / "nodes.csv"
    p.write_text("0,add,a\n0,add,b\n0,add,c\n1000,kill,b\n2000,remove,c\n3000,add,d\n")
    tr = load_trace(p)
    assert tr.points == ((0.0, 3), (1.0, 2), (2.0, 1), (3.0, 2))
    ev = schedule(tr, time_scale=1.0, max_nodes=3)
    assert ev[3:] == (NodeEvent(1.0, "kill", 1), NodeEvent(2.0, "remove", 2),
                      NodeEvent(3.0, "add", 1))
    clock = FakeClock()
    calls: list[tuple[str, int]] = []
    TraceReplayer(ev, add_node=lambda s: calls.append(("add", s)),
                  remove_node=lambda s: calls.append(("remove", s)),
                  kill_node=lambda s: calls.append(("kill", s)),
                  clock=clock, sleep=clock.sleep, skip_initial=True).run()
    assert calls == [("kill", 1), ("remove", 2), ("add", 1)]
    bad = tmp_path / "bad.csv"
    bad.write_text("0,add,a\n10,kill,z\n")
    with pytest.raises(TraceError, match="removed while not live"):
        load_trace(bad)


def test_with_notices_puts_a_notice_ahead_of_each_removal_only() -> None:
    events = (NodeEvent(0.0, "add", 0), NodeEvent(0.0, "add", 1), NodeEvent(5.0, "remove", 0),
              NodeEvent(6.0, "kill", 1), NodeEvent(6.5, "add", 0), NodeEvent(7.0, "remove", 0))
    out = with_notices(events, 2.0)
    notices = [e for e in out if e.kind == "notice"]
    # 5 - 2 = 3; the second removal's notice is clamped to the slot's add at 6.5.
    assert notices == [NodeEvent(3.0, "notice", 0), NodeEvent(6.5, "notice", 0)]
    assert [e for e in out if e.kind != "notice"] == sorted(events, key=lambda e: e.at_s)
    assert [e.at_s for e in out] == sorted(e.at_s for e in out)
    # A notice clamped to the slot's add comes after that add, never before it.
    assert out.index(NodeEvent(6.5, "notice", 0)) == out.index(NodeEvent(6.5, "add", 0)) + 1
    assert with_notices(events, 0.0)[2] == NodeEvent(5.0, "notice", 0)
    with pytest.raises(ValueError, match="notice_s"):
        with_notices(events, -1.0)


def test_replayer_hands_notices_to_their_callable() -> None:
    events = with_notices((NodeEvent(0.0, "add", 0), NodeEvent(0.2, "remove", 0)), 0.1)
    seen: list[tuple[str, int]] = []
    replay = TraceReplayer(events, lambda s: seen.append(("add", s)),
                           lambda s: seen.append(("remove", s)),
                           notice_node=lambda s: seen.append(("notice", s)))
    replay.run()
    assert seen == [("add", 0), ("notice", 0), ("remove", 0)]
    quiet = TraceReplayer(events, lambda s: None, lambda s: seen.append(("remove", s)))
    quiet.run()  # without a notice callable, notices are skipped
    assert seen[-1] == ("remove", 0) and len(quiet.history) == 3
