"""The Coordinator's state stays bounded however long the run (pure: an injected clock, no
Ray): the notice records, the draining-node marks, the step timings, what departed peers
were seen holding and the metrics sink's record are windows, while the run's counts
(notices, rebalance delays) stay exact."""

from __future__ import annotations

import json

from moshray.cluster import metrics
from moshray.cluster.coordinator import notices as notices_mod
from moshray.cluster.coordinator.core import CoordinatorCore
from moshray.cluster.coordinator.membership import DRAINED_KEEP_S, MembershipConfig
from moshray.cluster.coordinator.metrics_sink import MetricsSink
from moshray.cluster.coordinator.notices import NoticeBook
from moshray.cluster.coordinator import progress
from moshray.cluster.coordinator.progress import ProgressReport


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def churn(seconds: int, peers: int = 12):
    """A swarm of ``peers`` that steps every second; each second one node gets a notice
    (its peer leaves), one peer dies without a word, and two join."""
    clock = Clock()
    core = CoordinatorCore(MembershipConfig(peer_ttl_s=5.0), clock=clock,
                           target_batch_size=peers * 4)
    serial = iter(range(10**6))
    alive: list[str] = []

    def join() -> None:
        p = f"p{next(serial):05d}"
        core.register(p, p, f"n-{p}")
        core.donor(p)
        assert core.mark_ready(p, core.epoch)
        alive.append(p)

    for _ in range(peers):
        join()
    sizes = []
    for second in range(seconds):
        noticed, silent = alive.pop(0), alive.pop(0)
        core.note_notice(f"n-{noticed}", deadline_s=2.0)
        core.leave(noticed)
        del silent  # it just stops
        join(), join()
        epoch = core.epoch
        for p in list(alive):
            core.heartbeat(p)
            core.report(ProgressReport(p, epoch, 8))
        if core.epoch > epoch:
            for p in list(alive):
                reply = core.report(ProgressReport(p, core.epoch, 0))
                if reply.resync:
                    core.mark_ready(p, core.epoch)
        clock.t += 1.0
        if second in (seconds // 2, seconds - 1):
            sizes.append(len(json.dumps(core.snapshot())))
    return core, sizes


def test_a_long_run_keeps_windows_not_histories(monkeypatch):
    monkeypatch.setattr(progress, "TIMINGS_KEEP", 64)
    seconds = 400
    core, sizes = churn(seconds)
    assert core.epoch >= seconds // 3  # it stepped through the churn
    keep = notices_mod.KEEP_S + 2.0 + notices_mod.PRUNE_EVERY_S + 1
    assert len(core.notices.records) <= keep < seconds  # notices kept a minute past deadline
    assert len(core.membership.draining_nodes()) <= DRAINED_KEEP_S + 4
    assert len(core.progress.timings) == 64 < core.epoch
    members = len(core.membership.members())
    assert len(core.progress._held) <= members + 2 * core.progress.hold_s + 2
    assert sizes[1] <= sizes[0] * 1.1  # the saved records do not grow with the run
    stats = core.stats()
    assert stats["notices"] == seconds and stats["rebalance_pending"] <= 1  # (the last)
    assert len(stats["rebalance_s"]) == notices_mod.RECENT
    assert stats["rebalance_s_max"] == max(stats["rebalance_s"])
    assert core.shards.snapshot() == {"next": 0}


def test_the_notice_book_counts_every_notice_while_it_drops_old_records():
    book = NoticeBook()
    for i in range(3 * notices_mod.KEEP_RECORDS):  # deadlines far off: the cap drops them
        book.note(f"n{i}", float(i), 0.0, i, (f"p{i}",), deadline=1e9)
        book.rebalanced(i + 1, i + 0.5)
    assert len(book.records) <= notices_mod.KEEP_RECORDS + 1
    assert f"n{3 * notices_mod.KEEP_RECORDS - 1}" in book.records  # the newest are kept
    summary = book.summary()
    assert summary["notices"] == book.total == book.closed == 3 * notices_mod.KEEP_RECORDS
    assert summary["rebalance_s"] == [0.5] * notices_mod.RECENT
    again = NoticeBook()
    again.restore(json.loads(json.dumps(book.snapshot())))
    assert again.summary() == summary and again.stats() == book.stats()


def test_the_metrics_sink_observes_each_rebalance_once_with_a_record_of_constant_size():
    book = NoticeBook()
    sink = MetricsSink(metrics.Prices(), lambda: None)
    observed = []
    sink.exporter.apply = lambda event: observed.append(event.seconds)
    for i in range(50):
        book.note(f"n{i}", float(i), 0.0, i, (f"p{i}",), deadline=i + 2.0)
        book.rebalanced(i + 1, i + 0.25)
        sink.observe_rebalances(book)
        sink.observe_rebalances(book)  # nothing new: nothing observed
    assert observed == [0.25] * 50
    assert sink.snapshot()["rebalances_seen"] == 50
    restored = MetricsSink(metrics.Prices(), lambda: None)
    restored.restore(sink.snapshot())
    restored.exporter.apply = lambda event: observed.append(event.seconds)
    restored.observe_rebalances(book)
    assert len(observed) == 50  # none observed twice after a restart
