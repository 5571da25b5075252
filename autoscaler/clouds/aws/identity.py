"""How a node finds out it is on EC2, and which pool it is in (the AWS bundle's ``Identity``
and ``read_pool``).

* ``AWS_EC2_METADATA_SERVICE_ENDPOINT`` (boto's IMDS endpoint override) names the metadata
  service; ``AWS_EC2_METADATA_DISABLED=true`` (botocore's opt-out) takes AWS out of the
  search. The embedded cluster sets the first to its IMDSv2 emulator (``emulator.py``).
* DMI: Nitro instances say ``Amazon EC2``; older Xen-based instances say ``Xen`` and are
  found by the probe instead.
* ``probe_imds``: IMDSv2 answers ``PUT /latest/api/token`` with a TTL header with 200 and a
  token.
* ``read_pool``: the instance's pool from IMDSv2 (``instance-life-cycle``,
  ``instance-type``, ``placement/availability-zone``), for its Ray node labels
  (``clouds/node_labels.py``).
"""

from __future__ import annotations

import http.client
from collections.abc import Callable

from moshray.autoscaler.clouds.base import Identity
from moshray.autoscaler.clouds.detect import (
    ProbeAnswer,
    describe_trouble,
    metadata_get,
    probe_request,
)
from moshray.autoscaler.pools.records import Market, Pool

AWS_ENDPOINT_ENV = "AWS_EC2_METADATA_SERVICE_ENDPOINT"
AWS_DISABLED_ENV = "AWS_EC2_METADATA_DISABLED"
IMDS_TOKEN_PATH = "/latest/api/token"
IMDS_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
IMDS_TOKEN_HEADER = "X-aws-ec2-metadata-token"


def probe_imds(base: str, left: Callable[[], float]) -> ProbeAnswer:
    """Whether the metadata service at ``base`` is IMDSv2; each wait at most ``left()`` s.
    Never raises on network trouble."""
    try:
        status, _ = probe_request(base, "PUT", IMDS_TOKEN_PATH, {IMDS_TTL_HEADER: "60"}, left)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return ProbeAnswer("aws", base, False, describe_trouble(exc))
    if status == 200:
        return ProbeAnswer("aws", base, True, f"IMDSv2 answered PUT {IMDS_TOKEN_PATH} with 200")
    return ProbeAnswer("aws", base, False, f"PUT {IMDS_TOKEN_PATH} -> {status}")


IDENTITY = Identity(endpoint_env=AWS_ENDPOINT_ENV, opt_out_env=AWS_DISABLED_ENV,
                    dmi_prefixes=("Amazon",), probe=probe_imds)


def read_pool(base: str, timeout_s: float = 5.0) -> Pool:
    """This EC2 instance's pool from IMDSv2 at ``base``. Raises OSError (unreachable,
    refused) or ValueError (an answer that names no valid pool)."""
    token = metadata_get(base + IMDS_TOKEN_PATH, {IMDS_TTL_HEADER: "60"}, timeout_s,
                         method="PUT")

    def get(path: str) -> str:
        return metadata_get(base + "/latest/meta-data/" + path, {IMDS_TOKEN_HEADER: token},
                            timeout_s)

    # instance-life-cycle: "spot", "on-demand" (or "scheduled", "capacity-block": not spot)
    market = Market.SPOT if get("instance-life-cycle") == "spot" else Market.ON_DEMAND
    return Pool("aws", get("instance-type"), get("placement/availability-zone"), market)
