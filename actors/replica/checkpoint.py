"""Durable, self-checking checkpoints on a local directory or an object store.

File layout of ``ckpt-{step:09d}.pt``::

    magic    8 bytes   b"MOSHCKPT"
    version  uint32    FORMAT_VERSION (little endian)
    digest   32 bytes  sha256 of the payload
    length   uint64    payload length in bytes
    payload  length    torch.save(state) bytes

A file is written under a temporary name and then moved into place, so a
reader never sees a half-written checkpoint under the final name on a local
filesystem (on S3/GCS ``move`` is copy + delete, and the copy is atomic per
object). The header catches what atomicity cannot: a truncated upload, a
bit flip, a file from something else.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import pickle
import re
import struct
import uuid

import pyarrow.fs as pafs
import torch

__all__ = ["CheckpointStore", "FORMAT_VERSION", "MAGIC"]

log = logging.getLogger(__name__)

MAGIC = b"MOSHCKPT"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sI32sQ")  # magic, version, sha256 digest, payload length
_NAME = re.compile(r"^ckpt-(\d{9})\.pt$")
# What torch.load raises on bytes that are not a loadable torch.save payload.
_UNPICKLE_ERRORS = (
    pickle.UnpicklingError,
    EOFError,
    RuntimeError,
    AttributeError,
    ImportError,
    ValueError,
    TypeError,
    KeyError,
)


class _Corrupt(Exception):
    """Internal: a checkpoint file failed validation; the message is the reason."""


class CheckpointStore:
    """Numbered checkpoints under one directory or object-store prefix.

    ``uri`` is a local directory (``~`` expanded) or a ``scheme://`` URI that
    ``pyarrow.fs.FileSystem.from_uri`` understands (``s3://bucket/prefix``,
    ``gs://bucket/prefix``, ``file:///abs/dir``). The directory is created if
    missing. After each :meth:`save` only the newest ``keep`` checkpoints
    remain. Raises ``ValueError`` if ``keep < 1``; filesystem errors from
    pyarrow (``OSError``) propagate.
    """

    def __init__(self, uri: str, keep: int = 3) -> None:
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(f"keep must be a positive integer, got {keep!r}")
        self.uri = uri
        self.keep = keep
        if "://" in uri:
            self._fs, self._dir = pafs.FileSystem.from_uri(uri)
            local = isinstance(self._fs, pafs.LocalFileSystem)
            self._scheme = None if local else uri.split("://", 1)[0]
        else:
            self._fs = pafs.LocalFileSystem()
            self._dir = os.path.abspath(os.path.expanduser(uri))
            self._scheme = None
        self._dir = self._dir.rstrip("/")
        self._fs.create_dir(self._dir, recursive=True)

    # ------------------------------------------------------------------ naming

    def _path(self, step: int) -> str:
        return f"{self._dir}/ckpt-{step:09d}.pt"

    def _display(self, path: str) -> str:
        """Path as the user would write it (with the scheme for remote stores)."""
        return f"{self._scheme}://{path}" if self._scheme else path

    def path_for(self, step: int) -> str:
        """Location (path or URI) of the checkpoint for ``step``, whether or not it exists."""
        return self._display(self._path(step))

    def list_steps(self) -> list[int]:
        """Steps that have a checkpoint file, ascending; validity is not checked."""
        selector = pafs.FileSelector(self._dir, allow_not_found=True)
        steps = []
        for info in self._fs.get_file_info(selector):
            match = _NAME.match(info.base_name)
            if match and info.type == pafs.FileType.File:
                steps.append(int(match.group(1)))
        return sorted(steps)

    # ------------------------------------------------------------------ writing

    def save(self, state: dict, step: int) -> str:
        """Write ``state`` as the checkpoint for ``step`` and prune old ones.

        ``state`` is a dict (model and optimizer state dicts, step/epoch, the
        config dict, a ``version``...) that ``torch.save`` can serialise. The
        file is written to a temporary name in the same directory and moved to
        ``ckpt-{step:09d}.pt``, replacing an existing checkpoint for the same
        step. Returns the final location. Raises ``TypeError`` if ``state`` is
        not a dict, ``ValueError`` for a negative step, ``OSError`` on write
        failure (the temporary file is removed where possible).
        """
        if not isinstance(state, dict):
            raise TypeError(f"checkpoint state must be a dict, got {type(state).__name__}")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        buffer = io.BytesIO()
        torch.save(state, buffer)
        payload = buffer.getvalue()
        header = _HEADER.pack(MAGIC, FORMAT_VERSION, hashlib.sha256(payload).digest(), len(payload))

        final = self._path(step)
        tmp = f"{self._dir}/.ckpt-{step:09d}.pt.tmp-{uuid.uuid4().hex}"
        try:
            with self._fs.open_output_stream(tmp) as out:
                out.write(header)
                out.write(payload)
            self._fs.move(tmp, final)
        except BaseException:
            self._remove_quietly(tmp)
            raise
        self._prune()
        return self._display(final)

    def _remove_quietly(self, path: str) -> None:
        try:
            self._fs.delete_file(path)
        except OSError:
            pass  # never written, or already gone: nothing to clean up

    def _prune(self) -> None:
        for step in self.list_steps()[: -self.keep]:
            self._remove_quietly(self._path(step))

    # ------------------------------------------------------------------ reading

    def _read(self, path: str) -> dict:
        """Validated state dict from ``path``; raises ``_Corrupt(reason)``."""
        try:
            with self._fs.open_input_stream(path) as stream:
                blob = stream.read()
        except OSError as exc:
            raise _Corrupt(f"unreadable: {exc}") from exc
        if len(blob) < _HEADER.size:
            raise _Corrupt(f"truncated header: {len(blob)} bytes")
        magic, version, digest, length = _HEADER.unpack_from(blob)
        if magic != MAGIC:
            raise _Corrupt("bad magic")
        if version != FORMAT_VERSION:
            raise _Corrupt(f"unsupported format version {version}")
        payload = blob[_HEADER.size :]
        if len(payload) != length:
            raise _Corrupt(f"wrong length: header says {length} bytes, found {len(payload)}")
        if hashlib.sha256(payload).digest() != digest:
            raise _Corrupt("checksum mismatch")
        try:
            state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)
        except _UNPICKLE_ERRORS as exc:
            # The checksum matched, so these bytes are what was written: a class
            # that no longer exists, or a file from an incompatible torch.
            raise _Corrupt(f"unpicklable payload: {type(exc).__name__}") from exc
        if not isinstance(state, dict):
            raise _Corrupt(f"payload is a {type(state).__name__}, not a dict")
        return state

    def load_latest(self) -> tuple[int, dict] | None:
        """``(step, state)`` of the newest valid checkpoint, or ``None`` if there is none.

        Files that fail validation (bad magic, unsupported version, wrong
        length, checksum mismatch, unpicklable payload, unreadable) are skipped
        with one ``logging.warning`` line each naming the file and the reason,
        and the next newest is tried. Tensors are loaded onto the CPU.
        """
        for step in reversed(self.list_steps()):
            path = self._path(step)
            try:
                return step, self._read(path)
            except _Corrupt as exc:
                log.warning(
                    "checkpoint %s is corrupt (%s); skipping", self._display(path), exc
                )
        return None
