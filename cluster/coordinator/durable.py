"""Where the Coordinator's state survives its process: a key-value store and what goes in it.

Ray restarts a dead Coordinator (``max_restarts=-1``) with empty memory. What the summary,
the plans and the quarantine need is written, after every call that changed it and before
the call's reply leaves, to Ray's GCS internal key-value store (``GcsKV``), which outlives
the actor (and its node, but not the head's GCS), under one prefix per Coordinator
(``get_or_create`` makes it once; a restart gets the same constructor arguments):

- small records, written through when their JSON changes: ``core`` (the Coordinator's
  start time, its history id, restarts), ``steps`` (rollbacks, abandoned plans, stale
  returns, the history's branch and forks, the stop flag, quarantine records, draining
  marks), ``notices``, ``shards`` (the data position) and ``sink`` (counts of the metrics
  sink); a record object passed again unchanged (the same object, or an equal one) is
  not even encoded again, so a call that changed nothing costs no JSON;
- ``members`` (every member's id, and the peers a restarted Coordinator still awaits):
  written behind, as the lazy records below, so joins and leaves cost one write per
  ``flush_s``, not one each. What that window can lose is covered: a peer that joined
  since is heard from by a restarted Coordinator (its heartbeat is answered "unknown",
  so it is awaited), and one that left since is awaited until it has been silent for
  the hold time, as a member that died unnoticed is;
- two append logs cut into chunks of fixed size, of which only the chunk(s) that changed
  are rewritten: the step history (a row per global step; the last ``KEEP_EPOCHS`` rows
  may still be corrected) and the step profile (a ``StepPhases`` per replica and step;
  chunks that fell out of the profile's window are deleted).

Writes that come with every report are written behind, at most every ``flush_s``: a
history row's corrected sample count (a new row is written at once, and with it every
correction before it), the newest step known committed (``lazy`` records; the driver
also tells a restarted Coordinator, ``note_committed``) and the step profile. A kill
loses at most ``flush_s`` of those (and of the members), never a row, a notice, a drain, a
quarantine or a shard. So a global step costs about two writes (its history chunk and the
``progress`` record), plus one of ``members`` per ``flush_s`` while peers come and go,
bounded whatever the run's length and the swarm's size. ``MemoryKV`` is the same store in
a dict, for pure tests. Failures: a ``GcsKV`` write raises what Ray raises (the caller logs
it and tries again at the next call, since a record is rewritten until the stored JSON
matches).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Collection, Sequence
from dataclasses import asdict
from typing import Protocol

from moshray.cluster.coordinator.progress import StepRecord
from moshray.cluster.coordinator.step_profile import StepPhases
from moshray.cluster.coordinator.step_samples import KEEP_EPOCHS

KV_NAMESPACE = "moshray-coordinator"  # the GCS key-value namespace of every Coordinator
HISTORY_CHUNK = 64  # step-history rows per stored chunk
PROFILE_CHUNK = 32  # StepPhases per stored chunk
FLUSH_S = 1.0  # written-behind data is at most this old in the store


class KeyValue(Protocol):
    """A byte store (``GcsKV`` on a cluster, ``MemoryKV`` in tests)."""

    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, value: bytes) -> None: ...

    def delete(self, key: str) -> None: ...

    def delete_prefix(self, prefix: str) -> None: ...


class MemoryKV:
    """``KeyValue`` in a dict; ``puts`` / ``put_bytes`` count the writes."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.puts = 0
        self.put_bytes = 0

    def get(self, key: str) -> bytes | None:
        return self.data.get(key)

    def put(self, key: str, value: bytes) -> None:
        self.data[key] = bytes(value)
        self.puts += 1
        self.put_bytes += len(value)

    def delete(self, key: str) -> None:
        self.data.pop(key, None)

    def delete_prefix(self, prefix: str) -> None:
        for key in [k for k in self.data if k.startswith(prefix)]:
            del self.data[key]


class GcsKV:
    """``KeyValue`` in Ray's GCS internal key-value store, namespace ``KV_NAMESPACE``. Needs
    a connected Ray worker or driver; raises what Ray raises if the GCS does not answer."""

    def __init__(self, namespace: str = KV_NAMESPACE):
        self.namespace = namespace

    def get(self, key: str) -> bytes | None:
        from ray.experimental.internal_kv import _internal_kv_get

        return _internal_kv_get(key, namespace=self.namespace)

    def put(self, key: str, value: bytes) -> None:
        from ray.experimental.internal_kv import _internal_kv_put

        _internal_kv_put(key, value, overwrite=True, namespace=self.namespace)

    def delete(self, key: str) -> None:
        from ray.experimental.internal_kv import _internal_kv_del

        _internal_kv_del(key, namespace=self.namespace)

    def delete_prefix(self, prefix: str) -> None:
        from ray.experimental.internal_kv import _internal_kv_del

        _internal_kv_del(prefix, del_by_prefix=True, namespace=self.namespace)


def _dump(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _phases_row(p: StepPhases) -> dict:
    return asdict(p)


def _phases(row: dict) -> StepPhases:
    row = dict(row)
    row["round_phases"] = tuple((str(n), float(s)) for n, s in row.get("round_phases", ()))
    return StepPhases(**row)


class DurableState:
    """The Coordinator's records and logs under ``prefix`` in ``kv`` (see the module
    docstring). Not thread-safe: the actor's lock serializes its calls."""

    def __init__(self, kv: KeyValue, prefix: str, history_chunk: int = HISTORY_CHUNK,
                 profile_chunk: int = PROFILE_CHUNK, flush_s: float = FLUSH_S):
        if not prefix or history_chunk < 1 or profile_chunk < 1 or not flush_s >= 0:
            raise ValueError(f"need a prefix, chunk sizes >= 1 and flush_s >= 0, got "
                             f"{prefix!r}, {history_chunk}, {profile_chunk}, {flush_s}")
        self.kv, self.prefix = kv, prefix.rstrip("/") + "/"
        self.history_chunk, self.profile_chunk = history_chunk, profile_chunk
        self.flush_s = flush_s
        self._records: dict[str, bytes] = {}  # name -> the JSON last written
        self._objs: dict[str, object] = {}  # name -> the object that JSON was made of
        self._written_at: dict[str, float] = {}  # record or log -> when last written
        # the history's tail rows last written (the objects: a rewritten row is a new one)
        self._history_seen: list[StepRecord] = []
        self._history_len = 0
        self._profile_saved = 0  # StepPhases written (a global count)

    # -- records -----------------------------------------------------------------------------

    def save_record(self, name: str, obj: dict, now: float = 0.0, lazy: bool = False) -> bool:
        """Write ``obj`` as record ``name`` if its JSON changed (``lazy``: and the last
        write is ``flush_s`` older than ``now``); True if written. ``obj`` is not encoded
        when it is the object last saved as ``name`` or equal to it, so the caller must
        not change an object after passing it (a fresh or a cached, unchanged one)."""
        if lazy and not self.due(name, now):
            return False
        last = self._objs.get(name)
        if last is not None and (obj is last or obj == last):
            return False
        data = _dump(obj)
        if self._records.get(name) != data:
            self.kv.put(self.prefix + name, data)
            self._records[name] = data
            self._written_at[name] = now
            self._objs[name] = obj
            return True
        self._objs[name] = obj
        return False

    def due(self, name: str, now: float) -> bool:
        """A lazy record or log ``name`` may be written at ``now`` (its last write is
        ``flush_s`` old, or there was none)."""
        return now - self._written_at.get(name, float("-inf")) >= self.flush_s

    def load_record(self, name: str) -> dict | None:
        data = self.kv.get(self.prefix + name)
        self._objs.pop(name, None)
        if data is None:
            return None
        self._records[name] = bytes(data)
        return json.loads(data)

    # -- the step history --------------------------------------------------------------------

    def sync_history(self, history: Sequence[StepRecord], now: float = 0.0) -> int:
        """Write the chunks of ``history`` that changed since the last write (rows are
        appended, and only the last ``KEEP_EPOCHS`` may be rewritten): at once when a row
        was appended, else once the last write is ``flush_s`` old; returns how many chunks
        were written."""
        if not self._new_row(history) and not self.due("history", now):
            return 0
        tail_from = max(0, len(history) - KEEP_EPOCHS - 1)
        tail = list(history[tail_from:])
        old = dict(zip(range(self._history_len - len(self._history_seen), self._history_len),
                       self._history_seen))
        changed = [i for i, r in enumerate(tail, tail_from) if old.get(i) is not r]
        if not changed and len(history) == self._history_len:
            # nothing to write: look again ``flush_s`` from now (a correction made
            # meanwhile is written then, within ``flush_s``), not at every call
            self._written_at["history"] = now
            return 0
        if len(history) < self._history_len:  # rows dropped (not expected): rewrite the tail
            changed.append(max(0, len(history) - 1))
        written = 0
        for c in sorted({i // self.history_chunk for i in changed}):
            rows = history[c * self.history_chunk:(c + 1) * self.history_chunk]
            self.kv.put(f"{self.prefix}history/{c}",
                        _dump([[h.epoch, h.at_s, h.samples, h.loss, h.peers] for h in rows]))
            written += 1
        self._history_len, self._history_seen = len(history), tail
        self._written_at["history"] = now
        return written

    def _new_row(self, history: Sequence[StepRecord]) -> bool:
        """A row was added (or replaced by a newer plan's) since the last write; a
        correction keeps the row's epoch and time."""
        if len(history) != self._history_len:
            return True
        if not history or not self._history_seen:
            return False
        last, seen = history[-1], self._history_seen[-1]
        return (last.epoch, last.at_s) != (seen.epoch, seen.at_s)

    def load_history(self) -> list[StepRecord]:
        """Every row written, up to the first missing or partial chunk (the last one)."""
        rows: list[StepRecord] = []
        for c in itertools.count():
            data = self.kv.get(f"{self.prefix}history/{c}")
            if data is None:
                break
            chunk = json.loads(data)
            rows.extend(StepRecord(int(e), float(at), int(n), loss, int(peers))
                        for e, at, n, loss, peers in chunk)
            if len(chunk) < self.history_chunk:
                break
        tail_from = max(0, len(rows) - KEEP_EPOCHS - 1)
        self._history_len, self._history_seen = len(rows), rows[tail_from:]
        return rows

    # -- the step profile --------------------------------------------------------------------

    def sync_profile(self, steps: Collection[StepPhases], total: int, keep: int,
                     now: float = 0.0) -> int:
        """``steps`` are the last rows of ``total`` ever added (a window of ``keep``): once
        the last write is ``flush_s`` old, write the chunks holding rows added since, and
        delete chunks that left the window; returns how many chunks were written."""
        if total <= self._profile_saved or not self.due("profile", now):
            return 0
        first = total - len(steps)  # the global index of steps[0]
        written = 0
        for c in range(self._profile_saved // self.profile_chunk,
                       (total - 1) // self.profile_chunk + 1):
            lo = max(c * self.profile_chunk, first)
            rows = itertools.islice(steps, lo - first, (c + 1) * self.profile_chunk - first)
            self.kv.put(f"{self.prefix}profile/{c}",
                        _dump([lo, [_phases_row(p) for p in rows]]))
            written += 1
        gone = max(0, total - keep) // self.profile_chunk  # chunks below are out of the window
        for c in range(max(0, self._profile_saved - keep) // self.profile_chunk, gone):
            self.kv.delete(f"{self.prefix}profile/{c}")
        self._profile_saved = total
        self._written_at["profile"] = now
        return written

    def load_profile(self, total: int, keep: int) -> list[StepPhases]:
        """The last ``keep`` of the ``total`` rows written (those found)."""
        start = max(0, total - keep)
        out: list[StepPhases] = []
        for c in range(start // self.profile_chunk, (total - 1) // self.profile_chunk + 1
                       if total else 0):
            data = self.kv.get(f"{self.prefix}profile/{c}")
            if not data:
                continue
            lo, rows = json.loads(data)
            out.extend(_phases(r) for i, r in enumerate(rows, lo) if start <= i < total)
        self._profile_saved = total
        return out

    def clear(self) -> None:
        """Delete everything under the prefix (the job is over)."""
        self.kv.delete_prefix(self.prefix)
        self._records.clear()
        self._objs.clear()
        self._history_len, self._history_seen, self._profile_saved = 0, [], 0
        self._written_at.clear()
