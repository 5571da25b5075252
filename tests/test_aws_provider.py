"""AWSSpotNodeProvider against moto running as a server on 127.0.0.1 (boto3 with endpoint_url).

Capacity errors and lost responses are injected by a small proxy in front of moto
(tests/fake_ec2.py) that answers with EC2's real error document; the provider is used only
through Ray's NodeProvider methods.
"""

from __future__ import annotations

import itertools

import boto3
import pytest
from moto.core import DEFAULT_ACCOUNT_ID
from ray.autoscaler.node_launch_exception import NodeLaunchException
from ray.autoscaler.tags import (
    TAG_RAY_LAUNCH_CONFIG,
    TAG_RAY_NODE_KIND,
    TAG_RAY_NODE_NAME,
    TAG_RAY_NODE_STATUS,
    TAG_RAY_USER_NODE_TYPE,
)

from fake_ec2 import running_fake_ec2
from moshray.autoscaler.clouds.aws.provider import AWSSpotNodeProvider
from moshray.autoscaler.pools import EventKind, Pool
from moshray.autoscaler.tags import (
    AWS_PROVIDER,
    CLUSTER_TAG,
    MARKET_TAG,
    POOL_TAG,
    ROLE_TAG,
)

REGION = "us-east-1"
A = Pool("aws", "g4dn.xlarge", "us-east-1a")
B = Pool("aws", "g4dn.xlarge", "us-east-1b")
_names = itertools.count()


@pytest.fixture(scope="module")
def ec2_server():
    with running_fake_ec2() as fake:
        yield fake


@pytest.fixture
def fake(ec2_server):
    ec2_server.proxy.clear()
    yield ec2_server
    ec2_server.proxy.clear()


@pytest.fixture(scope="module")
def image_id(ec2_server):
    ec2 = boto3.client("ec2", region_name=REGION, endpoint_url=ec2_server.moto_url)
    return ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]


def direct(fake):
    """A plain boto3 client straight to moto (not through the proxy): the test's own eyes."""
    return boto3.client("ec2", region_name=REGION, endpoint_url=fake.moto_url)


def cluster_instances(fake, cluster):
    resp = direct(fake).describe_instances(
        Filters=[{"Name": f"tag:{CLUSTER_TAG}", "Values": [cluster]}])
    return [i for r in resp["Reservations"] for i in r["Instances"]]


def make(fake, pools=(A, B), on_demand=None, clock=None, **extra):
    name = f"c{next(_names)}"
    cfg = {
        "type": "external", "module": AWS_PROVIDER, "region": REGION,
        "endpoint_url": fake.url, "availability_zone": "us-east-1a",
        "pools": [{"instance_type": p.instance_type, "zone": p.zone, "market": p.market.value}
                  for p in pools],
        "capacity_cooldown_s": 60, "metrics_port": None, **extra,
    }
    if on_demand is not None:
        cfg["on_demand"] = on_demand
    kwargs = {"clock": clock} if clock else {}
    return AWSSpotNodeProvider(cfg, name, **kwargs), name


def worker_tags(name="spot_gpu"):
    return {TAG_RAY_NODE_KIND: "worker", TAG_RAY_USER_NODE_TYPE: name,
            TAG_RAY_LAUNCH_CONFIG: "0123abcd", TAG_RAY_NODE_NAME: "ray-test-worker",
            TAG_RAY_NODE_STATUS: "uninitialized"}


def tags_of(inst):
    return {t["Key"]: t["Value"] for t in inst.get("Tags", [])}


def test_launch_is_spot_tagged_and_idempotent_per_attempt(fake, image_id):
    provider, cluster = make(fake)
    created = provider.create_node({"ImageId": image_id, "KeyName": "k"}, worker_tags(), 2)
    assert len(created) == 2

    (run,) = fake.proxy.runs()
    assert run["InstanceMarketOptions.MarketType"] == "spot"
    assert run["InstanceMarketOptions.SpotOptions.SpotInstanceType"] == "one-time"
    assert run["InstanceMarketOptions.SpotOptions.InstanceInterruptionBehavior"] == "terminate"
    assert run["InstanceType"] == "g4dn.xlarge"
    assert run["Placement.AvailabilityZone"] == "us-east-1a"
    assert run["MinCount"] == run["MaxCount"] == "2"
    assert run["ClientToken"].startswith("moshray-") and len(run["ClientToken"]) <= 64
    assert run["KeyName"] == "k"

    instances = cluster_instances(fake, cluster)
    assert sorted(i["InstanceId"] for i in instances) == sorted(created)
    for inst in instances:
        assert inst["InstanceLifecycle"] == "spot"
        assert inst["ClientToken"] == run["ClientToken"]
        tags = tags_of(inst)
        assert tags[CLUSTER_TAG] == cluster and tags[ROLE_TAG] == "worker"
        assert tags[POOL_TAG] == A.key and tags[MARKET_TAG] == "spot"
        assert tags[TAG_RAY_USER_NODE_TYPE] == "spot_gpu" and tags["Name"] == "ray-test-worker"

    assert sorted(provider.non_terminated_nodes({})) == sorted(created)
    assert sorted(provider.non_terminated_nodes({TAG_RAY_USER_NODE_TYPE: "spot_gpu"})) \
        == sorted(created)
    assert provider.non_terminated_nodes({TAG_RAY_USER_NODE_TYPE: "other"}) == []
    node = created and sorted(created)[0]
    by_id = {i["InstanceId"]: i for i in instances}
    assert provider.internal_ip(node) == by_id[node]["PrivateIpAddress"]
    assert provider.external_ip(node) == by_id[node]["PublicIpAddress"]
    assert provider.node_tags(node)[TAG_RAY_LAUNCH_CONFIG] == "0123abcd"
    assert provider.is_running(node) and not provider.is_terminated(node)


def test_set_tags_and_terminate(fake, image_id):
    provider, cluster = make(fake)
    ids = sorted(provider.create_node({"ImageId": image_id}, worker_tags(), 2))
    provider.set_node_tags(ids[0], {TAG_RAY_NODE_STATUS: "up-to-date"})
    assert provider.node_tags(ids[0])[TAG_RAY_NODE_STATUS] == "up-to-date"
    by_id = {i["InstanceId"]: i for i in cluster_instances(fake, cluster)}
    assert tags_of(by_id[ids[0]])[TAG_RAY_NODE_STATUS] == "up-to-date"
    assert tags_of(by_id[ids[1]])[TAG_RAY_NODE_STATUS] == "uninitialized"

    provider.terminate_node(ids[0])
    states = {i["InstanceId"]: i["State"]["Name"] for i in cluster_instances(fake, cluster)}
    assert states[ids[0]] in ("shutting-down", "terminated")
    assert provider.non_terminated_nodes({}) == [ids[1]]
    assert provider.is_terminated(ids[0])
    provider.terminate_nodes([ids[1]])
    assert provider.non_terminated_nodes({}) == []
    # our own terminations are not preemptions
    assert not [e for e in provider.history.snapshot() if e.kind is EventKind.PREEMPTED]
    assert not provider.errors


def test_capacity_error_in_first_pool_uses_the_next(fake, image_id):
    fake.proxy.refuse("InsufficientInstanceCapacity", instance_type="g4dn.xlarge",
                      zone="us-east-1a", market="spot")
    provider, cluster = make(fake)
    (node,) = provider.create_node({"ImageId": image_id}, worker_tags(), 1)

    first, second = fake.proxy.runs()
    assert first["Placement.AvailabilityZone"] == "us-east-1a"
    assert second["Placement.AvailabilityZone"] == "us-east-1b"
    assert first["ClientToken"] != second["ClientToken"]
    (inst,) = cluster_instances(fake, cluster)
    assert inst["InstanceId"] == node and inst["Placement"]["AvailabilityZone"] == "us-east-1b"
    assert tags_of(inst)[POOL_TAG] == B.key and inst["InstanceLifecycle"] == "spot"
    kinds = [(e.pool, e.kind, e.detail) for e in provider.history.snapshot()]
    assert (A.key, EventKind.CAPACITY_ERROR, "InsufficientInstanceCapacity") in kinds
    (err,) = provider.errors
    assert err.operation == "launch" and err.pool == A.key
    assert err.code == "InsufficientInstanceCapacity"

    # the refused pool is cooling down: the next launch goes straight to B
    provider.create_node({"ImageId": image_id}, worker_tags(), 1)
    assert [r["Placement.AvailabilityZone"] for r in fake.proxy.runs()] == [
        "us-east-1a", "us-east-1b", "us-east-1b"]


@pytest.mark.parametrize("code, status", [
    ("SpotMaxPriceTooLow", 400), ("MaxSpotInstanceCountExceeded", 400),
    ("VcpuLimitExceeded", 400), ("Unsupported", 400), ("InsufficientHostCapacity", 500),
])
def test_price_quota_and_offering_errors_also_fall_back(fake, image_id, code, status):
    fake.proxy.refuse(code, zone="us-east-1a", status=status)
    provider, cluster = make(fake)
    provider.create_node({"ImageId": image_id}, worker_tags(), 1)
    (inst,) = cluster_instances(fake, cluster)
    assert tags_of(inst)[POOL_TAG] == B.key
    assert [e.code for e in provider.errors] == [code]


def test_a_bad_request_is_not_retried_in_other_pools(fake, image_id):
    fake.proxy.refuse("InvalidAMIID.Malformed", status=400)
    provider, cluster = make(fake)
    with pytest.raises(NodeLaunchException) as info:
        provider.create_node({"ImageId": "ami-bad"}, worker_tags(), 1)
    assert info.value.category == "InvalidAMIID.Malform"  # Ray wants < 20 characters
    assert len(fake.proxy.runs()) == 1
    assert cluster_instances(fake, cluster) == []
    assert not [e for e in provider.history.snapshot() if e.kind is EventKind.CAPACITY_ERROR]


def test_on_demand_fallback_stays_within_the_node_budget(fake, image_id):
    fake.proxy.refuse(market="spot")  # no spot anywhere
    provider, cluster = make(fake, on_demand={"max_nodes": 2})
    created = provider.create_node({"ImageId": image_id}, worker_tags(), 3)
    assert len(created) == 2  # partial: the budget allows 2; logged, not raised
    insts = cluster_instances(fake, cluster)
    assert len(insts) == 2
    for inst in insts:
        assert inst.get("InstanceLifecycle") is None  # on-demand
        assert tags_of(inst)[MARKET_TAG] == "on-demand"
        assert tags_of(inst)[POOL_TAG] == A.with_market("on-demand").key
    on_demand_runs = [r for r in fake.proxy.runs() if "InstanceMarketOptions.MarketType" not in r]
    assert len(on_demand_runs) == 1 and on_demand_runs[0]["MinCount"] == "2"

    # the budget is spent: nothing more, and Ray is told why
    with pytest.raises(NodeLaunchException, match="over_budget"):
        provider.create_node({"ImageId": image_id}, worker_tags(), 1)
    assert len(cluster_instances(fake, cluster)) == 2

    # a released on-demand node frees budget again
    provider.terminate_node(sorted(created)[0])
    provider.create_node({"ImageId": image_id}, worker_tags(), 1)
    live = [i for i in cluster_instances(fake, cluster) if i["State"]["Name"] != "terminated"
            and i["State"]["Name"] != "shutting-down"]
    assert len(live) == 2


def test_on_demand_fallback_within_a_dollar_budget(fake, image_id):
    fake.proxy.refuse(market="spot")
    provider, cluster = make(fake, pools=(A,), on_demand={
        "max_usd_per_hour": 1.2, "prices": {"g4dn.xlarge": 0.526}})
    created = provider.create_node({"ImageId": image_id}, worker_tags(), 3)
    assert len(created) == 2  # 2 x 0.526 <= 1.2 < 3 x 0.526


def test_no_on_demand_without_a_budget(fake, image_id):
    fake.proxy.refuse(market="spot")
    provider, cluster = make(fake)
    with pytest.raises(NodeLaunchException, match="cooling_down"):
        provider.create_node({"ImageId": image_id}, worker_tags(), 1)
    assert cluster_instances(fake, cluster) == []
    assert len(fake.proxy.runs()) == 2  # each spot pool once


def test_preemption_is_noticed_and_steers_the_next_launch(fake, image_id):
    from moto.ec2.models import ec2_backends
    from moto.ec2.models.instances import StateReason

    provider, cluster = make(fake)
    (node,) = provider.create_node({"ImageId": image_id}, worker_tags(), 1)
    assert provider.non_terminated_nodes({}) == [node]
    # EC2 reclaims the spot instance (what an interruption leaves in DescribeInstances)
    instance = ec2_backends[DEFAULT_ACCOUNT_ID][REGION].get_instance(node)
    instance.terminate()
    instance.state_reason = StateReason("Server.SpotInstanceTermination: Spot instance "
                                        "termination", "Server.SpotInstanceTermination")
    assert provider.non_terminated_nodes({}) == []
    preempted = [e for e in provider.history.snapshot() if e.kind is EventKind.PREEMPTED]
    assert [(e.pool, e.detail) for e in preempted] == [(A.key, "Server.SpotInstanceTermination")]
    provider.non_terminated_nodes({})  # counted once only
    assert len([e for e in provider.history.snapshot() if e.kind is EventKind.PREEMPTED]) == 1

    provider.create_node({"ImageId": image_id}, worker_tags(), 1)
    assert fake.proxy.runs()[-1]["Placement.AvailabilityZone"] == "us-east-1b"


def test_termination_by_someone_else_is_not_a_preemption(fake, image_id):
    provider, cluster = make(fake)
    (node,) = provider.create_node({"ImageId": image_id}, worker_tags(), 1)
    provider.non_terminated_nodes({})
    direct(fake).terminate_instances(InstanceIds=[node])  # Client.UserInitiatedShutdown
    assert provider.non_terminated_nodes({}) == []
    assert not [e for e in provider.history.snapshot() if e.kind is EventKind.PREEMPTED]


def test_lost_response_is_retried_with_the_same_token_and_launches_once(fake, image_id):
    fake.proxy.drop_next_run_response()
    provider, cluster = make(fake)
    (node,) = provider.create_node({"ImageId": image_id}, worker_tags(), 1)
    first, second = fake.proxy.runs()
    assert first["ClientToken"] == second["ClientToken"]
    (inst,) = cluster_instances(fake, cluster)
    assert inst["InstanceId"] == node


def test_listing_errors_are_collected_and_the_last_listing_is_used(fake, image_id):
    provider, cluster = make(fake)
    fake.proxy.fail_describe("UnauthorizedOperation")
    with pytest.raises(Exception, match="UnauthorizedOperation"):
        provider.non_terminated_nodes({})  # no earlier listing to fall back on
    fake.proxy.fail_describe(None)
    ids = provider.create_node({"ImageId": image_id}, worker_tags(), 1)
    assert provider.non_terminated_nodes({}) == list(ids)
    fake.proxy.fail_describe("UnauthorizedOperation")
    assert provider.non_terminated_nodes({}) == list(ids)
    assert [e.operation for e in provider.errors][-1] == "list"
    assert provider.errors[-1].code == "ClientError"


def test_head_is_on_demand_in_its_own_pool(fake, image_id):
    provider, cluster = make(fake)
    head_tags = {**worker_tags("ray.head.default"), TAG_RAY_NODE_KIND: "head"}
    (node,) = provider.create_node({"ImageId": image_id, "InstanceType": "m5.large"},
                                   head_tags, 1)
    (run,) = fake.proxy.runs()
    assert "InstanceMarketOptions.MarketType" not in run and run["InstanceType"] == "m5.large"
    (inst,) = cluster_instances(fake, cluster)
    tags = tags_of(inst)
    assert tags[ROLE_TAG] == "head" and tags[MARKET_TAG] == "on-demand"
    assert tags[POOL_TAG] == Pool("aws", "m5.large", "us-east-1a", "on-demand").key
    assert provider.non_terminated_nodes({TAG_RAY_NODE_KIND: "head"}) == [node]


def test_node_type_pools_override_and_user_tag_specs_merge(fake, image_id):
    provider, cluster = make(fake)
    config = {"ImageId": image_id,
              "moshray_pools": [{"instance_type": "g5.xlarge", "zone": "us-east-1c"}],
              "TagSpecifications": [{"ResourceType": "instance",
                                     "Tags": [{"Key": "team", "Value": "ml"},
                                              {"Key": CLUSTER_TAG, "Value": "spoofed"}]}],
              "InstanceMarketOptions": {"MarketType": "spot",
                                        "SpotOptions": {"MaxPrice": "0.40"}}}
    provider.create_node(config, worker_tags(), 1)
    (run,) = fake.proxy.runs()
    assert "moshray_pools" not in str(run)
    assert run["InstanceType"] == "g5.xlarge" and run["Placement.AvailabilityZone"] == "us-east-1c"
    assert run["InstanceMarketOptions.SpotOptions.MaxPrice"] == "0.40"
    (inst,) = cluster_instances(fake, cluster)
    assert tags_of(inst)["team"] == "ml" and tags_of(inst)[CLUSTER_TAG] == cluster


def test_return_to_spot_releases_one_on_demand_node_when_spot_is_stable(fake, image_id):
    now = [1000.0]
    fake.proxy.refuse(market="spot")
    provider, cluster = make(fake, pools=(A,), on_demand={"max_nodes": 2}, clock=lambda: now[0],
                             return_to_spot=True, spot_stable_s=300)
    (od,) = provider.create_node({"ImageId": image_id}, worker_tags(), 1)
    provider.non_terminated_nodes({})
    now[0] += 299
    provider.post_process()
    assert provider.non_terminated_nodes({}) == [od]
    now[0] += 1  # 300 s without spot trouble
    fake.proxy.clear()
    provider.post_process()
    assert provider.non_terminated_nodes({}) == []
    assert [e.kind for e in provider.history.snapshot()][-1] is EventKind.RELEASED
    (spot,) = provider.create_node({"ImageId": image_id}, worker_tags(), 1)  # Ray's replacement
    assert provider.node_tags(spot)[MARKET_TAG] == "spot"


@pytest.mark.parametrize("cfg, message", [
    ({}, "provider.region is required"),
    ({"region": REGION, "pools": [{"zone": "us-east-1a"}]}, "needs instance_type"),
    ({"region": REGION, "on_demand": {"max_usd_per_hour": 2},
      "pools": [{"instance_type": "g5.xlarge", "zone": "us-east-1a"}]}, "prices lack"),
    ({"region": REGION, "return_to_spot": "yes"}, "return_to_spot"),
])
def test_bad_config_says_what_to_fix(cfg, message):
    with pytest.raises(ValueError, match=message):
        AWSSpotNodeProvider({"type": "external", **cfg}, "bad")
