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


# The clusters shared by the tests that ask for them, in the order their users run: each is
# started by its first user and shut down right after its last one (``_SharedClusters``).
SHARED_CLUSTERS = ("local_cluster", "ray_start_cluster")


def _shared_cluster_of(item) -> str | None:
    """The shared cluster ``item`` uses (the first of ``SHARED_CLUSTERS``), or None."""
    names = getattr(item, "fixturenames", ())
    return next((name for name in SHARED_CLUSTERS if name in names), None)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """A test that uses the session's cluster is a cluster test, marked or not. The users of
    each shared cluster run together, first, in their collected order (the session's
    cluster's, then the ``ray start`` cluster's, then every other test), so each shared
    cluster is up only while its users run (``pytest_runtest_teardown`` ends it).

    Under pytest-xdist (``--dist loadgroup``, the project's default) every cluster test is in
    one group, ``cluster``, so they all run in this order on one worker, one at a time, and
    the pure tests run on the other workers beside them (``_pure_tests_yield_the_cpu``)."""
    for item in items:
        if _shared_cluster_of(item) is not None:
            item.add_marker(pytest.mark.cluster)
        if item.get_closest_marker("cluster") is not None:
            item.add_marker(pytest.mark.xdist_group(CLUSTER_LANE))

    def rank(item) -> int:
        name = _shared_cluster_of(item)
        return len(SHARED_CLUSTERS) if name is None else SHARED_CLUSTERS.index(name)

    items[:] = sorted(items, key=rank)


def _ray_sessions() -> set[str]:
    root = _GUARD / "ray"
    return {p.name for p in root.iterdir()} if root.is_dir() else set()


CLUSTER_LANE = "cluster"  # the pytest-xdist group of every cluster test: one worker, serial
PURE_NICE = 19  # a worker's niceness once it runs a pure test (Linux: ~1.5% of a busy CPU)


@pytest.fixture(autouse=True)
def _pure_tests_yield_the_cpu(request):
    """A pure test on a pytest-xdist worker runs at the lowest CPU priority: the cluster
    tests on the cluster worker judge scenarios inside time windows, and the pure tests then
    take only the CPU those leave idle (about a third of this 2-core machine in a serial
    run). Raised once per worker process and never lowered; a worker that runs cluster
    tests runs its pure tests after them (the ``cluster`` group is scheduled first, as the
    largest), so no cluster test runs niced."""
    if (os.environ.get("PYTEST_XDIST_WORKER") and request.node.get_closest_marker("cluster")
            is None and os.nice(0) < PURE_NICE):
        os.nice(PURE_NICE - os.nice(0))
    yield


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


class _SharedClusters:
    """The running shared clusters by fixture name. ``end(name)`` shuts one down (once);
    a fixture asked for again after its end raises, naming the cause."""

    def __init__(self) -> None:
        self.running: dict[str, object] = {}
        self.ended: set[str] = set()

    def start(self, name: str, make, stop):
        """``make()``'s cluster, kept under ``name`` with ``stop(cluster)`` to end it."""
        if name in self.ended:
            raise RuntimeError(f"the shared cluster {name} was already shut down after its "
                               "last user (tests/conftest.py): a test asked for it out of order")
        cluster = make()
        self.running[name] = (cluster, stop)
        return cluster

    def end(self, name: str) -> None:
        entry = self.running.pop(name, None)
        if entry is not None:
            self.ended.add(name)
            cluster, stop = entry
            stop(cluster)


_SHARED = _SharedClusters()


@pytest.fixture(scope="session")
def local_cluster():
    """A head plus 4 spot raylets (slots 0-3); tests may add and remove other slots. Started
    by its first user and shut down right after its last one (the users run first), so the
    tests after them run beside no idle cluster and with no driver connected."""
    from moshray.jobs.local.cluster import LocalCluster, LocalClusterConfig

    cluster = _SHARED.start("local_cluster", lambda: LocalCluster(
        LocalClusterConfig(spot_nodes=SPOT_NODES, cpus_per_node=4)), LocalCluster.shutdown)
    try:
        cluster.connect()
        yield cluster
    finally:
        _SHARED.end("local_cluster")


class _Replaceable:
    """A shared cluster as its users hold it: attribute reads go to the running cluster;
    ``replace`` ends it and starts a fresh one, for the users after one that left it
    dirty (a job still running, an actor left)."""

    def __init__(self, make) -> None:
        self._make = make
        self._cluster = make()

    def __getattr__(self, name: str):
        return getattr(self.__dict__["_cluster"], name)

    def replace(self) -> None:
        self._cluster.stop()
        self._cluster = self._make()

    def stop(self) -> None:
        self._cluster.stop()


def _later_users(item, name: str) -> bool:
    """Whether a test after ``item`` in this run uses the shared cluster ``name``."""
    items = item.session.items
    later = items[items.index(item) + 1:] if item in items else []
    return any(name in getattr(other, "fixturenames", ()) for other in later)


@pytest.fixture(scope="session")
def ray_start_cluster():
    """A cluster started with the real ``ray start`` CLI (tests/raystart.py): a head with the
    dashboard and job server plus two spot nodes, Ray's token authentication on. Shared by
    the tests of ``ray job submit`` (each leaves no job running and no moshray actor behind:
    ``_ray_start_cluster_left_as_found``); started by its first user, ended after its last."""
    from raystart import RayStartCluster

    cluster = _SHARED.start("ray_start_cluster",
                            lambda: _Replaceable(lambda: RayStartCluster(workers=2).start()),
                            _Replaceable.stop)
    try:
        yield cluster
    finally:
        _SHARED.end("ray_start_cluster")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test that uses a shared cluster (its fixtures torn down), the cluster
    is shut down: no later test in this run asks for it."""
    yield
    name = _shared_cluster_of(item)
    if name is None or name not in _SHARED.running:
        return
    if not _later_users(item, name):
        _SHARED.end(name)


@pytest.fixture(autouse=True)
def _ray_start_cluster_left_as_found(request):
    """A test of the shared ``ray start`` cluster leaves it as it found it: its two spot
    nodes alive, no job running and no moshray actor (replica, lease, Coordinator) left;
    otherwise the test fails with one line saying what it left, and the tests after it get
    a fresh cluster."""
    if "ray_start_cluster" not in request.fixturenames:
        yield
        return
    cluster = request.getfixturevalue("ray_start_cluster")
    yield
    from raystart import leftovers

    left = leftovers(cluster)
    if left:
        if _later_users(request.node, "ray_start_cluster"):
            cluster.replace()  # the tests after it start from a clean cluster
        pytest.fail(f"{request.node.nodeid} left the shared `ray start` cluster with {left} "
                    "(replaced by a fresh one for the tests after it)", pytrace=False)


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
