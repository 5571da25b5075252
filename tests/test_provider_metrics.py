"""The NodeProviders' own metrics (autoscaler/providers/metrics.py): launches, launch failures,
terminations and preemptions by pool, counted as the AWS provider works against moto's EC2
server, and served on a loopback port once per process (what the head's Prometheus scrapes).
"""

from __future__ import annotations

import socket
import urllib.request

import boto3
import pytest
from moto.core import DEFAULT_ACCOUNT_ID
from prometheus_client.parser import text_string_to_metric_families
from ray.autoscaler.tags import TAG_RAY_NODE_KIND, TAG_RAY_USER_NODE_TYPE

from fake_ec2 import running_fake_ec2
from raystart import free_port
import moshray.autoscaler.providers.metrics as provider_metrics
from moshray.autoscaler.clouds.aws.provider import AWSSpotNodeProvider
from moshray.autoscaler.pools import Pool
from moshray.autoscaler.providers.metrics import REGISTRY
from moshray.autoscaler.tags import AWS_PROVIDER

REGION = "us-east-1"
# Pools of their own (a zone no other test file uses), so the process-wide counters of this
# file's pools move only by what this file does.
A = Pool("aws", "g4dn.2xlarge", "us-east-1d")
B = Pool("aws", "g4dn.2xlarge", "us-east-1f")
WORKER = {TAG_RAY_NODE_KIND: "worker", TAG_RAY_USER_NODE_TYPE: "spot"}


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture(scope="module")
def fake():
    with running_fake_ec2() as server:
        yield server


def test_launches_failures_terminations_and_preemptions_by_pool(fake):
    from moto.ec2.models import ec2_backends
    from moto.ec2.models.instances import StateReason

    provider = AWSSpotNodeProvider(
        {"type": "external", "module": AWS_PROVIDER, "region": REGION,
         "endpoint_url": fake.url, "metrics_port": None,
         "pools": [{"instance_type": p.instance_type, "zone": p.zone} for p in (A, B)]},
        "metrics-c")
    direct = boto3.client("ec2", region_name=REGION, endpoint_url=fake.moto_url)
    image = direct.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    fake.proxy.refuse("InsufficientInstanceCapacity", zone=A.zone, market="spot")
    before = {
        "la": value("moshray_provider_launches_total", cloud="aws", pool=A.key),
        "lb": value("moshray_provider_launches_total", cloud="aws", pool=B.key),
        "fa": value("moshray_provider_launch_failures_total", cloud="aws", pool=A.key,
                    code="InsufficientInstanceCapacity", capacity="true"),
        "tb": value("moshray_provider_terminations_total", cloud="aws", pool=B.key),
        "pb": value("moshray_provider_preemptions_total", cloud="aws", pool=B.key),
        "el": value("moshray_provider_errors_total", cloud="aws", operation="launch"),
    }
    nodes = sorted(provider.create_node({"ImageId": image}, WORKER, 3))
    assert len(nodes) == 3
    assert value("moshray_provider_launches_total", cloud="aws", pool=A.key) == before["la"]
    assert value("moshray_provider_launches_total", cloud="aws", pool=B.key) == before["lb"] + 3
    assert value("moshray_provider_launch_failures_total", cloud="aws", pool=A.key,
                 code="InsufficientInstanceCapacity", capacity="true") == before["fa"] + 1
    assert value("moshray_provider_errors_total", cloud="aws",
                 operation="launch") == before["el"] + 1

    provider.terminate_nodes(nodes[:2])  # scale-down
    assert value("moshray_provider_terminations_total", cloud="aws",
                 pool=B.key) == before["tb"] + 2
    provider.non_terminated_nodes({})
    instance = ec2_backends[DEFAULT_ACCOUNT_ID][REGION].get_instance(nodes[2])
    instance.terminate()  # EC2 reclaims the last one
    instance.state_reason = StateReason("Server.SpotInstanceTermination",
                                        "Server.SpotInstanceTermination")
    provider.non_terminated_nodes({})
    assert value("moshray_provider_preemptions_total", cloud="aws",
                 pool=B.key) == before["pb"] + 1
    assert value("moshray_provider_terminations_total", cloud="aws",
                 pool=B.key) == before["tb"] + 2  # a preemption is not our termination
    fake.proxy.clear()


def test_served_once_per_process_on_loopback_and_scrapeable(fake):
    port = free_port()
    cfg = {"type": "external", "module": AWS_PROVIDER, "region": REGION,
           "endpoint_url": fake.url, "metrics_port": port, "spot_prices": {"g4dn.2xlarge": 0.3},
           "pools": [{"instance_type": A.instance_type, "zone": "us-east-1e"}]}
    try:
        first = AWSSpotNodeProvider(cfg, "metrics-s1")
        second = AWSSpotNodeProvider(cfg, "metrics-s2")  # Ray may build providers again
        first.post_process()
        second.post_process()  # same port, same process: no second server, no error
        assert provider_metrics.serve(port) == port
        assert not first.errors and not second.errors
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        for name in ("launches", "launch_failures", "terminations", "preemptions", "errors",
                     "spot_price_dollars"):
            assert f"moshray_provider_{name}" in families
        prices = {s.labels["pool"]: s.value
                  for s in families["moshray_provider_spot_price_dollars"].samples}
        assert prices[Pool("aws", A.instance_type, "us-east-1e").key] == 0.3
    finally:
        provider_metrics.stop(port)
    with socket.socket() as s:  # stopped: nothing answers any more
        s.settimeout(5)
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_a_port_in_use_is_logged_not_raised():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert provider_metrics.serve(port) is None
