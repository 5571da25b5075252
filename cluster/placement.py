"""Where things run: the resource names that separate the head node from spot nodes.

Spot worker nodes carry the custom resource ``SPOT_RESOURCE`` (the Ray cluster YAML and the
embedded local cluster both set it), so training replicas and experts land only there.
The Coordinator asks for a sliver of the head node's built-in resource, so it can never be
placed on a node that may be preempted.
"""

from __future__ import annotations

SPOT_RESOURCE = "spot"
HEAD_RESOURCE = "node:__internal_head__"  # Ray's built-in resource of the head node
NAMESPACE = "moshray"
SLOT_LABEL = "moshray-slot"  # node label of the embedded cluster's simulated nodes
MARKET_LABEL = "moshray-market"  # optional node label: spot (default) or on-demand
COORDINATOR_NAME = "moshray-coordinator"


def on_head() -> dict:
    """Ray ``.options(...)`` that pin an actor to the head node, using no CPU."""
    return {"num_cpus": 0, "resources": {HEAD_RESOURCE: 0.001}}


def on_spot(num_cpus: float = 1.0, num_gpus: float = 0.0) -> dict:
    """Ray ``.options(...)`` for an actor that must run on a spot worker node."""
    return {"num_cpus": num_cpus, "num_gpus": num_gpus, "resources": {SPOT_RESOURCE: 1}}
