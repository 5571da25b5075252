"""How the chaos bench and the tests break a running replica, from outside production code.

The production ``ReplicaActor`` has no fault-injection method. A harness reaches into one
replica's process through Ray's generic ``__ray_call__`` (a function run on the actor
instance, as an operator's debugger would) or wraps the user's loop before the job starts:

- ``set_replica_fault(handle, "nan" | "shape" | None)``: the replica's averager is wrapped
  in a ``FaultyAverager`` (defined here, never in production code) that feeds NaN values
  or one-element-too-long contributions into the unmodified collective until reset to
  None (the wrapper is taken off again);
- ``chaos_job(job, witness_dir)``: the same ``Job`` whose loop raises ``ChaosUserError``
  from ``session.batches()`` once ``order_user_error(handle)`` was called on that replica
  (a bug in the user's loop or data, as a user's code would raise it), leaving a file that
  says so (``user_error_witnessed``);
- ``process_pid(handle)``: the process to SIGKILL for a replica (or Coordinator) killed
  without its node;
- ``SmallDisk``: a small tmpfs (root only) for the job's checkpoints that ``fill()`` makes
  full and ``free()`` frees again; ``save_through(handle, uri)`` has a replica save a
  checkpoint through the production path meanwhile.

Every call is bounded by ``timeout_s`` and raises what Ray raises (``RayActorError`` for a
dead actor, ``GetTimeoutError``); ``ValueError`` for an unknown fault.

What ``__ray_call__`` means for the threat model: anyone who holds the cluster's token can
run any code in any actor (read its memory, its job key, replace its objects, as these
helpers do); Ray offers no per-actor access control. The job key
(``cluster/collective/auth.py``) protects a job's collective against processes that can
reach its actors and the object store but do not hold the key, not against the cluster's
operator.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from dataclasses import replace

REPLICA_FAULTS = (None, "nan", "shape")
_ORDER = "_chaos_user_error"  # on the replica's step manager: raise at the next batch
_RAISED = "_chaos_user_error_at"  # ... and when it did (the harness's observation)


class ChaosUserError(RuntimeError):
    """What a chaos-wrapped user loop raises once when told to (not a ``UserError``: the
    job treats it as any bug in the user's code)."""


def _call(handle, fn, timeout_s: float):
    import ray

    return ray.get(handle.__ray_call__.remote(fn), timeout=timeout_s)


class FaultyAverager:
    """A replica's ``Averager`` whose ``all_reduce`` sends ``fault`` contributions (test
    only): ``"nan"``: every value NaN; ``"shape"``: one extra element (peers reject it as a
    shape mismatch; the extra value is dropped from what comes back). Everything else,
    the transport methods included, goes to the wrapped averager unchanged, so the round
    under test is the production one. ``inner``: the wrapped averager."""

    def __init__(self, inner, fault: str):
        if fault not in REPLICA_FAULTS or fault is None:
            raise ValueError(f"unknown fault {fault!r}: use 'nan' or 'shape'")
        self.inner, self.fault = inner, fault

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def all_reduce(self, tensors, weight, plan, timeout):
        import torch

        tensors = list(tensors)
        if self.fault == "nan":
            tensors = [torch.full_like(torch.as_tensor(t), float("nan")) for t in tensors]
        else:
            tensors.append(torch.zeros(1))
        averaged, report = await self.inner.all_reduce(tensors, weight, plan, timeout)
        if self.fault == "shape":
            averaged = averaged[:-1]
        return averaged, report


def set_replica_fault(handle, fault: str | None, timeout_s: float = 30.0) -> None:
    """Make the replica behind ``handle`` send ``fault`` contributions from its next step
    on (None: healthy again), by wrapping its averager in a ``FaultyAverager`` (or taking
    the wrapper off)."""
    if fault not in REPLICA_FAULTS:
        raise ValueError(f"unknown fault {fault!r}: use 'nan', 'shape' or None")

    def apply(actor):
        manager = actor.manager
        inner = getattr(manager.averager, "inner", manager.averager)
        manager.averager = inner if fault is None else FaultyAverager(inner, fault)

    _call(handle, apply, timeout_s)


def process_pid(handle, timeout_s: float = 30.0) -> int:
    """The pid of the process behind an actor ``handle`` (a replica, the Coordinator)."""
    return _call(handle, lambda actor: os.getpid(), timeout_s)


def order_user_error(handle, timeout_s: float = 30.0) -> None:
    """Tell a replica started from ``chaos_job`` to raise ``ChaosUserError`` at its next
    batch (once)."""

    def order(actor):
        setattr(actor.manager, _ORDER, True)

    _call(handle, order, timeout_s)


def user_error_raised(handle, timeout_s: float = 30.0) -> float | None:
    """When (``time.time()`` on its node) the replica raised the ordered error; None if it
    has not yet."""
    return _call(handle, lambda actor: getattr(actor.manager, _RAISED, None), timeout_s)


def user_error_witnessed(witness_dir: str, peer_id: str) -> float | None:
    """When ``peer_id``'s loop raised the ordered error, from the file ``chaos_job`` wrote
    (None: not yet)."""
    try:
        return float(Path(witness_dir, peer_id).read_text())
    except (OSError, ValueError):
        return None


def chaos_job(job, witness_dir: str | None = None):
    """``job`` (an ``actors.replica.actor.Job``) whose loop sees a ``session.batches`` that
    raises ``ChaosUserError`` once ordered (``order_user_error``). With ``witness_dir`` (an
    absolute path every node can write: the nodes share this machine's filesystem) the loop
    also writes the time it raised into ``<witness_dir>/<peer id>`` first, which outlives
    the replica the controller replaces at once (``user_error_witnessed``)."""
    loop = job.loop

    def chaos_loop(session):
        batches = session.batches
        manager = session.manager

        def wrapped_batches(*args, **kwargs):
            for batch in batches(*args, **kwargs):
                if getattr(manager, _ORDER, False):
                    setattr(manager, _ORDER, False)
                    setattr(manager, _RAISED, time.time())
                    if witness_dir is not None:
                        Path(witness_dir, session.peer_id).write_text(repr(time.time()))
                    raise ChaosUserError(f"chaos: {session.peer_id}'s loop raises once")
                yield batch

        session.batches = wrapped_batches
        return loop(session)

    return replace(job, loop=chaos_loop)


# --------------------------------------------------------------------------- a full disk

SMALL_DISK_BYTES = 32 * 1024 * 1024  # room for the bench model's checkpoints (~1 MB each)


def small_disk_refusal() -> str | None:
    """Why a small disk cannot be mounted here (None: it can): it takes root and
    ``mount``."""
    import shutil

    if os.geteuid() != 0:
        return "mounting a small disk for the checkpoints needs root"
    if shutil.which("mount") is None or shutil.which("umount") is None:
        return "mounting a small disk for the checkpoints needs mount(8) and umount(8)"
    return None


class SmallDisk:
    """A tmpfs of ``size`` bytes mounted at ``path`` (created), for checkpoints that can
    run out of space: ``fill()`` takes every free byte, ``free()`` gives them back.
    ``close()`` unmounts it (also as a context manager). Raises ``OSError`` with mount's
    message if it cannot be mounted."""

    def __init__(self, path: str, size: int = SMALL_DISK_BYTES) -> None:
        import subprocess

        self.path = path
        os.makedirs(path, exist_ok=True)
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                              capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            raise OSError(f"mount tmpfs at {path}: {proc.stderr.strip() or proc.returncode}")
        self._filler = os.path.join(path, ".chaos-filler")

    def fill(self) -> int:
        """Write a filler file until the disk is full; returns the bytes it took."""
        import errno

        block, written = b"\0" * (1 << 20), 0
        with open(self._filler, "wb", buffering=0) as out:
            while True:
                try:
                    written += out.write(block)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    if len(block) == 1:
                        return written
                    block = block[: len(block) // 2]

    def free(self) -> None:
        """Remove the filler (no-op when there is none)."""
        try:
            os.remove(self._filler)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unmount (lazily if busy: a replica may still hold a file open)."""
        import subprocess

        self.free()
        proc = subprocess.run(["umount", self.path], capture_output=True, text=True,
                              timeout=30)
        if proc.returncode != 0:
            subprocess.run(["umount", "-l", self.path], capture_output=True, timeout=30)

    def __enter__(self) -> "SmallDisk":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def save_through(handle, uri: str, timeout_s: float = 60.0):
    """Have the replica behind ``handle`` write a checkpoint to ``uri`` through the
    production path (``ReplicaActor.save_checkpoint``); returns its ``SaveResult``."""
    import ray

    return ray.get(handle.save_checkpoint.remote(uri), timeout=timeout_s)
