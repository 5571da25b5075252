"""The files of a group checkpoint as ``torch.distributed.checkpoint`` (DCP) sees them, in a
form that loads no code: DCP plans and reshards as usual, but writes and reads through the
storage writer, reader and load planner here instead of its own file system ones.

What DCP's own ``FileSystemReader`` would unpickle, and what is read here instead:

- ``.metadata``, DCP's index (every entry's global shape, dtype and chunks, where each chunk
  lies in which shard file, the nested path of each flattened entry): DCP pickles it whole
  (``pickle.dump``/``pickle.load``). Here it is JSON (``index_to_json``/``index_from_json``)
  of plain numbers and names; the decoder builds DCP's dataclasses itself, accepts only
  known dtypes, and refuses an entry that points outside the shard files the manifest names
  or past their sizes.
- a tensor chunk in a shard file (``__<rank>_<n>.distcp``, one ``torch.save`` per chunk):
  read with ``torch.load(weights_only=True)``, which builds tensors and plain types only.
- a non-tensor entry (an optimizer's ``param_groups`` values: floats, bools, the betas
  tuple, the parameters' names): DCP's ``DefaultLoadPlanner.load_bytes`` reads it with
  ``torch.load(weights_only=False)``, a full unpickle; ``LoadPlanner`` here reads it
  weights-only as well.

The writes are DCP's own (``FileSystemWriter``: one file per rank, each chunk a
``torch.save``); only the index it writes last is JSON instead of a pickle. A refused read
raises ``CheckpointError`` (one line) having built nothing but tensors and plain values.

Imported only on the ranks (``save_state``/``load_state`` in ``group_checkpoint``): DCP
takes about a second to import, which a driver that only names checkpoints does without.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
import re
import uuid
from collections.abc import Mapping

import torch
import torch.distributed.checkpoint as dcp
from torch.futures import Future
from torch.distributed.checkpoint import FileSystemWriter, StorageReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
    TensorProperties, TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType

from moshray.actors.replica.group_checkpoint import INDEX, CheckpointError

INDEX_FORMAT = "moshray-dcp-index"
INDEX_VERSION = 1
_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values()
           if isinstance(d, torch.dtype)}
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")  # in torch's weights-only refusal
# What torch.load raises on bytes it cannot or will not load (a weights-only refusal is an
# UnpicklingError).
_UNPICKLE_ERRORS = (pickle.UnpicklingError, EOFError, RuntimeError, AttributeError,
                    ImportError, ValueError, TypeError, KeyError, IndexError)


@dataclasses.dataclass(frozen=True)
class Stored:
    """Where one entry (a tensor chunk, or a non-tensor value) lies: ``length`` bytes at
    ``offset`` of the shard file ``file``."""

    file: str
    offset: int
    length: int


# -- the index as JSON (pure) ----------------------------------------------------------------


def index_to_json(metadata: Metadata) -> str:
    """DCP's ``Metadata`` (its ``storage_data`` DCP's per-entry ``_StorageInfo``, or
    ``Stored``) as JSON. ``ValueError`` for an entry with stream transforms (compression),
    which this format does not describe."""
    entries = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, BytesStorageMetadata):
            entries[fqn] = {"bytes": True}
        else:
            entries[fqn] = {"dtype": str(meta.properties.dtype).removeprefix("torch."),
                            "size": list(meta.size),
                            "chunks": [[list(c.offsets), list(c.sizes)] for c in meta.chunks]}
    storage = []
    for index, info in metadata.storage_data.items():
        if getattr(info, "transform_descriptors", None):
            raise ValueError(f"{index.fqn}: stream transforms {info.transform_descriptors} "
                             f"are not part of this format")
        file = info.file if isinstance(info, Stored) else info.relative_path
        storage.append([index.fqn, None if index.offset is None else list(index.offset),
                        index.index, file, info.offset, info.length])
    paths = (None if metadata.planner_data is None else
             {fqn: list(path) for fqn, path in metadata.planner_data.items()})
    return json.dumps({"format": INDEX_FORMAT, "version": INDEX_VERSION,
                       "dcp_version": metadata.version, "entries": entries,
                       "paths": paths, "storage": storage}, separators=(",", ":"))


def index_from_json(blob: bytes, shards: Mapping[str, int], where: str) -> Metadata:
    """DCP's ``Metadata`` from ``index_to_json``'s bytes, every chunk placed in one of
    ``shards`` (file name -> size in bytes: the manifest's shard files) within its size.
    ``CheckpointError`` (one line, naming ``where``) for anything else: not JSON (a pickle
    is refused here, unread), another format, an unknown dtype, a malformed entry, a chunk
    in a file the manifest does not name or past its end."""
    try:
        d = json.loads(blob.decode("utf-8"))
    except ValueError:  # a pickle, or other bytes: never unpickled
        raise CheckpointError(f"{where}: {INDEX} refused, not a group checkpoint index: "
                              f"not JSON") from None
    try:
        if not isinstance(d, dict) or (d.get("format"), d.get("version")) != (
                INDEX_FORMAT, INDEX_VERSION):
            raise _Malformed(f"format {_get(d, 'format')!r} version {_get(d, 'version')!r}, "
                             f"expected {INDEX_FORMAT!r} {INDEX_VERSION}")
        entries = {}
        for fqn, e in _mapping(d["entries"], "entries").items():
            if e.get("bytes") is True:
                entries[fqn] = BytesStorageMetadata()
                continue
            if e["dtype"] not in _DTYPES:
                raise _Malformed(f"{fqn!r}: unknown dtype {e['dtype']!r}")
            entries[fqn] = TensorStorageMetadata(
                TensorProperties(dtype=_DTYPES[e["dtype"]]), _dims(e["size"], fqn),
                [ChunkStorageMetadata(_dims(o, fqn), _dims(s, fqn)) for o, s in e["chunks"]])
        storage = {}
        for fqn, offsets, index, file, offset, length in d["storage"]:
            if fqn not in entries:
                raise _Malformed(f"a chunk of {fqn!r}, which has no entry")
            if file not in shards:
                raise _Malformed(f"{fqn!r} is in {file!r}, not a shard file of the manifest")
            offset, length = _count(offset, fqn), _count(length, fqn)
            if offset + length > shards[file]:
                raise _Malformed(f"{fqn!r} ends at byte {offset + length} of {file}, which "
                                 f"has {shards[file]}")
            key = MetadataIndex(fqn, None if offsets is None else _dims(offsets, fqn),
                                None if index is None else _count(index, fqn))
            storage[key] = Stored(file, offset, length)
        paths = None if d["paths"] is None else {
            fqn: tuple(_component(c, fqn) for c in path)
            for fqn, path in _mapping(d["paths"], "paths").items()}
        if d["dcp_version"] is not None and not isinstance(d["dcp_version"], str):
            raise _Malformed("dcp_version is not a string")
        return Metadata(entries, planner_data=paths, storage_data=storage,
                        storage_meta=StorageMeta(load_id=uuid.uuid4().hex),
                        version=d["dcp_version"])
    except (_Malformed, ValueError, KeyError, TypeError, AttributeError) as exc:
        why = str(exc) if isinstance(exc, _Malformed) else f"{type(exc).__name__}: {exc}"
        raise CheckpointError(f"{where}: {INDEX} refused, not a group checkpoint index: "
                              f"{' '.join(why.split())[:200]}") from None


class _Malformed(Exception):
    """Internal: the index does not describe a checkpoint; the message says how."""


def _get(d, key):
    return d.get(key) if isinstance(d, dict) else None


def _mapping(value, what: str) -> dict:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise _Malformed(f"{what} is not a mapping of names")
    return value


def _count(value, fqn: str) -> int:
    if type(value) is not int or value < 0:
        raise _Malformed(f"{fqn!r}: {value!r} is not a count")
    return value


def _dims(value, fqn: str) -> torch.Size:
    if not isinstance(value, list):
        raise _Malformed(f"{fqn!r}: {value!r} is not a list of counts")
    return torch.Size(_count(v, fqn) for v in value)


def _component(value, fqn: str) -> str | int:
    if type(value) not in (str, int):
        raise _Malformed(f"{fqn!r}: path component {value!r} is not a name or an index")
    return value


# -- DCP's storage and planner (the rank side) ------------------------------------------------


class IndexWriter(FileSystemWriter):
    """DCP's file system writer (one shard file per rank, each chunk a ``torch.save``),
    whose ``finish`` (coordinator only, after every rank wrote) writes the index as JSON
    (``index_to_json``), synced and renamed into place, instead of pickling it."""

    def finish(self, metadata: Metadata, results) -> None:
        storage = {r.index: r.storage_data for per_rank in results for r in per_rank}
        text = index_to_json(dataclasses.replace(metadata, storage_data=storage,
                                                 version=CURRENT_DCP_VERSION))
        final = os.path.join(self.path, INDEX)
        tmp = final + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)


class IndexReader(StorageReader):
    """Reads a checkpoint directory ``path`` whose files were checked against the manifest
    (``group_checkpoint.verify_files``): the index through ``index_from_json`` (its bytes
    checked against ``metadata_sha256`` again, as every rank reads it), tensor chunks with
    ``torch.load(weights_only=True)``, non-tensor entries through the planner's
    ``load_bytes`` (``LoadPlanner``: weights-only too). ``shards``: the manifest's shard
    files, name -> size. ``read_metadata`` takes no rank, so DCP never falls back to
    per-rank index files."""

    def __init__(self, path: str, shards: Mapping[str, int], metadata_sha256: str):
        super().__init__()
        self.path, self.shards, self.metadata_sha256 = path, dict(shards), metadata_sha256
        self.storage_data: dict[MetadataIndex, Stored] = {}

    def reset(self, checkpoint_id=None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)

    def read_metadata(self) -> Metadata:
        with open(os.path.join(self.path, INDEX), "rb") as f:
            blob = f.read()
        if hashlib.sha256(blob).hexdigest() != self.metadata_sha256:
            raise CheckpointError(f"{self.path}: file {INDEX}: sha256 differs from the "
                                  f"manifest (corrupt or replaced); not loaded")
        return index_from_json(blob, self.shards, self.path)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan, planner) -> Future:
        if not isinstance(planner, LoadPlanner):  # DCP's own would unpickle non-tensors
            raise TypeError("IndexReader reads with group_checkpoint_storage.LoadPlanner")
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].file, []).append(item)
        for name, items in per_file.items():
            with open(os.path.join(self.path, name), "rb") as f:
                for item in items:
                    stored = self.storage_data[item.storage_index]
                    f.seek(stored.offset)
                    blob = io.BytesIO(f.read(stored.length))
                    if item.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(item, blob)
                        continue
                    chunk = weights_only(blob, f"{self.path}: {name}: {item.storage_index.fqn}")
                    if not isinstance(chunk, torch.Tensor):
                        raise CheckpointError(f"{self.path}: {name}: {item.storage_index.fqn} "
                                              f"holds a {type(chunk).__name__}, not a tensor")
                    for dim, (start, size) in enumerate(zip(item.storage_offsets,
                                                            item.lengths)):
                        if size < chunk.size(dim):  # the part of the chunk this rank holds
                            chunk = chunk.narrow(dim, start, size)
                    target = planner.resolve_tensor(item).detach()
                    if target.size() != chunk.size():
                        raise CheckpointError(f"{self.path}: {item.storage_index.fqn}: a chunk "
                                              f"of {tuple(chunk.size())} for a slot of "
                                              f"{tuple(target.size())}")
                    target.copy_(chunk)
                    planner.commit_tensor(item, target)
        done: Future = Future()
        done.set_result(None)
        return done

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner (flattened state, resharding) whose ``load_bytes`` reads a
    non-tensor entry with ``torch.load(weights_only=True)`` instead of a full unpickle;
    ``where`` (the checkpoint) begins its refusals."""

    def __init__(self, where: str):
        super().__init__()
        self.where = where

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = weights_only(value, f"{self.where}: {fqn}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def weights_only(stream: io.BytesIO, where: str):
    """``torch.load(stream, weights_only=True)`` on the CPU; ``CheckpointError`` (one line)
    for what it cannot or will not build (anything but tensors and plain values)."""
    try:
        return torch.load(stream, map_location="cpu", weights_only=True)
    except _UNPICKLE_ERRORS as exc:
        named = _GLOBAL.search(str(exc))  # what it would have called or built
        why = (f"it names {named.group(1)}, neither a tensor nor a plain value" if named
               else " ".join(str(exc).split())[:120])
        raise CheckpointError(f"{where}: refused by the weights-only loader "
                              f"({type(exc).__name__}: {why})") from None


def save(state: dict, directory: str) -> None:
    """``dcp.save`` of ``state`` into ``directory`` (a collective over the default process
    group when there is one), the index as JSON."""
    dcp.save(state, storage_writer=IndexWriter(directory))


def load(state: dict, directory: str, shards: Mapping[str, int], metadata_sha256: str) -> None:
    """``dcp.load`` into ``state`` (in place, resharded to its layout) from ``directory``
    (see ``IndexReader``). A collective: when a rank fails, DCP tells them all, and every
    rank raises ``CheckpointError`` (one line: the lowest failing rank's refusal, or what
    else went wrong there)."""
    try:
        dcp.load(state, storage_reader=IndexReader(directory, shards, metadata_sha256),
                 planner=LoadPlanner(directory))
    except CheckpointException as exc:
        failures = [f[0] if isinstance(f, tuple) else f
                    for _, f in sorted(exc.failures.items())]
        first = next((f for f in failures if isinstance(f, CheckpointError)),
                     failures[0] if failures else exc)
        if isinstance(first, CheckpointError):
            raise CheckpointError(str(first)) from None
        raise CheckpointError(f"{directory}: not loaded ({type(first).__name__}: "
                              f"{' '.join(str(first).split())[:200]})") from None
