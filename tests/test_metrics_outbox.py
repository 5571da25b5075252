"""The replica's metrics batching (actors/replica/metrics_outbox.py): what is sent, when, and that a
Coordinator that is gone loses only the batch in hand."""

from __future__ import annotations

import logging

import ray

from moshray.actors.replica.metrics_outbox import MetricsOutbox


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Record:
    def __init__(self, fail: bool = False) -> None:
        self.batches: list[tuple] = []
        self.fail = fail

    def remote(self, batch: tuple) -> None:
        if self.fail:
            raise ray.exceptions.RayActorError()
        self.batches.append(batch)


class _Coordinator:
    def __init__(self, fail: bool = False) -> None:
        self.record = _Record(fail)


def test_events_wait_until_the_interval_passes_then_go_in_one_batch():
    clock, coordinator = _Clock(), _Coordinator()
    outbox = MetricsOutbox("p0", coordinator, every_s=1.0, clock=clock)
    outbox.add(("a",))
    clock.now += 0.5
    outbox.add(("b", "c"))
    assert coordinator.record.batches == []
    clock.now += 0.6
    outbox.add(("d",))
    assert coordinator.record.batches == [("a", "b", "c", "d")]
    assert outbox.events == []


def test_flush_sends_at_once_and_an_empty_queue_sends_nothing():
    clock, coordinator = _Clock(), _Coordinator()
    outbox = MetricsOutbox("p0", coordinator, every_s=1.0, clock=clock)
    outbox.add((), flush=True)
    clock.now += 5.0
    outbox.add(())
    assert coordinator.record.batches == []
    outbox.add(("a",), flush=True)
    assert coordinator.record.batches == [("a",)]


def test_a_gone_coordinator_drops_that_batch_and_the_outbox_goes_on(caplog):
    clock, coordinator = _Clock(), _Coordinator(fail=True)
    outbox = MetricsOutbox("p0", coordinator, every_s=1.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="moshray.actors.replica.metrics_outbox"):
        outbox.add(("a",), flush=True)  # does not raise
    assert outbox.events == []
    assert "metrics not recorded" in caplog.text
    coordinator.record.fail = False
    outbox.add(("b",), flush=True)
    assert coordinator.record.batches == [("b",)]
