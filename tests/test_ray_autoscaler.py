"""Ray's autoscaler and moshray's spot capacity: the cluster YAMLs, and Ray's autoscaler on one
machine. (Ray's own autoscaler loop driving the providers against local clouds:
tests/test_ray_autoscaler_loop.py.)

* The example cluster YAMLs (infra/ray/) pass Ray's own config preparation and schema
  validation offline, name provider modules that Ray's loader resolves to moshray's providers,
  and their node types launch through those providers against moto (AWS) and the local
  Compute endpoint (GCP).
* Ray's autoscaler on one machine (its fake multi-node provider: real raylets on 127.0.0.1):
  demand for replicas (actors needing the ``spot`` resource) launches nodes, and a node killed
  without notice is replaced. This starts its own cluster, so it runs in a subprocess
  (tests/fake_autoscaling.py) and never meets a cluster this pytest process is connected to.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import boto3
import pytest
import yaml
from ray.autoscaler._private.providers import _get_node_provider_cls
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.autoscaler.tags import TAG_RAY_NODE_KIND, TAG_RAY_USER_NODE_TYPE

from fake_gcp import FakeCompute
from moshray.autoscaler.clouds.aws.provider import AWSSpotNodeProvider
from moshray.autoscaler.clouds.gcp.provider import GCPSpotNodeProvider
from moshray.autoscaler.tags import (
    AWS_PROVIDER,
    CLUSTER_TAG,
    GCP_PROVIDER,
    MARKET_TAG,
    POOL_TAG,
    ROLE_TAG,
)
from moshray.jobs.cli import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[1]
YAMLS = {"aws": ROOT / "infra/ray/cluster-aws.yaml", "gcp": ROOT / "infra/ray/cluster-gcp.yaml"}
MODULES = {"aws": AWS_PROVIDER, "gcp": GCP_PROVIDER}
CLASSES = {"aws": AWSSpotNodeProvider, "gcp": GCPSpotNodeProvider}


def load(cloud: str) -> dict:
    return yaml.safe_load(YAMLS[cloud].read_text())


def worker_type(config: dict) -> str:
    (name,) = [n for n in config["available_node_types"] if n != config["head_node_type"]]
    return name


@pytest.mark.parametrize("cloud", ["aws", "gcp"])
def test_cluster_yaml_passes_rays_validation_and_names_our_provider(cloud):
    config = load(cloud)
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)  # Ray's JSON schema + its own checks, offline
    provider = prepared["provider"]
    assert provider["type"] == "external" and provider["module"] == MODULES[cloud]
    assert _get_node_provider_cls(provider) is CLASSES[cloud]
    # the placement section parses (pools, budget, time constants) as the provider reads it
    instance = CLASSES[cloud]({**provider, "anonymous_credentials": True}, config["cluster_name"]) \
        if cloud == "gcp" else CLASSES[cloud](provider, config["cluster_name"])
    assert len(instance.placement.pools) >= 2
    assert all(p.is_spot for p in instance.placement.pools)
    workers = prepared["available_node_types"][worker_type(config)]
    assert workers["resources"]["spot"] > 0 and workers["max_workers"] <= prepared["max_workers"]
    head = prepared["available_node_types"][prepared["head_node_type"]]
    assert head["max_workers"] == 0


@pytest.mark.parametrize("cloud", ["aws", "gcp"])
def test_workers_start_the_notice_watcher(cloud):
    config = load(cloud)
    commands = " ; ".join(config["worker_start_ray_commands"])
    assert f"moshray watch --source {cloud}" in commands
    assert '"spot": 1000' in commands  # the same resource as the node type declares
    (watch,) = [c for c in COMMANDS if c.words == ("watch",)]
    assert watch.module == "moshray.autoscaler.watch"
    if importlib.util.find_spec(watch.module) is not None:  # once the watcher module lands
        args = build_parser(["watch"]).parse_args(["watch", "--source", cloud])
        assert args.source == cloud


def test_aws_yaml_node_types_launch_against_moto(moto_ec2):
    config = load("aws")
    ec2 = boto3.client("ec2", region_name=config["provider"]["region"],
                       endpoint_url=moto_ec2.moto_url)
    # What a user does with the placeholders: put their own subnet and security group in.
    vpc = ec2.describe_vpcs()["Vpcs"][0]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="172.31.200.0/24",
                               AvailabilityZone="us-east-1a")["Subnet"]["SubnetId"]
    group = ec2.create_security_group(GroupName="moshray", Description="moshray",
                                      VpcId=vpc)["GroupId"]
    text = YAMLS["aws"].read_text().replace("subnet-0123456789abcdef0", subnet) \
        .replace("sg-0123456789abcdef0", group)
    config = prepare_config(yaml.safe_load(text))
    provider = AWSSpotNodeProvider({**config["provider"], "endpoint_url": moto_ec2.url},
                                   config["cluster_name"])
    types = config["available_node_types"]
    head_type, spot_type = config["head_node_type"], worker_type(config)
    (head,) = provider.create_node(types[head_type]["node_config"],
                                   {TAG_RAY_NODE_KIND: "head",
                                    TAG_RAY_USER_NODE_TYPE: head_type}, 1)
    workers = provider.create_node(types[spot_type]["node_config"],
                                   {TAG_RAY_NODE_KIND: "worker",
                                    TAG_RAY_USER_NODE_TYPE: spot_type}, 2)
    assert len(workers) == 2
    described = {i["InstanceId"]: i for r in ec2.describe_instances(Filters=[
        {"Name": f"tag:{CLUSTER_TAG}", "Values": [config["cluster_name"]]}])["Reservations"]
        for i in r["Instances"]}
    tags = {k: {t["Key"]: t["Value"] for t in v["Tags"]} for k, v in described.items()}
    assert described[head]["InstanceType"] == "m5.large"
    assert described[head].get("InstanceLifecycle") is None and described[head]["SubnetId"] == subnet
    assert tags[head][ROLE_TAG] == "head" and tags[head][MARKET_TAG] == "on-demand"
    first_pool = provider.placement.pools[0]
    for node in workers:
        assert described[node]["InstanceLifecycle"] == "spot"
        assert described[node]["InstanceType"] == first_pool.instance_type
        assert tags[node][POOL_TAG] == first_pool.key
        assert described[node]["MetadataOptions"]["HttpTokens"] == "required"
        assert described[node]["MetadataOptions"]["InstanceMetadataTags"] == "enabled"
    assert sorted(provider.non_terminated_nodes({TAG_RAY_NODE_KIND: "worker"})) == sorted(workers)


def test_gcp_yaml_node_types_launch_against_the_local_endpoint():
    fake = FakeCompute().start()
    try:
        config = prepare_config(load("gcp"))
        provider = GCPSpotNodeProvider(
            {**config["provider"], "api_endpoint": fake.endpoint, "anonymous_credentials": True},
            config["cluster_name"])
        types = config["available_node_types"]
        head_type, spot_type = config["head_node_type"], worker_type(config)
        provider.create_node(types[head_type]["node_config"],
                             {TAG_RAY_NODE_KIND: "head", TAG_RAY_USER_NODE_TYPE: head_type}, 1)
        workers = provider.create_node(types[spot_type]["node_config"],
                                       {TAG_RAY_NODE_KIND: "worker",
                                        TAG_RAY_USER_NODE_TYPE: spot_type}, 1)
        head_body, worker_body = (r.body for r in fake.inserts())
        assert head_body["scheduling"]["provisioningModel"] == "STANDARD"
        assert worker_body["scheduling"]["provisioningModel"] == "SPOT"
        assert worker_body["scheduling"]["instanceTerminationAction"] == "DELETE"
        zone = provider.placement.pools[0].zone
        assert worker_body["guestAccelerators"][0]["acceleratorType"] == \
            f"zones/{zone}/acceleratorTypes/nvidia-l4"
        text = json.dumps(worker_body)
        assert "{zone}" not in text and "{region}" not in text  # every placeholder replaced
        assert list(provider.non_terminated_nodes({TAG_RAY_NODE_KIND: "worker"})) == \
            list(workers)
    finally:
        fake.stop()


@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_ray_autoscaler_launches_spot_nodes_for_replicas_and_replaces_a_killed_one():
    script = Path(__file__).with_name("fake_autoscaling.py")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=840, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    initial = summary["initial_nodes"]
    assert len(initial) == summary["replicas"] == 2  # demand launched one node per replica
    assert summary["killed"] in initial
    assert summary["replacement"] not in initial  # a new node, launched by the autoscaler
    assert summary["killed"] not in summary["alive_workers"]
    assert summary["replacement"] in summary["alive_workers"]
    assert len(summary["alive_workers"]) == 2
    survivor = next(n for n in initial if n != summary["killed"])
    assert summary["other_replica_home"] == survivor  # the other replica was not disturbed
