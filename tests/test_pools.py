"""Pool selection policy with plain data: no cloud, no clock, no Ray."""

from __future__ import annotations

import re

import pytest

from moshray.autoscaler.pools import (
    Candidate,
    EventKind,
    Market,
    Observations,
    OnDemandBudget,
    Pool,
    PoolEvent,
    PoolSelector,
    RunningNode,
    SelectorConfig,
    SkipReason,
    decode_pool,
    encode_pool,
)

A = Pool("aws", "g4dn.xlarge", "us-east-1a")
B = Pool("aws", "g4dn.xlarge", "us-east-1b")
C = Pool("aws", "g5.xlarge", "us-east-1a")
CFG = SelectorConfig(capacity_cooldown_s=100, max_cooldown_s=350, preemption_window_s=1000,
                     spot_stable_s=500)
LABEL_VALUE = re.compile(r"^[a-z0-9_-]{0,63}$")


def ev(pool: Pool, kind: EventKind, at: float) -> PoolEvent:
    return PoolEvent(pool.key, kind, at)


def order(plan) -> list[str]:
    return [c.pool.key for c in plan.candidates]


# --- pool keys ---------------------------------------------------------------------------

@pytest.mark.parametrize("pool", [
    A, C.with_market(Market.ON_DEMAND),
    Pool("aws", "u-6tb1.112xlarge", "ap-southeast-2a"),
    Pool("gcp", "a2-ultragpu-8g", "us-central1-a", "on-demand"),
    Pool("gcp", "n1-custom-4-5120", "europe-west4-b"),
])
def test_pool_key_is_a_valid_label_and_round_trips(pool):
    key = encode_pool(pool)
    assert LABEL_VALUE.match(key), key
    assert decode_pool(key) == pool
    assert pool.key == key


def test_pool_key_example_and_subnet_not_in_identity():
    assert A.key == "aws__us-east-1a__g4dn_xlarge__spot"
    with_subnet = Pool("aws", "g4dn.xlarge", "us-east-1a", subnet_id="subnet-1")
    assert with_subnet.key == A.key


def test_keys_of_different_pools_differ():
    pools = [A, B, C, A.with_market(Market.ON_DEMAND), Pool("gcp", "g4dn-xlarge", "us-east-1a")]
    assert len({p.key for p in pools}) == len(pools)


@pytest.mark.parametrize("kwargs, message", [
    (dict(cloud="azure", instance_type="x", zone="z"), "cloud"),
    (dict(cloud="aws", instance_type="G4dn.xlarge", zone="us-east-1a"), "instance_type"),
    (dict(cloud="aws", instance_type="g4dn_xlarge", zone="us-east-1a"), "instance_type"),
    (dict(cloud="aws", instance_type="g4dn.xlarge", zone="us east"), "zone"),
    (dict(cloud="aws", instance_type="g4dn.xlarge", zone="a", market="preemptible"), "market"),
    (dict(cloud="gcp", instance_type="n" * 60, zone="us-central1-a"), "longer than 63"),
])
def test_bad_pool_is_rejected_with_what_to_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Pool(**kwargs)


def test_pool_from_config():
    assert Pool.from_config("gcp", {"machine_type": "g2-standard-4", "zone": "us-central1-a"}) \
        == Pool("gcp", "g2-standard-4", "us-central1-a")
    p = Pool.from_config("aws", {"instance_type": "g5.xlarge", "zone": "us-east-1b",
                                 "market": "on-demand", "subnet_id": "subnet-9"})
    assert p.market is Market.ON_DEMAND and p.subnet_id == "subnet-9"
    with pytest.raises(ValueError, match="needs instance_type"):
        Pool.from_config("aws", {"zone": "us-east-1a"})
    with pytest.raises(ValueError, match="unknown pool field"):
        Pool.from_config("aws", {"instance_type": "g5.xlarge", "zone": "a", "price": 1})
    with pytest.raises(ValueError, match="not a pool key"):
        decode_pool("aws-us-east-1a-g5.xlarge")


# --- ordering and cool-down --------------------------------------------------------------

def test_no_history_keeps_configured_order_spot_only_by_default():
    sel = PoolSelector([A, B, C], config=CFG)
    plan = sel.decide(Observations(now=0.0), count=3)
    assert order(plan) == [A.key, B.key, C.key]
    assert all(c.max_count == 3 for c in plan.candidates)
    # default budget is 0 on-demand nodes: every on-demand counterpart is over budget
    assert {s.reason for s in plan.skipped} == {SkipReason.OVER_BUDGET}
    assert {s.pool.key for s in plan.skipped} == {p.with_market("on-demand").key
                                                  for p in (A, B, C)}


def test_preempted_pools_go_last_most_preempted_last():
    sel = PoolSelector([A, B, C], config=CFG)
    events = (ev(A, EventKind.PREEMPTED, 10), ev(A, EventKind.PREEMPTED, 20),
              ev(B, EventKind.PREEMPTED, 30))
    plan = sel.decide(Observations(now=100, events=events), count=1)
    assert order(plan) == [C.key, B.key, A.key]
    assert plan.first == Candidate(C, 1, 0)
    assert [c.preemptions for c in plan.candidates] == [0, 1, 2]


def test_preemptions_outside_the_window_are_forgotten():
    sel = PoolSelector([A, B], config=CFG)
    events = (ev(A, EventKind.PREEMPTED, 0),)
    assert order(sel.decide(Observations(now=999, events=events), 1)) == [B.key, A.key]
    assert order(sel.decide(Observations(now=1001, events=events), 1)) == [A.key, B.key]


def test_capacity_error_cools_the_pool_down_then_it_returns_last_within_the_window():
    sel = PoolSelector([A, B], config=CFG)
    events = (ev(A, EventKind.CAPACITY_ERROR, 50),)
    plan = sel.decide(Observations(now=60, events=events), 1)
    assert order(plan) == [B.key]
    cooling = [s for s in plan.skipped if s.reason is SkipReason.COOLING_DOWN]
    assert [(s.pool, s.until) for s in cooling] == [(A, 150)]
    # after the cool-down A is tried again, behind B (it refused recently)
    assert order(sel.decide(Observations(now=150, events=events), 1)) == [B.key, A.key]
    # and once the error leaves the window, configured order again
    assert order(sel.decide(Observations(now=1051, events=events), 1)) == [A.key, B.key]


def test_cool_down_doubles_per_error_in_a_row_capped_and_resets_on_launch():
    sel = PoolSelector([A], config=CFG)

    def until(events, now):
        return sel.stats(Observations(now=now, events=tuple(events)))[A.key].cooldown_until

    errs = [ev(A, EventKind.CAPACITY_ERROR, 0)]
    assert until(errs, 1) == 100
    errs.append(ev(A, EventKind.CAPACITY_ERROR, 100))
    assert until(errs, 101) == 300  # 100 + 200
    errs.append(ev(A, EventKind.CAPACITY_ERROR, 300))
    assert until(errs, 301) == 650  # 300 + min(400, 350)
    assert until(errs, 650) is None
    assert sel.stats(Observations(now=301, events=tuple(errs)))[A.key].errors_in_a_row == 3
    errs += [ev(A, EventKind.LAUNCHED, 700), ev(A, EventKind.CAPACITY_ERROR, 800)]
    assert until(errs, 801) == 900  # back to the base cool-down


def test_events_of_the_future_and_of_unknown_pools_are_ignored():
    sel = PoolSelector([A, B], config=CFG)
    events = (ev(A, EventKind.CAPACITY_ERROR, 500), ev(C, EventKind.CAPACITY_ERROR, 0),
              ev(B, EventKind.PREEMPTED, 500))
    assert order(sel.decide(Observations(now=100, events=events), 1)) == [A.key, B.key]


def test_all_cooling_down_and_no_budget_gives_an_empty_plan_with_reasons():
    sel = PoolSelector([A, B], config=CFG)
    events = (ev(A, EventKind.CAPACITY_ERROR, 0), ev(B, EventKind.CAPACITY_ERROR, 0))
    plan = sel.decide(Observations(now=1, events=events), 2)
    assert plan.candidates == () and plan.first is None
    reasons = {s.pool.key: s.reason for s in plan.skipped}
    assert reasons == {A.key: SkipReason.COOLING_DOWN, B.key: SkipReason.COOLING_DOWN,
                       A.with_market("on-demand").key: SkipReason.OVER_BUDGET,
                       B.with_market("on-demand").key: SkipReason.OVER_BUDGET}


# --- on-demand budget --------------------------------------------------------------------

def test_on_demand_comes_after_spot_and_is_capped_by_nodes():
    sel = PoolSelector([A, B], OnDemandBudget(max_nodes=2), CFG)
    plan = sel.decide(Observations(now=0, on_demand_in_use=("g4dn.xlarge",)), count=3)
    assert order(plan) == [A.key, B.key, A.with_market("on-demand").key,
                           B.with_market("on-demand").key]
    assert [c.max_count for c in plan.candidates] == [3, 3, 1, 1]
    full = sel.decide(Observations(now=0, on_demand_in_use=("g4dn.xlarge",) * 2), count=3)
    assert order(full) == [A.key, B.key]
    assert {s.reason for s in full.skipped} == {SkipReason.OVER_BUDGET}


def test_on_demand_capped_by_dollars_per_hour():
    budget = OnDemandBudget(max_nodes=None, max_usd_per_hour=2.0,
                            prices={"g4dn.xlarge": 0.5, "g5.xlarge": 1.0})
    sel = PoolSelector([A, C], budget, CFG)
    obs = Observations(now=0, on_demand_in_use=("g5.xlarge",))  # 1.0 spent, 1.0 left
    caps = {c.pool.key: c.max_count for c in sel.decide(obs, 5).candidates}
    assert caps[A.with_market("on-demand").key] == 2
    assert caps[C.with_market("on-demand").key] == 1
    # exactly at the budget (float sums like 0.1 * 3 included) leaves no room
    tiny = PoolSelector([A], OnDemandBudget(None, 0.3, {"g4dn.xlarge": 0.1}), CFG)
    assert tiny.budget.headroom("g4dn.xlarge", ("g4dn.xlarge",) * 2) == 1
    assert tiny.budget.headroom("g4dn.xlarge", ("g4dn.xlarge",) * 3) == 0


def test_both_caps_apply_and_explicit_on_demand_pools_replace_counterparts():
    od = Pool("aws", "m5.xlarge", "us-east-1c", Market.ON_DEMAND)
    budget = OnDemandBudget(max_nodes=1, max_usd_per_hour=10.0, prices={"m5.xlarge": 0.2})
    sel = PoolSelector([A, od], budget, CFG)
    assert sel.on_demand_pools == (od,)
    plan = sel.decide(Observations(now=0), 4)
    assert [(c.pool, c.max_count) for c in plan.candidates] == [(A, 4), (od, 1)]


def test_on_demand_pool_with_capacity_error_cools_down_too():
    sel = PoolSelector([A], OnDemandBudget(max_nodes=5), CFG)
    od = A.with_market("on-demand")
    events = (ev(A, EventKind.CAPACITY_ERROR, 0), ev(od, EventKind.CAPACITY_ERROR, 1))
    plan = sel.decide(Observations(now=2, events=events), 1)
    assert plan.candidates == ()
    assert {s.reason for s in plan.skipped} == {SkipReason.COOLING_DOWN}


def test_spot_first_again_when_its_cool_down_ends():
    sel = PoolSelector([A], OnDemandBudget(max_nodes=5), CFG)
    events = (ev(A, EventKind.CAPACITY_ERROR, 0),)
    assert order(sel.decide(Observations(now=50, events=events), 1)) == [
        A.with_market("on-demand").key]
    assert order(sel.decide(Observations(now=100, events=events), 1)) == [
        A.key, A.with_market("on-demand").key]


# --- back to spot ------------------------------------------------------------------------

def test_release_one_on_demand_node_when_spot_is_stable_at_most_once_per_period():
    sel = PoolSelector([A, B], OnDemandBudget(max_nodes=5), CFG)
    od = A.with_market("on-demand")
    nodes = (RunningNode("i-2", od.key, 20.0), RunningNode("i-1", od.key, 10.0))
    events = [ev(A, EventKind.CAPACITY_ERROR, 0), ev(B, EventKind.CAPACITY_ERROR, 0)]
    # spot still in trouble: keep on-demand
    assert sel.on_demand_to_release(Observations(now=499, events=tuple(events)), nodes) == ()
    assert not sel.spot_is_back(Observations(now=499, events=tuple(events)))
    # 500 s without trouble: give back the longest-running one
    assert sel.on_demand_to_release(Observations(now=500, events=tuple(events)), nodes) == ("i-1",)
    events.append(ev(od, EventKind.RELEASED, 500))
    # not again within spot_stable_s of the last release
    assert sel.on_demand_to_release(Observations(now=999, events=tuple(events)),
                                    nodes[:1]) == ()
    assert sel.on_demand_to_release(Observations(now=1000, events=tuple(events)),
                                    nodes[:1]) == ("i-2",)
    assert sel.on_demand_to_release(Observations(now=1000, events=tuple(events)), ()) == ()


def test_a_recent_preemption_blocks_release_until_stable():
    sel = PoolSelector([A], OnDemandBudget(max_nodes=5), CFG)
    nodes = (RunningNode("n1", A.with_market("on-demand").key, 0.0),)
    events = (ev(A, EventKind.PREEMPTED, 100),)
    assert sel.on_demand_to_release(Observations(now=599, events=events), nodes) == ()
    assert sel.on_demand_to_release(Observations(now=600, events=events), nodes) == ("n1",)


# --- validation --------------------------------------------------------------------------

def test_selector_rejects_bad_setups_with_what_to_fix():
    with pytest.raises(ValueError, match="at least one pool"):
        PoolSelector([])
    with pytest.raises(ValueError, match="duplicate pools"):
        PoolSelector([A, Pool("aws", "g4dn.xlarge", "us-east-1a", subnet_id="s")])
    with pytest.raises(ValueError, match="same cloud"):
        PoolSelector([A, Pool("gcp", "g2-standard-4", "us-central1-a")])
    with pytest.raises(ValueError, match="prices lack"):
        PoolSelector([A, C], OnDemandBudget(None, 3.0, {"g4dn.xlarge": 0.5}))
    with pytest.raises(ValueError, match="count"):
        PoolSelector([A]).decide(Observations(now=0), 0)
    with pytest.raises(ValueError, match="max_nodes"):
        OnDemandBudget(max_nodes=-1)
    with pytest.raises(ValueError, match="price"):
        OnDemandBudget(prices={"x": 0})
    with pytest.raises(ValueError, match="max_cooldown_s"):
        SelectorConfig(capacity_cooldown_s=10, max_cooldown_s=5)
    with pytest.raises(ValueError, match="unknown on_demand"):
        OnDemandBudget.from_config({"nodes": 2})


def test_budget_from_config_defaults():
    assert OnDemandBudget.from_config(None).max_nodes == 0
    dollars = OnDemandBudget.from_config({"max_usd_per_hour": 3, "prices": {"g5.xlarge": 1.0}})
    assert dollars.max_nodes is None and dollars.headroom("g5.xlarge", ()) == 3
    assert OnDemandBudget.from_config({"max_nodes": 4}).headroom("x", ("x",)) == 3
