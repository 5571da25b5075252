"""Spot prices per pool (autoscaler/clouds/prices.py): the newest EC2 spot price per (type, zone),
cached for a TTL, the configured price where the API has none or fails; exported as
``moshray_provider_spot_price_dollars{pool}``. The AWS path runs against moto's EC2 server on
127.0.0.1 (moto serves DescribeSpotPriceHistory), through the fault proxy of fake_ec2.py.
"""

from __future__ import annotations

import datetime as dt

import pytest

from fake_ec2 import running_fake_ec2
from moshray.autoscaler.clouds.aws.provider import AWSSpotNodeProvider
from moshray.autoscaler.clouds.gcp.provider import GCPSpotNodeProvider
from moshray.autoscaler.pools import Pool
from moshray.autoscaler.clouds.prices import PriceConfig, SpotPrices, newest_prices
from moshray.autoscaler.providers.metrics import REGISTRY
from moshray.autoscaler.tags import AWS_PROVIDER, GCP_PROVIDER

REGION = "us-east-1"
A = Pool("aws", "g4dn.xlarge", "us-east-1a")
B = Pool("aws", "g4dn.xlarge", "us-east-1b")
E = Pool("aws", "g4dn.xlarge", "us-east-1e")  # moto offers no g4dn.xlarge there
MOTO_PRICE = 0.00001  # what moto answers for every type and zone


def gauge(pool: Pool) -> float | None:
    return REGISTRY.get_sample_value("moshray_provider_spot_price_dollars", {"pool": pool.key})


def record(itype, zone, price, when):
    return {"InstanceType": itype, "AvailabilityZone": zone, "SpotPrice": price,
            "ProductDescription": "Linux/UNIX", "Timestamp": when}


T0 = dt.datetime(2025, 3, 1, 12, 0, tzinfo=dt.timezone.utc)


def test_newest_price_per_type_and_zone():
    history = [
        record("g4dn.xlarge", "us-east-1a", "0.2000", T0),
        record("g4dn.xlarge", "us-east-1a", "0.2500", T0 + dt.timedelta(minutes=5)),
        record("g4dn.xlarge", "us-east-1a", "0.1000", T0 - dt.timedelta(hours=1)),
        record("g4dn.xlarge", "us-east-1b", "0.3000", "2025-03-01T12:00:00.123456789Z"),
        record("g5.xlarge", "us-east-1a", "not a price", T0),
        record("g5.xlarge", "us-east-1b", "0", T0),
        {"InstanceType": "g5.xlarge"},  # incomplete
    ]
    assert newest_prices(history) == {("g4dn.xlarge", "us-east-1a"): 0.25,
                                      ("g4dn.xlarge", "us-east-1b"): 0.3}


def test_cached_for_the_ttl_with_the_config_as_fallback():
    now = [1000.0]
    calls = []

    def fetch(itypes, zones):
        calls.append((itypes, zones))
        if len(calls) == 3:
            raise RuntimeError("throttled")
        return [record("g4dn.xlarge", "us-east-1a", f"{0.2 + 0.1 * len(calls):.4f}", T0)]

    prices = SpotPrices(PriceConfig({"g4dn.xlarge": 0.5}, ttl_s=300), fetch, lambda: now[0])
    on_demand = A.with_market("on-demand")
    assert prices.current((A, B, on_demand)) == ({A.key: 0.3, B.key: 0.5}, None)
    assert calls == [(("g4dn.xlarge",), ("us-east-1a", "us-east-1b"))]
    now[0] += 299
    assert prices.current((A, B))[0] == {A.key: 0.3, B.key: 0.5}
    assert len(calls) == 1  # cached
    now[0] += 1
    assert prices.current((A, B))[0][A.key] == pytest.approx(0.4)
    now[0] += 300
    values, failure = prices.current((A, B))
    assert isinstance(failure, RuntimeError)
    assert values[A.key] == pytest.approx(0.4)  # the last good price is kept
    assert prices.current((A, B)) == (values, None) and len(calls) == 3  # no retry until TTL
    prices.current((A, B, E))  # a pool not fetched yet: fetched at once
    assert len(calls) == 4
    # no fetch function: configured prices only; unknown types have no price
    static = SpotPrices(PriceConfig({"g4dn.xlarge": 0.5}), None, lambda: 0.0)
    assert static.current((A, Pool("aws", "g5.xlarge", "us-east-1a"))) == ({A.key: 0.5}, None)


@pytest.mark.parametrize("cfg, message", [
    ({"spot_prices": {"g4dn.xlarge": 0}}, "spot_prices.g4dn.xlarge must be a number > 0"),
    ({"spot_prices": {"g4dn.xlarge": "cheap"}}, "must be a number > 0"),
    ({"spot_prices": [0.2]}, "provider.spot_prices must be a mapping"),
    ({"spot_price_ttl_s": -1}, "provider.spot_price_ttl_s must be a number >= 0"),
])
def test_bad_price_config_says_what_to_fix(cfg, message):
    with pytest.raises(ValueError, match=message):
        PriceConfig.from_provider_config(cfg)


@pytest.fixture(scope="module")
def ec2_server():
    with running_fake_ec2() as fake:
        yield fake


def aws_provider(fake, name, **extra):
    cfg = {"type": "external", "module": AWS_PROVIDER, "region": REGION,
           "endpoint_url": fake.url, "metrics_port": None,
           "pools": [{"instance_type": p.instance_type, "zone": p.zone} for p in (A, B, E)],
           "spot_prices": {"g4dn.xlarge": 0.21}, **extra}
    return AWSSpotNodeProvider(cfg, name)


def test_aws_spot_price_history_from_moto_with_config_fallback(ec2_server):
    ec2_server.proxy.clear()
    provider = aws_provider(ec2_server, "prices-a")
    provider.post_process()  # what Ray's autoscaler calls after every update
    (request,) = [r for r in ec2_server.proxy.requests
                  if r["Action"] == "DescribeSpotPriceHistory"]
    assert request["InstanceType.1"] == "g4dn.xlarge"
    assert request["ProductDescription.1"] == "Linux/UNIX"
    assert {request["Filter.1.Value.1"], request["Filter.1.Value.2"],
            request["Filter.1.Value.3"]} == {"us-east-1a", "us-east-1b", "us-east-1e"}
    assert "StartTime" in request
    assert gauge(A) == gauge(B) == MOTO_PRICE  # from the API
    assert gauge(E) == 0.21  # moto has no g4dn.xlarge in us-east-1e: the configured price
    provider.post_process()  # within the TTL: no second call
    assert len([r for r in ec2_server.proxy.requests
                if r["Action"] == "DescribeSpotPriceHistory"]) == 1
    assert not provider.errors


def test_aws_price_api_refused_falls_back_to_config_and_is_collected(ec2_server):
    ec2_server.proxy.clear()
    ec2_server.proxy.fail_action("DescribeSpotPriceHistory", "UnauthorizedOperation")
    try:
        provider = aws_provider(ec2_server, "prices-b", spot_prices={"g4dn.xlarge": 0.26})
        assert provider.update_prices() == {A.key: 0.26, B.key: 0.26, E.key: 0.26}
        assert gauge(A) == 0.26
        (err,) = provider.errors
        assert err.operation == "prices" and "UnauthorizedOperation" in err.message
    finally:
        ec2_server.proxy.clear()


def test_gcp_prices_come_from_the_config():
    a = Pool("gcp", "g2-standard-4", "us-central1-a")
    provider = GCPSpotNodeProvider(
        {"type": "external", "module": GCP_PROVIDER, "project_id": "p",
         "anonymous_credentials": True, "api_endpoint": "http://127.0.0.1:9",
         "metrics_port": None, "spot_prices": {"g2-standard-4": 0.28},
         "pools": [{"machine_type": a.instance_type, "zone": a.zone}]}, "prices-g")
    assert provider.update_prices() == {a.key: 0.28}
    assert gauge(a) == 0.28
