"""The driver's bounded calls into the running job: the Coordinator and staying replicas.

Every call has a timeout and a bounded number of attempts; none raises into the driver's
loop. A Coordinator that is restarting is retried (``call_with_retries``); a replica that
does not answer is skipped for the next staying one (``checkpoint_through_replica``,
``final_state``).
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
class Saved:
    """A checkpoint save: ``path`` written (None: not written) after ``tried`` replicas
    were asked (0: no staying replica to ask, which is no failure of the save)."""

    path: str | None
    tried: int

    @property
    def failed(self) -> bool:
        return self.tried > 0 and self.path is None


def checkpoint_through_replica(uri: str, controller, timeout_s: float = 60.0) -> Saved:
    """Have the first staying replica that answers write a checkpoint to ``uri`` (each
    asked for at most ``timeout_s``); never raises (each failure logged)."""
    import ray

    tried = 0
    for peer_id, handle in _staying(controller):
        tried += 1
        try:
            result = ray.get(handle.save_checkpoint.remote(uri), timeout=timeout_s)
            if not result.ok:  # a checkpoint.SaveResult: full disk, storage error, ...
                log.warning("checkpoint through %s failed: %s", peer_id, result)
                continue
            log.info("checkpoint %s written by %s", result.location, peer_id)
            return Saved(result.location, tried)
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
