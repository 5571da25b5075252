"""Node images and build identity, offline.

- ``infra/images/check_node.py`` run as the startup scripts run it, in a subprocess, against
  real Python environments (venvs whose site-packages hold the distributions' metadata):
  versions present -> exit 0 and "ok"; missing, other versions, no interpreter -> exit 1.
- The startup script Terraform renders runs that check first and installs only when it fails.
- The image recipes: the Dockerfile's base is Ray's own image at a Ray version inside
  pyproject's range and equal to infra's pins, it installs the wheel, names no ``latest``;
  the Packer template parses as HCL and installs the same.
- The build version: derived from git (pyproject), visible as ``moshray.__version__``; the
  pure comparison and the replica's one-line refusal, which the controller's UserError path
  turns into a stop of the job.
"""

from __future__ import annotations

import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from infra_helpers import INFRA, hcl
from test_infra_hcl import parse, string_value

IMAGES = INFRA / "images"
CHECK = IMAGES / "check_node.py"
ROOT = INFRA.parent
WHEEL = "moshray-0.1.1.dev5+g1a2b3c4-py3-none-any.whl"
WANT = ["--ray", "2.60.0", "--torch", "2.13.0", "--wheel", WHEEL]


def fake_env(path: Path, versions: dict[str, str]) -> Path:
    """A real venv (no pip) whose site-packages holds only the metadata of ``versions``;
    returns its interpreter."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(path)
    site = next((path / "lib").glob("python3*/site-packages"))
    for name, version in versions.items():
        info = site / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\n"
                                       f"Version: {version}\n")
    return path / "bin" / "python"


def check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), *args], capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def envs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("envs")
    full = {"ray": "2.60.0", "torch": "2.13.0+cu128", "moshray": "0.1.1.dev5+g1a2b3c4"}
    return {
        "image": fake_env(base / "image", full),
        "old-build": fake_env(base / "old", dict(full, moshray="0.1.1.dev4+g9f8e7d6")),
        "bare": fake_env(base / "bare", {}),
        "other-torch": fake_env(base / "torch", dict(full, torch="2.12.0+cu126")),
    }


def test_check_passes_when_the_image_holds_every_version(envs):
    proc = check("--python", str(envs["image"]), *WANT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (line,) = proc.stdout.splitlines()
    assert line.startswith("ok: ray 2.60.0, torch 2.13.0+cu128, moshray 0.1.1.dev5+g1a2b3c4")


@pytest.mark.parametrize("env, named", [
    ("old-build", "moshray 0.1.1.dev4+g9f8e7d6 (want 0.1.1.dev5+g1a2b3c4)"),
    ("bare", "ray missing (want 2.60.0), torch missing (want 2.13.0), moshray missing"),
    ("other-torch", "torch 2.12.0+cu126 (want 2.13.0)"),
])
def test_check_asks_for_the_install_and_names_what_differs(envs, env, named):
    proc = check("--python", str(envs[env]), *WANT)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (line,) = proc.stdout.splitlines()
    assert line.startswith("install needed: ") and named in line, line


def test_check_without_an_interpreter_or_with_a_bad_wheel_name(tmp_path):
    proc = check("--python", str(tmp_path / "no" / "python"), *WANT)
    assert proc.returncode == 1 and proc.stdout.strip() == \
        f"install needed: no interpreter at {tmp_path / 'no' / 'python'}"
    proc = check("--ray", "2.60.0", "--torch", "2.13.0", "--wheel", "other-1.0.tar.gz")
    assert proc.returncode == 2 and "is not a moshray wheel file name" in proc.stderr


def test_version_rules():
    sys.path.insert(0, str(IMAGES))
    try:
        import check_node as c
    finally:
        sys.path.remove(str(IMAGES))
    assert c.wheel_version("wheels/" + WHEEL) == "0.1.1.dev5+g1a2b3c4"
    assert c.version_matches("2.13.0+cu128", "2.13.0")  # a build variant of what is pinned
    assert not c.version_matches("2.13.0+cu128", "2.13.0+cu126")
    assert not c.version_matches("0.1.1.dev5+g1a2b3c4", "0.1.1.dev5", exact=True)
    code, line = c.decide({"ray": "2.60.0", "torch": "2.13.0", "moshray": "0.2+g1"},
                          {"ray": "2.60.0", "torch": "2.13.0", "moshray": "0.2"})
    assert code == c.INSTALL and line == "install needed: moshray 0.2+g1 (want 0.2)"
    assert not c.version_matches(None, "2.60.0")


def install_snippet(cloud: str, check_node: str) -> str:
    """The bootstrap module's install template rendered the way Terraform renders it."""
    template = (INFRA / cloud / "modules/bootstrap/templates/install.sh.tftpl").read_text()
    values = {"check_node": check_node, "ray_version": "2.60.0", "torch_version": "2.13.0",
              "wheel_file": WHEEL, "wheel_bucket": "b", "wheel_key": "wheels/" + WHEEL,
              "region": "us-east-1"}
    return re.sub(r"\$\{(\w+)\}", lambda m: values[m.group(1)], template)


@pytest.mark.parametrize("cloud", ["aws", "gcp"])
def test_startup_install_is_skipped_on_a_node_from_the_image(tmp_path, envs, cloud):
    """The rendered install runs its check first; with the image's interpreter the
    downloads never run, with a bare one they do (stubbed here: they only log)."""
    main_tf = (INFRA / cloud / "modules/bootstrap/main.tf").read_text()
    assert 'check_node = file("${path.module}/../../../images/check_node.py")' in main_tf
    script = install_snippet(cloud, CHECK.read_text())
    log = tmp_path / "calls.log"
    for env, installs in (("image", False), ("bare", True)):
        # Point the script at a scratch prefix; stub python3 -m venv / pip / the downloads.
        prefix = tmp_path / env
        (prefix / "bin").mkdir(parents=True)
        stub = f'#!/bin/sh\necho "$0 $*" >> {log}\ncat >/dev/null\nexit 0\n'
        for name in ("pip", "python"):
            (prefix / "bin" / name).write_text(stub)
            (prefix / "bin" / name).chmod(0o755)
        body = script.split("\nfi\n", 1)[0] + "\nfi\n"  # the final import check needs Ray
        body = (body.replace("/opt/moshray-check-node.py", str(tmp_path / "check.py"))
                .replace("--python /opt/moshray/bin/python", f"--python {envs[env]}")
                .replace("python3 -m venv /opt/moshray", "true")
                .replace("/opt/moshray/", f"{prefix}/"))
        log.write_text("")
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", body], capture_output=True,
                              text=True, timeout=120,
                              env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"})
        assert proc.returncode == 0, proc.stderr
        calls = log.read_text()
        if installs:
            assert "install needed: " in proc.stdout
            assert f"pip install {prefix}/{WHEEL} ray[default,train]==2.60.0 torch==2.13.0" \
                in calls, calls
        else:
            assert "ok: ray 2.60.0" in proc.stdout and calls == "", calls


# ------------------------------------------------------------------------- image recipes

def pins() -> dict[str, str]:
    variables = {v.labels[0]: v.body for v in hcl("aws").blocks("variable")}
    return {n: string_value(variables[n].attr("default")) for n in ("ray_version",
                                                                    "torch_version")}


def test_dockerfile_builds_on_rays_image_at_the_pinned_versions():
    from packaging.requirements import Requirement

    text = (IMAGES / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))
    (base,) = re.findall(r"^FROM (\S+)", text, re.M)
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
    image, _, tag = base.partition(":")
    assert image == "rayproject/ray" and "latest" not in text.lower()
    ray_version = tag.split("-")[0]
    (line,) = re.findall(r'"(ray\[[a-z,]+\][<>=!~][^"]*)"',
                         (ROOT / "pyproject.toml").read_text())
    assert Requirement(line).specifier.contains(ray_version), (ray_version, line)
    assert re.fullmatch(r"py3\d+-cu12\d*", tag.split("-", 1)[1]), tag
    assert (ray_version, args["TORCH_VERSION"]) == (pins()["ray_version"],
                                                     pins()["torch_version"])
    install = " ".join(text.split("\\\n"))
    assert re.search(r"pip install .*/tmp/wheels/moshray-\*\.whl", install)
    assert '"ray[default,train]==${RAY_VERSION}" "torch==${TORCH_VERSION}"' in install
    assert "check-node.py" in install and "--wheel" in install  # the build checks itself


def test_packer_template_parses_and_installs_the_same():
    body = parse((IMAGES / "node.pkr.hcl").read_text(), "node.pkr.hcl")
    variables = {v.labels[0]: v.body for v in body.blocks("variable")}
    assert {n: string_value(variables[n].attr("default"))
            for n in ("ray_version", "torch_version")} == pins()
    assert variables["moshray_wheel"].attr("default") is None  # required
    assert {s.labels[0] for s in body.blocks("source")} == {"amazon-ebs", "googlecompute"}
    (build,) = body.blocks("build")
    (shell,) = build.body.blocks("provisioner", "shell")
    inline = shell.body.attr("inline")
    assert ("/opt/moshray/bin/pip install /tmp/${basename(var.moshray_wheel)} "
            "'ray[default,train]==${var.ray_version}' 'torch==${var.torch_version}'") in inline
    assert "check_node.py --python /opt/moshray/bin/python" in inline


# ------------------------------------------------------------------------ build version

def test_version_comes_from_git_and_is_the_packages():
    import tomllib
    from importlib import metadata

    import moshray
    from moshray.actors.replica.build_check import installed_build

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" in project["project"]["dynamic"]
    assert any(r.startswith("setuptools-scm") for r in project["build-system"]["requires"])
    assert project["tool"]["setuptools_scm"]["fallback_version"]
    assert moshray.__version__ == installed_build() == metadata.version("moshray")


def test_build_mismatch_is_pure_and_one_line():
    from moshray.actors.replica.build_check import build_mismatch
    from moshray.actors.errors import UserError

    assert build_mismatch("0.1.1.dev5+g1a2b3c4", "0.1.1.dev5+g1a2b3c4", "10.0.0.5") is None
    assert build_mismatch(None, "0.1.1.dev5+g1a2b3c4", "10.0.0.5") is None  # no check asked
    err = build_mismatch("0.1.1.dev5+g1a2b3c4", "0.1.1.dev4+g9f8e7d6", "10.0.0.5")
    assert isinstance(err, UserError) and err.what == "version"
    assert "\n" not in str(err) and str(err).startswith(
        "version: the driver runs moshray 0.1.1.dev5+g1a2b3c4 but node 10.0.0.5 has moshray "
        "0.1.1.dev4+g9f8e7d6")


def test_spec_carries_the_drivers_build():
    from moshray.actors.replica.build_check import installed_build
    from moshray.jobs.controller.replica_launch import ReplicaSpec

    assert ReplicaSpec({}, None, None).build == installed_build()


@pytest.mark.cluster
def test_replica_of_another_build_refuses_and_the_controller_stops_the_job(local_cluster):
    """A replica told of another driver build fails ``run()`` with the UserError, without
    joining; the controller's outcome check re-raises it (the job stops)."""
    import ray

    from moshray.actors.errors import UserError
    from moshray.jobs.config import TrainConfig
    from moshray.jobs.controller.elastic import ElasticController
    from moshray.jobs.controller.replica_launch import ReplicaSpec, launch_replica
    from replica_supervisor import slot_node_id

    node = slot_node_id(0)
    spec = ReplicaSpec(TrainConfig().to_dict(), None, None, build="0.0.0+another.build")
    handle, run = launch_replica(spec, "replica-version-test", node, 0)
    try:
        ray.wait([run], timeout=120)
        controller = ElasticController.__new__(ElasticController)
        controller.outcomes = {}
        with pytest.raises(UserError) as caught:
            controller._outcome("replica-version-test", run)
        assert caught.value.what == "version"
        assert "the driver runs moshray 0.0.0+another.build but node" in str(caught.value)
    finally:
        ray.kill(handle)


# ------------------------------------------------------------- a user's extra packages

def test_digits_brings_scikit_learn_through_rays_runtime_env():
    from packaging.requirements import Requirement
    from ray.runtime_env import RuntimeEnv

    from moshray.jobs.examples import digits

    RuntimeEnv(**digits.RUNTIME_ENV)  # a runtime_env Ray accepts
    (req,) = [Requirement(r) for r in digits.RUNTIME_ENV["pip"]]
    assert req.name == "scikit-learn"
    assert digits.runtime_env_to_add(None, False) == digits.RUNTIME_ENV
    assert digits.runtime_env_to_add({"env_vars": {"A": "1"}}, False) == digits.RUNTIME_ENV
    # A job submitted with its own packages keeps them (Ray would refuse to merge two).
    assert digits.runtime_env_to_add({"pip": ["scikit-learn", "pandas"]}, False) is None
    assert digits.runtime_env_to_add(None, True) is None  # the driver's install has it
