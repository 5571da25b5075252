"""``notice_source = auto``: which cloud a node is on (autoscaler/clouds/detect.py).

The decision is tested with plain data (env beats DMI beats probe; AWS vs GCP; garbage and
contradicting DMI; nothing -> none; the SDKs' opt-outs); the IO against a DMI directory in
tmp and against the metadata emulators on 127.0.0.1 (never the real 169.254.169.254): found,
a closed port, a server that accepts and never answers. Last, ``WatcherConfig("auto")``
builds the right source from an empty environment and injected DMI / probe address.
"""

from __future__ import annotations

import itertools
import logging
import socket
from contextlib import contextmanager
from pathlib import Path

import pytest

from metadata_servers import GCEMetadataServer, IMDSv2Server
from moshray.autoscaler.clouds.detect import (
    LINK_LOCAL_URL,
    DetectConfig,
    Detection,
    Dmi,
    ProbeAnswer,
    decide,
    detect,
    probe,
    read_dmi,
    searched_clouds,
)
from moshray.autoscaler.clouds.aws.notices import AWSMetadataSource
from moshray.autoscaler.clouds.gcp.notices import GCPMetadataSource
from moshray.autoscaler.notices.local import SilentSource
from moshray.autoscaler.notices.sources import AutoSource
from moshray.autoscaler.watch import WatcherConfig

pytestmark = pytest.mark.timeout(60)

NODE = "ab" * 28
AWS_ENV = {"AWS_EC2_METADATA_SERVICE_ENDPOINT": "http://127.0.0.1:9/"}
GCP_ENV = {"GCE_METADATA_HOST": "127.0.0.1:8"}
NITRO = Dmi("Amazon EC2", "m5.large")
GCE = Dmi("Google", "Google Compute Engine")
BASE = "http://127.0.0.1:1"
AWS_FOUND = ProbeAnswer("aws", BASE, True, "IMDSv2 answered")
GCP_FOUND = ProbeAnswer("gcp", BASE, True, "GCE metadata answered")
AWS_MISS = ProbeAnswer("aws", BASE, False, "connection refused")
GCP_MISS = ProbeAnswer("gcp", BASE, False, "connection refused")


# -- the pure decision ---------------------------------------------------------------------------


@pytest.mark.parametrize("env, dmi, probes, want", [
    # 1. the environment names the service: it wins over DMI and probe, and needs no probe
    (AWS_ENV, GCE, None, ("aws", "http://127.0.0.1:9")),
    (GCP_ENV, NITRO, (AWS_FOUND,), ("gcp", "http://127.0.0.1:8")),
    ({**AWS_ENV, **GCP_ENV}, Dmi(), None, ("aws", "http://127.0.0.1:9")),
    # 2. DMI, at the link-local address; beats the probe
    ({}, NITRO, None, ("aws", LINK_LOCAL_URL)),
    ({}, Dmi("Amazon", None), None, ("aws", LINK_LOCAL_URL)),
    ({}, GCE, None, ("gcp", LINK_LOCAL_URL)),
    ({}, Dmi(None, "Google Compute Engine"), None, ("gcp", LINK_LOCAL_URL)),
    ({}, NITRO, (GCP_FOUND,), ("aws", LINK_LOCAL_URL)),
    # 3. the probe, when DMI says nothing usable (missing, garbage, two clouds at once)
    ({}, Dmi(), (AWS_FOUND,), ("aws", BASE)),
    ({}, Dmi("QEMU", "Standard PC (i440FX + PIIX, 1996)"), (AWS_MISS, GCP_FOUND), ("gcp", BASE)),
    ({}, Dmi("\x00\ufffd\ufffd", ""), (GCP_FOUND,), ("gcp", BASE)),
    ({}, Dmi("Amazon EC2", "Google Compute Engine"), (AWS_MISS, GCP_FOUND), ("gcp", BASE)),
    ({}, Dmi("Xen", "HVM domU"), (AWS_FOUND,), ("aws", BASE)),  # old Xen EC2: only the probe
    # 4. nothing
    ({}, Dmi(), (AWS_MISS, GCP_MISS), ("none", None)),
    ({}, Dmi("innotek GmbH", "VirtualBox"), (), ("none", None)),
    # the SDKs' opt-outs take a cloud out of DMI and probe, never out of a named service
    ({"AWS_EC2_METADATA_DISABLED": "true"}, NITRO, (AWS_FOUND, GCP_MISS), ("none", None)),
    ({"AWS_EC2_METADATA_DISABLED": "TRUE"}, NITRO, (GCP_FOUND,), ("gcp", BASE)),
    ({"NO_GCE_CHECK": "true"}, GCE, (GCP_FOUND,), ("none", None)),
    ({"NO_GCE_CHECK": "True", "AWS_EC2_METADATA_DISABLED": "true"}, NITRO, None, ("none", None)),
    ({**AWS_ENV, "AWS_EC2_METADATA_DISABLED": "true"}, Dmi(), None, ("aws", "http://127.0.0.1:9")),
    ({"NO_GCE_CHECK": "false"}, GCE, None, ("gcp", LINK_LOCAL_URL)),
])
def test_detection_order(env, dmi, probes, want):
    found = decide(env, dmi, probes)  # DMI: the link-local address; a probe: where it answered
    assert (found.cloud, found.metadata_url) == want
    assert found.how  # always says how


def test_the_decision_asks_for_a_probe_only_when_nothing_else_decides():
    assert decide({}, Dmi(), None) is None
    assert decide({}, Dmi("QEMU", None), None) is None
    assert decide({"AWS_EC2_METADATA_DISABLED": "true"}, NITRO, None) is None  # gcp may answer
    assert searched_clouds({"AWS_EC2_METADATA_DISABLED": "true"}) == ("gcp",)
    assert searched_clouds({"NO_GCE_CHECK": "true"}) == ("aws",)
    assert searched_clouds({}) == ("aws", "gcp")


def test_detections_say_how_they_were_found():
    assert str(decide(AWS_ENV, Dmi(), None)) == (
        "aws (AWS_EC2_METADATA_SERVICE_ENDPOINT=http://127.0.0.1:9/), metadata at "
        "http://127.0.0.1:9")
    assert str(decide({}, NITRO, None)) == (
        "aws (DMI sys_vendor 'Amazon EC2'), metadata at http://169.254.169.254")
    assert decide({}, GCE, None).how == "DMI sys_vendor 'Google'"
    none = decide({}, Dmi("QEMU", "pc"), (AWS_MISS, GCP_MISS), BASE)
    assert str(none).startswith("none (no cloud detected")
    assert "DMI sys_vendor 'QEMU'" in none.how and "aws: connection refused" in none.how
    assert BASE in none.how
    with pytest.raises(ValueError, match="cloud must be one of aws, gcp, none"):
        Detection("azure", "http://x", "")
    with pytest.raises(ValueError, match="metadata URL goes with a cloud, not with none"):
        Detection("none", "http://x", "")
    with pytest.raises(ValueError, match="budget_s must be positive"):
        DetectConfig(budget_s=0)


# -- reading DMI -----------------------------------------------------------------------------------


def test_dmi_read_from_a_directory(tmp_path: Path):
    (tmp_path / "sys_vendor").write_text("Amazon EC2\n")
    (tmp_path / "product_name").write_text("c6i.large\n")
    assert read_dmi(tmp_path) == Dmi("Amazon EC2", "c6i.large")
    (tmp_path / "sys_vendor").write_bytes(b"\xff\xfe\x00garbage")
    (tmp_path / "product_name").unlink()
    dmi = read_dmi(tmp_path)
    assert dmi.product_name is None and "garbage" in dmi.sys_vendor
    assert decide({}, dmi, None) is None  # garbage decides nothing: the probe does
    assert read_dmi(tmp_path / "missing") == Dmi(None, None)


# -- probing the metadata service ------------------------------------------------------------------


@contextmanager
def closed_port():
    """A bound TCP port nobody listens on: connections are refused (RST)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


@contextmanager
def hanging_server():
    """A port that accepts connections (the kernel's backlog) and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def test_probe_finds_imdsv2():
    with IMDSv2Server() as imds:
        answers = probe(imds.url)
        (put,) = imds.seen("/latest/api/token")
    assert answers == (ProbeAnswer("aws", imds.url, True,
                                   "IMDSv2 answered PUT /latest/api/token with 200"),)
    assert put.method == "PUT" and put.status == 200
    assert put.header("X-aws-ec2-metadata-token-ttl-seconds") == "60"


def test_probe_finds_gce_after_the_aws_question_is_refused():
    with GCEMetadataServer() as gce:
        aws, gcp = probe(gce.url)
        seen = gce.seen()
    assert not aws.found and aws.detail == "PUT /latest/api/token -> 403"
    assert gcp.found and gcp.cloud == "gcp" and gcp.url == gce.url
    assert "Metadata-Flavor: Google" in gcp.detail
    assert [(r.method, r.path, r.status) for r in seen][-1] == \
        ("GET", "/computeMetadata/v1/instance/id", 200)
    assert seen[-1].header("Metadata-Flavor") == "Google"


def test_probe_asks_only_the_searched_clouds():
    with IMDSv2Server() as imds:
        (gcp,) = probe(imds.url, ("gcp",))
        assert not imds.seen("/latest/api/token")
    assert not gcp.found and gcp.detail == "GET /computeMetadata/v1/instance/id -> 401 " \
        "without Metadata-Flavor"


def test_probe_of_a_closed_port_finds_nothing_and_does_not_raise():
    with closed_port() as url:
        answers = probe(url)
    assert [(a.cloud, a.found, a.detail) for a in answers] == [
        ("aws", False, "connection refused"), ("gcp", False, "connection refused")]
    assert decide({}, Dmi(), answers, url).cloud == "none"


def test_probe_of_a_server_that_never_answers_is_bounded():
    # Unbounded, this would hang until the test's timeout: the server never answers.
    with hanging_server() as url:
        answers = probe(url, request_timeout_s=0.2, budget_s=0.5)
    assert answers[0] == ProbeAnswer("aws", url, False, "timed out")
    assert all(not a.found for a in answers)
    assert answers[-1].detail in ("timed out", "not probed: budget spent")


def test_probe_stops_when_the_budget_is_spent():
    """The budget is checked against the injected clock: it reads 0 for the start, the
    check before AWS and that request's timeout, then 5 s later: GCE is not asked."""
    ticks = itertools.chain([0.0, 0.0, 0.0], itertools.repeat(5.0))
    with closed_port() as url:
        answers = probe(url, budget_s=1.0, clock=lambda: next(ticks))
    assert [(a.cloud, a.detail) for a in answers] == [
        ("aws", "connection refused"), ("gcp", "not probed: budget spent")]


def test_probe_rejects_a_malformed_address_in_one_line():
    for bad in ("169.254.169.254", "ftp://x", "https://127.0.0.1:1", "http://127.0.0.1:port"):
        with pytest.raises(ValueError, match=r"http://host\[:port\]"):
            probe(bad)


def test_detect_logs_one_line_saying_what_and_how(tmp_path: Path, caplog):
    config = DetectConfig(dmi_dir=str(tmp_path))
    caplog.set_level(logging.INFO, logger="moshray.autoscaler.clouds.detect")
    with IMDSv2Server() as imds:
        found = detect({}, base_url=imds.url, config=config)
    assert (found.cloud, found.metadata_url) == ("aws", imds.url)
    (record,) = caplog.records
    assert record.levelno == logging.INFO and record.getMessage() == (
        f"notice source: aws (IMDSv2 answered PUT /latest/api/token with 200), "
        f"metadata at {imds.url}")
    caplog.clear()
    with closed_port() as url:
        found = detect({}, base_url=url, config=config)
    (record,) = caplog.records
    assert found.cloud == "none" and record.levelno == logging.WARNING
    assert record.getMessage().startswith("notice source: none (no cloud detected")
    assert record.getMessage().endswith("spot notices will not be heard on this node")


# -- WatcherConfig("auto") ------------------------------------------------------------------------


def _dmi(tmp_path: Path, vendor: str | None = None, product: str | None = None) -> DetectConfig:
    for name, value in (("sys_vendor", vendor), ("product_name", product)):
        if value is not None:
            (tmp_path / name).write_text(value + "\n")
    return DetectConfig(dmi_dir=str(tmp_path), request_timeout_s=0.5, budget_s=1.0)


def test_auto_on_a_node_whose_dmi_says_ec2_hears_its_notice(tmp_path: Path):
    with IMDSv2Server() as imds:
        config = WatcherConfig(source="auto", metadata_url=imds.url, aws_interval_s=0.1,
                               detect=_dmi(tmp_path, "Amazon EC2", "m5.large"))
        source = config.make_source(NODE, {"MOSHRAY_POOL": "m5.large/us-east-1a/spot"})
        try:
            assert isinstance(source, AutoSource) and isinstance(source.inner, AWSMetadataSource)
            assert source.cloud == "aws" and source.pool == "m5.large/us-east-1a/spot"
            assert source.describe() == (f"aws-imds {imds.url} "
                                         "(auto: DMI sys_vendor 'Amazon EC2')")
            assert not imds.seen()  # DMI decided: no probe
            imds.interrupt("terminate")
            notice = source.poll(5.0)
            assert notice is not None and notice.cloud == "aws" and notice.node_id == NODE
            assert notice.source == f"aws-imds {imds.url}"
        finally:
            source.close()
        assert source.closed and source.poll(0) is None


def test_auto_without_env_or_dmi_probes_gce(tmp_path: Path):
    with GCEMetadataServer(max_wait_s=2) as gce:
        config = WatcherConfig(source="auto", metadata_url=gce.url, detect=_dmi(tmp_path))
        source = config.make_source(NODE, {})
        try:
            assert isinstance(source.inner, GCPMetadataSource) and source.cloud == "gcp"
            assert source.inner.base_url == gce.url
            assert source.describe().startswith(f"gcp-metadata {gce.url} (auto: GCE metadata")
        finally:
            source.close()


def test_auto_without_env_or_dmi_probes_imdsv2(tmp_path: Path):
    with IMDSv2Server() as imds:
        config = WatcherConfig(source="auto", metadata_url=imds.url,
                               detect=_dmi(tmp_path, "QEMU", "Standard PC"))
        source = config.make_source(NODE, {})
        try:
            assert isinstance(source.inner, AWSMetadataSource) and source.errors == 0
            assert "(auto: IMDSv2 answered" in source.describe()
        finally:
            source.close()


def test_auto_with_nothing_answering_is_silent_and_says_why(tmp_path: Path, caplog):
    caplog.set_level(logging.WARNING, logger="moshray.autoscaler.clouds.detect")
    with closed_port() as url:
        source = WatcherConfig(source="auto", metadata_url=url,
                               detect=_dmi(tmp_path)).make_source(NODE, {})
    assert isinstance(source.inner, SilentSource) and source.cloud == "none"
    assert source.describe().startswith("none (auto: no cloud detected")
    assert source.poll(0) is None
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    source.close()


def test_auto_uses_the_service_the_environment_names_first(tmp_path: Path):
    with IMDSv2Server() as imds, closed_port() as elsewhere:
        config = WatcherConfig(source="auto", metadata_url=elsewhere,
                               detect=_dmi(tmp_path, "Google", "Google Compute Engine"))
        source = config.make_source(NODE, {"AWS_EC2_METADATA_SERVICE_ENDPOINT": imds.url})
        try:
            assert isinstance(source.inner, AWSMetadataSource) and source.base_url == imds.url
            assert source.describe().endswith(
                f"(auto: AWS_EC2_METADATA_SERVICE_ENDPOINT={imds.url})")
        finally:
            source.close()


def test_watcher_config_checks_its_metadata_url():
    with pytest.raises(ValueError, match=r"http://host\[:port\]"):
        WatcherConfig(source="auto", metadata_url="169.254.169.254")
    with pytest.raises(ValueError, match="detect must be a DetectConfig"):
        WatcherConfig(source="auto", detect="/sys/class/dmi/id")


def test_moshray_watch_defaults_to_auto_and_says_so():
    from moshray.jobs.cli import build_parser

    parser = build_parser(["watch"])
    assert parser.parse_args(["watch"]).source == "auto"
    assert parser.parse_args(["watch", "--source", "aws"]).source == "aws"
    (sub,) = [a for a in parser._actions if a.choices and "watch" in a.choices]
    help_text = " ".join(sub.choices["watch"].format_help().split())
    assert "default auto" in help_text and "DMI vendor strings" in help_text
    assert LINK_LOCAL_URL in help_text


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_watcher_on_a_node_shows_how_auto_found_its_source(local_cluster):
    """A watcher with ``source="auto"`` on an embedded-cluster node: the node names its
    metadata emulator in its environment, and ``status()["source"]`` says so."""
    import ray

    from moshray.autoscaler.watch.watcher import open_watcher

    slot = local_cluster.add_node()
    try:
        node = local_cluster.node_id(slot)
        opened = open_watcher(node, WatcherConfig(source="auto", poll_s=0.2))
        assert opened.created
        try:
            status = ray.get(opened.actor.status.remote(), timeout=120)
        finally:
            ray.get(opened.actor.stop.remote(), timeout=30)
            ray.kill(opened.actor, no_restart=True)
        imds_url = local_cluster.metadata[slot].url
        assert status["source"] == (f"aws-imds {imds_url} "
                                    f"(auto: AWS_EC2_METADATA_SERVICE_ENDPOINT={imds_url})")
        assert status["source_errors"] == 0
    finally:
        local_cluster.remove_node(slot)
