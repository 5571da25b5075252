"""Shared fixtures: one multi-node Ray cluster on 127.0.0.1 for the whole session, moto's
EC2 server (tests/fake_ec2.py), one per test that asks for it, and moto's S3 server
(tests/moto_s3.py), one per module that asks for it.

Two tiers (CONTRIBUTING.md): a test that starts or joins Ray is marked ``cluster`` (a test
that asks for ``local_cluster`` is marked by itself); ``pytest -m "not cluster"`` runs the
rest, the fast tier. The marker is enforced: an unmarked test runs with Ray's temporary
directory pointed at a guard directory, and one that left a Ray session there (``ray.init``,
``ray start``, a ``LocalCluster``, in this process or a child) fails with one line. Every run
ends with its wall time against the suite's budget.

Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER and RAY_ENABLE_AUTO_CONNECT when imported, so they
are set here, before any test module imports Ray. Auto-connect is off: a Ray call from a test
whose driver was disconnected fails at once instead of starting a stray local Ray instance
that every later test would run beside.
"""

from __future__ import annotations

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"

import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

SPOT_NODES = 4
# The README's test command, the whole suite, on a 2-core machine; the fast tier's own bound.
SUITE_BUDGET_S = 20 * 60
FAST_TIER_BUDGET_S = 3 * 60
_STARTED = time.monotonic()
# Short: Ray's socket paths live under it and a Unix socket path holds at most 107 bytes.
_GUARD = Path(tempfile.mkdtemp(prefix="mr-guard-", dir="/tmp"))


def pytest_collection_modifyitems(config, items):
    """A test that uses the session's cluster is a cluster test, marked or not."""
    for item in items:
        if "local_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cluster)


def _ray_sessions() -> set[str]:
    root = _GUARD / "ray"
    return {p.name for p in root.iterdir()} if root.is_dir() else set()


@pytest.fixture(autouse=True)
def _ray_only_in_cluster_tests(request, monkeypatch):
    """Fail an unmarked test that starts Ray (see the module's docstring)."""
    if request.node.get_closest_marker("cluster") is not None:
        yield
        return
    before = _ray_sessions()
    monkeypatch.setenv("RAY_TMPDIR", str(_GUARD))
    yield
    if _ray_sessions() - before:
        pytest.fail(f"{request.node.nodeid} starts Ray but is not marked: add "
                    "pytest.mark.cluster to it (tests/conftest.py)", pytrace=False)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The run's wall time against its budget: the whole suite's, or the fast tier's."""
    if config.getoption("collectonly", False):
        return
    wall = time.monotonic() - _STARTED
    fast = "not cluster" in (config.getoption("markexpr", "") or "")
    budget = FAST_TIER_BUDGET_S if fast else SUITE_BUDGET_S
    verdict = "within" if wall <= budget else "OVER"
    terminalreporter.write_line(
        f"suite wall time {wall / 60:.1f} min: {verdict} the {budget / 60:.0f}-min budget of "
        f"{'the fast tier' if fast else 'the full suite'} (tests/conftest.py)",
        red=wall > budget, green=wall <= budget)


def pytest_unconfigure(config):
    shutil.rmtree(_GUARD, ignore_errors=True)


@pytest.fixture(scope="session")
def local_cluster():
    """A head plus 4 spot raylets (slots 0-3); tests may add and remove other slots."""
    from moshray.jobs.local.cluster import LocalCluster, LocalClusterConfig

    cluster = LocalCluster(LocalClusterConfig(spot_nodes=SPOT_NODES, cpus_per_node=4))
    cluster.connect()
    try:
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture(autouse=True)
def _session_cluster_left_as_found(request):
    """A test of the session's cluster leaves its spot slots as it found them: a slot added
    and not removed, or removed and not added back, fails the test with one line, and the
    cluster is put back so the tests after it start from the same four slots."""
    if "local_cluster" not in request.fixturenames:
        yield
        return
    cluster = request.getfixturevalue("local_cluster")
    before = cluster.live_slots()
    yield
    after = cluster.live_slots()
    if after == before:
        return
    for slot in set(after) - set(before):
        cluster.remove_node(slot)
    for slot in set(before) - set(after):
        cluster.add_node(slot)
    pytest.fail(f"{request.node.nodeid} left the session's cluster with slots {list(after)} "
                f"instead of {list(before)} (put back)", pytrace=False)


@pytest.fixture(scope="module")
def s3_endpoint():
    """moto's S3 on 127.0.0.1 with a bucket ``ckpt`` (tests/moto_s3.py), for a module."""
    from moto_s3 import running_s3  # moto, imported only where it is used

    with running_s3() as endpoint:
        yield endpoint


@pytest.fixture
def moto_ec2():
    """moto's EC2 server behind tests/fake_ec2.py's proxy, with fake credentials in the env."""
    from fake_ec2 import running_fake_ec2  # moto, imported only where it is used

    with running_fake_ec2() as fake:
        yield fake
