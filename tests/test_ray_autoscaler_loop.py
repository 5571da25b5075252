"""Ray's own autoscaler loop (``StandardAutoscaler``, unchanged) driving moshray's AWS provider
against moto's EC2 server and its GCP provider against the local Compute endpoint, after
``bootstrap_config`` as ``ray up`` runs it: a resource request launches spot workers (with the
workers' identity), a preempted pool is avoided for the replacement, a pool without capacity
falls back to the next, idle workers are drained and terminated; the providers' metrics
endpoint shows the launches, failures, preemptions and terminations by pool.

(The cluster YAMLs and Ray's autoscaler on one machine: tests/test_ray_autoscaler.py.)
"""

from __future__ import annotations

import copy

import boto3
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.autoscaler.tags import TAG_RAY_NODE_KIND, TAG_RAY_USER_NODE_TYPE

from fake_ec2 import FakeEC2
from fake_gcp import FakeCompute
from raystart import free_port
from moshray.autoscaler.clouds.aws.provider import AWSSpotNodeProvider
from moshray.autoscaler.clouds.gcp.provider import GCPSpotNodeProvider
from moshray.autoscaler.tags import AWS_PROVIDER, GCP_PROVIDER, POOL_TAG

MODULES = {"aws": AWS_PROVIDER, "gcp": GCP_PROVIDER}


# ------------------------------------------------------------------------------------------
# Ray's own autoscaler loop (StandardAutoscaler) driving moshray's providers against a cloud on
# 127.0.0.1. The loop is Ray's class, unchanged; around it only what the monitor would feed it
# (LoadMetrics: resource requests as `request_resources` sets them, raylets reporting idle)
# and a GCS stand-in that accepts drain requests. Node updaters are off (no SSH), launches run
# in the foreground (each update() launches synchronously), so every step is deterministic.

SPOT_BUNDLE = {"CPU": 4, "spot": 1}  # one replica: a whole spot worker's CPUs


class FakeGcs:
    """What StandardAutoscaler asks the GCS: drain raylets before their nodes are terminated."""

    def __init__(self) -> None:
        self.drained: list[bytes] = []

    def drain_nodes(self, node_ids, timeout: int):
        self.drained += list(node_ids)
        return list(node_ids)


class AwsCloud:
    """moto's EC2 (through the fault proxy) with an IAM instance profile per role."""

    cloud = "aws"
    provider_cls = AWSSpotNodeProvider
    zones = ("us-east-1a", "us-east-1b", "us-east-1c")
    itype = "g4dn.xlarge"

    def __init__(self, fake: FakeEC2) -> None:
        self.fake = fake
        self.ec2 = boto3.client("ec2", region_name="us-east-1", endpoint_url=fake.moto_url)
        iam = boto3.client("iam", region_name="us-east-1", endpoint_url=fake.moto_url)
        self.identity = {}
        for role in ("head", "worker"):
            name = f"moshray-e2e-{role}-{id(self)}"
            profile = iam.create_instance_profile(InstanceProfileName=name)["InstanceProfile"]
            self.identity[role] = profile["Arn"]
        self.image = self.ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]

    def provider(self) -> dict:
        return {"region": "us-east-1", "availability_zone": self.zones[0],
                "endpoint_url": self.fake.url,
                "pools": [{"instance_type": self.itype, "zone": z} for z in self.zones],
                "head_instance_profile_arn": self.identity["head"],
                "worker_instance_profile_arn": self.identity["worker"]}

    def head_config(self) -> dict:
        return {"InstanceType": "m5.large", "ImageId": self.image}

    def worker_config(self) -> dict:
        return {"ImageId": self.image}

    def refuse(self, zone: str) -> None:
        self.fake.proxy.refuse("InsufficientInstanceCapacity", instance_type=self.itype,
                               zone=zone, market="spot")

    def preempt(self, node_id: str) -> None:
        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.ec2.models import ec2_backends
        from moto.ec2.models.instances import StateReason

        instance = ec2_backends[DEFAULT_ACCOUNT_ID]["us-east-1"].get_instance(node_id)
        instance.terminate()  # what a spot interruption leaves in DescribeInstances
        instance.state_reason = StateReason("Server.SpotInstanceTermination: Spot instance "
                                            "termination", "Server.SpotInstanceTermination")

    def spot_launch_identities(self) -> set:
        """The instance profile of every spot RunInstances request (moto associates a profile
        with the first instance of a request only, so the request is the evidence)."""
        return {r.get("IamInstanceProfile.Arn") for r in self.fake.proxy.runs()
                if r.get("InstanceMarketOptions.MarketType") == "spot"}

    def described(self, node_id: str) -> dict:
        (inst,) = [i for r in self.ec2.describe_instances(InstanceIds=[node_id])["Reservations"]
                   for i in r["Instances"]]
        return {"zone": inst["Placement"]["AvailabilityZone"],
                "spot": inst.get("InstanceLifecycle") == "spot",
                "live": inst["State"]["Name"] in ("pending", "running"),
                "identity": (inst.get("IamInstanceProfile") or {}).get("Arn")}


class GcpCloud:
    """The local Compute endpoint (tests/fake_gcp.py) with a service account per role."""

    cloud = "gcp"
    provider_cls = GCPSpotNodeProvider
    zones = ("us-central1-a", "us-central1-b", "us-central1-c")
    itype = "g2-standard-4"
    project = "proj-e2e"

    def __init__(self, fake: FakeCompute) -> None:
        self.fake = fake
        self.identity = {role: f"moshray-{role}@{self.project}.iam.gserviceaccount.com"
                         for role in ("head", "worker")}

    def provider(self) -> dict:
        return {"project_id": self.project, "availability_zone": self.zones[0],
                "api_endpoint": self.fake.endpoint, "anonymous_credentials": True,
                "pools": [{"machine_type": self.itype, "zone": z} for z in self.zones],
                "head_service_account": self.identity["head"],
                "worker_service_account": self.identity["worker"]}

    def head_config(self) -> dict:
        return {"machineType": "n2-standard-4", **self.worker_config()}

    def worker_config(self) -> dict:
        return {"disks": [{"boot": True, "autoDelete": True, "initializeParams": {
                    "sourceImage": "projects/debian-cloud/global/images/family/debian-12"}}],
                "networkInterfaces": [{"subnetwork": "regions/{region}/subnetworks/default"}]}

    def refuse(self, zone: str) -> None:
        self.fake.exhaust(zone, self.itype, "SPOT")

    def _find(self, node_id: str):
        return next(((z, i) for (p, z, n), i in self.fake.instances.items()
                     if n == node_id and p == self.project), (None, None))

    def preempt(self, node_id: str) -> None:
        zone, _ = self._find(node_id)
        self.fake.preempt(self.project, zone, node_id)  # termination action DELETE: gone

    def spot_launch_identities(self) -> set:
        return {r.body["serviceAccounts"][0]["email"] for r in self.fake.inserts()
                if r.body["scheduling"]["provisioningModel"] == "SPOT"}

    def described(self, node_id: str) -> dict:
        zone, inst = self._find(node_id)
        if inst is None:
            return {"zone": None, "spot": None, "live": False, "identity": None}
        return {"zone": zone, "live": inst["status"] in ("PROVISIONING", "STAGING", "RUNNING"),
                "spot": inst["scheduling"]["provisioningModel"] == "SPOT",
                "identity": inst["serviceAccounts"][0]["email"]}


def cluster_config(cloud, name: str, metrics_port: int) -> dict:
    """A cluster YAML as a user writes it (then prepared as Ray prepares one)."""
    return prepare_config({
        "cluster_name": name, "max_workers": 4, "upscaling_speed": 1.0,
        "idle_timeout_minutes": 5,
        "provider": {"type": "external", "module": MODULES[cloud.cloud],
                     "disable_node_updaters": True, "foreground_node_launch": True,
                     "disable_launch_config_check": True, "metrics_port": metrics_port,
                     **cloud.provider()},
        "auth": {"ssh_user": "ubuntu"},
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 2}, "max_workers": 0,
                                 "node_config": cloud.head_config()},
            "ray.worker.spot": {"resources": {"CPU": 4, "spot": 1000}, "min_workers": 0,
                                "max_workers": 4, "node_config": cloud.worker_config()},
        },
        "head_node_type": "ray.head.default",
        "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [],
        "setup_commands": [], "head_setup_commands": [], "worker_setup_commands": [],
        "head_start_ray_commands": [], "worker_start_ray_commands": [],
    })


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    with urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def capacity_scenario(cloud, name: str) -> None:
    """ray up (bootstrap + head) -> demand launches spot workers in the first pool -> a
    preempted pool is avoided for the replacement -> a refused pool falls back to the next ->
    idle workers are drained and terminated."""
    from ray.autoscaler._private.autoscaler import StandardAutoscaler
    from ray.autoscaler._private.load_metrics import LoadMetrics
    from ray.autoscaler._private.prom_metrics import AutoscalerPrometheusMetrics

    import moshray.autoscaler.providers.metrics as provider_metrics
    from moshray.autoscaler.pools import EventKind, Pool

    port = free_port()
    pools = [Pool(cloud.cloud, cloud.itype, z) for z in cloud.zones]
    a, b, c = (p.key for p in pools)
    # `ray up`: Ray resolves the provider class, bootstraps the config, launches the head.
    config = cloud.provider_cls.bootstrap_config(cluster_config(cloud, name, port))
    validate_config(config)
    head_type = config["head_node_type"]
    (head,) = cloud.provider_cls(config["provider"], name).create_node(
        config["available_node_types"][head_type]["node_config"],
        {TAG_RAY_NODE_KIND: "head", TAG_RAY_USER_NODE_TYPE: head_type}, 1)
    assert cloud.described(head)["identity"] == cloud.identity["head"]
    assert cloud.described(head)["spot"] is False

    # The head's autoscaler: Ray's loop reading the bootstrapped config.
    load = LoadMetrics()
    gcs = FakeGcs()
    scaler = StandardAutoscaler(lambda: copy.deepcopy(config), load, gcs, max_failures=0,
                                update_interval_s=0, prom_metrics=AutoscalerPrometheusMetrics())
    provider = scaler.provider
    assert isinstance(provider, cloud.provider_cls)

    def workers() -> list[str]:
        return sorted(provider.non_terminated_nodes({TAG_RAY_NODE_KIND: "worker"}))

    def pool_of(node: str) -> str:
        return provider.node_tags(node)[POOL_TAG]

    try:
        # 1. request_resources for two replicas: two spot workers in the first pool
        load.set_resource_requests([SPOT_BUNDLE] * 2)
        scaler.update()
        first = workers()
        assert len(first) == 2 and {pool_of(n) for n in first} == {a}
        for node in first:
            seen = cloud.described(node)
            assert seen["spot"] and seen["zone"] == cloud.zones[0]
        assert cloud.spot_launch_identities() == {cloud.identity["worker"]}
        scaler.update()  # demand met: nothing more
        assert workers() == first

        # 2. the cloud reclaims one: its replacement avoids the preempted pool
        cloud.preempt(first[0])
        scaler.update()
        second = workers()
        assert first[0] not in second and len(second) == 2
        (replacement,) = set(second) - set(first)
        assert pool_of(replacement) == b and cloud.described(replacement)["spot"]
        assert [e.pool for e in provider.history.snapshot()
                if e.kind is EventKind.PREEMPTED] == [a]

        # 3. more demand while the second pool has no capacity: the next pool takes it
        cloud.refuse(cloud.zones[1])
        load.set_resource_requests([SPOT_BUNDLE] * 3)
        scaler.update()
        third = workers()
        (extra,) = set(third) - set(second)
        assert pool_of(extra) == c and cloud.described(extra)["zone"] == cloud.zones[2]
        assert (b, EventKind.CAPACITY_ERROR) in [(e.pool, e.kind)
                                                 for e in provider.history.snapshot()]

        # the head's Prometheus sees it: the providers' endpoint on the loopback port
        metrics = scrape(port)
        launches = {pool: metrics.get(("moshray_provider_launches_total",
                                       (("cloud", cloud.cloud), ("pool", pool))), 0)
                    for pool in (a, b, c)}
        assert launches[a] >= 2 and launches[b] >= 1 and launches[c] >= 1
        failures = [v for (n, labels), v in metrics.items()
                    if n == "moshray_provider_launch_failures_total"
                    and ("pool", b) in labels and ("capacity", "true") in labels]
        assert sum(failures) >= 1
        assert metrics[("moshray_provider_preemptions_total",
                        (("cloud", cloud.cloud), ("pool", a)))] >= 1

        # 4. demand gone, the raylets report idle: drained and terminated, the head stays
        load.set_resource_requests([])
        for index, node in enumerate(third):
            static = {"CPU": 4.0, "spot": 1000.0}
            load.update(provider.internal_ip(node), f"raylet-{index}".encode(), static,
                        dict(static), node_idle_duration_s=3600)
        before = dict(metrics)
        scaler.update()
        assert workers() == []
        assert sorted(gcs.drained) == sorted(f"raylet-{i}".encode() for i in range(3))
        assert not any(cloud.described(n)["live"] for n in third)
        assert cloud.described(head)["live"]
        assert provider.non_terminated_nodes({TAG_RAY_NODE_KIND: "head"}) == [head]
        assert [e.pool for e in provider.history.snapshot()
                if e.kind is EventKind.PREEMPTED] == [a]  # scale-down is no preemption
        after = scrape(port)
        for pool, count in ((a, 1), (b, 1), (c, 1)):
            key = ("moshray_provider_terminations_total", (("cloud", cloud.cloud), ("pool", pool)))
            assert after[key] - before.get(key, 0) == count
    finally:
        provider_metrics.stop(port)


def test_rays_standard_autoscaler_drives_the_aws_provider_against_moto(moto_ec2):
    capacity_scenario(AwsCloud(moto_ec2), "e2e-aws")


def test_rays_standard_autoscaler_drives_the_gcp_provider_against_the_local_endpoint():
    fake = FakeCompute().start()
    try:
        capacity_scenario(GcpCloud(fake), "e2e-gcp")
    finally:
        fake.stop()
