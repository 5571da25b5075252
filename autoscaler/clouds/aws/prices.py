"""AWS prices: EC2's spot price history (the AWS bundle's ``spot_price_fetch`` and
``region``).

``ec2_spot_price_history`` reads ``DescribeSpotPriceHistory`` with a given client (the AWS
NodeProvider's); ``ec2_fetch`` is a ``prices.Fetch`` with its own boto3 clients, one per
region (the controller's ``PriceBook``). ``region_of`` names a zone's region (us-east-1a ->
us-east-1), for the shipped price table. boto3 is imported only when a fetch runs.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Sequence
from typing import Any

from moshray.autoscaler.clouds.prices import Fetch

LINUX_PRODUCTS = ("Linux/UNIX", "Linux/UNIX (Amazon VPC)")
_REGION_RE = re.compile(r"^([a-z]{2}(-[a-z]+)+-\d+)[a-z]$")  # us-east-1a -> us-east-1


def region_of(zone: str) -> str:
    """us-east-1a -> us-east-1; "" for a name that is not an AWS availability zone."""
    m = _REGION_RE.match(zone)
    return m.group(1) if m else ""


def ec2_spot_price_history(client: Any, instance_types: Sequence[str],
                           zones: Sequence[str]) -> list[dict[str, Any]]:
    """EC2 ``DescribeSpotPriceHistory`` records for these types and zones from now on: the
    price in effect now per (type, zone, product), plus any change since
    (``prices.newest_prices`` picks the newest). Linux only, as the node images are. Raises what
    botocore raises."""
    paginator = client.get_paginator("describe_spot_price_history")
    pages = paginator.paginate(
        InstanceTypes=list(instance_types),
        ProductDescriptions=list(LINUX_PRODUCTS),
        Filters=[{"Name": "availability-zone", "Values": list(zones)}],
        StartTime=dt.datetime.now(dt.timezone.utc),
    )
    return [record for page in pages for record in page.get("SpotPriceHistory", [])]


def ec2_fetch(endpoint_url: str | None = None, timeout_s: float = 5.0) -> Fetch:
    """A ``prices.Fetch`` reading EC2's spot price history with boto3, one client per region
    (made on first use; the zones say the region). Short timeouts and one retry: it runs on
    the controller's tick, at most once per TTL. ``endpoint_url`` None: boto3's own choice
    (``AWS_ENDPOINT_URL_EC2`` / ``AWS_ENDPOINT_URL``, else the real endpoint)."""
    clients: dict[str, Any] = {}

    def fetch(instance_types: tuple[str, ...], zones: tuple[str, ...]) -> list[dict[str, Any]]:
        import boto3
        import botocore.config

        by_region: dict[str, list[str]] = {}
        for zone in zones:
            region = region_of(zone)
            if region:
                by_region.setdefault(region, []).append(zone)
        records: list[dict[str, Any]] = []
        for region, region_zones in sorted(by_region.items()):
            if region not in clients:
                config = botocore.config.Config(
                    connect_timeout=timeout_s, read_timeout=timeout_s,
                    retries={"total_max_attempts": 2, "mode": "standard"})
                clients[region] = boto3.session.Session(region_name=region).client(
                    "ec2", endpoint_url=endpoint_url, config=config)
            records += ec2_spot_price_history(clients[region], instance_types, region_zones)
        return records

    return fetch
