"""Market and price from the source: node labels (node_labels.py), the price choice and the
controller's PriceBook (prices.py), EC2's spot price history through boto3 against moto's
server on 127.0.0.1, and the labels the infra/ray cluster YAMLs give ``ray start``.
"""

from __future__ import annotations

import io
import logging
import subprocess
import sys
import urllib.parse
from pathlib import Path

import pytest
import yaml
from ray._private.label_utils import parse_node_labels_string

from fake_ec2 import running_fake_ec2
import moshray.autoscaler.clouds.node_labels as node_labels
from moshray.autoscaler.clouds.aws.emulator import IMDSv2Server
from moshray.autoscaler.clouds.aws.prices import ec2_fetch
from moshray.autoscaler.clouds.gcp.emulator import GCEMetadataServer
from moshray.autoscaler.pools import Market, Pool
from moshray.autoscaler.clouds.prices import (
    NodeKey,
    NodePrice,
    PriceBook,
    PriceSource,
    PriceTable,
    choose_price,
)
from moshray.jobs.controller.observations import Market as NodeMarket
from moshray.jobs.controller.observations import node_view

ROOT = Path(__file__).resolve().parents[1]
FALLBACK = {"spot": 0.16, "on-demand": 0.526}
A = NodeKey("aws", "spot", "g4dn.xlarge", "us-east-1a")


# -- the choice (pure) ---------------------------------------------------------------------


@pytest.mark.parametrize("provider, table, expected", [
    (0.21, 0.28, NodePrice(0.21, PriceSource.PROVIDER)),  # provider beats table
    (None, 0.28, NodePrice(0.28, PriceSource.TABLE)),  # table beats config
    (None, None, NodePrice(0.16, PriceSource.CONFIG)),  # config only when nothing is known
    (0.0001, None, NodePrice(0.0001, PriceSource.PROVIDER)),
])
def test_provider_beats_table_beats_config(provider, table, expected):
    assert choose_price(provider, table, 0.16) == expected


def test_shipped_table_names_its_date_and_sources():
    table = PriceTable.shipped()
    assert table.as_of and all(url.startswith("https://") for url in table.sources.values())
    assert table.price(NodeKey("gcp", "spot", "g2-standard-4", "us-central1-b")) == 0.28
    assert table.price(NodeKey("aws", "on-demand", "g4dn.xlarge", "us-east-1c")) == 0.526
    assert table.price(NodeKey("gcp", "spot", "g2-standard-4", "europe-west4-a")) is None


@pytest.mark.parametrize("doc, message", [
    ({"sources": {}, "prices": {}}, "needs as_of"),
    ({"as_of": "2026-01-01", "sources": {}, "prices": {"gcp": {"r": {"t": {"spot": -1}}}}},
     r"prices.gcp.r.t.spot must be a number > 0"),
    ({"as_of": "2026-01-01", "sources": {}, "prices": {"gcp": {"r": {"t": {"preempt": 1}}}}},
     "market must be spot or on-demand"),
])
def test_a_bad_table_says_what_to_fix(doc, message):
    with pytest.raises(ValueError, match=message):
        PriceTable.from_json(doc)


def test_price_book_per_node_cached_with_fallbacks(caplog):
    now = [0.0]
    calls = []

    def fetch(itypes, zones):
        calls.append((itypes, zones))
        if len(calls) == 2:
            raise RuntimeError("throttled")
        return [{"InstanceType": "g4dn.xlarge", "AvailabilityZone": "us-east-1a",
                 "SpotPrice": f"{0.2 + 0.01 * len(calls):.4f}", "Timestamp": "2026-01-01"}]

    book = PriceBook(FALLBACK, {"aws": fetch}, PriceTable.shipped(), lambda: now[0], ttl_s=300)
    nodes = [
        A,  # live spot price
        NodeKey("aws", "spot", "g4dn.xlarge", "us-east-1b"),  # not in the history: config
        NodeKey("aws", "on-demand", "g4dn.xlarge", "us-east-1a"),  # the table's list price
        NodeKey("gcp", "spot", "g2-standard-4", "us-central1-a"),  # the GCE table
        NodeKey("aws", "spot", "p9.unknown", "us-east-1a"),  # unknown type: config
        NodeKey(),  # no labels at all (e.g. the embedded cluster): config, no fetch for it
        NodeKey("gcp", "on-demand", "Bad Type!", "us-central1-a"),  # bad label: config
    ]
    with caplog.at_level(logging.INFO, logger="moshray.autoscaler.clouds.prices"):
        got = book.prices(nodes)
        assert [(p.dollars_per_hour, p.source.value) for p in got] == [
            (pytest.approx(0.21), "provider"), (0.16, "config"), (0.526, "table"),
            (0.28, "table"), (0.16, "config"), (0.16, "config"), (0.526, "config")]
        assert calls == [(("g4dn.xlarge", "p9.unknown"), ("us-east-1a", "us-east-1b"))]
        now[0] = 299
        assert book.prices(nodes) == got and len(calls) == 1  # cached within the TTL
        now[0] = 300
        failed = book.prices(nodes)  # the fetch fails: the last good price is kept
        assert failed[0] == NodePrice(pytest.approx(0.21), PriceSource.PROVIDER)
        now[0] = 600
        assert book.prices(nodes)[0].dollars_per_hour == pytest.approx(0.23)
        now[0] = 900
        book.prices(nodes)
    warnings = [r for r in caplog.records if "spot prices not read" in r.getMessage()]
    assert len(warnings) == 1  # logged once
    assert sum("p9.unknown" in r.getMessage() for r in caplog.records) == 1


def test_price_book_never_raises_and_validates_its_fallback():
    def broken(itypes, zones):
        raise ConnectionError("no route")

    book = PriceBook(FALLBACK, {"aws": broken}, None, lambda: 0.0)
    assert book.prices([A]) == (NodePrice(0.16, PriceSource.CONFIG),)
    with pytest.raises(ValueError, match="fallback price for on-demand"):
        PriceBook({"spot": 0.1}, {}, None, lambda: 0.0)


class _Metrics:
    spot_price_per_hour = 0.3
    on_demand_price_per_hour = 0.9


def test_controller_book_uses_the_metrics_section_as_fallback():
    book = PriceBook.for_config(_Metrics(), lambda: 0.0)
    assert book.prices([NodeKey(), NodeKey(market="on-demand")]) == (
        NodePrice(0.3, PriceSource.CONFIG), NodePrice(0.9, PriceSource.CONFIG))
    assert book.table is not None


# -- EC2 spot price history through boto3, against moto's server ---------------------------


def test_ec2_reader_against_moto_server():
    with running_fake_ec2() as fake:
        fetch = ec2_fetch(endpoint_url=fake.moto_url, timeout_s=10)
        records = fetch(("g4dn.xlarge",), ("us-east-1a", "us-east-1b"))
        assert {(r["InstanceType"], r["AvailabilityZone"]) for r in records} == {
            ("g4dn.xlarge", "us-east-1a"), ("g4dn.xlarge", "us-east-1b")}
        assert all(r["ProductDescription"].startswith("Linux/UNIX") for r in records)
        book = PriceBook(FALLBACK, {"aws": fetch}, PriceTable.shipped(), lambda: 0.0)
        price = book.prices([A])[0]
        assert price.source is PriceSource.PROVIDER
        assert price.dollars_per_hour == pytest.approx(float(records[0]["SpotPrice"]))


# -- node labels ----------------------------------------------------------------------------


def test_pool_labels_use_rays_keys_and_parse_with_rays_parser():
    labels = node_labels.pool_labels(Pool("aws", "g4dn.xlarge", "us-east-1a", Market.ON_DEMAND))
    text = node_labels.labels_arg(labels)
    assert parse_node_labels_string(text) == labels  # what `ray start --labels` accepts
    import ray._raylet

    assert labels[ray._raylet.RAY_NODE_MARKET_TYPE_KEY] == "on-demand"
    assert labels[ray._raylet.RAY_NODE_ZONE_KEY] == "us-east-1a"
    view = node_view({"NodeID": "n", "Alive": True, "Resources": {"spot": 1000.0},
                      "Labels": labels})
    assert (view.market, view.cloud, view.instance_type, view.zone) == (
        NodeMarket.ON_DEMAND, "aws", "g4dn.xlarge", "us-east-1a")


class _IMDSWithInstance(IMDSv2Server):
    """The emulator (tokens enforced by it) plus the instance facts node_labels reads."""

    facts = {"instance-life-cycle": "spot", "instance-type": "g5.xlarge",
             "placement/availability-zone": "us-east-1c"}

    def _answer(self, h):
        status, body, headers = super()._answer(h)
        path = urllib.parse.urlsplit(h.path).path.removeprefix("/latest/meta-data/")
        if status == 404 and path in self.facts:
            return 200, self.facts[path].encode(), {"Content-Type": "text/plain"}
        return status, body, headers


def test_labels_command_reads_imdsv2():
    with _IMDSWithInstance() as imds:
        out, err = io.StringIO(), io.StringIO()
        assert node_labels.main(["aws", "--endpoint", imds.url], out, err) == 0
    assert parse_node_labels_string(out.getvalue().strip()) == {
        "ray.io/market-type": "spot", "moshray-market": "spot",
        "ray.io/availability-zone": "us-east-1c", "moshray-instance-type": "g5.xlarge",
        "moshray-cloud": "aws"}


def test_labels_command_reads_gce_metadata_and_fails_open():
    with GCEMetadataServer() as gce:
        base = "/computeMetadata/v1/instance/"
        gce.set_value(base + "scheduling/preemptible", "FALSE")
        gce.set_value(base + "machine-type", "projects/1/machineTypes/g2-standard-4")
        gce.set_value(base + "zone", "projects/1/zones/us-central1-b")
        out = io.StringIO()
        assert node_labels.main(["gcp", "--endpoint", gce.url], out, io.StringIO()) == 0
        labels = parse_node_labels_string(out.getvalue().strip())
        assert labels["ray.io/market-type"] == "on-demand"
        assert labels["moshray-instance-type"] == "g2-standard-4"
        gce.fail_next(10, 500)  # metadata unreadable: no labels, one line, exit 0
        out, err = io.StringIO(), io.StringIO()
        assert node_labels.main(["gcp", "--endpoint", gce.url, "--timeout-s", "2"],
                                out, err) == 0
    assert out.getvalue() == "\n" and len(err.getvalue().strip().splitlines()) == 1
    assert parse_node_labels_string("") == {}  # `ray start --labels=""` adds none


@pytest.mark.parametrize("cloud", ["aws", "gcp"])
def test_cluster_yaml_ray_start_carries_the_labels(cloud):
    config = yaml.safe_load((ROOT / "infra" / "ray" / f"cluster-{cloud}.yaml").read_text())
    starts = [c for c in config["worker_start_ray_commands"] if "ray start" in c]
    assert len(starts) == 1
    assert f'--labels="$(python3 -m moshray.autoscaler.clouds.node_labels {cloud})"' in starts[0]
    # The command it runs exists and, given a pool, prints labels Ray's parser accepts.
    proc = subprocess.run(
        [sys.executable, "-m", "moshray.autoscaler.clouds.node_labels", "--pool",
         Pool(cloud, "g4dn.xlarge" if cloud == "aws" else "g2-standard-4",
              "us-east-1a" if cloud == "aws" else "us-central1-a").key],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert parse_node_labels_string(proc.stdout.strip())["ray.io/market-type"] == "spot"
