"""The real notice sources against local servers that speak IMDSv2 and GCE metadata exactly."""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.error
import urllib.request

import pytest

from moshray.autoscaler.clouds.aws.notices import AWSMetadataSource
from moshray.autoscaler.clouds.gcp.notices import GCPMetadataSource
from moshray.autoscaler.notices.local import SimulatedSource
from moshray.autoscaler.notices.message import PreemptionNotice
from moshray.autoscaler.notices.sources import make_source
from metadata_servers import GCEMetadataServer, IMDSv2Server

NODE = "ab" * 28

pytestmark = pytest.mark.timeout(60)


def _http(method: str, url: str, headers: dict | None = None) -> tuple[int, bytes, dict]:
    req = urllib.request.Request(url, method=method, headers=headers or {},
                                 data=b"" if method == "PUT" else None)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=10) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


@pytest.fixture
def imds():
    with IMDSv2Server() as server:
        yield server


@pytest.fixture
def gce():
    with GCEMetadataServer(max_wait_s=10) as server:
        yield server


# -- the servers enforce the protocols (so passing tests mean the clients follow them) ------


def test_imds_server_enforces_tokens(imds):
    action = imds.url + "/latest/meta-data/spot/instance-action"
    assert _http("GET", action)[0] == 401  # no token
    assert _http("GET", action, {"X-aws-ec2-metadata-token": "forged"})[0] == 401
    token_url = imds.url + "/latest/api/token"
    assert _http("PUT", token_url)[0] == 400  # TTL header required
    assert _http("PUT", token_url, {"X-aws-ec2-metadata-token-ttl-seconds": "0"})[0] == 400
    assert _http("PUT", token_url, {"X-aws-ec2-metadata-token-ttl-seconds": "21601"})[0] == 400
    assert _http("GET", token_url, {"X-aws-ec2-metadata-token-ttl-seconds": "60"})[0] == 405
    assert _http("PUT", token_url, {"X-aws-ec2-metadata-token-ttl-seconds": "60",
                                    "X-Forwarded-For": "10.0.0.1"})[0] == 403
    status, token, _ = _http("PUT", token_url, {"X-aws-ec2-metadata-token-ttl-seconds": "60"})
    assert status == 200 and token
    auth = {"X-aws-ec2-metadata-token": token.decode()}
    assert _http("GET", action, auth)[0] == 404  # no notice yet
    doc = imds.interrupt("stop", at_unix_s=1_800_000_000)
    status, body, _ = _http("GET", action, auth)
    assert status == 200 and json.loads(body) == doc == {"action": "stop",
                                                         "time": "2027-01-15T08:00:00Z"}
    imds.expire_tokens()
    assert _http("GET", action, auth)[0] == 401


def test_gce_server_enforces_header_and_etag(gce):
    url = gce.url + GCEMetadataServer.PREEMPTED_PATH
    status, body, _ = _http("GET", url)
    assert status == 403 and b"Metadata-Flavor" in body
    assert _http("GET", url, {"Metadata-Flavor": "google-ish"})[0] == 403
    status, body, headers = _http("GET", url, {"Metadata-Flavor": "Google"})
    assert (status, body, headers["Metadata-Flavor"]) == (200, b"FALSE", "Google")
    etag = headers["ETag"]
    assert _http("GET", url + "?wait_for_change=true&timeout_sec=0",
                 {"Metadata-Flavor": "Google"})[0] == 400
    # A stale last_etag answers at once; the current one hangs until the timeout.
    t = time.monotonic()
    status, body, _ = _http("GET", url + "?wait_for_change=true&timeout_sec=5&last_etag=00",
                            {"Metadata-Flavor": "Google"})
    assert (status, body) == (200, b"FALSE") and time.monotonic() - t < 2
    t = time.monotonic()
    status, body, h2 = _http("GET", url + f"?wait_for_change=true&timeout_sec=1&last_etag={etag}",
                             {"Metadata-Flavor": "Google"})
    assert (status, body, h2["ETag"]) == (200, b"FALSE", etag) and time.monotonic() - t >= 0.9


# -- AWS ------------------------------------------------------------------------------------


def test_aws_no_notice_then_termination_notice(imds):
    source = AWSMetadataSource(NODE, imds.url, pool="g4dn.xlarge/us-east-1c", interval_s=0.05)
    assert source.poll(0) is None
    # Every GET carried a token obtained by PUT with a TTL header.
    puts = imds.seen("/latest/api/token")
    assert [r.method for r in puts] == ["PUT"] and puts[0].status == 200
    assert 1 <= int(puts[0].header("X-aws-ec2-metadata-token-ttl-seconds")) <= 21600
    gets = imds.seen("/latest/meta-data/")
    assert {r.path for r in gets} == {"/latest/meta-data/spot/instance-action",
                                      "/latest/meta-data/events/recommendations/rebalance"}
    assert all(r.header("X-aws-ec2-metadata-token") and r.status == 404 for r in gets)

    deadline = math.floor(time.time()) + 120
    imds.interrupt("terminate", at_unix_s=deadline)
    before = time.time()
    notice = source.poll(5)
    assert isinstance(notice, PreemptionNotice)
    assert (notice.node_id, notice.cloud, notice.action) == (NODE, "aws", "terminate")
    assert notice.deadline_unix_s == deadline
    assert before - 1 <= notice.received_unix_s <= time.time()
    assert notice.pool == "g4dn.xlarge/us-east-1c" and imds.url in notice.source
    assert 110 < notice.notice_s <= 121 and not notice.is_rebalance
    # Delivered once: the document stays, but the same notice is not returned again.
    assert source.poll(0.2) is None
    assert source.tokens_fetched == 1  # the token was reused across polls


def test_aws_poll_waits_for_a_notice_published_later(imds):
    source = AWSMetadataSource(NODE, imds.url, interval_s=0.05)
    timer = threading.Timer(0.5, imds.interrupt, kwargs={"action": "hibernate"})
    timer.start()
    try:
        t = time.monotonic()
        notice = source.poll(10)
        assert notice is not None and notice.action == "hibernate"
        assert 0.4 < time.monotonic() - t < 5
    finally:
        timer.cancel()


def test_aws_rebalance_recommendation_then_notice(imds):
    source = AWSMetadataSource(NODE, imds.url, interval_s=0.05)
    imds.recommend_rebalance()
    rec = source.poll(1)
    assert rec is not None and rec.is_rebalance and rec.action == "rebalance"
    assert math.isinf(rec.deadline_unix_s) and rec.seconds_left(time.time()) == math.inf
    assert source.poll(0.1) is None
    imds.interrupt("terminate")
    notice = source.poll(1)
    assert notice is not None and notice.action == "terminate"


def test_aws_termination_before_rebalance_seen_in_the_same_check(imds):
    source = AWSMetadataSource(NODE, imds.url, interval_s=0.05)
    imds.recommend_rebalance()
    imds.interrupt("terminate")
    assert [source.poll(0).action, source.poll(0).action] == ["terminate", "rebalance"]


def test_aws_checks_at_its_interval_however_short_the_polls(imds):
    source = AWSMetadataSource(NODE, imds.url, interval_s=0.5)
    end = time.monotonic() + 1.2
    while time.monotonic() < end:  # a watcher polling every 0.05 s to notice its stop
        assert source.poll(0.05) is None
    checks = [r for r in imds.seen("/latest/meta-data/spot")]
    assert len(checks) == 3  # at 0, 0.5 and 1.0 s: not one per poll
    imds.interrupt()
    notice = source.poll(1.0)  # the next due check finds it
    assert notice is not None and notice.action == "terminate"


def test_aws_token_refreshed_after_expiry(imds):
    source = AWSMetadataSource(NODE, imds.url, interval_s=0.001)
    assert source.poll(0) is None
    imds.expire_tokens()
    imds.interrupt()
    # Not poll(0): the next check is due interval_s after the last one began, and on a fast
    # machine the lines above take less than that; the wait is bounded by the next check.
    notice = source.poll(1.0)
    assert notice is not None and notice.action == "terminate"
    assert source.tokens_fetched == 2 and source.errors == 0
    assert [r.status for r in imds.seen("/latest/meta-data/spot")][-2:] == [401, 200]


def test_aws_token_refreshed_before_ttl_runs_out(imds):
    source = AWSMetadataSource(NODE, imds.url, token_ttl_s=1, interval_s=0.05)
    assert source.poll(0) is None
    time.sleep(1.1)
    assert source.poll(0) is None
    assert source.tokens_fetched == 2
    assert all(r.status == 404 for r in imds.seen("/latest/meta-data/"))  # never a 401


def test_aws_transient_errors_do_not_crash(imds):
    source = AWSMetadataSource(NODE, imds.url, interval_s=0.001)
    imds.fail_next(3, status=503)
    assert source.poll(0) is None  # the token PUT failed: logged, counted
    assert source.errors == 1
    imds.interrupt()
    notice = source.poll(5)  # two more failures, then the notice
    assert notice is not None and source.errors == 3
    # A garbled document is an error too, not a crash.
    imds.instance_action = {"action": "terminate", "time": "not a time"}
    odd = source.poll(1.0)  # at the next due check (interval_s may not have passed yet)
    assert odd is not None and 119 <= odd.notice_s <= 121  # AWS's two minutes assumed


def test_aws_unreachable_server_is_an_error_not_an_exception():
    with IMDSv2Server() as server:
        url = server.url
    source = AWSMetadataSource(NODE, url, interval_s=0.05, request_timeout_s=0.5)
    assert source.poll(0.2) is None and source.errors >= 1


def test_aws_bad_settings_rejected():
    with pytest.raises(ValueError, match="token_ttl_s"):
        AWSMetadataSource(NODE, "http://127.0.0.1:1", token_ttl_s=0)
    with pytest.raises(ValueError, match="metadata URL"):
        AWSMetadataSource(NODE, "169.254.169.254")


# -- GCP ------------------------------------------------------------------------------------


def test_gcp_long_poll_returns_on_change(gce):
    source = GCPMetadataSource(NODE, gce.url, notice_s=30)
    assert source.poll(0) is None  # first read: FALSE, remembers the ETag
    assert source.etag == gce.etag(GCEMetadataServer.PREEMPTED_PATH)
    timer = threading.Timer(0.5, gce.preempt)
    timer.start()
    try:
        t = time.monotonic()
        notice = source.poll(8)
        waited = time.monotonic() - t
    finally:
        timer.cancel()
    assert notice is not None and (notice.cloud, notice.action) == ("gcp", "preempt")
    assert 0.4 < waited < 4  # answered on the change, not at the 8 s timeout
    assert notice.deadline_unix_s == pytest.approx(notice.received_unix_s + 30)
    hanging = [r for r in gce.seen(GCEMetadataServer.PREEMPTED_PATH) if "wait_for_change" in r.path]
    assert hanging and all("last_etag=" in r.path and "timeout_sec=" in r.path for r in hanging)
    assert all(r.header("Metadata-Flavor") == "Google" for r in gce.seen())
    assert source.poll(0.1) is None  # delivered once


def test_gcp_long_poll_times_out_without_change(gce):
    source = GCPMetadataSource(NODE, gce.url)
    assert source.poll(0) is None
    t = time.monotonic()
    assert source.poll(1) is None
    assert 0.9 < time.monotonic() - t < 5
    assert source.errors == 0


def test_gcp_already_preempted_at_first_read(gce):
    gce.preempt()
    notice = GCPMetadataSource(NODE, gce.url, notice_s=25).poll(0)
    assert notice is not None and notice.notice_s == pytest.approx(25)


def test_gcp_transient_errors_do_not_crash(gce):
    source = GCPMetadataSource(NODE, gce.url, error_backoff_s=0.05)
    gce.fail_next(2, status=503)
    gce.preempt()
    notice = source.poll(5)
    assert notice is not None and source.errors == 2


def test_gcp_rejects_a_server_that_is_not_gce(imds):
    # The IMDS server answers 401 to the GCP path: the source counts errors, never raises.
    source = GCPMetadataSource(NODE, imds.url, error_backoff_s=0.05)
    assert source.poll(0.2) is None and source.errors >= 1


# -- simulated ------------------------------------------------------------------------------


def test_simulated_trigger_and_deliver():
    clock = iter([100.0, 200.0]).__next__
    source = SimulatedSource(NODE, pool="p", clock=clock)
    assert source.poll(0) is None
    sent = source.trigger(30)
    assert source.poll(1) == sent and sent.deadline_unix_s == 130.0 and sent.cloud == "simulated"
    other = PreemptionNotice("cd" * 28, "aws", "stop", 50.0, 10.0, "elsewhere")
    got = source.deliver(other)
    assert source.poll(0) == got and got.node_id == NODE and got.cloud == "simulated"
    threading.Timer(0.2, source.trigger, args=(5,)).start()
    assert source.poll(5) is not None
    source.close()
    assert source.poll(1) is None


def test_notice_validation_and_make_source():
    with pytest.raises(ValueError, match="action"):
        PreemptionNotice(NODE, "aws", "explode", 1.0, 0.0, "x")
    with pytest.raises(ValueError, match="cloud"):
        PreemptionNotice(NODE, "azure", "terminate", 1.0, 0.0, "x")
    assert isinstance(make_source("gcp", NODE, metadata_url="http://127.0.0.1:9"),
                      GCPMetadataSource)
    assert isinstance(make_source("simulated", NODE), SimulatedSource)
    with pytest.raises(ValueError, match="one of aws, gcp, simulated, sigterm, none"):
        make_source("azure", NODE)


def test_watcher_source_follows_what_the_node_names():
    from moshray.autoscaler.clouds.detect import node_metadata_service
    from moshray.autoscaler.watch import WatcherConfig

    assert node_metadata_service({}) == ("none", None)
    assert node_metadata_service({"AWS_EC2_METADATA_SERVICE_ENDPOINT": "http://127.0.0.1:9/"}) \
        == ("aws", "http://127.0.0.1:9")
    assert node_metadata_service({"GCE_METADATA_HOST": "127.0.0.1:8"}) == \
        ("gcp", "http://127.0.0.1:8")
    env = {"AWS_EC2_METADATA_SERVICE_ENDPOINT": "http://127.0.0.1:9",
           "MOSHRAY_POOL": "g5.xlarge/us-east-1a/spot"}
    source = WatcherConfig(source="auto").make_source("ab" * 28, env)
    assert source.cloud == "aws" and source.pool == "g5.xlarge/us-east-1a/spot"
    source.close()
    # Naming no service, with the SDKs' opt-outs set: none, without a DMI read or a probe of
    # the real 169.254.169.254 (tests/test_cloud_detect.py covers the search itself).
    off = {"AWS_EC2_METADATA_DISABLED": "true", "NO_GCE_CHECK": "true"}
    silent = WatcherConfig(source="auto").make_source("ab" * 28, off)
    assert silent.cloud == "none" and silent.describe().startswith("none (auto: ")
