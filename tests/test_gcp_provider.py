"""GCPSpotNodeProvider with google-cloud-compute (REST) against a local Compute endpoint.

The endpoint (tests/fake_gcp.py) listens on 127.0.0.1 and answers in GCE's JSON shapes; the
client is pointed at it with ``client_options.api_endpoint = http://127.0.0.1:port`` and
anonymous credentials, exactly as the provider config allows.
"""

from __future__ import annotations

import itertools
import uuid

import pytest
from ray.autoscaler.node_launch_exception import NodeLaunchException
from ray.autoscaler.tags import (
    TAG_RAY_LAUNCH_CONFIG,
    TAG_RAY_NODE_KIND,
    TAG_RAY_NODE_NAME,
    TAG_RAY_NODE_STATUS,
    TAG_RAY_USER_NODE_TYPE,
)

from fake_gcp import FakeCompute
from moshray.autoscaler.clouds.gcp.provider import (
    GCPSpotNodeProvider,
    decode_label_value,
    encode_label_value,
    labels_to_tags,
    tags_to_labels,
)
from moshray.autoscaler.pools import EventKind, Pool
from moshray.autoscaler.tags import (
    CLUSTER_TAG,
    GCP_PROVIDER,
    MARKET_TAG,
    POOL_TAG,
    ROLE_TAG,
)

PROJECT = "proj-1"
A = Pool("gcp", "g2-standard-4", "us-central1-a")
B = Pool("gcp", "g2-standard-4", "us-central1-b")
NODE_CONFIG = {
    "disks": [{"boot": True, "autoDelete": True, "initializeParams": {
        "sourceImage": "projects/debian-cloud/global/images/family/debian-12",
        "diskSizeGb": "50", "diskType": "zones/{zone}/diskTypes/pd-balanced"}}],
    "networkInterfaces": [{"subnetwork": "regions/{region}/subnetworks/default",
                           "accessConfigs": [{"name": "External NAT",
                                              "type": "ONE_TO_ONE_NAT"}]}],
    "guestAccelerators": [{"acceleratorType": "zones/{zone}/acceleratorTypes/nvidia-l4",
                           "acceleratorCount": 1}],
    "labels": {"team": "ml"},
}
_names = itertools.count()


@pytest.fixture(scope="module")
def compute():
    fake = FakeCompute().start()
    try:
        yield fake
    finally:
        fake.stop()


@pytest.fixture
def fake(compute):
    compute.clear()
    yield compute
    compute.clear()


def make(fake, pools=(A, B), on_demand=None, **extra):
    name = f"c{next(_names)}"
    cfg = {"type": "external", "module": GCP_PROVIDER, "project_id": PROJECT,
           "api_endpoint": fake.endpoint, "anonymous_credentials": True,
           "availability_zone": "us-central1-a", "capacity_cooldown_s": 60, "metrics_port": None,
           "pools": [{"machine_type": p.instance_type, "zone": p.zone, "market": p.market.value}
                     for p in pools], **extra}
    if on_demand is not None:
        cfg["on_demand"] = on_demand
    return GCPSpotNodeProvider(cfg, name), name


def worker_tags(node_type="gpu.spot"):
    return {TAG_RAY_NODE_KIND: "worker", TAG_RAY_USER_NODE_TYPE: node_type,
            TAG_RAY_LAUNCH_CONFIG: "0a1b2c", TAG_RAY_NODE_NAME: "ray-c-worker",
            TAG_RAY_NODE_STATUS: "uninitialized"}


def cluster_vms(fake, cluster):
    return {name: inst for (p, z, name), inst in fake.instances.items()
            if inst.get("labels", {}).get(CLUSTER_TAG) == cluster}


def test_spot_request_body_labels_and_request_ids(fake):
    provider, cluster = make(fake)
    created = provider.create_node(NODE_CONFIG, worker_tags(), 2)
    assert len(created) == 2
    inserts = fake.inserts()
    assert len(inserts) == 2
    for req in inserts:
        assert req.path == f"/compute/v1/projects/{PROJECT}/zones/us-central1-a/instances"
        assert "Authorization" not in req.headers  # anonymous credentials
        uuid.UUID(req.query["requestId"])  # a valid UUID, as GCE requires
        body = req.body
        assert body["scheduling"] == {"provisioningModel": "SPOT",
                                      "instanceTerminationAction": "DELETE",
                                      "automaticRestart": False,
                                      "onHostMaintenance": "TERMINATE"}
        assert body["machineType"] == "zones/us-central1-a/machineTypes/g2-standard-4"
        assert body["disks"][0]["initializeParams"]["diskType"] == \
            "zones/us-central1-a/diskTypes/pd-balanced"
        assert body["networkInterfaces"][0]["subnetwork"] == \
            "regions/us-central1/subnetworks/default"
        assert body["guestAccelerators"][0]["acceleratorType"] == \
            "zones/us-central1-a/acceleratorTypes/nvidia-l4"
        labels = body["labels"]
        assert labels[CLUSTER_TAG] == cluster and labels[ROLE_TAG] == "worker"
        assert labels[POOL_TAG] == A.key and labels[MARKET_TAG] == "spot"
        assert labels[TAG_RAY_USER_NODE_TYPE] == "gpu_2espot"  # escaped '.'
        assert labels["team"] == "ml"
        assert {"key": POOL_TAG, "value": A.key} in body["metadata"]["items"]
        assert body["name"] in created
    assert len({r.query["requestId"] for r in inserts}) == 2

    vms = cluster_vms(fake, cluster)
    assert sorted(vms) == sorted(created)
    assert sorted(provider.non_terminated_nodes({})) == sorted(created)
    assert sorted(provider.non_terminated_nodes({TAG_RAY_USER_NODE_TYPE: "gpu.spot"})) == \
        sorted(created)
    assert provider.non_terminated_nodes({TAG_RAY_USER_NODE_TYPE: "other"}) == []
    listing = [r for r in fake.requests if r.path.endswith("/aggregated/instances")]
    assert listing and listing[-1].query["filter"] == f'labels.{CLUSTER_TAG} = "{cluster}"'
    node = sorted(created)[0]
    nic = vms[node]["networkInterfaces"][0]
    assert provider.internal_ip(node) == nic["networkIP"]
    assert provider.external_ip(node) == nic["accessConfigs"][0]["natIP"]
    assert provider.node_tags(node)[TAG_RAY_USER_NODE_TYPE] == "gpu.spot"
    assert provider.is_running(node) and not provider.is_terminated(node)


def test_termination_action_stop_and_a_preempted_stopped_vm(fake):
    provider, cluster = make(fake, termination_action="STOP")
    (node,) = provider.create_node(NODE_CONFIG, worker_tags(), 1)
    assert fake.inserts()[0].body["scheduling"]["instanceTerminationAction"] == "STOP"
    assert provider.non_terminated_nodes({}) == [node]
    fake.preempt(PROJECT, "us-central1-a", node)  # GCE stops the Spot VM
    assert provider.non_terminated_nodes({}) == []
    assert provider.is_terminated(node)
    preempted = [(e.pool, e.detail) for e in provider.history.snapshot()
                 if e.kind is EventKind.PREEMPTED]
    assert preempted == [(A.key, "TERMINATED")]


def test_preempted_and_deleted_vm_steers_the_next_launch(fake):
    provider, cluster = make(fake)
    (node,) = provider.create_node(NODE_CONFIG, worker_tags(), 1)
    provider.non_terminated_nodes({})
    fake.preempt(PROJECT, "us-central1-a", node)  # DELETE action: the VM is gone
    assert provider.non_terminated_nodes({}) == []
    assert [e.pool for e in provider.history.snapshot() if e.kind is EventKind.PREEMPTED] == \
        [A.key]
    provider.create_node(NODE_CONFIG, worker_tags(), 1)
    assert "/zones/us-central1-b/" in fake.inserts()[-1].path


def test_zone_pool_exhausted_falls_back_to_the_next_zone(fake):
    fake.exhaust("us-central1-a")
    provider, cluster = make(fake)
    (node,) = provider.create_node(NODE_CONFIG, worker_tags(), 1)
    zones = [r.path.split("/zones/")[1].split("/")[0] for r in fake.inserts()]
    assert zones == ["us-central1-a", "us-central1-b"]
    # the waited-on operation carried the error; the provider read it from there
    waits = [r for r in fake.requests if r.path.endswith("/wait")]
    assert any("/zones/us-central1-a/operations/" in r.path for r in waits)
    vm = cluster_vms(fake, cluster)[node]
    assert vm["labels"][POOL_TAG] == B.key
    assert vm["machineType"].endswith("/zones/us-central1-b/machineTypes/g2-standard-4")
    assert vm["disks"][0]["initializeParams"]["diskType"] == \
        "zones/us-central1-b/diskTypes/pd-balanced"
    (err,) = provider.errors
    assert (err.code, err.pool) == ("ZONE_RESOURCE_POOL_EXHAUSTED", A.key)
    # zone a cools down: the next launch goes to b directly
    provider.create_node(NODE_CONFIG, worker_tags(), 1)
    assert len(fake.inserts()) == 3 and "/zones/us-central1-b/" in fake.inserts()[-1].path


def test_quota_error_also_falls_back(fake):
    fake.quota("us-central1-a")
    provider, cluster = make(fake)
    (node,) = provider.create_node(NODE_CONFIG, worker_tags(), 1)
    assert cluster_vms(fake, cluster)[node]["labels"][POOL_TAG] == B.key
    assert provider.errors[-1].code == "quotaExceeded"


def test_on_demand_fallback_within_budget(fake):
    fake.exhaust("us-central1-a", provisioning_model="SPOT")
    fake.exhaust("us-central1-b", provisioning_model="SPOT")
    provider, cluster = make(fake, on_demand={"max_nodes": 1})
    (node,) = provider.create_node(NODE_CONFIG, worker_tags(), 1)
    body = fake.inserts()[-1].body
    assert body["scheduling"] == {"provisioningModel": "STANDARD"}
    assert body["labels"][MARKET_TAG] == "on-demand"
    assert body["labels"][POOL_TAG] == A.with_market("on-demand").key
    with pytest.raises(NodeLaunchException, match="over_budget"):
        provider.create_node(NODE_CONFIG, worker_tags(), 1)
    assert list(cluster_vms(fake, cluster)) == [node]


def test_lost_insert_response_is_retried_with_the_same_request_id(fake):
    fake.lose_next_insert_response()
    provider, cluster = make(fake)
    (node,) = provider.create_node(NODE_CONFIG, worker_tags(), 1)
    first, second = fake.inserts()
    assert first.query["requestId"] == second.query["requestId"]
    assert list(cluster_vms(fake, cluster)) == [node]  # one VM, not two


def test_set_tags_with_fingerprint_and_terminate(fake):
    provider, cluster = make(fake)
    ids = sorted(provider.create_node(NODE_CONFIG, worker_tags(), 2))
    provider.non_terminated_nodes({})
    # someone changes the labels behind the provider's back: its fingerprint is stale
    fake.instances[(PROJECT, "us-central1-a", ids[0])]["labels"]["extra"] = "x"
    fake.instances[(PROJECT, "us-central1-a", ids[0])]["labelFingerprint"] = "changed"
    provider.set_node_tags(ids[0], {TAG_RAY_NODE_STATUS: "up-to-date",
                                    TAG_RAY_USER_NODE_TYPE: "ray.worker.default"})
    labels = fake.instances[(PROJECT, "us-central1-a", ids[0])]["labels"]
    assert labels[TAG_RAY_NODE_STATUS] == "up-to-date"
    assert labels[TAG_RAY_USER_NODE_TYPE] == "ray_2eworker_2edefault"
    assert labels["extra"] == "x" and labels[CLUSTER_TAG] == cluster
    assert provider.node_tags(ids[0])[TAG_RAY_USER_NODE_TYPE] == "ray.worker.default"
    assert not provider.errors

    provider.terminate_node(ids[0])
    deletes = [r for r in fake.requests if r.method == "DELETE"]
    assert len(deletes) == 1 and uuid.UUID(deletes[0].query["requestId"])
    assert provider.non_terminated_nodes({}) == [ids[1]]
    provider.terminate_nodes([ids[1]])
    assert cluster_vms(fake, cluster) == {}
    assert provider.non_terminated_nodes({}) == []
    assert not [e for e in provider.history.snapshot() if e.kind is EventKind.PREEMPTED]


def test_head_is_on_demand_in_the_default_zone(fake):
    provider, cluster = make(fake)
    head = {**worker_tags("ray.head.default"), TAG_RAY_NODE_KIND: "head"}
    (node,) = provider.create_node({**NODE_CONFIG, "machineType": "n2-standard-4"}, head, 1)
    body = fake.inserts()[-1].body
    assert body["scheduling"] == {"provisioningModel": "STANDARD"}
    assert body["machineType"] == "zones/us-central1-a/machineTypes/n2-standard-4"
    assert body["labels"][ROLE_TAG] == "head" and "-head-" in node
    assert provider.non_terminated_nodes({TAG_RAY_NODE_KIND: "head"}) == [node]


def test_bad_node_config_is_a_launch_failure_not_a_fallback(fake):
    provider, cluster = make(fake)
    with pytest.raises(NodeLaunchException, match="InvalidNodeConfig"):
        provider.create_node({"disk": []}, worker_tags(), 1)
    assert fake.inserts() == []


@pytest.mark.parametrize("value", ["ray.head.default", "Up_Per", "0a1b2c", "ümlaut", ""])
def test_label_values_round_trip(value):
    encoded = encode_label_value(value)
    assert all(c in "abcdefghijklmnopqrstuvwxyz0123456789-_" for c in encoded)
    assert decode_label_value(encoded) == value
    tags = {"ray-user-node-type": value, POOL_TAG: A.key}
    assert labels_to_tags(tags_to_labels(tags)) == tags


def test_label_errors_say_what_to_fix():
    with pytest.raises(ValueError, match="too long"):
        encode_label_value("." * 30)
    with pytest.raises(ValueError, match="label key"):
        tags_to_labels({"Name": "x"})
    with pytest.raises(ValueError, match="label values"):
        tags_to_labels({"team": "ML"})


@pytest.mark.parametrize("cfg, cluster, message", [
    ({}, "ok", "provider.project_id is required"),
    ({"project_id": "p", "termination_action": "HIBERNATE"}, "ok", "DELETE or STOP"),
    ({"project_id": "p"}, "My.Cluster", "cluster_name"),
])
def test_bad_config_says_what_to_fix(cfg, cluster, message):
    with pytest.raises(ValueError, match=message):
        GCPSpotNodeProvider({"type": "external", "anonymous_credentials": True, **cfg}, cluster)
