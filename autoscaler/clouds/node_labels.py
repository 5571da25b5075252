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

The command reads the node's metadata service with the named cloud's ``read_pool`` (its
bundle, ``clouds/base.py``; AWS IMDSv2: ``instance-life-cycle``, ``instance-type``,
``placement/availability-zone``; GCE: ``scheduling/preemptible``, ``machine-type``,
``zone``), bounded by ``--timeout-s``. Failure behaviour: if the metadata
cannot be read it prints an empty line (``ray start --labels=""`` adds no label; the node then
counts as spot at the configured price), says why on stderr in one line and exits 0, so a
node always joins.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping

from moshray.autoscaler.clouds.base import Cloud, clouds, get_cloud
from moshray.autoscaler.pools.records import Pool, decode_pool
from moshray.cluster.placement import (
    CLOUD_LABEL,
    INSTANCE_TYPE_LABEL,
    LEGACY_MARKET_LABEL,
    MARKET_LABEL,
    ZONE_LABEL,
)


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


def _metadata_base(cloud: Cloud, endpoint: str | None) -> str:
    """``--endpoint``, else the service the node names as the cloud's SDK finds it (its
    ``Identity.endpoint_env``), else the cloud's own address."""
    if endpoint:
        return endpoint.rstrip("/")
    named = os.environ.get(cloud.identity.endpoint_env, "").strip() if cloud.identity else ""
    if named:
        return named.rstrip("/") if "://" in named else f"http://{named.rstrip('/')}"
    return cloud.metadata_url.rstrip("/")


def main(argv: list[str] | None = None, out=sys.stdout, err=sys.stderr) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m moshray.autoscaler.clouds.node_labels",
        description="Print this node's Ray labels (market, instance type, zone, cloud) for "
                    "`ray start --labels`.")
    names = tuple(c.name for c in clouds() if c.read_pool is not None)
    parser.add_argument("cloud", nargs="?", choices=names,
                        help="read them from this cloud's metadata service")
    parser.add_argument("--pool",
                        help="derive them from this pool key (autoscaler/pools/records.py)")
    parser.add_argument("--endpoint", help="metadata service base URL (default: the cloud's)")
    parser.add_argument("--timeout-s", type=float, default=5.0)
    args = parser.parse_args(argv)
    if (args.cloud is None) == (args.pool is None):
        parser.error(f"name a cloud ({' or '.join(names)}) or give --pool, not both")
    try:
        if args.pool is not None:
            pool = decode_pool(args.pool)
        else:
            cloud = get_cloud(args.cloud)
            pool = cloud.read_pool(_metadata_base(cloud, args.endpoint), args.timeout_s)
    except (OSError, ValueError) as exc:
        print(f"node_labels: no market/instance-type labels ({type(exc).__name__}: {exc}); "
              "the node counts as spot at the configured price", file=err)
        print("", file=out)
        return 0
    print(labels_arg(pool_labels(pool)), file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
