"""How a node finds out it is on GCE, and which pool it is in (the GCP bundle's ``Identity``
and ``read_pool``).

* ``GCE_METADATA_HOST`` (google-auth's metadata host, ``host[:port]``) names the metadata
  service; ``NO_GCE_CHECK=true`` (google-auth's opt-out) takes GCP out of the search.
* DMI: GCE says ``Google`` / ``Google Compute Engine``.
* ``probe_gce``: ``GET /computeMetadata/v1/instance/id`` with ``Metadata-Flavor: Google``
  is answered with the header ``Metadata-Flavor: Google``.
* ``read_pool``: the VM's pool from the metadata server (``scheduling/preemptible``,
  ``machine-type``, ``zone``), for its Ray node labels (``clouds/node_labels.py``).
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

GCP_HOST_ENV = "GCE_METADATA_HOST"
GCE_CHECK_OFF_ENV = "NO_GCE_CHECK"
GCE_ID_PATH = "/computeMetadata/v1/instance/id"
GCE_FLAVOR = ("Metadata-Flavor", "Google")


def probe_gce(base: str, left: Callable[[], float]) -> ProbeAnswer:
    """Whether the metadata service at ``base`` is GCE's; each wait at most ``left()`` s.
    Never raises on network trouble."""
    name, value = GCE_FLAVOR
    try:
        status, headers = probe_request(base, "GET", GCE_ID_PATH, {name: value}, left)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return ProbeAnswer("gcp", base, False, describe_trouble(exc))
    if headers.get(name) == value:
        return ProbeAnswer("gcp", base, True, f"GCE metadata answered GET {GCE_ID_PATH} "
                                              f"({status}) with {name}: {value}")
    return ProbeAnswer("gcp", base, False, f"GET {GCE_ID_PATH} -> {status} without {name}")


IDENTITY = Identity(endpoint_env=GCP_HOST_ENV, opt_out_env=GCE_CHECK_OFF_ENV,
                    dmi_prefixes=("Google",), probe=probe_gce)


def read_pool(base: str, timeout_s: float = 5.0) -> Pool:
    """This GCE VM's pool from the metadata server at ``base``. Raises OSError or
    ValueError."""

    def get(path: str) -> str:
        return metadata_get(base + "/computeMetadata/v1/instance/" + path, dict([GCE_FLAVOR]),
                            timeout_s)

    # TRUE for Spot VMs and (legacy) preemptible VMs, FALSE for standard ones.
    spot = get("scheduling/preemptible").upper() == "TRUE"
    machine_type = get("machine-type").rsplit("/", 1)[-1]  # projects/N/machineTypes/<type>
    zone = get("zone").rsplit("/", 1)[-1]  # projects/N/zones/<zone>
    return Pool("gcp", machine_type, zone, Market.SPOT if spot else Market.ON_DEMAND)
