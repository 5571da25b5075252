"""Where things run: the resource names that separate the head node from spot nodes.

Spot worker nodes carry the custom resource ``SPOT_RESOURCE`` (the Ray cluster YAML and the
embedded local cluster both set it), so training replicas and experts land only there.
The Coordinator asks for a sliver of the head node's built-in resource, so it can never be
placed on a node that may be preempted.

Node labels say what a worker node is, for the controller's node counts and prices
(``jobs/controller/observations.py node_view``). Where Ray defines a key it is used, with Ray's values:
``ray.io/market-type`` (``spot`` / ``on-demand``; Ray also fills it from ``RAY_NODE_MARKET_TYPE``)
and ``ray.io/availability-zone``. Ray has no key for the instance type or the cloud, so those are
moshray's. The infra/ node setup (``python -m moshray.autoscaler.clouds.node_labels``) passes them to
``ray start --labels`` from the node's own metadata service. ``LEGACY_MARKET_LABEL`` is still
read when Ray's key is absent.

Jobs share a cluster side by side: each training job's Coordinator is named after the job
(``coordinator_name``); a node's watcher tells every job's Coordinator of a notice
(``job_coordinators``).
"""

from __future__ import annotations

SPOT_RESOURCE = "spot"
HEAD_RESOURCE = "node:__internal_head__"  # Ray's built-in resource of the head node
NAMESPACE = "moshray"
SLOT_LABEL = "moshray-slot"  # node label of the embedded cluster's simulated nodes
MARKET_LABEL = "ray.io/market-type"  # Ray's key (RAY_NODE_MARKET_TYPE_KEY): spot | on-demand
LEGACY_MARKET_LABEL = "moshray-market"  # the older moshray key, read when Ray's is absent
ZONE_LABEL = "ray.io/availability-zone"  # Ray's key (RAY_NODE_ZONE_KEY)
INSTANCE_TYPE_LABEL = "moshray-instance-type"  # e.g. g4dn.xlarge, g2-standard-4 (Ray has none)
CLOUD_LABEL = "moshray-cloud"  # aws | gcp (Ray has none)
COORDINATOR_NAME = "moshray-coordinator"  # the prefix of every job's Coordinator's name


def coordinator_name(job: str) -> str:
    """The Ray actor name (namespace ``NAMESPACE``) of job ``job``'s Coordinator."""
    return f"{COORDINATOR_NAME}:{job}"


def job_coordinators() -> dict[str, object]:
    """``{job name: Coordinator handle}`` of every training job on the cluster (actors named
    by ``coordinator_name``). Needs a connected Ray worker; a Coordinator that dies between
    the listing and the lookup is left out."""
    import ray

    found = {}
    prefix = COORDINATOR_NAME + ":"
    for actor in ray.util.list_named_actors(all_namespaces=True):
        name = actor["name"]
        if actor.get("namespace") == NAMESPACE and name.startswith(prefix):
            try:
                found[name[len(prefix):]] = ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                pass
    return found


def on_head() -> dict:
    """Ray ``.options(...)`` that pin an actor to the head node, using no CPU."""
    return {"num_cpus": 0, "resources": {HEAD_RESOURCE: 0.001}}


def on_spot(num_cpus: float = 1.0, num_gpus: float = 0.0) -> dict:
    """Ray ``.options(...)`` for an actor that must run on a spot worker node."""
    return {"num_cpus": num_cpus, "num_gpus": num_gpus, "resources": {SPOT_RESOURCE: 1}}


def sole_coordinator():
    """The Coordinator of the one training job on the cluster (a harness that runs one job
    at a time: a bench, a test). ``ValueError`` when there is none, or several (name the
    job then: ``coordinator_name``)."""
    found = job_coordinators()
    if len(found) != 1:
        raise ValueError(f"expected one training job's Coordinator, found {len(found)}: "
                         f"{', '.join(sorted(found)) or 'none'}")
    return next(iter(found.values()))
