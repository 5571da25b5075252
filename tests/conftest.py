"""Shared fixtures: one multi-node Ray cluster on 127.0.0.1 for the whole session, moto's
EC2 server (tests/fake_ec2.py), one per test that asks for it, and moto's S3 server
(tests/moto_s3.py), one per module that asks for it.

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

import pytest  # noqa: E402

SPOT_NODES = 4


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
