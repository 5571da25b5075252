"""Durable checkpoints that load no code, belong to one run and are visible only when whole.

Layout under ``<uri>/<run_id>/`` (one directory per run: two jobs never read each other's
checkpoints unless one is told to, see ``run_location``)::

    ckpt-{step:09d}-{write_id}.part{i:03d}       the payload, in parts of <= part_bytes
    ckpt-{step:09d}-{write_id}.manifest.json     written last: names the parts

The payload is ``torch.save`` of the state after ``encode_state`` (tensors and plain types
only; numpy arrays become tagged bytes), and it is read back with
``torch.load(weights_only=True)``, which refuses to build any object that is not a tensor
or a plain type: a file planted under the prefix cannot run code on the reader.

Manifest-last: the parts are written under names no reader trusts, then the manifest (the
run id, the step, the write time, each part's size and sha256, and the job's config when the
state carries one) makes them one checkpoint. A job that resumes reads only manifests on its
driver (``resume_point``: the step and the config to check); its replicas read the state.
Locally the manifest is written under a temporary name and renamed; on S3/GCS it is one
PUT, atomic per object, so nothing is ever copied or moved there (a single CopyObject
cannot move an object over 5 GiB). A reader trusts only parts a manifest of its own run
names, and only when their sizes and checksums match.

Retention keeps the manifest just written plus the ``keep - 1`` newest others of this run
by write time (never by step number, so a foreign, corrupt or renumbered file cannot make
a save delete what it just wrote); it deletes a dropped manifest before its parts, and
removes parts no manifest names and ``.tmp`` files once they are older than ``stale_s``.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import pickle
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow.fs as pafs
import torch

__all__ = ["CheckpointStore", "FORMAT", "FORMAT_VERSION", "SaveResult", "check_run_id",
           "config_mismatch", "decode_state", "encode_state", "job_run_id", "load_resumed",
           "resume_point",
           "run_location", "save_to"]

log = logging.getLogger(__name__)

FORMAT = "moshray-checkpoint"
FORMAT_VERSION = 2
PART_BYTES = 512 * 1024 * 1024  # far under S3's 5 GiB per PUT and pyarrow's upload limits
WRITE_BYTES = 8 * 1024 * 1024  # a part is written (and its progress reported) in these
STALE_S = 3600.0  # an unnamed part or a .tmp file older than this is a crashed writer's
_MANIFEST = re.compile(r"^ckpt-(\d{9})-([0-9a-f]{12})\.manifest\.json$")
_PART = re.compile(r"^ckpt-(\d{9})-([0-9a-f]{12})\.part(\d{3})$")
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_NDARRAY = "__ndarray__"  # the tag of an encoded numpy array
_PLAIN = (str, int, float, bool, bytes, type(None), torch.dtype, torch.device, torch.Size)
# What torch.load raises on bytes it cannot or will not load (weights_only refusals are
# UnpicklingError); the checksum matched, so these are what was written.
_UNPICKLE_ERRORS = (pickle.UnpicklingError, EOFError, RuntimeError, AttributeError,
                    ImportError, ValueError, TypeError, KeyError)
# The model settings that decide parameter shapes (a checkpoint of other shapes cannot load).
SHAPE_FIELDS = ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "d_ff",
                "moe_layers", "moe_grid")


class _Corrupt(Exception):
    """Internal: a checkpoint failed validation; the message is the reason."""


@dataclass(frozen=True)
class SaveResult:
    """The outcome of ``CheckpointStore.try_save``: crosses actor boundaries.

    ``location``: the manifest's path or URI when saved. ``kind`` when not: ``"no_space"``
    (ENOSPC / EDQUOT), ``"io"`` (any other storage error) or ``"state"`` (the state holds
    something a checkpoint cannot store); ``error`` is one line naming the cause."""

    step: int
    location: str | None = None
    kind: str | None = None
    error: str | None = None
    bytes: int = 0  # the payload written (0: unknown, or not saved)
    seconds: float = 0.0  # how long the save took, serializing included

    @property
    def ok(self) -> bool:
        return self.location is not None

    def __str__(self) -> str:
        return self.location if self.ok else f"step {self.step} not saved ({self.kind}): " \
                                             f"{self.error}"


# --------------------------------------------------------------------------- run identity


def check_run_id(run_id: str) -> str:
    """``run_id`` if it is a usable directory name; else ``ValueError`` saying what to use."""
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
        raise ValueError(f"run id must be 1-128 letters, digits, '.', '_' or '-' (starting "
                         f"with a letter or digit), got {run_id!r}")
    return run_id


def run_location(location: str) -> tuple[str, str]:
    """``(uri, run_id)`` of a run's directory given as ``<uri>/<run_id>`` (how
    ``checkpoint.resume_from`` names another job's run outside this job's ``uri``).
    Raises ``ValueError`` if the last component is not a run id."""
    base, _, run_id = location.rstrip("/").rpartition("/")
    if not base or base.endswith(":/"):
        raise ValueError(f"{location!r} does not name a run directory: use <uri>/<run_id>")
    return base, check_run_id(run_id)


def job_run_id(checkpoint, name: str | None) -> str:
    """The run id of a job: ``checkpoint.run_id`` (a ``CheckpointSection``), else the job's
    ``name`` (``TrainConfig.named``: unique unless the user named the job, so a new job
    never continues another's run; resubmitting a name resumes that job's run). Raises
    ``ConfigError`` if neither is set (a config that was not ``named``)."""
    if checkpoint.run_id:
        return checkpoint.run_id
    if not name:
        from moshray.jobs.config.fields import ConfigError

        raise ConfigError("name", "the job has no name to name its checkpoints' run by")
    return check_run_id(name)


def resume_point(uri: str, run_id: str, resume_from: str | None,
                 config: dict) -> tuple["CheckpointRef", str] | None:
    """``(ref, location)`` of the checkpoint a job starts from: this run's newest under
    ``<uri>/<run_id>``; if it has none and ``resume_from`` names another run (a run id under
    ``uri``, or ``<uri>/<run_id>``), that run's; else None. ``ref`` (a
    ``cluster.messages.CheckpointRef``) is what the replicas load the state from; only
    manifests are read here (``CheckpointStore.latest_manifest``), so the driver's memory does
    not grow with the model. ``config`` is this job's ``TrainConfig.to_dict()``. Raises
    ``ConfigError`` (one line) when ``resume_from`` has no checkpoint, or when the
    checkpoint's model shapes differ from ``config``'s (``config_mismatch``; a checkpoint
    whose manifest names no config is checked by the replica that loads it); storage errors
    (``OSError``) propagate."""
    from moshray.cluster.messages import CheckpointRef
    from moshray.jobs.config.fields import ConfigError

    base, run = uri, run_id
    store = CheckpointStore(base, run_id=run)
    found = store.latest_manifest()
    if found is None and resume_from:
        base, run = run_location(resume_from) if "/" in resume_from else (uri, resume_from)
        store = CheckpointStore(base, run_id=run)
        found = store.latest_manifest()
        if found is None:
            raise ConfigError("checkpoint.resume_from", f"no valid checkpoint in "
                              f"{store.location} to start from")
    if found is None:
        return None
    step, stored = found
    mismatch = config_mismatch(stored, config)
    if mismatch:
        raise ConfigError("checkpoint", f"{store.location} step {step}: {mismatch}")
    return CheckpointRef(base, run, step), store.location


def load_resumed(ref: "CheckpointRef", config: dict) -> tuple[int, dict] | None:
    """A replica's load of the checkpoint its job resumes from (``resume_point``'s ref): the
    newest valid checkpoint of that run (``load_latest``: checksums checked, a failing one
    skipped for an older one), or None if none is left. Raises ``UserError`` (one line)
    when its model shapes differ from ``config``'s (a checkpoint whose manifest carried no
    config, unchecked by the driver); storage errors (``OSError``) propagate."""
    from moshray.actors.errors import UserError

    store = CheckpointStore(ref.uri, run_id=ref.run_id)
    found = store.load_latest()
    if found is None:
        return None
    mismatch = config_mismatch(found[1].get("config"), config)
    if mismatch:
        raise UserError("checkpoint", f"{store.location} step {found[0]}: {mismatch}")
    return found


def _config_entry(config) -> dict:
    """The manifest's ``config`` entry: the state's config if it is a JSON-able dict, else
    nothing (the replica that loads the state checks it then)."""
    if not isinstance(config, dict):
        return {}
    try:
        json.dumps(config)
    except (TypeError, ValueError):
        return {}
    return {"config": config}


def save_to(uri: str, run_id: str | None, state: dict, step: int,
            progress: Callable[[int, int], None] | None = None) -> SaveResult:
    """Write ``state`` as ``step`` into ``<uri>/<run_id>``; never raises for storage or
    state problems (a store that cannot even be opened is an ``"io"``/``"no_space"``
    result too): see ``CheckpointStore.try_save`` (and ``save`` for ``progress``)."""
    try:
        store = CheckpointStore(uri, run_id=run_id)
    except OSError as exc:
        return SaveResult(step, kind=_storage_kind(exc), error=_one_line(exc))
    return store.try_save(state, step, progress)


def _storage_kind(exc: OSError) -> str:
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(exc)
    return "no_space" if full else "io"


def model_fingerprint(model_state) -> list[list]:
    """The fingerprint of a model's state dict: ``[name, shape, dtype]`` of every tensor in
    its order (``dtype`` as torch names it, without ``torch.``). What a checkpoint's manifest
    records of the user's model (``fingerprint``) and what a load compares; it holds no
    values. Entries that are not tensors are left out."""
    return [[name, list(t.shape), str(t.dtype).removeprefix("torch.")]
            for name, t in model_state.items() if isinstance(t, torch.Tensor)]


def fingerprint_mismatch(stored, current) -> str | None:
    """The first difference between two ``model_fingerprint``s, as one line naming the
    tensor (a tensor only one side has, then one whose shape or dtype differs, in the
    stored order); None when they agree. Pure."""
    then = {name: (shape, dtype) for name, shape, dtype in stored}
    now = {name: (shape, dtype) for name, shape, dtype in current}
    for name, _, _ in stored:
        if name not in now:
            return f"{name!r} is in the stored model but not in this one"
    for name, _, _ in current:
        if name not in then:
            return f"{name!r} is in this model but not in the stored one"
    for name, _, _ in stored:
        if then[name] != now[name]:
            (s1, d1), (s2, d2) = then[name], now[name]
            return f"{name!r} is {s1} {d1} in the stored model but {s2} {d2} in this one"
    return None


def _fingerprint_entry(model_state) -> dict:
    """The manifest's ``fingerprint`` entry (``model_fingerprint`` of the state's model),
    or nothing when the state carries no model dict."""
    if not isinstance(model_state, dict):
        return {}
    return {"fingerprint": model_fingerprint(model_state)}


def config_mismatch(stored: dict | None, current: dict) -> str | None:
    """One line naming the model settings that decide parameter shapes and differ between
    a checkpoint's config (``stored``, a ``TrainConfig.to_dict()``) and this job's; None if
    they agree or the checkpoint carries no config."""
    if not isinstance(stored, dict) or not isinstance(stored.get("model"), dict):
        return None
    then, now = stored["model"], current.get("model", {})
    diff = [f"model.{k} {_show(then.get(k))} -> {_show(now.get(k))}" for k in SHAPE_FIELDS
            if k in then and k in now and _show(then[k]) != _show(now[k])]
    if not diff:
        return None
    return (f"the checkpoint's model has other shapes ({', '.join(diff)}): train with the "
            f"checkpoint's settings, or start a new run (another checkpoint.run_id)")


def _show(value) -> str:
    return str(list(value)) if isinstance(value, (list, tuple)) else str(value)


# --------------------------------------------------------------------------- encoding


def encode_state(value, where: str = "state"):
    """``value`` with numpy arrays and scalars turned into plain types, so that
    ``torch.load(weights_only=True)`` can read it back (``decode_state`` reverses it).
    Raises ``TypeError`` naming the first entry that is neither a tensor nor a plain type
    (dict, list, tuple, str, int, float, bool, bytes, None)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise TypeError(f"{where} is a numpy array of Python objects: store plain values")
        return {_NDARRAY: np.ascontiguousarray(value).tobytes(), "dtype": value.dtype.str,
                "shape": list(value.shape)}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, dict):
        out = OrderedDict() if isinstance(value, OrderedDict) else {}
        for k, v in value.items():
            if not isinstance(k, (str, int, float, bool, type(None))):
                raise TypeError(f"{where} has a key of type {type(k).__name__}: use str or int")
            out[k] = encode_state(v, f"{where}.{k}")
        return out
    if isinstance(value, (list, tuple)):
        items = [encode_state(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    raise TypeError(f"{where} is a {type(value).__name__}: a checkpoint stores tensors and "
                    f"plain types only (give the object state_dict/load_state_dict)")


def decode_state(value):
    """The inverse of ``encode_state`` (numpy arrays come back as writable arrays)."""
    if isinstance(value, dict):
        if _NDARRAY in value and set(value) == {_NDARRAY, "dtype", "shape"}:
            array = np.frombuffer(value[_NDARRAY], dtype=np.dtype(value["dtype"]))
            return array.reshape(value["shape"]).copy()
        out = OrderedDict() if isinstance(value, OrderedDict) else {}
        for k, v in value.items():
            out[k] = decode_state(v)
        return out
    if isinstance(value, list):
        return [decode_state(v) for v in value]
    if isinstance(value, tuple):
        return tuple(decode_state(v) for v in value)
    return value


# --------------------------------------------------------------------------- the store


@dataclass(frozen=True)
class _Manifest:
    name: str
    step: int
    write_id: str
    written_at: float
    run_id: str | None
    parts: tuple[tuple[str, int, str], ...]  # (name, bytes, sha256 hex)
    config: dict | None = None  # the job's TrainConfig.to_dict(), if the state carried one


class CheckpointStore:
    """One run's checkpoints under ``<uri>/<run_id>/`` (see module docstring).

    ``uri`` is a local directory (``~`` expanded) or a ``scheme://`` URI that
    ``pyarrow.fs.FileSystem.from_uri`` understands (``s3://bucket/prefix``,
    ``gs://bucket/prefix``, ``file:///abs/dir``); ``run_id`` names this run (None: ``uri``
    is already the run's own directory, as for an expert host's snapshots). The directory
    is created if missing. ``keep``: checkpoints left after a save; ``part_bytes``: the
    largest part; ``clock``: wall time for the manifests and the age of leftovers;
    ``filesystem``: a pyarrow filesystem to use instead of the one the URI names (with
    ``uri`` then a path on it). Raises ``ValueError`` for a bad ``keep``, ``part_bytes`` or
    ``run_id``; filesystem errors from pyarrow (``OSError``) propagate.
    """

    def __init__(self, uri: str, run_id: str | None = None, keep: int = 3, *,
                 part_bytes: int = PART_BYTES, stale_s: float = STALE_S,
                 clock: Callable[[], float] = time.time,
                 filesystem: pafs.FileSystem | None = None) -> None:
        for name, value in (("keep", keep), ("part_bytes", part_bytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.uri, self.keep, self.part_bytes = uri, keep, part_bytes
        self.run_id = None if run_id is None else check_run_id(run_id)
        self.stale_s, self.clock = stale_s, clock
        if filesystem is not None:
            self._fs, base, self._scheme = filesystem, uri, None
        elif "://" in uri:
            self._fs, base = pafs.FileSystem.from_uri(uri)
            local = isinstance(self._fs, pafs.LocalFileSystem)
            self._scheme = None if local else uri.split("://", 1)[0]
        else:
            self._fs = pafs.LocalFileSystem()
            base, self._scheme = os.path.abspath(os.path.expanduser(uri)), None
        base = base.rstrip("/")
        self._dir = f"{base}/{self.run_id}" if self.run_id else base
        self._local = isinstance(self._fs, pafs.LocalFileSystem)
        self._fs.create_dir(self._dir, recursive=True)

    @property
    def location(self) -> str:
        """This run's directory, as the user would write it."""
        return self._display(self._dir)

    def _display(self, path: str) -> str:
        return f"{self._scheme}://{path}" if self._scheme else path

    # ------------------------------------------------------------------ listing

    def _infos(self) -> list:
        selector = pafs.FileSelector(self._dir, allow_not_found=True)
        return [i for i in self._fs.get_file_info(selector) if i.type == pafs.FileType.File]

    def _manifests(self) -> tuple[list[_Manifest], list[str]]:
        """This run's readable manifests, and the names of manifests that are not (torn,
        foreign, another run's: never counted, never deleted)."""
        good, bad = [], []
        for info in self._infos():
            if _MANIFEST.match(info.base_name):
                try:
                    good.append(self._read_manifest(info.base_name))
                except _Corrupt as exc:
                    log.warning("checkpoint manifest %s is corrupt or not this run's (%s); "
                                "ignored", self._display(info.path), exc)
                    bad.append(info.base_name)
        return good, bad

    def _read_manifest(self, name: str) -> _Manifest:
        try:
            with self._fs.open_input_stream(f"{self._dir}/{name}") as stream:
                raw = json.loads(stream.read().decode())
            if raw.get("format") != FORMAT or raw.get("version") != FORMAT_VERSION:
                raise _Corrupt(f"not a {FORMAT} v{FORMAT_VERSION} manifest")
            manifest = _Manifest(name, int(raw["step"]), str(raw["write_id"]),
                                 float(raw["written_at"]), raw.get("run_id"),
                                 tuple((str(p["name"]), int(p["bytes"]), str(p["sha256"]))
                                       for p in raw["parts"]),
                                 raw["config"] if isinstance(raw.get("config"), dict) else None)
        except OSError as exc:
            raise _Corrupt(f"unreadable: {exc}") from exc
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise _Corrupt(f"malformed: {type(exc).__name__}") from exc
        if manifest.run_id != self.run_id:
            raise _Corrupt(f"written by run {manifest.run_id!r}, this is run {self.run_id!r}")
        if not name.startswith(f"ckpt-{manifest.step:09d}-{manifest.write_id}."):
            raise _Corrupt("its name does not match its step")
        if any(not _PART.match(p[0]) or not p[0].startswith(name.split(".")[0])
               for p in manifest.parts):
            raise _Corrupt("it names parts of another checkpoint")
        return manifest

    def list_steps(self) -> list[int]:
        """Steps of this run that have a readable manifest, ascending (parts unchecked)."""
        return sorted({m.step for m in self._manifests()[0]})

    # ------------------------------------------------------------------ writing

    def save(self, state: dict, step: int,
             progress: Callable[[int, int], None] | None = None) -> str:
        """Write ``state`` as the checkpoint for ``step``, then apply retention.

        ``state`` is a dict of tensors and plain types (numpy arrays allowed; see
        ``encode_state``). A checkpoint already there for the same step stays until
        retention drops it; readers take the newer write. Returns the manifest's location.
        ``progress(done, total)``, if given, is called with the payload's size once it is
        serialized (``done`` 0) and after every ``WRITE_BYTES`` written (a caller bounds its
        wait by the bytes that move, not by a constant).
        Raises ``TypeError`` if ``state`` is not a dict or holds another type, ``ValueError``
        for a negative step, ``OSError`` on a storage failure (what was written of this
        checkpoint is removed where possible; nothing of it is ever visible)."""
        if not isinstance(state, dict):
            raise TypeError(f"checkpoint state must be a dict, got {type(state).__name__}")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        buffer = io.BytesIO()
        torch.save(encode_state(state), buffer)
        payload = buffer.getbuffer()
        report = progress or (lambda done, total: None)
        report(0, len(payload))
        write_id = uuid.uuid4().hex[:12]
        stem = f"ckpt-{step:09d}-{write_id}"
        written: list[str] = []
        parts = []
        try:
            for i, start in enumerate(range(0, max(len(payload), 1), self.part_bytes)):
                chunk = payload[start:start + self.part_bytes]
                name = f"{stem}.part{i:03d}"
                written.append(f"{self._dir}/{name}")
                with self._fs.open_output_stream(written[-1]) as out:
                    for at in range(0, len(chunk), WRITE_BYTES):
                        out.write(chunk[at:at + WRITE_BYTES])
                        report(start + min(at + WRITE_BYTES, len(chunk)), len(payload))
                parts.append({"name": name, "bytes": len(chunk),
                              "sha256": hashlib.sha256(chunk).hexdigest()})
            manifest = {"format": FORMAT, "version": FORMAT_VERSION, "run_id": self.run_id,
                        "step": step, "write_id": write_id, "written_at": self.clock(),
                        "parts": parts, **_config_entry(state.get("config")),
                        **_fingerprint_entry(state.get("model"))}
            final = f"{self._dir}/{stem}.manifest.json"
            self._write_visible(final, json.dumps(manifest, indent=1).encode(), written)
        except BaseException:
            for path in reversed(written):
                self._remove_quietly(path)
            raise
        self._retain(f"{stem}.manifest.json")
        return self._display(final)

    def try_save(self, state: dict, step: int,
                 progress: Callable[[int, int], None] | None = None) -> SaveResult:
        """``save`` that reports a failure as a ``SaveResult`` instead of raising: storage
        errors (``kind`` ``"no_space"`` or ``"io"``) and a state that cannot be stored
        (``"state"``). A bad ``step`` still raises ``ValueError`` (a caller's bug). A saved
        result carries the payload's size and the save's duration."""
        started, size = time.monotonic(), [0]

        def seen(done: int, total: int) -> None:
            size[0] = total
            if progress is not None:
                progress(done, total)

        try:
            location = self.save(state, step, seen)
            return SaveResult(step, location=location, bytes=size[0],
                              seconds=time.monotonic() - started)
        except OSError as exc:
            return SaveResult(step, kind=_storage_kind(exc), error=_one_line(exc))
        except TypeError as exc:
            return SaveResult(step, kind="state", error=_one_line(exc))

    def _write_visible(self, final: str, data: bytes, written: list[str]) -> None:
        """The manifest: locally under a temporary name, then renamed (atomic); on an
        object store one PUT (atomic per object; nothing is copied)."""
        if not self._local:
            written.append(final)
            with self._fs.open_output_stream(final) as out:
                out.write(data)
            return
        tmp = f"{self._dir}/.{final.rsplit('/', 1)[1]}.tmp-{uuid.uuid4().hex}"
        written.append(tmp)
        with self._fs.open_output_stream(tmp) as out:
            out.write(data)
        self._fs.move(tmp, final)
        written[-1] = final

    def _remove_quietly(self, path: str) -> None:
        try:
            self._fs.delete_file(path)
        except OSError:
            pass  # never written, or already gone: nothing to clean up

    def _retain(self, just_written: str) -> None:
        """Keep ``just_written`` and the ``keep - 1`` newest other manifests of this run by
        write time; drop the rest (manifest first, then its parts); remove stale leftovers.
        Failures are logged, never raised: the checkpoint itself is written."""
        try:
            manifests, foreign = self._manifests()
            others = sorted((m for m in manifests if m.name != just_written),
                            key=lambda m: (m.written_at, m.name), reverse=True)
            kept = [m for m in manifests if m.name == just_written] + others[:self.keep - 1]
            for m in others[self.keep - 1:]:
                self._remove_quietly(f"{self._dir}/{m.name}")
                for part, _, _ in m.parts:
                    self._remove_quietly(f"{self._dir}/{part}")
            named = {p[0] for m in kept for p in m.parts}
            owned = {n.split(".")[0] for n in foreign}  # a torn manifest's parts: left alone
            now = self.clock()
            for info in self._infos():
                name = info.base_name
                leftover = (".tmp-" in name or (_PART.match(name) and name not in named
                                                and name.split(".")[0] not in owned))
                if leftover and info.mtime is not None and \
                        now - info.mtime.timestamp() > self.stale_s:
                    self._remove_quietly(info.path)
        except OSError as exc:
            log.warning("checkpoint retention in %s failed: %s", self.location, _one_line(exc))

    # ------------------------------------------------------------------ reading

    def _read(self, manifest: _Manifest) -> dict:
        """The validated state a manifest names; raises ``_Corrupt(reason)``."""
        blobs = []
        for name, size, digest in manifest.parts:
            try:
                with self._fs.open_input_stream(f"{self._dir}/{name}") as stream:
                    blob = stream.read()
            except OSError as exc:
                raise _Corrupt(f"part {name} unreadable: {_one_line(exc)}") from exc
            if len(blob) != size:
                raise _Corrupt(f"part {name}: wrong length, manifest says {size} bytes, "
                               f"found {len(blob)}")
            if hashlib.sha256(blob).hexdigest() != digest:
                raise _Corrupt(f"part {name}: checksum mismatch")
            blobs.append(blob)
        try:
            state = torch.load(io.BytesIO(b"".join(blobs)), map_location="cpu",
                               weights_only=True)
        except _UNPICKLE_ERRORS as exc:
            raise _Corrupt(f"payload refused by the weights-only loader: "
                           f"{type(exc).__name__}") from exc
        if not isinstance(state, dict):
            raise _Corrupt(f"payload is a {type(state).__name__}, not a dict")
        return decode_state(state)

    def latest_manifest(self) -> tuple[int, dict | None] | None:
        """``(step, config)`` of the newest checkpoint of this run whose manifest is readable
        and whose parts are all there at their sizes (highest step, then latest write), or
        ``None``. Reads manifests and the parts' sizes only, never the state: what a driver
        needs to resume (its replicas read the state with ``load_latest``, which also checks
        the checksums and falls back to an older checkpoint should this one fail them).
        ``config`` is None for a checkpoint whose manifest carries none. A checkpoint with a
        part missing or of the wrong size is skipped with one warning line, as in
        ``load_latest``."""
        manifests, _ = self._manifests()
        for m in sorted(manifests, key=lambda m: (m.step, m.written_at), reverse=True):
            try:
                self._check_sizes(m)
                return m.step, m.config
            except _Corrupt as exc:
                log.warning("checkpoint %s is corrupt (%s); skipping",
                            self._display(f"{self._dir}/{m.name}"), exc)
        return None

    def _check_sizes(self, manifest: _Manifest) -> None:
        """Every part of ``manifest`` is there at its size; raises ``_Corrupt(reason)``."""
        paths = [f"{self._dir}/{name}" for name, _, _ in manifest.parts]
        try:
            infos = self._fs.get_file_info(paths)
        except OSError as exc:
            raise _Corrupt(f"parts unreadable: {_one_line(exc)}") from exc
        for (name, size, _), info in zip(manifest.parts, infos):
            if info.type == pafs.FileType.NotFound:
                raise _Corrupt(f"part {name} missing")
            if info.size != size:
                raise _Corrupt(f"part {name}: wrong length, manifest says {size} bytes, "
                               f"found {info.size}")

    def load_latest(self) -> tuple[int, dict] | None:
        """``(step, state)`` of the newest valid checkpoint of this run (highest step, then
        latest write), or ``None`` if there is none.

        A checkpoint that fails validation (unreadable or malformed manifest, another run's
        manifest, a part missing or of the wrong size or checksum, a payload the
        weights-only loader refuses) is skipped with one ``logging.warning`` line naming it
        and the reason, and the next newest is tried. Tensors are loaded onto the CPU."""
        manifests, _ = self._manifests()
        for m in sorted(manifests, key=lambda m: (m.step, m.written_at), reverse=True):
            try:
                return m.step, self._read(m)
            except _Corrupt as exc:
                log.warning("checkpoint %s is corrupt (%s); skipping",
                            self._display(f"{self._dir}/{m.name}"), exc)
        return None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:300]
