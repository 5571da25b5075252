"""Clouds as plug-ins (autoscaler/clouds/base.py): the registry, the built-in bundles' contract,
and a toy third cloud registered through the public interface only.

The toy cloud ("toy") brings what a real one does, each part small: a metadata server
(a ``MetadataServer`` on 127.0.0.1: ``GET /toy/v1/id`` answered with ``X-Toy-Cloud: yes``,
``/toy/v1/preempted`` FALSE until announced, ``/toy/v1/pool``), a notice source polling it,
an identity (endpoint variable, opt-out, DMI prefix, probe), a region rule and a pool reader.
Registered, it is accepted by the config, the watcher's source choice, ``auto``'s detection
(by environment, DMI and probe), notices, pools, node labels and prices, with no other edit;
unregistered, it is refused again. Every server is on 127.0.0.1 (never 169.254.169.254).
"""

from __future__ import annotations

import argparse
import http.client
import io
import time
from pathlib import Path

import pytest

from moshray.autoscaler.clouds import (
    Cloud,
    Identity,
    cloud_names,
    clouds,
    get_cloud,
    register_cloud,
    unregister_cloud,
)
from moshray.autoscaler.clouds import node_labels
from moshray.autoscaler.clouds.detect import (
    DetectConfig,
    Dmi,
    ProbeAnswer,
    decide,
    describe_trouble,
    metadata_env_names,
    probe_request,
    search_off_environ,
)
from moshray.autoscaler.clouds.metadata_emulator import MetadataServer
from moshray.autoscaler.clouds.prices import NodeKey
from moshray.autoscaler.notices.http import MetadataConnection
from moshray.autoscaler.notices.message import PREEMPT, NoticeSource, PreemptionNotice
from moshray.autoscaler.notices.sources import AutoSource, make_source, source_names
from moshray.autoscaler.pools import Market, Pool, decode_pool
from moshray.autoscaler.watch import WatcherConfig
from moshray.autoscaler.watch.cli import add_arguments
from moshray.jobs.config import ClusterSection, ConfigError

pytestmark = pytest.mark.timeout(60)

NODE = "cd" * 28
TOY_ENDPOINT_ENV = "TOY_METADATA_ENDPOINT"
TOY_OFF_ENV = "TOY_METADATA_DISABLED"
FLAVOR = ("X-Toy-Cloud", "yes")


# -- the toy cloud: each part as its own module of a real cloud would hold it -----------------


class ToyMetadataServer(MetadataServer):
    """The toy cloud's metadata service."""

    def __init__(self, instance_id: str = "toy-1", listen=None) -> None:
        self.instance_id = instance_id
        self.preempted = False
        super().__init__(listen)

    def announce_preemption(self, deadline_unix_s: float) -> None:
        with self.lock:
            self.preempted = True

    def _answer(self, h):
        headers = {FLAVOR[0]: FLAVOR[1], "Content-Type": "text/plain"}
        failure = self._take_failure()
        if failure is not None:
            return failure, b"", headers
        with self.lock:
            preempted = self.preempted
        body = {"/toy/v1/id": self.instance_id,
                "/toy/v1/preempted": "TRUE" if preempted else "FALSE",
                "/toy/v1/pool": "small-2 toy-east-1b spot"}.get(h.path)
        if body is None:
            return 404, b"", headers
        return 200, body.encode(), headers


class ToySource(NoticeSource):
    """Polls ``/toy/v1/preempted``; TRUE becomes one notice due ``notice_s`` from now."""

    cloud = "toy"

    def __init__(self, node_id: str, base_url: str, *, pool: str = "", notice_s: float = 10.0):
        self.node_id, self.base_url, self.pool, self.notice_s = node_id, base_url, pool, notice_s
        self.errors = 0
        self.http = MetadataConnection(base_url)
        self._delivered = False

    def describe(self) -> str:
        return f"toy {self.base_url}"

    def poll(self, timeout_s: float) -> PreemptionNotice | None:
        end = time.monotonic() + timeout_s
        while not self.closed and not self._delivered:
            resp = self.http.request("GET", "/toy/v1/preempted", {}, 2.0)
            if resp.status == 200 and resp.body == b"TRUE":
                self._delivered = True
                now = time.time()
                return PreemptionNotice(self.node_id, "toy", PREEMPT, now + self.notice_s, now,
                                        self.describe(), self.pool)
            if time.monotonic() >= end:
                break
            time.sleep(0.05)
        return None

    def close(self) -> None:
        super().close()
        self.http.close()


def probe_toy(base: str, left) -> ProbeAnswer:
    try:
        _, headers = probe_request(base, "GET", "/toy/v1/id", {}, left)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return ProbeAnswer("toy", base, False, describe_trouble(exc))
    found = headers.get(FLAVOR[0]) == FLAVOR[1]
    return ProbeAnswer("toy", base, found, "toy metadata answered" if found else "not toy")


def read_toy_pool(base: str, timeout_s: float = 5.0) -> Pool:
    conn = MetadataConnection(base)
    try:
        body = conn.request("GET", "/toy/v1/pool", {}, timeout_s).body.decode()
    finally:
        conn.close()
    itype, zone, market = body.split()
    return Pool("toy", itype, zone, Market(market))


TOY = Cloud(
    name="toy",
    metadata_url="http://127.0.0.1:9",  # a closed port: nothing real is ever polled
    notice_source=ToySource,
    notice_options=lambda watcher_config: {"notice_s": 7.0},
    identity=Identity(endpoint_env=TOY_ENDPOINT_ENV, opt_out_env=TOY_OFF_ENV,
                      dmi_prefixes=("ToyCloud",), probe=probe_toy),
    emulator=ToyMetadataServer,
    region=lambda zone: zone[:-1] if zone.startswith("toy-") else "",
    read_pool=read_toy_pool,
)


@pytest.fixture
def toy():
    register_cloud(TOY)
    try:
        yield TOY
    finally:
        unregister_cloud("toy")
    assert "toy" not in cloud_names()


def _dmi_dir(tmp_path: Path, vendor: str) -> DetectConfig:
    (tmp_path / "sys_vendor").write_text(vendor + "\n")
    return DetectConfig(dmi_dir=str(tmp_path), request_timeout_s=0.5, budget_s=1.5)


# -- the registry ------------------------------------------------------------------------------


def test_the_built_in_clouds_are_registered_in_search_order():
    assert cloud_names()[:2] == ("aws", "gcp")
    assert [c.name for c in clouds()] == list(cloud_names())
    for cloud in clouds():
        assert cloud.provider_class().__name__.endswith("SpotNodeProvider")
        assert cloud.identity is not None and cloud.emulator is not None
    assert get_cloud("aws").region("us-east-1a") == "us-east-1"
    assert get_cloud("gcp").region("us-central1-a") == "us-central1"
    assert get_cloud("aws").spot_price_fetch is not None
    assert get_cloud("gcp").spot_price_fetch is None  # GCP has no spot price API


def test_the_registry_refuses_bad_bundles_in_one_line():
    with pytest.raises(ValueError, match="unknown cloud 'azure'; registered: aws, gcp"):
        get_cloud("azure")
    with pytest.raises(ValueError, match="already registered"):
        register_cloud(get_cloud("aws"))
    for name, match in (("none", "reserved"), ("auto", "reserved"), ("simulated", "reserved"),
                        ("Toy", "lowercase"), ("toy_cloud", "lowercase"), ("", "lowercase")):
        with pytest.raises(ValueError, match=match):
            Cloud(name=name, metadata_url="http://127.0.0.1:9", notice_source=ToySource)
    with pytest.raises(ValueError, match="metadata_url"):
        Cloud(name="toy", metadata_url="127.0.0.1:9", notice_source=ToySource)
    with pytest.raises(ValueError, match="notice_source must be callable"):
        Cloud(name="toy", metadata_url="http://127.0.0.1:9", notice_source="ToySource")
    with pytest.raises(ValueError, match="provider must be a dotted"):
        Cloud(name="toy", metadata_url="http://127.0.0.1:9", notice_source=ToySource,
              provider="ToyProvider")
    with pytest.raises(ValueError, match="toy has no NodeProvider"):
        TOY.provider_class()
    with pytest.raises(ValueError, match="endpoint_env"):
        Identity(endpoint_env="", opt_out_env=TOY_OFF_ENV)
    with pytest.raises(ValueError, match="register_cloud takes a Cloud"):
        register_cloud("toy")


@pytest.mark.parametrize("name", ["aws", "gcp"])
def test_each_built_in_bundle_hears_a_preemption_from_its_own_emulator(name):
    """The bundle's contract, through the registry only: its emulator announces, the source
    its bundle builds (with the options the watcher would pass) hears it as that cloud."""
    cloud = get_cloud(name)
    options = dict(cloud.notice_options(WatcherConfig(source=name, aws_interval_s=0.05)))
    server = cloud.emulator()
    source = make_source(name, NODE, metadata_url=server.url, pool="p", **options)
    try:
        assert source.poll(0.2) is None
        server.announce_preemption(time.time() + 60)
        notice = None
        deadline = time.monotonic() + 10
        while notice is None and time.monotonic() < deadline:
            notice = source.poll(1.0)
        assert notice is not None and notice.cloud == name and notice.node_id == NODE
        assert notice.pool == "p" and not notice.is_rebalance and notice.notice_s > 0
    finally:
        source.close()
        server.close()


# -- a toy third cloud, through the public interface only ---------------------------------------


def test_a_registered_toy_cloud_is_accepted_by_config_validation(toy):
    assert ClusterSection(notice_source="toy").notice_source == "toy"
    assert WatcherConfig(source="toy").source == "toy"
    assert "toy" in source_names() and "toy" in source_names(simulated=False)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--source", "toy"]).source == "toy"
    # Notices, pools, prices and node labels read the registry too.
    assert PreemptionNotice(NODE, "toy", PREEMPT, 2.0, 1.0, "x").cloud == "toy"
    pool = Pool("toy", "small-2", "toy-east-1b")
    assert decode_pool(pool.key) == pool
    assert NodeKey("toy", "spot", "small-2", "toy-east-1b").region == "toy-east-1"


def test_without_its_registration_the_toy_cloud_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="cluster.notice_source: must be one of 'auto', "
                                          "'aws', 'gcp', 'none', got 'toy'"):
        ClusterSection(notice_source="toy")
    with pytest.raises(ValueError, match="source must be one of auto, aws, gcp"):
        WatcherConfig(source="toy")
    with pytest.raises(ValueError, match="notice source must be one of aws, gcp"):
        make_source("toy", NODE)
    with pytest.raises(ValueError, match="cloud must be one of aws, gcp, simulated"):
        PreemptionNotice(NODE, "toy", PREEMPT, 2.0, 1.0, "x")
    with pytest.raises(ValueError, match="pool cloud must be one of aws, gcp"):
        Pool("toy", "small-2", "toy-east-1b")
    assert NodeKey("toy", "spot", "small-2", "toy-east-1b").region == ""


def test_the_watcher_picks_the_toy_source_and_hears_its_notice(toy):
    with ToyMetadataServer() as server:
        config = WatcherConfig(source="toy", metadata_url=server.url, pool="small-2")
        source = config.make_source(NODE, {})
        try:
            assert isinstance(source, ToySource) and source.notice_s == 7.0  # notice_options
            assert source.poll(0) is None
            server.announce_preemption(time.time() + 7)
            notice = source.poll(5.0)
            assert notice is not None and notice.cloud == "toy" and notice.pool == "small-2"
            assert notice.source == f"toy {server.url}"
        finally:
            source.close()
        # Without a URL, a node that names its own toy service is polled there.
        named = WatcherConfig(source="toy").make_source(NODE, {TOY_ENDPOINT_ENV: server.url})
        assert named.base_url == server.url
        named.close()


def test_auto_detects_the_toy_cloud_by_env_dmi_and_probe(toy, tmp_path: Path):
    # The decision, with plain data.
    found = decide({TOY_ENDPOINT_ENV: "127.0.0.1:7"}, Dmi(), None)
    assert (found.cloud, found.metadata_url) == ("toy", "http://127.0.0.1:7")
    assert decide({}, Dmi("ToyCloud Inc.", "vm"), None).cloud == "toy"
    assert decide({TOY_OFF_ENV: "true"}, Dmi("ToyCloud Inc.", "vm"), None) is None
    assert search_off_environ()[TOY_OFF_ENV] == "true"
    assert {TOY_ENDPOINT_ENV, TOY_OFF_ENV} <= set(metadata_env_names())
    with ToyMetadataServer() as server:
        # By the environment: no probe.
        source = WatcherConfig(source="auto", detect=_dmi_dir(tmp_path, "QEMU")).make_source(
            NODE, {TOY_ENDPOINT_ENV: server.url})
        assert isinstance(source, AutoSource) and isinstance(source.inner, ToySource)
        assert source.describe().endswith(f"(auto: {TOY_ENDPOINT_ENV}={server.url})")
        source.close()
        assert not server.seen()
        # By the probe: AWS's and GCE's questions go unanswered as theirs, the toy's is.
        source = WatcherConfig(source="auto", metadata_url=server.url,
                               detect=_dmi_dir(tmp_path, "QEMU")).make_source(NODE, {})
        try:
            assert source.cloud == "toy" and source.inner.base_url == server.url
            assert source.describe().endswith("(auto: toy metadata answered)")
            assert server.seen("/toy/v1/id")
            server.announce_preemption(time.time() + 7)
            notice = source.poll(5.0)
            assert notice is not None and notice.cloud == "toy"
        finally:
            source.close()
        # By DMI: the address given is polled, nothing is probed.
        before = len(server.seen())
        source = WatcherConfig(source="auto", metadata_url=server.url,
                               detect=_dmi_dir(tmp_path, "ToyCloud Inc.")).make_source(NODE, {})
        assert source.describe().endswith("(auto: DMI sys_vendor 'ToyCloud Inc.')")
        assert len(server.seen()) == before
        source.close()


def test_node_labels_read_the_toy_cloud_pool(toy):
    with ToyMetadataServer() as server:
        out = io.StringIO()
        assert node_labels.main(["toy", "--endpoint", server.url], out, io.StringIO()) == 0
    labels = dict(item.split("=", 1) for item in out.getvalue().strip().split(","))
    assert labels["moshray-cloud"] == "toy" and labels["ray.io/market-type"] == "spot"
    assert labels["moshray-instance-type"] == "small-2"
    assert labels["ray.io/availability-zone"] == "toy-east-1b"
