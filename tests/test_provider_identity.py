"""``bootstrap_config`` of the spot NodeProviders: every node type gets the head's or the
workers' identity (AWS instance profile, GCP service account) from the provider config, as
Ray's own cloud bootstraps do; pure, and a missing one is a one-line error naming the key.

The shipped cluster YAMLs (infra/ray/) go through it with the provider keys set, and through
Ray's own ``prepare_config`` + ``validate_config`` afterwards.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.providers import _get_node_provider_cls
from ray.autoscaler._private.util import prepare_config, validate_config

from moshray.autoscaler.clouds.aws.provider import AWSSpotNodeProvider
from moshray.autoscaler.clouds.gcp.provider import GCPSpotNodeProvider
from moshray.autoscaler.providers.config import GCP_SCOPES, bootstrap_identity, metrics_port
from moshray.autoscaler.tags import PROVIDER_METRICS_PORT

ROOT = Path(__file__).resolve().parents[1]
HEAD_ARN = "arn:aws:iam::123456789012:instance-profile/moshray-head"
WORKER_ARN = "arn:aws:iam::123456789012:instance-profile/moshray-worker"
HEAD_SA = "moshray-head@proj-1.iam.gserviceaccount.com"
WORKER_SA = "moshray-worker@proj-1.iam.gserviceaccount.com"


def cluster(cloud: str, head_config: dict | None = None, worker_config: dict | None = None,
            **provider) -> dict:
    return {
        "cluster_name": "c",
        "provider": {"type": "external", "region": "us-east-1", **provider},
        "head_node_type": "head",
        "available_node_types": {
            "head": {"node_config": head_config or {}, "resources": {}},
            "spot": {"node_config": worker_config or {"ImageId": "ami-1"}, "resources": {}},
        },
    }


def test_aws_profiles_go_into_the_node_types_and_the_input_is_untouched():
    config = cluster("aws", head_instance_profile_arn=HEAD_ARN,
                     worker_instance_profile_arn=WORKER_ARN)
    before = copy.deepcopy(config)
    out = AWSSpotNodeProvider.bootstrap_config(config)
    assert config == before  # pure
    types = out["available_node_types"]
    assert types["head"]["node_config"]["IamInstanceProfile"] == {"Arn": HEAD_ARN}
    assert types["spot"]["node_config"] == {"ImageId": "ami-1",
                                            "IamInstanceProfile": {"Arn": WORKER_ARN}}
    assert AWSSpotNodeProvider.bootstrap_config(out) == out  # idempotent


def test_gcp_service_accounts_go_into_the_node_types():
    config = cluster("gcp", head_service_account=HEAD_SA, worker_service_account=WORKER_SA,
                     worker_config={"machineType": "g2-standard-4"})
    out = GCPSpotNodeProvider.bootstrap_config(config)
    types = out["available_node_types"]
    assert types["head"]["node_config"]["serviceAccounts"] == [
        {"email": HEAD_SA, "scopes": list(GCP_SCOPES)}]
    assert types["spot"]["node_config"]["serviceAccounts"][0]["email"] == WORKER_SA
    assert GCPSpotNodeProvider.bootstrap_config(out) == out


def test_an_identity_in_node_config_is_kept_and_a_launch_template_carries_one():
    config = cluster("aws", head_config={"IamInstanceProfile": {"Name": "own-head"}},
                     worker_config={"LaunchTemplate": {"LaunchTemplateId": "lt-1"}})
    out = AWSSpotNodeProvider.bootstrap_config(config)
    types = out["available_node_types"]
    assert types["head"]["node_config"]["IamInstanceProfile"] == {"Name": "own-head"}
    assert "IamInstanceProfile" not in types["spot"]["node_config"]
    # the same identity named twice is fine (ARN or its profile name)
    same = cluster("aws", head_config={"IamInstanceProfile": {"Name": "moshray-head"}},
                   head_instance_profile_arn=HEAD_ARN, worker_instance_profile_arn=WORKER_ARN)
    AWSSpotNodeProvider.bootstrap_config(same)


@pytest.mark.parametrize("cloud, config, message", [
    ("aws", cluster("aws", head_instance_profile_arn=HEAD_ARN),
     r"^provider.worker_instance_profile_arn is required: an IAM instance profile ARN for the "
     r"worker nodes \(the Terraform output\), or set one in "
     r"available_node_types.spot.node_config$"),
    ("aws", cluster("aws", worker_instance_profile_arn=WORKER_ARN),
     r"^provider.head_instance_profile_arn is required"),
    ("aws", cluster("aws", head_instance_profile_arn=HEAD_ARN,
                    worker_instance_profile_arn="moshray-worker"),
     r"^provider.worker_instance_profile_arn must be an IAM instance profile ARN"),
    ("aws", cluster("aws", head_config={"IamInstanceProfile": {"Arn": WORKER_ARN}},
                    head_instance_profile_arn=HEAD_ARN, worker_instance_profile_arn=WORKER_ARN),
     r"available_node_types.head.node_config names identity .* set only one of them$"),
    ("aws", cluster("aws", head_config={"IamInstanceProfile": "x"},
                    worker_instance_profile_arn=WORKER_ARN), r"IamInstanceProfile must be"),
    ("gcp", cluster("gcp", head_service_account=HEAD_SA),
     r"^provider.worker_service_account is required"),
    ("gcp", cluster("gcp", head_service_account="moshray-head", worker_service_account=WORKER_SA),
     r"^provider.head_service_account must be a service account email"),
])
def test_missing_or_conflicting_identity_is_one_clear_line(cloud, config, message):
    cls = AWSSpotNodeProvider if cloud == "aws" else GCPSpotNodeProvider
    with pytest.raises(ValueError, match=message) as info:
        cls.bootstrap_config(config)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("cloud, keys", [
    ("aws", {"head_instance_profile_arn": HEAD_ARN, "worker_instance_profile_arn": WORKER_ARN}),
    ("gcp", {}),  # the shipped GCP YAML names a service account in each node_config
])
def test_shipped_yamls_bootstrap_and_still_pass_rays_validation(cloud, keys):
    raw = yaml.safe_load((ROOT / f"infra/ray/cluster-{cloud}.yaml").read_text())
    raw["provider"].update(keys)
    cls = _get_node_provider_cls(raw["provider"])  # what `ray up` resolves
    out = cls.bootstrap_config(prepare_config(raw))
    validate_config(out)
    for node_type in out["available_node_types"].values():
        node_config = node_type["node_config"]
        assert node_config.get("IamInstanceProfile") or node_config.get("serviceAccounts")


def test_metrics_port_default_off_and_checked():
    assert metrics_port({}) == PROVIDER_METRICS_PORT
    assert metrics_port({"metrics_port": None}) is None
    assert metrics_port({"metrics_port": 9999}) == 9999
    for bad in (True, "9451", -1, 70000):
        with pytest.raises(ValueError, match="provider.metrics_port must be a port number"):
            metrics_port({"metrics_port": bad})


def test_bootstrap_identity_rejects_an_unknown_cloud():
    with pytest.raises(ValueError, match="unknown cloud"):
        bootstrap_identity("azure", cluster("aws"))
