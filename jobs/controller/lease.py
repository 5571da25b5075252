"""The job outlives its driver: a lease the driver renews, held by an actor that is not the
driver's.

Why this shape. A driver is one process that ``ray job stop`` SIGKILLs three seconds after
its SIGTERM, that a laptop's sleep or an OOM ends, and whose death Ray turns into the death
of everything it owns. So nothing the run needs is owned by it:

- the replicas are *detached* named actors (``moshray-replica:<run id>:<replica id>`` in
  the ``moshray`` namespace), so they keep training through the driver's death (their
  ``run()`` goes on; a later driver awaits it with ``wait_run``);
- the Coordinator already is detached and named (``placement.COORDINATOR_NAME``), and keeps
  the step history the summary is made from;
- the job's own state (run id, config fingerprint, the replicas and their nodes, the
  watchers it started, the newest checkpoint's step) lives in ``JobLease``, a detached actor
  on the head node, mirrored into Ray's GCS key-value store (a restarted ``JobLease`` reads
  it back).

The driver renews the lease from a thread of its own (``LeaseKeeper``), every quarter of
``cluster.driver_lease_s`` (at most every 5 s), with the job's state as the controller last
published it: a supervision tick that blocks (a checkpoint save of gigabytes, a drain, the
end of a run) delays no renewal. A resubmitted driver with the same config
(``fingerprint``) finds the record and, when the driver holding it is dead (Ray's job
table says so), *adopts* the swarm: the same Coordinator, the same replicas, no step lost
(``decide_claim``). Anything else (another config, a swarm that is stopping) is ended first,
as one training job per cluster always was. Nothing leaks, and a live job is never reaped:
``JobLease`` ends the swarm by itself (``reap_reason``) when its driver is dead (Ray's job
table) and has not renewed the lease for ``cluster.driver_lease_s`` (the window in which a
resubmitted driver adopts it), or at once when a driver that said it is stopping (SIGTERM,
``ray job stop``) is dead: it writes a
final checkpoint through a replica (if the job has a checkpoint location), tells the
Coordinator to stop the replicas, kills them, the watchers the job started and the
Coordinator, withdraws the capacity request, deletes the record and removes itself. A driver
that ends normally (or by an error) does the same itself and ``release``s the lease.

``decide_claim`` and ``reap_reason`` are pure; ``JobLease`` carries them out, and
``LeaseKeeper`` renews.
"""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
import threading
import time
from dataclasses import dataclass, replace

import ray

from moshray.cluster import placement

log = logging.getLogger("moshray.lease")
LEASE_NAME = "moshray-job-lease"
KV_KEY = b"moshray/job-record"
REPLICA_PREFIX = "moshray-replica"


def replica_actor_name(run_id: str, replica_id: str) -> str:
    """The detached replica's Ray actor name (namespace ``placement.NAMESPACE``)."""
    return f"{REPLICA_PREFIX}:{run_id}:{replica_id}"


def fingerprint(config_dict: dict) -> str:
    """What makes a resubmission the same job: the model, training (but its bounds), data
    and checkpoint sections and ``run_dir`` (whose name is the run's identity in the
    checkpoints' path, ``actors/replica/checkpoint.py``); not its address or output
    format. Pure."""
    same = {k: config_dict.get(k)
            for k in ("model", "training", "data", "checkpoint", "run_dir")}
    # How long or how many steps it runs may change between submissions of the same job.
    same["training"] = {k: v for k, v in (same["training"] or {}).items()
                        if k not in ("max_steps", "max_seconds")}
    return hashlib.sha256(json.dumps(same, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class JobRecord:
    """The job's state that must outlive its driver. ``holder``: the Ray job id (hex) of the
    driver holding the lease; ``replicas``: ``(replica_id, node_id, num_gpus)`` of every
    replica not gone; ``count``: replicas started so far (ids go on from it);
    ``own_watchers``: nodes whose watcher the job started; ``last_checkpoint``: the newest
    checkpoint's step; ``stopping``: the driver was told to stop (SIGTERM)."""

    run_id: str
    fingerprint: str
    holder: str
    lease_s: float
    checkpoint_uri: str | None = None
    replicas: tuple[tuple[str, str, float], ...] = ()
    count: int = 0
    own_watchers: tuple[str, ...] = ()
    last_checkpoint: int = 0
    stopping: bool = False


@dataclass(frozen=True)
class Adopt:
    """Take over the running swarm of ``record``."""

    record: JobRecord


@dataclass(frozen=True)
class Replace:
    """End the swarm there is (``reason``), then start afresh."""

    reason: str


@dataclass(frozen=True)
class Fresh:
    """No job holds the cluster."""


def decide_claim(record: JobRecord | None, me: str, fingerprint_: str,
                 holder_alive: bool) -> Adopt | Replace | Fresh:
    """What a driver (Ray job id ``me``) starting a job of ``fingerprint_`` does with the
    cluster's ``record``. Pure. Adopt only the same job whose driver is gone (or is this
    very driver, e.g. a second ``fit`` in one process after an error left it) and that was
    not told to stop."""
    if record is None:
        return Fresh()
    if record.stopping:
        return Replace("the previous job was stopping")
    if record.fingerprint != fingerprint_:
        return Replace("a job with another config holds the cluster")
    if holder_alive and record.holder != me:
        return Replace(f"its driver (Ray job {record.holder}) is still alive")
    return Adopt(record)


def reap_reason(record: JobRecord | None, since_renewed_s: float,
                holder_alive: bool) -> str | None:
    """Why ``JobLease`` ends the swarm now, or None. Pure. Only a driver that is gone is
    reaped: at once if it was told to stop, else once it has not renewed the lease for
    ``lease_s`` (the time a resubmitted driver has to adopt the swarm). A driver Ray lists
    as alive is never reaped, however long since it renewed (``job_alive`` answers alive
    when Ray's job table cannot be read)."""
    if record is None or holder_alive:
        return None
    if record.stopping:
        return "its driver was stopped and is gone"
    if since_renewed_s > record.lease_s:
        return (f"its driver is gone and did not renew the lease for {since_renewed_s:.0f} s "
                f"(cluster.driver_lease_s={record.lease_s:g})")
    return None


def renewed(record: JobRecord, state: JobState) -> JobRecord:
    """``record`` with the job's state of a renewal: its replicas, count, watchers, newest
    checkpoint and checkpoint location (kept if the state names none). Pure."""
    return replace(record, replicas=tuple(state.replicas), count=state.count,
                   own_watchers=tuple(state.own_watchers),
                   last_checkpoint=state.last_checkpoint,
                   checkpoint_uri=state.checkpoint_uri or record.checkpoint_uri)


def renew_interval(lease_s: float) -> float:
    """How often ``LeaseKeeper`` renews a lease of ``lease_s``: a quarter of it, at most 5 s
    and at least 0.1 s. Pure."""
    return min(max(lease_s / 4.0, 0.1), 5.0)


@dataclass(frozen=True)
class JobState:
    """What a renewal carries: the job's state as the controller last saw it
    (``JobRecord``'s fields of the same names; ``checkpoint_uri``: where checkpoints go
    now, which the durability guard may have switched since the claim)."""

    replicas: tuple[tuple[str, str, float], ...] = ()
    count: int = 0
    own_watchers: tuple[str, ...] = ()
    last_checkpoint: int = 0
    checkpoint_uri: str | None = None


class LeaseKeeper:
    """Renews the job's lease from a daemon thread of the driver, every ``interval_s``,
    with the newest ``JobState`` the controller ``publish``ed, whatever the controller's own
    loop is doing (a checkpoint save, a drain or the end of a run may block it for minutes).

    ``renew(state)`` is one bounded renewal: True if the lease stands, False if it ended (its
    reaper ended the swarm); an exception is a failed attempt (logged; a lease restarting is
    renewed on the next). After a False, ``ended`` is True and the thread stops: the
    controller raises ``JobFailed`` on its next tick. ``stop`` ends the thread (bounded);
    the driver stops it before it releases the lease. Nothing is renewed before the first
    ``publish``."""

    def __init__(self, renew, interval_s: float, name: str = "lease-keeper"):
        self._renew = renew
        self.interval_s = interval_s
        self._state: JobState | None = None
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self.ended = False
        self.renewals = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._thread.start()

    def publish(self, state: JobState) -> None:
        """The job's state now; the first one is renewed at once, later ones on schedule."""
        first = self._state is None
        self._state = state
        if first:
            self._wake.set()

    def renew_now(self) -> bool:
        """Renew with the state published last, in the caller's thread (bounded by
        ``renew``), before the caller goes on: e.g. a replica in the record before it is
        launched, so that a driver dying right after the launch leaves it to the lease.
        False if the lease ended or the renewal failed (logged)."""
        state = self._state
        if state is None or self.ended:
            return False
        try:
            if self._renew(state):
                return True
            self.ended = True
        except Exception as exc:  # noqa: BLE001 - a lease restarting
            log.warning("lease not renewed: %r", exc)
        return False

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopped.set()
        self._wake.set()
        self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        while not self._stopped.is_set():
            state = self._state
            if state is not None:
                try:
                    if not self._renew(state):
                        self.ended = True
                        return
                    self.renewals += 1
                except Exception as exc:  # noqa: BLE001 - a lease restarting: next time
                    log.warning("lease not renewed: %r", exc)
            self._wake.wait(self.interval_s if state is not None else None)
            self._wake.clear()


def ray_renewal(lease, timeout_s: float = 30.0):
    """``LeaseKeeper``'s ``renew`` for the ``JobLease`` actor ``lease``."""

    def renew(state: JobState) -> bool:
        return ray.get(lease.renew.remote(state), timeout=timeout_s)

    return renew


def job_alive(job_id: str) -> bool:
    """Whether Ray's job table lists ``job_id`` (hex) as not dead; True if unknown (a
    driver is never declared gone on a failed read)."""
    try:
        rows = ray._private.state.jobs()  # noqa: SLF001 - Ray's own job table, via the GCS
    except Exception:  # noqa: BLE001
        return True
    for row in rows:
        if row.get("JobID") == job_id:
            return not row.get("IsDead", False)
    return True


def current_job() -> str:
    return ray.get_runtime_context().get_job_id()


@ray.remote
class JobLease:
    """See the module docstring. Create with ``get_or_create``; every method is bounded."""

    def __init__(self, poll_s: float = 0.5, clock=time.monotonic):
        self.clock = clock
        self.poll_s = poll_s
        self.lock = threading.RLock()
        self.record: JobRecord | None = self._load()
        self.renewed_at = clock()  # a restarted lease gives the driver a full term
        self.ended: str | None = None
        threading.Thread(target=self._reaper, daemon=True, name="lease-reaper").start()

    # -- the record ---------------------------------------------------------------------------

    @staticmethod
    def _load() -> JobRecord | None:
        from ray.experimental.internal_kv import _internal_kv_get

        raw = _internal_kv_get(KV_KEY)
        return pickle.loads(raw) if raw else None

    def _store(self) -> None:
        from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_put

        if self.record is None:
            _internal_kv_del(KV_KEY)
        else:
            _internal_kv_put(KV_KEY, pickle.dumps(self.record), overwrite=True)

    def get(self) -> tuple[JobRecord | None, bool]:
        """The record and whether its holder's driver is alive."""
        with self.lock:
            record = self.record
        return record, record is not None and job_alive(record.holder)

    def take(self, record: JobRecord) -> None:
        """``record``'s holder holds the lease from now on (a new job or an adoption)."""
        with self.lock:
            self.record, self.renewed_at, self.ended = record, self.clock(), None
            self._store()

    def renew(self, state: JobState) -> bool:
        """The holder is alive; the job's state as it is now. False if there is no record
        (the lease ended the swarm: the driver should stop)."""
        with self.lock:
            if self.record is None:
                return False
            record = renewed(self.record, state)
            self.renewed_at = self.clock()
            if record != self.record:  # the GCS mirror is written when the state changed
                self.record = record
                self._store()
            return True

    def stopping(self) -> None:
        """The driver was told to stop: should it die before it is done, end the swarm."""
        with self.lock:
            if self.record is not None:
                self.record = replace(self.record, stopping=True)
                self._store()

    def release(self) -> None:
        """The driver ended the job itself: forget it (the driver then removes this actor)."""
        with self.lock:
            self.record = None
            self._store()

    def status(self) -> dict:
        with self.lock:
            return {"record": self.record, "since_renewed_s": self.clock() - self.renewed_at,
                    "ended": self.ended}

    # -- ending a swarm whose driver is gone -------------------------------------------------

    def _reaper(self) -> None:
        while True:
            time.sleep(self.poll_s)
            with self.lock:
                record, since = self.record, self.clock() - self.renewed_at
            if record is None:
                continue
            try:
                reason = reap_reason(record, since, job_alive(record.holder))
                if reason is not None:
                    self.end(reason)
                    ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                    return
            except Exception as exc:  # noqa: BLE001 - the reaper must outlive a failed read
                log.warning("lease reaper: %r", exc)

    def end(self, reason: str) -> str:
        """End the swarm of the record (see the module docstring) and forget it; each
        failure is logged and the next part is done. Returns ``reason``."""
        with self.lock:
            record = self.record
        if record is None:
            return reason
        log.warning("ending job %s: %s", record.run_id, reason)
        end_swarm(record, reason)
        with self.lock:
            self.record, self.ended = None, reason
            self._store()
        return reason


def end_swarm(record: JobRecord, reason: str, grace_s: float = 20.0) -> None:
    """Final checkpoint (if the job has a location), a graceful stop, then nothing left:
    replicas, the job's own watchers, the Coordinator, the capacity request. Bounded; each
    failure is logged, never raised."""
    handles = []
    for replica_id, _, _ in record.replicas:
        try:
            handles.append(ray.get_actor(replica_actor_name(record.run_id, replica_id),
                                         namespace=placement.NAMESPACE))
        except ValueError:
            pass
    try:
        coordinator = ray.get_actor(placement.COORDINATOR_NAME, namespace=placement.NAMESPACE)
    except ValueError:
        coordinator = None
    if record.checkpoint_uri:
        from moshray.jobs.controller.driver_calls import save_through

        for handle in handles:
            try:  # bounded by the bytes that move, not a constant (driver_calls.py)
                result = save_through(handle, record.checkpoint_uri)
                log.warning("final checkpoint %s (%s)", result, reason)
                if result is not None and result.ok:
                    break
            except (ray.exceptions.RayError, TimeoutError) as exc:
                log.warning("final checkpoint not written: %r", exc)
    if coordinator is not None and handles:
        try:
            ray.get(coordinator.request_stop.remote(), timeout=10)
            ray.wait([h.wait_run.remote() for h in handles], num_returns=len(handles),
                     timeout=grace_s)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            log.warning("graceful stop failed: %r", exc)
    for handle in handles:
        _kill(handle)
    from moshray.autoscaler.watch.watcher import get_watcher

    for node_id in record.own_watchers:
        watcher = get_watcher(node_id)
        if watcher is not None:
            _kill(watcher)
    try:
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=[])
    except Exception as exc:  # noqa: BLE001
        log.warning("capacity request not withdrawn: %r", exc)
    if coordinator is not None:
        from moshray.cluster.coordinator.actor import remove

        try:
            remove(coordinator)  # its state saved in the GCS too
        except Exception as exc:  # noqa: BLE001
            log.info("Coordinator not removed: %r", exc)


def _kill(handle) -> None:
    try:
        ray.kill(handle, no_restart=True)
    except Exception as exc:  # noqa: BLE001 - already gone
        log.info("not killed: %r", exc)


def get_or_create(poll_s: float = 0.5):
    """The cluster's ``JobLease`` (detached, on the head node, restarted by Ray if its
    process dies)."""
    return JobLease.options(
        name=LEASE_NAME, namespace=placement.NAMESPACE, lifetime="detached",
        get_if_exists=True, max_restarts=-1, max_concurrency=8, **placement.on_head(),
    ).remote(poll_s)


def find() -> object | None:
    """The cluster's ``JobLease`` if one stands, else None."""
    try:
        return ray.get_actor(LEASE_NAME, namespace=placement.NAMESPACE)
    except ValueError:
        return None
