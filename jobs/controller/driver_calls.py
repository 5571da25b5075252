"""The driver's bounded calls into the running job: the Coordinator and staying replicas.

Every call has a bound and a bounded number of attempts; none raises into the driver's
loop. A Coordinator that is restarting is retried (``call_with_retries``); a replica that
does not answer is skipped for the next staying one (``checkpoint_through_replica``,
``final_state``).

A wait that moves the job's state (a checkpoint save, gigabytes at real model sizes) has no
fixed timeout: it is bounded by the bytes that move (``move_verdict``), from the replica's
own report of its save (``ReplicaActor.move_progress``): the state must be serialized and
sized within ``MoveBounds.start_s``, bytes must keep moving (``stall_s``), and, once a save
of the job was measured (``rate``, its bytes per second), the whole save must end within
``margin`` times its size over that rate, plus ``slack_s``. A wait that ends says the size
and the rate it assumed. The first save is bounded by the stall rule alone: its rate is
what is being measured.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

log = logging.getLogger("moshray.train")


def call_with_retries(method, what: str, attempts: int = 6, timeout_s: float = 30.0):
    """``ray.get(method.remote())`` for a Coordinator that may be restarting: bounded
    retries, None if it never answered (logged)."""
    import ray

    for attempt in range(attempts):
        try:
            return ray.get(method.remote(), timeout=timeout_s)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            log.warning("could not %s (attempt %d: %s)", what, attempt + 1, type(exc).__name__)
            time.sleep(1.0)
    return None


def _staying(controller):
    leaving = controller.leaving()
    return [(peer_id, handle) for peer_id, handle, _ in controller.live()
            if peer_id not in leaving]


def _cause(exc: BaseException) -> str:
    return ((str(exc).strip().splitlines() or [""])[-1])[:300]


@dataclass(frozen=True)
class MoveBounds:
    """How long the driver waits on a move of the job's state (see the module docstring).
    ``rate``: bytes per second an earlier save of this job measured (None: none yet).
    ``limit_s``: an outer deadline of the caller's (e.g. Ray's grace after a stop), or
    None. ``poll_s``: how often the replica is asked how its save goes."""

    start_s: float = 120.0
    stall_s: float = 60.0
    margin: float = 2.0
    slack_s: float = 30.0
    rate: float | None = None
    limit_s: float | None = None
    poll_s: float = 1.0


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def move_verdict(progress: dict | None, waited_s: float, bounds: MoveBounds) -> str | None:
    """Why the driver stops waiting on a state move, in one line, or None to wait on.
    ``progress``: the replica's ``move_progress`` (``done``/``total`` bytes, ``since_s``,
    ``idle_s``; None or ``total`` 0: not sized yet); ``waited_s``: since the driver asked.
    Pure."""
    if bounds.limit_s is not None and waited_s > bounds.limit_s:
        return f"the caller's limit of {bounds.limit_s:g} s passed"
    if progress is None or not progress.get("total"):
        if waited_s > bounds.start_s:
            return f"the state was not serialized and sized within {bounds.start_s:g} s"
        return None
    done, total = progress["done"], progress["total"]
    since, idle = progress["since_s"], progress["idle_s"]
    if idle > bounds.stall_s:
        return f"no byte moved for {idle:.0f} s ({_size(done)} of {_size(total)} written)"
    if bounds.rate:
        expected = total / bounds.rate
        bound = bounds.margin * expected + bounds.slack_s
        if since > bound:
            return (f"{_size(total)} at the {_size(bounds.rate)}/s the last save measured "
                    f"takes ~{expected:.0f} s; its bound of {bound:.0f} s ({bounds.margin:g}x "
                    f"+ {bounds.slack_s:g} s) passed with {_size(done)} written")
    return None


def save_through(handle, uri: str, bounds: MoveBounds = MoveBounds(), who: str = "replica"):
    """Have the replica behind ``handle`` write a checkpoint to ``uri``; wait as
    ``move_verdict`` allows. Returns its ``checkpoint.SaveResult``, or None when the wait
    ended (logged with the reason; the replica's save may still finish). Raises what Ray
    raises for a dead replica."""
    import ray

    ref = handle.save_checkpoint.remote(uri)
    started = time.monotonic()
    last, last_at = None, started
    while True:
        ready, _ = ray.wait([ref], timeout=bounds.poll_s)
        if ready:
            return ray.get(ref)
        now = time.monotonic()
        try:
            last, last_at = ray.get(handle.move_progress.remote(), timeout=10), now
        except (ray.exceptions.RayError, TimeoutError):
            pass  # busy or going: judged by its last report, aged
        aged = None if last is None else {**last, "since_s": last["since_s"] + now - last_at,
                                          "idle_s": last["idle_s"] + now - last_at}
        why = move_verdict(aged, now - started, bounds)
        if why is not None:
            log.warning("checkpoint through %s abandoned: %s", who, why)
            return None


@dataclass(frozen=True)
class Saved:
    """A checkpoint save: ``path`` written (None: not written) after ``tried`` replicas
    were asked (0: no staying replica to ask, which is no failure of the save); ``rate``:
    the bytes per second it measured (None: not written), for the next save's bounds."""

    path: str | None
    tried: int
    rate: float | None = None

    @property
    def failed(self) -> bool:
        return self.tried > 0 and self.path is None


def checkpoint_through_replica(uri: str, controller,
                               bounds: MoveBounds = MoveBounds()) -> Saved:
    """Have the first staying replica that answers write a checkpoint to ``uri`` (each
    waited on as ``save_through`` does); never raises (each failure logged)."""
    import ray

    tried = 0
    for peer_id, handle in _staying(controller):
        tried += 1
        try:
            result = save_through(handle, uri, bounds, peer_id)
            if result is None:
                continue
            if not result.ok:  # a checkpoint.SaveResult: full disk, storage error, ...
                log.warning("checkpoint through %s failed: %s", peer_id, result)
                continue
            log.info("checkpoint %s written by %s (%s in %.1f s)", result.location, peer_id,
                     _size(result.bytes), result.seconds)
            rate = result.bytes / result.seconds if result.bytes and result.seconds else None
            return Saved(result.location, tried, rate)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            log.warning("checkpoint through %s failed: %s %s", peer_id, type(exc).__name__,
                        _cause(exc))
    return Saved(None, tried)


def final_state(controller, steps: int) -> dict | None:
    """The state of a staying replica that holds the run's last step ``steps`` (None if
    none answers)."""
    import ray

    for peer_id, handle in _staying(controller):
        try:
            epoch, [ref] = ray.get(handle.get_state.remote(), timeout=60)
            if epoch == steps:
                return ray.get(ref, timeout=60)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            log.warning("final state of %s not read (%s)", peer_id, type(exc).__name__)
    return None
