"""Starting a training replica on a given node: the one way every caller does it.

``launch_replica`` pins the ReplicaActor to its node with Ray's node-affinity scheduling
(``soft=False``: it runs there or not at all; no shared custom resource decides where) and
gives it ``num_gpus`` GPUs through Ray, then starts its ``run()``. The elastic controller
uses it for every replica (tests/replica_supervisor.py wraps it by slot for tests that
drive replicas on the embedded cluster directly).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moshray.actors.replica.build_check import installed_build
from moshray.cluster.collective.auth import new_job_key


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica of a job shares: the config dict, the job (the user's loop and
    data source, ``actors.replica.Job``), the Coordinator and the optional checkpoint the
    job resumes from (``resume``, a ``CheckpointRef``: the replicas read it from the store). ``build``: the driver's moshray build, read where the
    spec is made (``actors/replica/build_check.py``); a replica whose installed build
    differs refuses to run, which stops the job (None: no check). ``run_id``: the training
    job's run (see ``jobs/controller/lease.py``): its replicas are detached named actors
    that outlive the driver; None (tests, benchmarks): replicas owned by the driver,
    unnamed. ``job_key``: the secret the job's replicas sign and check contributions with
    (``cluster/collective/auth.py``), made here on the driver and handed to each replica as
    a constructor argument only (never an environment variable or a named place); a driver
    that adopts a running swarm must reuse its key (``adopted_job_key``)."""

    config: dict
    job: Any
    coordinator: Any
    resume: Any = None  # cluster.messages.CheckpointRef
    build: str | None = field(default_factory=installed_build)
    run_id: str | None = None
    job_key: bytes = field(default_factory=new_job_key, repr=False)


def launch_replica(spec: ReplicaSpec, peer_id: str, node_id: str,
                   num_gpus: float) -> tuple[Any, Any]:
    """Start ``peer_id`` on ``node_id``; returns ``(handle, run_ref)``. Never blocks: a node
    that died meanwhile shows up as a failed ``run_ref``. Detached and named when
    ``spec.run_id`` is set (the caller kills it when it is done with it)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from moshray.actors.replica.actor import ReplicaActor

    from moshray.cluster.placement import NAMESPACE
    from moshray.jobs.controller.lease import replica_actor_name

    lifetime = {} if spec.run_id is None else {
        "name": replica_actor_name(spec.run_id, peer_id), "namespace": NAMESPACE,
        "lifetime": "detached"}
    handle = ReplicaActor.options(
        num_cpus=1, num_gpus=num_gpus, max_concurrency=16,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False), **lifetime,
    ).remote(peer_id, spec.config, spec.job, spec.coordinator, spec.resume,
              build=spec.build, job_key=spec.job_key)
    return handle, handle.run.remote()


def adopted_job_key(handles, timeout_s: float = 30.0) -> bytes | None:
    """The job key of a running swarm (for a driver that adopts it): read out of the first
    replica of ``handles`` that answers, through Ray's ``__ray_call__`` (the power anyone
    with the cluster's token has: see ``cluster/collective/auth.py``). None if none
    answers (the swarm is gone: a fresh key is right then)."""
    import ray

    def key_of(actor):
        auth = actor.manager.averager.auth
        return None if auth is None else auth._key

    for handle in handles:
        try:
            key = ray.get(handle.__ray_call__.remote(key_of), timeout=timeout_s)
        except ray.exceptions.RayError:  # gone, or not a replica (no averager)
            continue
        if key is not None:
            return key
    return None
