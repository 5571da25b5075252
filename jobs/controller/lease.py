"""The job outlives its driver: a lease the driver renews, held by an actor that is not the
driver's.

Why this shape. A driver is one process that ``ray job stop`` SIGKILLs three seconds after
its SIGTERM, that a laptop's sleep or an OOM ends, and whose death Ray turns into the death
of everything it owns. So nothing the run needs is owned by it:

- the replicas are *detached* named actors (``moshray-replica:<run id>:<replica id>`` in
  the ``moshray`` namespace), so they keep training through the driver's death (their
  ``run()`` goes on; a later driver awaits it with ``wait_run``);
- the Coordinator already is detached and named after the job
  (``placement.coordinator_name``), and keeps the step history the summary is made from;
- the job's own state (run id, config fingerprint, the replicas and their nodes, the
  watchers it started, the newest checkpoint's step) lives in the job's ``JobLease``
  (``moshray-job-lease:<job name>``), a detached actor on the head node, mirrored into Ray's
  GCS key-value store under ``moshray/job-record/<job name>`` (a restarted ``JobLease`` reads
  it back).

Jobs run side by side: every name has its own lease, Coordinator, replicas and share of the
capacity asked of Ray's autoscaler (``request_capacity``: Ray keeps one request per
cluster, so each job's bundles are kept under ``moshray/capacity/<job name>`` and Ray is
asked for their sum). ``list_jobs`` reads every job's record (``moshray jobs``).

The driver renews the lease from a thread of its own (``LeaseKeeper``), every quarter of
``cluster.driver_lease_s`` (at most every 5 s), with the job's state as the controller last
published it: a supervision tick that blocks (a checkpoint save of gigabytes, a drain, the
end of a run) delays no renewal. A resubmitted driver with the same config
(``fingerprint``) finds the record and, when the driver holding it is dead (Ray's job
table says so), *adopts* the swarm: the same Coordinator, the same replicas, no step lost
(``decide_claim``). A job of the same name whose driver lives is never touched: the new
submission is refused (``Refuse``, one line). A swarm of the same name that was stopping, or
ran another config, is ended first. No job ever ends a job of another name. Nothing leaks,
and a live job is never reaped:
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
LEASE_PREFIX = "moshray-job-lease"
KV_PREFIX = "moshray/job-record/"
CAPACITY_PREFIX = "moshray/capacity/"
WATCHERS_PREFIX = "moshray/job-watchers/"
REPLICA_PREFIX = "moshray-replica"


def lease_name(job: str) -> str:
    """The Ray actor name (namespace ``placement.NAMESPACE``) of job ``job``'s lease."""
    return f"{LEASE_PREFIX}:{job}"


def replica_actor_name(run_id: str, replica_id: str) -> str:
    """The detached replica's Ray actor name (namespace ``placement.NAMESPACE``)."""
    return f"{REPLICA_PREFIX}:{run_id}:{replica_id}"


def fingerprint(config_dict: dict) -> str:
    """What makes a resubmission of a name the same job: the model, training (but its
    bounds), data and checkpoint sections and ``run_dir``; not its address or output format.
    Pure."""
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
    checkpoint's step; ``stopping``: the driver was told to stop (SIGTERM);
    ``name``: the job's name; ``stop_requested``: ``moshray stop`` asked the driver to end the
    job (it ends as at its time limit)."""

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
    name: str = ""
    stop_requested: bool = False


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
    """No job of this name runs."""


@dataclass(frozen=True)
class Refuse:
    """A job of this name runs with a live driver: the new submission stops (``reason``,
    one line) and touches nothing."""

    reason: str


def decide_claim(record: JobRecord | None, me: str, fingerprint_: str,
                 holder_alive: bool) -> Adopt | Replace | Fresh | Refuse:
    """What a driver (Ray job id ``me``) starting a job of ``fingerprint_`` does with the
    ``record`` of the job of its name. Pure. A live driver's job is never ended: refused.
    Adopt only the same job whose driver is gone (or is this very driver, e.g. a second
    ``fit`` in one process after an error left it) and that was not told to stop; a
    stopping swarm, or one of another config, is replaced."""
    if record is None:
        return Fresh()
    if holder_alive and record.holder != me:
        return Refuse(f"a job named {record.name or record.run_id!r} is running (its driver "
                      f"is Ray job {record.holder}): end it with `moshray stop "
                      f"{record.name or record.run_id}`, or give this job another name")
    if record.stopping:
        return Replace("the previous job of this name was stopping")
    if record.fingerprint != fingerprint_:
        return Replace("the previous job of this name ran another config")
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
    reaper ended the swarm), ``STOP_REQUESTED`` if it stands and ``moshray stop`` asked the
    job to end (``stop_requested`` turns True: the driver ends the run as at its time
    limit); an exception is a failed attempt (logged; a lease restarting is renewed on the
    next). After a False, ``ended`` is True and the thread stops: the controller raises
    ``JobFailed`` on its next tick. ``stop`` ends the thread (bounded);
    the driver stops it before it releases the lease. Nothing is renewed before the first
    ``publish``. One renewal at a time (the thread's and ``renew_now``'s), each with the
    state published last when it starts: an older state never lands after a newer one
    (e.g. the record without a replica about to be launched, after the renewal with it)."""

    def __init__(self, renew, interval_s: float, name: str = "lease-keeper"):
        self._renew = renew
        self.interval_s = interval_s
        self._state: JobState | None = None
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._renewing = threading.Lock()  # one renewal at a time (see the class docstring)
        self.ended = False
        self.stop_requested = False
        self.renewals = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._thread.start()

    def publish(self, state: JobState) -> None:
        """The job's state now; the first one is renewed at once, later ones on schedule."""
        first = self._state is None
        self._state = state
        if first:
            self._wake.set()

    def renew_now(self, state: JobState | None = None) -> bool:
        """Publish ``state`` (if given) and renew with the state published last, in the
        caller's thread (bounded by ``renew``), before the caller goes on: e.g. a replica
        in the record before it is launched, so that a driver dying right after the launch
        leaves it to the lease. False if the lease ended or the renewal failed (logged)."""
        if state is not None:
            self.publish(state)
        with self._renewing:
            state = self._state
            if state is None or self.ended:
                return False
            try:
                if self._answer(self._renew(state)):
                    return True
                self.ended = True
            except Exception as exc:  # noqa: BLE001 - a lease restarting
                log.warning("lease not renewed: %r", exc)
            return False

    def _answer(self, answer) -> bool:
        if answer == STOP_REQUESTED:
            self.stop_requested = True
        return bool(answer)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopped.set()
        self._wake.set()
        self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        while not self._stopped.is_set():
            with self._renewing:
                if self.ended:
                    return
                state = self._state
                if state is not None:
                    try:
                        if not self._answer(self._renew(state)):
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


STOP_REQUESTED = "stop"  # a renewal's answer: the lease stands, and the job is to end


@ray.remote
class JobLease:
    """See the module docstring. Create with ``get_or_create``; every method is bounded.
    ``job``: the job's name (its record's key)."""

    def __init__(self, job: str, poll_s: float = 0.5, clock=time.monotonic):
        self.key = (KV_PREFIX + job).encode()
        self.clock = clock
        self.poll_s = poll_s
        self.lock = threading.RLock()
        self.record: JobRecord | None = self._load()
        self.renewed_at = clock()  # a restarted lease gives the driver a full term
        self.ended: str | None = None
        threading.Thread(target=self._reaper, daemon=True, name="lease-reaper").start()

    # -- the record ---------------------------------------------------------------------------

    def _load(self) -> JobRecord | None:
        from ray.experimental.internal_kv import _internal_kv_get

        raw = _internal_kv_get(self.key)
        return pickle.loads(raw) if raw else None

    def _store(self) -> None:
        from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_put

        if self.record is None:
            _internal_kv_del(self.key)
        else:
            _internal_kv_put(self.key, pickle.dumps(self.record), overwrite=True)

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

    def renew(self, state: JobState) -> bool | str:
        """The holder is alive; the job's state as it is now. False if there is no record
        (the lease ended the swarm: the driver should stop); ``STOP_REQUESTED`` if
        ``moshray stop`` asked the job to end; else True."""
        with self.lock:
            if self.record is None:
                return False
            record = renewed(self.record, state)
            self.renewed_at = self.clock()
            if record != self.record:  # the GCS mirror is written when the state changed
                self.record = record
                self._store()
            return STOP_REQUESTED if record.stop_requested else True

    def request_stop(self) -> bool:
        """``moshray stop``: the driver is to end the job as at its time limit (final
        checkpoint, summary, everything released); it hears so at its next renewal.
        Returns whether there was a job to stop."""
        with self.lock:
            if self.record is None:
                return False
            self.record = replace(self.record, stop_requested=True)
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
        coordinator = ray.get_actor(placement.coordinator_name(record.name),
                                    namespace=placement.NAMESPACE)
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
    try:
        release_watchers(record.name, {})
    except Exception as exc:  # noqa: BLE001
        log.warning("watchers not released: %r", exc)
    try:
        withdraw_capacity(record.name)
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


def get_or_create(job: str, poll_s: float = 0.5):
    """Job ``job``'s ``JobLease`` (detached, on the head node, restarted by Ray if its
    process dies)."""
    return JobLease.options(
        name=lease_name(job), namespace=placement.NAMESPACE, lifetime="detached",
        get_if_exists=True, max_restarts=-1, max_concurrency=8, **placement.on_head(),
    ).remote(job, poll_s)


def find(job: str) -> object | None:
    """Job ``job``'s ``JobLease`` if one stands, else None."""
    try:
        return ray.get_actor(lease_name(job), namespace=placement.NAMESPACE)
    except ValueError:
        return None


# -- the cluster's jobs ------------------------------------------------------------------------

def list_jobs() -> dict[str, JobRecord]:
    """``{name: record}`` of every job whose lease holds a record (running, or its driver
    gone and not yet reaped), from the GCS. Needs a connected driver."""
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_list

    jobs = {}
    for key in _internal_kv_list(KV_PREFIX.encode()):
        raw = _internal_kv_get(key)
        if raw:
            jobs[key.decode()[len(KV_PREFIX):]] = pickle.loads(raw)
    return dict(sorted(jobs.items()))


def mark_job_watcher(node_id: str) -> None:
    """A job started ``node_id``'s watcher (``open_watcher`` created it): jobs own it
    together, and the last job to end removes it (``release_watchers``). A node's own
    watcher (``moshray watch``) is never marked."""
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put((WATCHERS_PREFIX + node_id).encode(), b"1", overwrite=True)


def release_watchers(job: str, own: dict, timeout_s: float = 10.0) -> int:
    """Job ``job`` ends: the watchers jobs started serve every job (a watcher tells each
    job's Coordinator), so while another job runs they stay; the last job to end stops and
    removes them all (``own``: node id -> watcher handles this job holds; the rest are
    looked up). Returns how many were removed. Raises what Ray raises on a failed read."""
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_list

    from moshray.autoscaler.watch.watcher import close_watchers, get_watcher

    others = set(list_jobs()) - {job}
    if others:
        log.info("job %s: watchers left to the jobs still running (%s)", job,
                 ", ".join(sorted(others)))
        return 0
    watchers = dict(own)
    for key in _internal_kv_list(WATCHERS_PREFIX.encode()):
        node_id = key.decode()[len(WATCHERS_PREFIX):]
        if node_id not in watchers:
            handle = get_watcher(node_id)
            if handle is not None:
                watchers[node_id] = handle
        _internal_kv_del(key)
    close_watchers(watchers, timeout_s)
    return len(watchers)


def _capacity_sum() -> list[dict]:
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_list

    bundles: list[dict] = []
    for key in sorted(_internal_kv_list(CAPACITY_PREFIX.encode())):
        raw = _internal_kv_get(key)
        if raw:
            bundles.extend(json.loads(raw))
    return bundles


def request_capacity(job: str, bundles: list[dict]) -> list[dict]:
    """Job ``job`` wants ``bundles`` (Ray resource dicts) from Ray's autoscaler. Ray keeps one
    request per cluster (``request_resources`` replaces the last), so this job's share is
    kept in the GCS and Ray is asked for every job's sum, which is returned. Two jobs asking
    at once may each ask Ray for a sum without the other's newest share: each job asks again
    whenever its own share changes and the last ask holds every share written before it.
    Raises what Ray raises."""
    from ray.autoscaler.sdk import request_resources
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put((CAPACITY_PREFIX + job).encode(), json.dumps(list(bundles)),
                     overwrite=True)
    total = _capacity_sum()
    request_resources(bundles=total)
    return total


def withdraw_capacity(job: str) -> list[dict]:
    """Job ``job`` wants nothing more: its share is deleted and Ray is asked for the other
    jobs' (returned). Idempotent. Raises what Ray raises."""
    from ray.autoscaler.sdk import request_resources
    from ray.experimental.internal_kv import _internal_kv_del

    _internal_kv_del((CAPACITY_PREFIX + job).encode())
    total = _capacity_sum()
    request_resources(bundles=total)
    return total
