"""The example configs ship with the package and load on every Python the images run.

* ``jobs/configs/{local,aws,gcp}.toml`` load through :func:`moshray.jobs.config.load_config`
  (validated: unknown keys and bad values raise), found through the installed package
  (``importlib.resources``), not through the checkout.
* The cloud configs checkpoint to durable, shared storage: the cluster's own
  (``MOSHRAY_CHECKPOINT_URI``, the ``checkpoint_uri`` output of ``infra/``), never a
  placeholder bucket of their own; without one the job refuses to start on several machines.
* pyproject declares the configs as package data and ``tomli`` for Python < 3.11, and a wheel
  built from the checkout carries the configs.
"""

from __future__ import annotations

import importlib.resources
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

try:  # Python 3.11+
    import tomllib
except ImportError:  # Python 3.10: the dependency pyproject declares
    import tomli as tomllib

from moshray.jobs.config import TrainConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("local", "aws", "gcp")
DURABLE = {"aws": "s3://", "gcp": "gs://"}


def shipped(name: str) -> Path:
    path = importlib.resources.files("moshray.jobs") / "configs" / f"{name}.toml"
    assert path.is_file(), f"moshray.jobs has no configs/{name}.toml"
    return Path(str(path))


@pytest.mark.parametrize("name", CONFIGS)
def test_each_shipped_config_loads_and_validates(name):
    config = load_config(str(shipped(name)))
    assert isinstance(config, TrainConfig)
    # Every key in the file is a real field (load_config rejects unknown keys); and the file
    # sets something, so it is not silently the defaults.
    assert config != TrainConfig()
    # The file round-trips: what it says is what the job runs with.
    assert TrainConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("cloud", sorted(DURABLE))
def test_cloud_configs_checkpoint_to_the_clusters_object_storage(cloud):
    from moshray.jobs.controller.durability import Stop, Switch, decide_durability

    config = load_config(str(shipped(cloud)))
    assert config.checkpoint.uri is None and config.checkpoint.optional is False
    # On a cluster the job takes the cluster's durable location (infra/ sets it on the
    # head), and refuses to start on several machines without one.
    cluster_uri = f"{DURABLE[cloud]}bucket-of-infra/moshray"
    assert decide_durability(config, 3, cluster_uri) == Switch(cluster_uri)
    assert isinstance(decide_durability(config, 3, None), Stop)
    # On a real cluster the job attaches to it; it never starts an embedded one.
    assert config.cluster.address == "auto"
    for path in config.data.paths:
        assert path.startswith(DURABLE[cloud]), path


def test_local_config_runs_the_embedded_cluster():
    config = load_config(str(shipped("local")))
    assert config.cluster.address is None
    assert config.cluster.local_nodes >= 2
    assert config.checkpoint.uri and "://" not in config.checkpoint.uri


def test_a_typo_in_a_shipped_config_would_be_caught(tmp_path):
    from moshray.jobs.config import ConfigError

    bad = tmp_path / "bad.toml"
    bad.write_text(shipped("aws").read_text().replace("every_steps", "every_step"))
    with pytest.raises(ConfigError, match="every_step"):
        load_config(str(bad))


def test_pyproject_ships_the_configs_and_tomli_for_python_3_10():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "configs/*.toml" in project["tool"]["setuptools"]["package-data"]["moshray.jobs"]
    deps = [d.replace(" ", "") for d in project["project"]["dependencies"]]
    assert 'tomli>=2.0;python_version<"3.11"' in deps


def test_the_wheel_built_from_the_checkout_carries_the_configs(tmp_path):
    """What infra/README.md builds and the nodes install: `pip wheel --no-deps .`."""
    src = tmp_path / "src"  # a copy: the build writes build/ and *.egg-info next to the sources
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("cluster", "actors", "autoscaler", "jobs"):
        shutil.copytree(ROOT / folder, src / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-q", "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = (tmp_path / "dist").glob("moshray-*-py3-none-any.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in CONFIGS:
        assert f"moshray/jobs/configs/{name}.toml" in names
    # Every module of every subpackage ships (a subpackage missing from pyproject's
    # `packages` would leave its modules out of the wheel).
    roots = {"jobs/api": "moshray", "cluster": "moshray/cluster", "actors": "moshray/actors",
             "autoscaler": "moshray/autoscaler", "jobs": "moshray/jobs"}
    missing = []
    for folder, package in roots.items():
        for path in (src / folder).rglob("*.py"):
            rel = path.relative_to(src / folder).as_posix()
            if folder == "jobs" and rel.startswith("api/") or rel == "_version.py":
                continue
            if f"{package}/{rel}" not in names:
                missing.append(f"{package}/{rel}")
    assert not missing, missing
