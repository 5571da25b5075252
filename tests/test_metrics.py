"""The Prometheus exporter: exposition format, values after events, the Coordinator's endpoint.

Pure tests drive ``MetricsExporter`` with events and parse its text output with
prometheus_client's own parser. The cluster test creates a real Coordinator actor with an
exporter on a free port, registers peers, commits a global step, records events and
scrapes its HTTP endpoint.
"""

from __future__ import annotations

import math
import socket
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from moshray.cluster import metrics as m
from moshray.cluster.messages import AllReduceReport, RejectReason, Rejection


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: dict, family: str, sample: str | None = None, **labels) -> float:
    """The one sample named ``sample`` (default: the family name) carrying ``labels``."""
    name = sample or family
    hits = [s.value for s in fams[family].samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, f"{name}{labels}: {hits}"
    return hits[0]


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        assert resp.status == 200
        return resp.read().decode()


# -- pure: events -> exposition --------------------------------------------------------------


def test_events_are_counted_and_output_parses():
    state = m.TrainingState(live_peers=3, draining_peers=1, global_step=42, samples_total=5376,
                            samples_per_s=128.0, loss=2.75, preemptions=2, live_experts=6)
    ex = m.MetricsExporter(m.Prices(spot_per_hour=0.25, on_demand_per_hour=1.0),
                           state=lambda: state)
    applied = ex.apply_all([
        m.RoundEvent(0.2, 1000, (("late", 2), ("non_finite", 1)), failed=True),
        m.RoundEvent(0.7, 3000, cross_zone_bytes=1200),
        m.NoticeEvent("aws", "g4dn.xlarge/us-east-1a"),
        m.NoticeEvent("aws", "g4dn.xlarge/us-east-1a"),
        m.NoticeEvent("gcp", "n1-standard-8/us-central1-a"),
        m.NodeLostEvent(with_notice=True),
        m.NodeLostEvent(with_notice=False),
        m.NodeLostEvent(with_notice=False),
        m.RebalanceEvent(1.5),
        m.JoinEvent(12.0),
        m.ExpertCallEvent("ok", 0.004),
        m.ExpertCallEvent("ok", 0.02),
        m.ExpertCallEvent("timeout", 1.0),
        m.LaunchEvent("g4dn.xlarge/us-east-1a", ok=True),
        m.LaunchEvent("g4dn.xlarge/us-east-1a", ok=False),
        m.LaunchEvent("m5.large/us-east-1b", ok=True, market="on_demand"),
        m.CapacityEvent(spot_nodes=3, on_demand_nodes=1),
    ])
    assert applied == 17
    f = families(ex.render())

    assert value(f, "moshray_peers", state="live") == 3
    assert value(f, "moshray_peers", state="draining") == 1
    assert value(f, "moshray_global_step") == 42
    assert value(f, "moshray_samples_processed", "moshray_samples_processed_total") == 5376
    assert value(f, "moshray_samples_per_second") == 128.0
    assert value(f, "moshray_training_loss") == 2.75
    assert value(f, "moshray_preemptions", "moshray_preemptions_total") == 2
    assert value(f, "moshray_live_experts") == 6

    rounds = "moshray_allreduce_round_duration_seconds"
    assert value(f, rounds, rounds + "_count") == 2
    assert value(f, rounds, rounds + "_sum") == pytest.approx(0.9)
    assert value(f, rounds, rounds + "_bucket", le="0.25") == 1
    assert value(f, rounds, rounds + "_bucket", le="1.0") == 2
    assert value(f, "moshray_allreduce_sent_bytes", "moshray_allreduce_sent_bytes_total") == 4000
    cross = "moshray_allreduce_cross_zone_sent_bytes"
    assert value(f, cross, cross + "_total") == 1200
    assert value(f, "moshray_allreduce_failed_rounds",
                 "moshray_allreduce_failed_rounds_total") == 1
    rej = "moshray_allreduce_rejected_contributions"
    assert value(f, rej, rej + "_total", reason="late") == 2
    assert value(f, rej, rej + "_total", reason="non_finite") == 1

    notices = "moshray_preemption_notices"
    assert value(f, notices, notices + "_total", cloud="aws",
                 pool="g4dn.xlarge/us-east-1a") == 2
    assert value(f, notices, notices + "_total", cloud="gcp",
                 pool="n1-standard-8/us-central1-a") == 1
    assert value(f, "moshray_nodes_lost", "moshray_nodes_lost_total", notice="true") == 1
    assert value(f, "moshray_nodes_lost", "moshray_nodes_lost_total", notice="false") == 2
    assert value(f, "moshray_rebalance_seconds", "moshray_rebalance_seconds_sum") == 1.5
    join = "moshray_join_to_first_contribution_seconds"
    assert value(f, join, join + "_count") == 1

    calls = "moshray_expert_calls"
    assert value(f, calls, calls + "_total", outcome="ok") == 2
    assert value(f, calls, calls + "_total", outcome="timeout") == 1
    assert value(f, calls, calls + "_total", outcome="failed") == 0
    assert value(f, calls, calls + "_total", outcome="rejected") == 0
    lat = "moshray_expert_call_latency_seconds"
    assert value(f, lat, lat + "_count") == 3
    assert value(f, lat, lat + "_bucket", le="0.005") == 1

    spot_pool = dict(pool="g4dn.xlarge/us-east-1a", market="spot")
    assert value(f, "moshray_launches", "moshray_launches_total", **spot_pool) == 2
    assert value(f, "moshray_launch_failures", "moshray_launch_failures_total", **spot_pool) == 1
    assert value(f, "moshray_launches", "moshray_launches_total", pool="m5.large/us-east-1b",
                 market="on_demand") == 1
    assert value(f, "moshray_nodes", market="spot") == 3
    assert value(f, "moshray_nodes", market="on_demand") == 1
    per_hour = 3 * 0.25 + 1 * 1.0
    assert value(f, "moshray_estimated_cost_dollars_per_hour") == pytest.approx(per_hour)
    assert value(f, "moshray_estimated_cost_dollars_per_sample") == \
        pytest.approx(per_hour / 3600 / 128.0)
    assert value(f, "moshray_node_price_dollars_per_hour", market="spot") == 0.25


def test_cost_sums_the_live_nodes_prices_and_names_their_sources():
    ex = m.MetricsExporter(m.Prices(spot_per_hour=0.16, on_demand_per_hour=0.526),
                           state=lambda: m.TrainingState(samples_per_s=100.0))
    ex.apply(m.CapacityEvent(2, 1, (("spot", 0.21, "provider"), ("spot", 0.25, "provider"),
                                    ("on_demand", 0.707, "table"))))
    f = families(ex.render())
    price = "moshray_node_price_dollars_per_hour"
    assert value(f, price, market="spot", source="provider") == pytest.approx(0.23)  # mean
    assert value(f, price, market="on_demand", source="table") == pytest.approx(0.707)
    assert not [s for s in f[price].samples if s.labels["source"] == "config"]
    per_hour = 0.21 + 0.25 + 0.707
    assert value(f, "moshray_estimated_cost_dollars_per_hour") == pytest.approx(per_hour)
    assert value(f, "moshray_estimated_cost_dollars_per_sample") == \
        pytest.approx(per_hour / 3600 / 100.0)
    # A node priced from the config, none on demand: the configured on-demand price is shown.
    ex.apply(m.CapacityEvent(2, 0, (("spot", 0.21, "provider"), ("spot", 0.16, "config"))))
    f = families(ex.render())
    assert value(f, price, market="spot", source="config") == 0.16
    assert value(f, price, market="on_demand", source="config") == 0.526
    assert value(f, "moshray_estimated_cost_dollars_per_hour") == pytest.approx(0.37)


@pytest.mark.parametrize("prices, message", [
    ((("spot", 0.2, "guess"),), "price source must be one of"),
    ((("spot", -1.0, "table"),), "node price must be a finite number"),
    ((("spot", 0.2, "table"), ("spot", 0.2, "table")), "name 2 spot and 0 on-demand"),
    ((("spot", 0.2),), "triples"),
])
def test_capacity_prices_are_validated(prices, message):
    with pytest.raises(ValueError, match=message):
        m.CapacityEvent(1, 0, prices)


def test_names_follow_prometheus_conventions():
    ex = m.MetricsExporter()
    ex.apply_all([m.RoundEvent(0.1, 10, (("late", 1),)), m.LaunchEvent("p", ok=False),
                  m.NoticeEvent("aws", "p")])
    for fam in text_string_to_metric_families(ex.render()):
        assert fam.name.startswith("moshray_"), fam.name
        if fam.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in fam.samples), fam.name
        if fam.type == "histogram":
            assert fam.name.endswith("_seconds"), fam.name
        assert "_ms" not in fam.name and "milli" not in fam.name, fam.name
    assert "moshray_allreduce_sent_bytes_total" in ex.metric_names()


def test_no_state_and_no_throughput_give_zeros_and_nan():
    ex = m.MetricsExporter()
    f = families(ex.render())
    assert value(f, "moshray_peers", state="live") == 0
    assert math.isnan(value(f, "moshray_training_loss"))
    assert math.isnan(value(f, "moshray_estimated_cost_dollars_per_sample"))
    assert value(f, "moshray_estimated_cost_dollars_per_hour") == 0


def test_failing_state_does_not_break_a_scrape():
    def broken() -> m.TrainingState:
        raise RuntimeError("coordinator busy")

    ex = m.MetricsExporter(state=broken)
    ex.apply(m.RoundEvent(0.5, 100))
    f = families(ex.render())
    assert value(f, "moshray_global_step") == 0
    assert value(f, "moshray_allreduce_sent_bytes", "moshray_allreduce_sent_bytes_total") == 100


@pytest.mark.parametrize("make, field", [
    (lambda: m.RoundEvent(-1.0, 0), "duration_s"),
    (lambda: m.RoundEvent(float("nan"), 0), "duration_s"),
    (lambda: m.RoundEvent(0.1, -5), "bytes_moved"),
    (lambda: m.RoundEvent(0.1, 5, (("late",),)), "rejected"),
    (lambda: m.RoundEvent(0.1, 5, (("late", -1),)), "rejection count"),
    (lambda: m.NoticeEvent("", "pool"), "cloud"),
    (lambda: m.NodeLostEvent(with_notice="yes"), "with_notice"),
    (lambda: m.RebalanceEvent(float("inf")), "seconds"),
    (lambda: m.JoinEvent(-3), "seconds_to_first_contribution"),
    (lambda: m.ExpertCallEvent("maybe", 0.1), "outcome"),
    (lambda: m.LaunchEvent("p", ok=True, market="reserved"), "market"),
    (lambda: m.CapacityEvent(1.5, 0), "spot_nodes"),
    (lambda: m.Prices(spot_per_hour=-1), "spot_per_hour"),
])
def test_bad_values_are_refused_with_the_field_named(make, field):
    with pytest.raises(ValueError, match=field) as err:
        make()
    assert "\n" not in str(err.value)


def test_apply_all_skips_what_is_not_an_event():
    ex = m.MetricsExporter()
    assert ex.apply_all([m.JoinEvent(3.0), "junk", {"duration_s": 1}]) == 1
    with pytest.raises(TypeError, match="not a metrics event"):
        ex.apply(42)


def test_round_event_from_an_allreduce_report():
    report = AllReduceReport(
        epoch=3, peer="a", contributors=("a", "b"), partial_contributors=(),
        rejections=(Rejection("c", 0, RejectReason.LATE), Rejection("c", 1, RejectReason.LATE),
                    Rejection("d", 0, RejectReason.NON_FINITE)),
        failed_owners=(), bytes_sent=12345, bytes_received=999, seconds=0.42, total_weight=64.0)
    ev = m.RoundEvent.from_report(report)
    assert ev == m.RoundEvent(0.42, 12345, (("late", 2), ("non_finite", 1)), failed=True)
    clean = AllReduceReport(3, "a", ("a", "b"), (), (), (), 10, 10, 0.1, 2.0)
    assert m.RoundEvent.from_report(clean).failed is False


def test_training_state_rate_over_the_recent_window():
    # (epoch, at_s, samples, loss, peers): 10 steps of 32 samples, one per second, t=1..10
    history = [(i, float(i), 32, 5.0 - 0.1 * i, 2) for i in range(1, 11)]
    s = m.training_state(history, now_s=10.0, live=2, draining=0, epoch=10, window_s=5.0)
    assert s.samples_total == 320
    assert s.samples_per_s == pytest.approx(5 * 32 / 5.0)  # steps in (5, 10]: one a second
    assert s.loss == pytest.approx(4.0)
    early = m.training_state(history[:2], now_s=2.0, live=2, draining=0, epoch=2, window_s=60)
    assert early.samples_per_s == pytest.approx(64 / 2.0)  # span = time since start
    idle = m.training_state(history, now_s=100.0, live=2, draining=0, epoch=10, window_s=30)
    assert idle.samples_per_s == 0.0 and idle.samples_total == 320
    assert m.training_state([(1, 1.0, 8, None, 1)], now_s=1, live=1, draining=0,
                            epoch=1).loss is None


def test_serves_http_on_a_free_port_and_stops():
    ex = m.MetricsExporter()
    host, port = ex.serve("127.0.0.1", 0)
    try:
        assert host == "127.0.0.1" and port > 0
        ex.apply(m.NodeLostEvent(False))
        f = families(scrape(f"{host}:{port}"))
        assert value(f, "moshray_nodes_lost", "moshray_nodes_lost_total", notice="false") == 1
        with pytest.raises(RuntimeError, match="already serving"):
            ex.serve("127.0.0.1", 0)
        other = m.MetricsExporter()
        with pytest.raises(OSError):
            other.serve("127.0.0.1", port)  # taken
        with pytest.raises(ValueError, match="metrics port"):
            other.serve("127.0.0.1", 70000)
    finally:
        ex.close()
    with pytest.raises(OSError):
        with socket.create_connection((host, port), timeout=2):
            pass


# -- the Coordinator actor on the shared local cluster ---------------------------------------


@pytest.mark.cluster
def test_coordinator_serves_metrics_from_its_state_and_events(local_cluster):
    import ray

    import moshray.cluster.coordinator.actor as coord
    from moshray.cluster.coordinator.progress import ProgressReport

    name = f"metrics-test-{time.time_ns()}"
    c = coord.get_or_create(target_batch_size=32, name=name, metrics_port=0,
                            prices=m.Prices(spot_per_hour=0.3, on_demand_per_hour=0.9))
    try:
        address = ray.get(c.metrics_address.remote(), timeout=60)
        assert address is not None and address.startswith("127.0.0.1:")
        for i in range(3):
            ray.get(c.register.remote(f"p{i}", None, f"node-{i}"), timeout=30)
            assert ray.get(c.mark_ready.remote(f"p{i}", 0), timeout=30)
        ray.get(c.report.remote(ProgressReport("p0", 0, 16, loss=3.0)), timeout=30)
        # a preemption notice for p2's node, received 0.5 s ago on that node: it re-plans
        # at once (the staying peers step with what they have): step 1 without p2,
        # planned on p0's 16, p1 taking part with none yet
        assert ray.get(c.note_notice.remote("node-2", 30.0, 0.5), timeout=30) == ("p2",)
        reply = ray.get(c.report.remote(ProgressReport("p1", 0, 16, loss=2.0)), timeout=30)
        # (p1's view of the plan: one group of the two)
        assert reply.plan is not None and reply.plan.peer_count == 2
        assert sorted(reply.plan.mates) == ["p0", "p1"]
        applied = ray.get(c.record.remote((
            m.RoundEvent(0.3, 2048, (("late", 1),), failed=True),
            m.RoundEvent(0.1, 2048),
            m.NoticeEvent("simulated", "local"),
            m.NodeLostEvent(with_notice=True),
            m.JoinEvent(4.0),
            m.CapacityEvent(spot_nodes=2, on_demand_nodes=0),
            "not an event",
        )), timeout=30)
        assert applied == 6

        f = families(scrape(address))
        assert value(f, "moshray_peers", state="live") == 2
        assert value(f, "moshray_peers", state="draining") == 1
        assert value(f, "moshray_global_step") == 1
        assert value(f, "moshray_samples_processed", "moshray_samples_processed_total") == 16
        assert value(f, "moshray_training_loss") == pytest.approx(3.0)
        assert value(f, "moshray_samples_per_second") > 0
        rounds = "moshray_allreduce_round_duration_seconds"
        assert value(f, rounds, rounds + "_count") == 2
        assert value(f, "moshray_allreduce_sent_bytes", "moshray_allreduce_sent_bytes_total") \
            == 4096
        assert value(f, "moshray_allreduce_rejected_contributions",
                     "moshray_allreduce_rejected_contributions_total", reason="late") == 1
        assert value(f, "moshray_preemption_notices", "moshray_preemption_notices_total",
                     cloud="simulated", pool="local") == 1
        # the notice was closed by the step planned after it: one delay of at least its age
        rebalance = "moshray_rebalance_seconds"
        assert value(f, rebalance, rebalance + "_count") == 1
        assert 0.5 <= value(f, rebalance, rebalance + "_sum") < 60
        f = families(scrape(address))  # observed once, not once per scrape
        assert value(f, rebalance, rebalance + "_count") == 1
        assert value(f, "moshray_estimated_cost_dollars_per_hour") == pytest.approx(0.6)
        assert value(f, "moshray_estimated_cost_dollars_per_sample") > 0
        assert value(f, "moshray_live_experts") == 0
    finally:
        ray.kill(c)


@pytest.mark.cluster
def test_coordinator_without_a_port_counts_but_does_not_serve(local_cluster):
    import ray

    import moshray.cluster.coordinator.actor as coord
    c = coord.get_or_create(name=f"metrics-noport-{time.time_ns()}")
    try:
        assert ray.get(c.metrics_address.remote(), timeout=60) is None
        assert ray.get(c.record.remote((m.JoinEvent(1.0),)), timeout=30) == 1
    finally:
        ray.kill(c)


def test_controller_events_replica_states_joins_and_quarantines():
    ex = m.MetricsExporter(m.Prices(), lambda: m.TrainingState())
    assert ex.apply_all([
        m.ReplicaStatesEvent((("training", 3), ("syncing", 1))),
        m.NodeJoinedEvent("spot"), m.NodeJoinedEvent("spot"),
        m.QuarantineEvent("non_finite"),
    ]) == 4
    ex.apply(m.ReplicaStatesEvent((("training", 2),)))  # a gauge: the last value wins
    text = ex.render()
    assert 'moshray_replicas{state="training"} 2.0' in text
    assert 'moshray_replicas{state="syncing"} 0.0' in text
    assert 'moshray_nodes_joined_total{market="spot"} 2.0' in text
    assert 'moshray_quarantines_total{reason="non_finite"} 1.0' in text
    with pytest.raises(ValueError, match="replica state"):
        m.ReplicaStatesEvent((("flying", 1),))
