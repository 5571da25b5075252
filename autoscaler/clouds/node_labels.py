"""The Ray node labels of a cloud node: its market, instance type, zone and cloud.

A NodeProvider picks each worker's pool (cloud, instance type, zone, market: pools.py), so
the node only learns which one it got when it boots. ``ray start`` then labels the Ray node
with it, and the controller reads the labels back (``jobs/controller/observations.py node_view``) to
count spot and on-demand nodes and to price each one (prices.py ``PriceBook``).

Keys (cluster/placement.py): Ray's own ``ray.io/market-type`` (values ``spot`` /
``on-demand``, as Ray's docs and KubeRay use them) and ``ray.io/availability-zone``; Ray
defines no key for the instance type or the cloud, so those are ``moshray-instance-type`` and
``moshray-cloud``. The older ``moshray-market`` is written too, for readers of that key.

On a node (infra/ray/cluster-*.yaml, infra/*/modules/bootstrap worker scripts)::

    ray start ... --labels="$(python -m moshray.autoscaler.clouds.node_labels aws)"
    python -m moshray.autoscaler.clouds.node_labels --pool "$MOSHRAY_POOL"   # from a known pool key

The command reads the node's metadata service (AWS IMDSv2: ``instance-life-cycle``,
``instance-type``, ``placement/availability-zone``; GCE: ``scheduling/preemptible``,
``machine-type``, ``zone``), bounded by ``--timeout-s``. Failure behaviour: if the metadata
cannot be read it prints an empty line (``ray start --labels=""`` adds no label; the node then
counts as spot at the configured price), says why on stderr in one line and exits 0, so a
node always joins.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.request
from collections.abc import Mapping

from moshray.autoscaler.pools import Market, Pool, decode_pool
from moshray.cluster.placement import (
    CLOUD_LABEL,
    INSTANCE_TYPE_LABEL,
    LEGACY_MARKET_LABEL,
    MARKET_LABEL,
    ZONE_LABEL,
)

AWS_METADATA = "http://169.254.169.254"
GCE_METADATA = "http://metadata.google.internal"


def pool_labels(pool: Pool) -> dict[str, str]:
    """The node labels of a node launched in ``pool`` (pure)."""
    return {
        MARKET_LABEL: pool.market.value,
        LEGACY_MARKET_LABEL: pool.market.value,
        ZONE_LABEL: pool.zone,
        INSTANCE_TYPE_LABEL: pool.instance_type,
        CLOUD_LABEL: pool.cloud,
    }


def labels_arg(labels: Mapping[str, str]) -> str:
    """``key=value,...`` as ``ray start --labels`` parses it (sorted, so stable)."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def _get(url: str, headers: Mapping[str, str], timeout_s: float, method: str = "GET") -> str:
    request = urllib.request.Request(url, headers=dict(headers), method=method)
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return response.read().decode().strip()


def aws_pool(base: str = AWS_METADATA, timeout_s: float = 5.0) -> Pool:
    """This EC2 instance's pool from IMDSv2. Raises OSError (unreachable, refused) or
    ValueError (an answer that names no valid pool)."""
    token = _get(base + "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "60"},
                 timeout_s, method="PUT")

    def get(path: str) -> str:
        return _get(base + "/latest/meta-data/" + path, {"X-aws-ec2-metadata-token": token},
                    timeout_s)

    # instance-life-cycle: "spot", "on-demand" (or "scheduled", "capacity-block": not spot)
    market = Market.SPOT if get("instance-life-cycle") == "spot" else Market.ON_DEMAND
    return Pool("aws", get("instance-type"), get("placement/availability-zone"), market)


def gce_pool(base: str = GCE_METADATA, timeout_s: float = 5.0) -> Pool:
    """This GCE VM's pool from the metadata server. Raises OSError or ValueError."""

    def get(path: str) -> str:
        return _get(base + "/computeMetadata/v1/instance/" + path,
                    {"Metadata-Flavor": "Google"}, timeout_s)

    # TRUE for Spot VMs and (legacy) preemptible VMs, FALSE for standard ones.
    spot = get("scheduling/preemptible").upper() == "TRUE"
    machine_type = get("machine-type").rsplit("/", 1)[-1]  # projects/N/machineTypes/<type>
    zone = get("zone").rsplit("/", 1)[-1]  # projects/N/zones/<zone>
    return Pool("gcp", machine_type, zone, Market.SPOT if spot else Market.ON_DEMAND)


def _metadata_base(cloud: str, endpoint: str | None) -> str:
    if endpoint:
        return endpoint.rstrip("/")
    if cloud == "aws":  # as the AWS SDKs find a non-default endpoint
        return os.environ.get("AWS_EC2_METADATA_SERVICE_ENDPOINT", AWS_METADATA).rstrip("/")
    host = os.environ.get("GCE_METADATA_HOST")  # as Google's libraries do
    return f"http://{host}" if host else GCE_METADATA


def main(argv: list[str] | None = None, out=sys.stdout, err=sys.stderr) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m moshray.autoscaler.clouds.node_labels",
        description="Print this node's Ray labels (market, instance type, zone, cloud) for "
                    "`ray start --labels`.")
    parser.add_argument("cloud", nargs="?", choices=("aws", "gcp"),
                        help="read them from this cloud's metadata service")
    parser.add_argument("--pool", help="derive them from this pool key (autoscaler/pools/__init__.py)")
    parser.add_argument("--endpoint", help="metadata service base URL (default: the cloud's)")
    parser.add_argument("--timeout-s", type=float, default=5.0)
    args = parser.parse_args(argv)
    if (args.cloud is None) == (args.pool is None):
        parser.error("name a cloud (aws or gcp) or give --pool, not both")
    try:
        if args.pool is not None:
            pool = decode_pool(args.pool)
        else:
            base = _metadata_base(args.cloud, args.endpoint)
            read = aws_pool if args.cloud == "aws" else gce_pool
            pool = read(base, args.timeout_s)
    except (OSError, ValueError) as exc:
        print(f"node_labels: no market/instance-type labels ({type(exc).__name__}: {exc}); "
              "the node counts as spot at the configured price", file=err)
        print("", file=out)
        return 0
    print(labels_arg(pool_labels(pool)), file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
