"""Sharded checkpoints of a replica group: every rank writes its own shard
with ``torch.distributed.checkpoint`` (DCP), and a checkpoint written by W ranks loads into a
group of any other size W' (DCP reshards on load). Loading one runs no code from storage:
nothing a checkpoint holds is unpickled (below).

Layout of a checkpoint directory ``path``::

    path/__<rank>_0.distcp     each rank's shard of the model and optimizer state: one
                               ``torch.save`` per tensor chunk or non-tensor value (DCP)
    path/.metadata             DCP's index of every entry's chunks (rank 0, after all wrote),
                               as JSON (``group_checkpoint_storage``), not DCP's pickle
    path/moshray.json          the manifest (``CheckpointManifest``, format version 2): step,
                               world size, the unsharded shape of every state entry, and the
                               size and sha256 of every file

Loads no code: DCP's own reader unpickles ``.metadata`` and reads non-tensor entries (an
optimizer's ``param_groups``) with a full unpickle, and the checkpoint lives where every
worker may write. Here DCP saves and loads through ``group_checkpoint_storage``: the index
is JSON and decoded into DCP's dataclasses by hand, and every shard entry, tensor or not, is
read with ``torch.load(weights_only=True)`` (tensors and plain values only). A manifest of
version 1 (an older moshray's: no hashes, a pickled index) is refused, not loaded.

Checked before anything is read: a load (``load_sharded``) has rank 0 read the manifest
(``read_manifest``: the format and version, the files it names, each there at its size; a
name other than ``.metadata`` or a rank's ``__<rank>_<n>.distcp`` is refused), compare it
with the model (``first_difference``), then hash every file it names and decode the index
(``verify_files``), and tell the others, so on any refusal no rank reads a shard and the
group stays sound. Each refusal is a ``CheckpointError`` of one line naming the checkpoint
and the file. A file whose hash matches can still be refused while loading (a manifest
rewritten to match a planted file): the weights-only loader refuses what is not a tensor
or a plain value, having built nothing else.

Visible only when whole: the ranks write into a staging directory beside ``path``
(``staging_path``: ``<path>.partial-<nonce>``, the same file system), rank 0 adds the manifest
once ``dcp.save`` has returned (DCP's last phase gathers every rank's write results before
it returns, so every shard is on disk by then), and renames the directory to ``path`` (one
``rename(2)``: atomic on a POSIX file system). A reader sees no directory or a whole one; a
failed save leaves ``<path>.partial-*`` behind, which nothing reads.

Durable storage: ``path`` may also be a URI ``pyarrow.fs`` understands (``s3://bucket/dir``,
``gs://bucket/dir``, with options as query parameters), the location a group job on several
machines needs. The ranks then stage on their node's disk (``local_staging``), rank 0 uploads
the shards and ``.metadata`` to ``path`` and writes the manifest last: an object store has
no rename, so the manifest is the commit (a reader takes a directory only with its manifest
and every file it names at its size; a save that failed leaves shards without a manifest).
A load downloads the files the manifest names to a node-local directory first (rank 0,
``fetch``, which checks the copies' hashes; the others read the same directory, as the group
is on one node), and removes it after.

Resharding: each rank asks ``get_state_dict`` for the state of the model and optimizer it
holds, laid out as the *loading* group shards it (FSDP2 DTensor shards of 1/W', or whole
tensors under DDP), and ``dcp.load`` fills each of those tensors from whichever saved chunks
overlap it (the index records the offsets of each chunk); ``set_state_dict`` then hands the
optimizer its state. All ranks must see the same directory: the group's ranks are on one
node (``ReplicaGroup.start`` packs them), or ``path`` is on a shared file system.

The pure parts (manifest, comparisons, staging names) are apart from the rank-side I/O
(``save_state``, ``load_state``), which the ``GroupRank`` actor calls; DCP itself is imported
on the ranks only.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass

import pyarrow.fs as pafs
import torch

FORMAT = "moshray-group-checkpoint"
VERSION = 2
MANIFEST = "moshray.json"
INDEX = ".metadata"  # DCP's index (JSON here, see group_checkpoint_storage)
_SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")  # DCP's shard file of a rank
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_READ_BYTES = 8 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint cannot be written or read here; ``str()`` is one line."""


class OlderCheckpointError(CheckpointError):
    """A checkpoint in a format an older moshray wrote and this one refuses to load (its
    manifest version is older): the message says what to do."""


# -- the manifest and the checks (pure) --------------------------------------------------------


@dataclass(frozen=True)
class CheckpointManifest:
    """What a checkpoint holds, written last (see module docstring). ``state``: the unsharded
    shape of each model entry, in the model's order; ``files``: each file's name, size in
    bytes and sha256 (hex)."""

    step: int
    world_size: int
    parallel: str
    optimizer: str
    state: tuple[tuple[str, tuple[int, ...]], ...]
    files: tuple[tuple[str, int, str], ...] = ()

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "version": VERSION, "step": self.step,
                           "world_size": self.world_size, "parallel": self.parallel,
                           "optimizer": self.optimizer,
                           "state": [[k, list(s)] for k, s in self.state],
                           "files": [[f, n, h] for f, n, h in self.files]}, indent=1)

    @classmethod
    def from_json(cls, text: str, where: str = "checkpoint") -> CheckpointManifest:
        """Parse a manifest; ``CheckpointError`` (one line) for another format or version
        (``OlderCheckpointError`` for an older moshray's), or for files that are not a group
        checkpoint's (``file_difference``)."""
        try:
            d = json.loads(text)
            if d.get("format") == FORMAT and d.get("version") == 1:
                raise OlderCheckpointError(
                    f"{where}: written by an older moshray (manifest version 1, no hashes, "
                    f"its {INDEX} a pickle), which this version does not load; start fresh "
                    f"(another checkpoint location or run id) or remove it")
            if d.get("format") != FORMAT or d.get("version") != VERSION:
                raise CheckpointError(f"{where}: format {d.get('format')!r} version "
                                      f"{d.get('version')!r}, expected {FORMAT!r} {VERSION}")
            manifest = cls(int(d["step"]), int(d["world_size"]), str(d["parallel"]),
                           str(d["optimizer"]), tuple((k, tuple(s)) for k, s in d["state"]),
                           tuple((str(f), int(n), str(h)) for f, n, h in d["files"]))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"{where}: unreadable manifest ({type(exc).__name__}: "
                                  f"{exc})") from None
        odd = file_difference(manifest)
        if odd:
            raise CheckpointError(f"{where}: refused: {odd}")
        return manifest

    @property
    def shards(self) -> dict[str, int]:
        """The shard files (all but the index), name -> size in bytes."""
        return {name: size for name, size, _ in self.files if name != INDEX}

    def sha256(self, name: str) -> str:
        """The sha256 (hex) the manifest gives the file ``name`` (one it names)."""
        return next(h for f, _, h in self.files if f == name)


def file_difference(manifest: CheckpointManifest) -> str | None:
    """The first file entry of ``manifest`` that is not a group checkpoint's, in one line,
    or None: a name other than ``.metadata`` or ``__<rank>_<n>.distcp`` of a rank below the
    world size (a name with a path in it included), a name twice, a negative size, a
    sha256 that is not 64 hex digits, or no ``.metadata`` at all. Pure."""
    seen = set()
    for name, size, digest in manifest.files:
        shard = _SHARD.match(name)
        if name != INDEX and not (shard and int(shard.group(1)) < manifest.world_size):
            return f"the manifest names {name!r}, not a file of a group checkpoint of " \
                   f"{manifest.world_size} ranks"
        if name in seen:
            return f"the manifest names {name} twice"
        if size < 0 or not _SHA256.match(digest):
            return f"the manifest gives {name} a size of {size} and sha256 {digest!r}"
        seen.add(name)
    return None if INDEX in seen else f"the manifest names no {INDEX}"


@dataclass(frozen=True)
class CheckpointAnswer:
    """A rank's answer to a save or load: the step saved or loaded, or why the group
    refused it (one line; nothing was written or loaded then, the group is sound)."""

    step: int | None
    refused: str | None = None


def state_shapes(state: Mapping[str, object]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The (name, unsharded shape) of every tensor entry of a model state dict, in order
    (a DTensor's ``shape`` is its global shape)."""
    return tuple((k, tuple(v.shape)) for k, v in state.items() if isinstance(v, torch.Tensor))


def first_entry_difference(theirs, ours, missing: str, extra: str, shape: str) -> str | None:
    """The first difference between two ``(name, shape)`` sequences, in one line, or None:
    an entry of ``theirs`` that ``ours`` lacks (``missing``) or holds in another shape
    (``shape``), in ``theirs``' order, then one only ``ours`` has (``extra``). The three are
    format strings over ``{name}`` (the entry's repr) and, for ``shape``, ``{theirs}`` and
    ``{ours}`` (the two shapes). Pure; shared by checkpoint loads and shard joins."""
    mine = dict(ours)
    for name, dims in theirs:
        if name not in mine:
            return missing.format(name=repr(name))
        if tuple(mine[name]) != tuple(dims):
            return shape.format(name=repr(name), theirs=tuple(dims), ours=tuple(mine[name]))
    known = {name for name, _ in theirs}
    return next((extra.format(name=repr(name)) for name, _ in ours if name not in known), None)


def first_difference(saved: CheckpointManifest, model: tuple[tuple[str, tuple[int, ...]], ...],
                     optimizer: str) -> str | None:
    """The first way the checkpoint ``saved`` does not fit a model with state ``model``
    (``state_shapes``) and an optimizer named ``optimizer``, in one line; ``None`` when it
    fits. Entries are compared in the checkpoint's order, then the model's extra ones."""
    if saved.optimizer != optimizer:
        return f"optimizer: the checkpoint has {saved.optimizer}, the task {optimizer}"
    return first_entry_difference(
        saved.state, model, missing="{name} is in the checkpoint, not in the model",
        extra="{name} is in the model, not in the checkpoint",
        shape="{name} has shape {theirs} in the checkpoint, {ours} in the model")


def torn_file(saved: CheckpointManifest, present: Mapping[str, int]) -> str | None:
    """The first file the manifest names that is missing or has another size in ``present``
    (name -> bytes on disk), in one line; ``None`` when all are whole."""
    for name, size, _ in saved.files:
        if name not in present:
            return f"file {name} is missing"
        if present[name] != size:
            return f"file {name} has {present[name]} bytes, the manifest says {size}"
    return None


def is_remote(location: str) -> bool:
    """A URI other than ``file://`` (object storage: no rename, reached through pyarrow)."""
    return "://" in location and not location.startswith("file://")


def child(location: str, *names: str) -> str:
    """``location`` (a path or a URI, options after ``?`` kept at the end) with ``names``
    appended as path components. Pure."""
    base, sep, query = location.partition("?")
    return "/".join([base.rstrip("/"), *names]) + sep + query if "://" in base else \
        os.path.join(base, *names) + (sep + query if sep else "")


def resolve(location: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow file system and the path on it for a checkpoint ``location`` (a local
    path, ``~`` expanded, or a URI). Raises what ``pyarrow.fs.FileSystem.from_uri`` raises
    for an unknown scheme (``ValueError``/``OSError``)."""
    if "://" in location:
        return pafs.FileSystem.from_uri(location)
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(location))


def staging_path(path: str, nonce: str) -> str:
    """Where a save writes before the rename: beside ``path``, so on its file system; for a
    remote ``path``, a directory on the writing node's own disk (``local_staging``)."""
    if is_remote(path):
        return local_staging(nonce)
    if path.startswith("file://"):
        path = path[len("file://"):]
    return f"{os.path.normpath(path)}.partial-{nonce}"


def local_staging(nonce: str) -> str:
    """A node-local directory for staging a remote checkpoint (the same path on every rank
    of a group: they share a node)."""
    return os.path.join(tempfile.gettempdir(), f"moshray-group-checkpoint-{nonce}")


def list_checkpoints(base: str) -> list[str]:
    """The ``step-<n>`` entries under ``base`` (a path or a URI), newest first, as
    locations; empty when ``base`` does not exist."""
    fs, root = resolve(base)
    infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    names = sorted((i.base_name for i in infos if i.type == pafs.FileType.Directory
                    and i.base_name.startswith("step-") and ".partial-" not in i.base_name),
                   reverse=True)
    return [child(base, name) for name in names]


def newest(base: str) -> str | None:
    """The newest whole checkpoint (``step-<n>`` with its manifest and every file it names)
    under ``base``, or None; a torn or partial one is passed over for an older one. An older
    moshray's (``OlderCheckpointError``) is raised, not passed over: a job would otherwise
    start afresh beside it without a word."""
    for location in list_checkpoints(base):
        try:
            read_manifest(location)
        except OlderCheckpointError:
            raise
        except CheckpointError:
            continue
        return location
    return None


# -- the rank side (I/O; every rank of the group calls these, in the same order) ---------------


def _storage():
    """DCP through this format's storage (``group_checkpoint_storage``) and DCP's state dict
    API, imported on first use (about a second; drivers never need them)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from moshray.actors.replica import group_checkpoint_storage

    return group_checkpoint_storage, get_state_dict, set_state_dict


def _files(fs: pafs.FileSystem, root: str) -> dict[str, int]:
    """name -> size of the files directly in ``root`` (empty if it does not exist)."""
    infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    return {i.base_name: i.size for i in infos if i.type == pafs.FileType.File}


def _sha256(fs: pafs.FileSystem, path: str, keep: bool = False) -> tuple[str, bytes | None]:
    """The sha256 (hex) of the file ``path``, read in pieces; with ``keep``, its bytes too."""
    h, kept = hashlib.sha256(), []
    with fs.open_input_stream(path) as stream:
        while piece := stream.read(_READ_BYTES):
            h.update(piece)
            if keep:
                kept.append(piece)
    return h.hexdigest(), b"".join(kept) if keep else None


def _unreadable(path: str, exc: Exception) -> CheckpointError:
    return CheckpointError(f"{path}: unreadable ({type(exc).__name__}: "
                           f"{' '.join(str(exc).split())[:200]})")


def read_manifest(path: str) -> CheckpointManifest:
    """The manifest of the checkpoint at ``path`` (a path or a URI), its files checked
    against it by name and size (not by content: ``verify_files``); ``CheckpointError`` (one
    line) when there is none (not a whole checkpoint), it is torn, of another format or
    version (``OlderCheckpointError``: an older moshray's), it names a file a group
    checkpoint does not have, or the storage cannot be read."""
    try:
        fs, root = resolve(path)
        present = _files(fs, root)
        if MANIFEST not in present:
            what = ("no such directory" if fs.get_file_info(root).type != pafs.FileType.Directory
                    and not present else f"no {MANIFEST}, not a whole group checkpoint")
            raise CheckpointError(f"{path}: {what}")
        with fs.open_input_stream(f"{root}/{MANIFEST}") as stream:
            manifest = CheckpointManifest.from_json(stream.read().decode(), path)
    except (OSError, ValueError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise _unreadable(path, exc) from None
    torn = torn_file(manifest, present)
    if torn:
        raise CheckpointError(f"{path}: torn checkpoint: {torn}")
    return manifest


def verify_files(path: str, manifest: CheckpointManifest, where: str | None = None) -> None:
    """Check the files of the checkpoint at ``path`` (a path or a URI) against ``manifest``
    before anything reads them: each file's sha256, then the index (``.metadata``) decoded
    as JSON, every chunk it places in a shard file the manifest names, within its size.
    Reads every file once, in pieces, and builds nothing from a shard. ``CheckpointError``
    (one line, naming the file) for the first that differs, an index that is not this
    format's (a pickle among them: it is never unpickled), or storage that cannot be
    read; the message names ``where`` (default ``path``)."""
    storage, _, _ = _storage()
    where = where or path
    try:
        fs, root = resolve(path)
        index = None
        for name, _, digest in manifest.files:
            found, blob = _sha256(fs, f"{root}/{name}", keep=name == INDEX)
            if found != digest:
                raise CheckpointError(f"{where}: file {name}: sha256 differs from the "
                                      f"manifest (corrupt or replaced); not loaded")
            index = blob if name == INDEX else index
    except OSError as exc:
        raise _unreadable(where, exc) from None
    storage.index_from_json(index, manifest.shards, where)


def exists(location: str) -> bool:
    """Whether a checkpoint ``location`` is taken: a local directory, or for a remote one a
    manifest (an object store's shards without one are a failed save's leftovers)."""
    if is_remote(location):
        fs, root = resolve(location)
        return fs.get_file_info(f"{root}/{MANIFEST}").type == pafs.FileType.File
    return os.path.exists(resolve(location)[1])


def save_state(model: torch.nn.Module, opt: torch.optim.Optimizer, staging: str, final: str,
               manifest: CheckpointManifest, rank: int) -> str | None:
    """Write this rank's shard of ``model`` and ``opt`` into ``staging`` (DCP, the index as
    JSON); rank 0 then adds the manifest (``manifest`` with the shapes and every file's size
    and sha256 filled in) and renames ``staging`` to ``final``, or for a remote ``final``
    uploads the files and writes the manifest there last (module docstring). A
    collective: every rank calls it. Returns ``None``, or on rank 0 why ``final`` was not
    written (it appeared meanwhile; the staging directory is removed). Storage errors
    (``OSError``) propagate; ``CheckpointError`` if DCP wrote a file this format does not
    name (nothing is published then)."""
    storage, get_state_dict, _ = _storage()
    msd, osd = get_state_dict(model, opt)  # FSDP2: DTensor shards, DDP: whole tensors
    storage.save({"model": msd, "optim": osd}, staging)
    if rank:
        return None
    local = pafs.LocalFileSystem()
    files = tuple(sorted((e.name, e.stat().st_size, _sha256(local, e.path)[0])
                         for e in os.scandir(staging) if e.is_file()))
    manifest = CheckpointManifest(manifest.step, manifest.world_size, manifest.parallel,
                                  manifest.optimizer, state_shapes(model.state_dict()), files)
    odd = file_difference(manifest)
    if odd:
        shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(f"{final}: not saved: {odd}")
    if is_remote(final):
        try:
            return _upload(staging, final, manifest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    final = resolve(final)[1]
    _write_synced(os.path.join(staging, MANIFEST), manifest.to_json())
    if os.path.exists(final):  # rename(2) would replace an empty directory silently
        shutil.rmtree(staging, ignore_errors=True)
        return f"{final}: exists (written meanwhile); not replaced"
    os.rename(staging, final)
    _fsync_dir(os.path.dirname(os.path.abspath(final)))
    return None


def _upload(staging: str, final: str, manifest: CheckpointManifest) -> str | None:
    """Rank 0's publication of a remote checkpoint: every file of ``staging`` to ``final``,
    then the manifest (the commit). None, or why not (``final`` was taken meanwhile)."""
    if exists(final):
        return f"{final}: exists (written meanwhile); not replaced"
    fs, root = resolve(final)
    fs.create_dir(root, recursive=True)
    for name, _, _ in manifest.files:
        pafs.copy_files(os.path.join(staging, name), f"{root}/{name}",
                        source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
    with fs.open_output_stream(f"{root}/{MANIFEST}") as out:
        out.write(manifest.to_json().encode())
    return None


def fetch(path: str, into: str, manifest: CheckpointManifest) -> str:
    """The files ``manifest`` (read from the remote checkpoint ``path``) names, copied into
    the local directory ``into`` and checked there (``verify_files``: what a load reads is
    what was hashed); returns ``into``. ``CheckpointError`` (one line) for a copy that
    differs or storage that cannot be read; ``into`` is removed then."""
    try:
        fs, root = resolve(path)
        os.makedirs(into, exist_ok=True)
        for name, _, _ in manifest.files:
            pafs.copy_files(f"{root}/{name}", os.path.join(into, name), source_filesystem=fs,
                            destination_filesystem=pafs.LocalFileSystem())
        verify_files(into, manifest, where=path)
    except (CheckpointError, OSError) as exc:
        shutil.rmtree(into, ignore_errors=True)
        if isinstance(exc, CheckpointError):
            raise
        raise _unreadable(path, exc) from None
    return into


def load_state(model: torch.nn.Module, opt: torch.optim.Optimizer, path: str,
               manifest: CheckpointManifest) -> None:
    """Fill ``model`` and ``opt`` (sharded as this group shards them) from the checkpoint at
    ``path`` (a local directory: a remote checkpoint is ``fetch``ed first), resharding as
    needed (see module docstring). A collective: every rank calls it with the ``manifest``
    rank 0 read, after ``first_difference`` and ``verify_files`` found nothing wrong. Reads
    no code whatever the files hold; ``CheckpointError`` (one line, on every rank) when an
    entry is refused while loading, which may leave ``model`` and ``opt`` part-filled."""
    storage, get_state_dict, set_state_dict = _storage()
    msd, osd = get_state_dict(model, opt)  # a fresh optimizer gets zero state to fill here
    state = {"model": msd, "optim": osd}
    storage.load(state, resolve(path)[1], manifest.shards, manifest.sha256(INDEX))
    set_state_dict(model, opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def _write_synced(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
