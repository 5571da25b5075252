"""Sharded checkpoints of a replica group: every rank writes its own shard
with ``torch.distributed.checkpoint`` (DCP), and a checkpoint written by W ranks loads into a
group of any other size W' (DCP reshards on load).

Layout of a checkpoint directory ``path``::

    path/__<rank>_0.distcp     each rank's shard of the model and optimizer state (DCP)
    path/.metadata             DCP's index of every tensor's chunks (rank 0, after all wrote)
    path/moshray.json          the manifest (``CheckpointManifest``): step, world size, the
                               unsharded shape of every state entry, the size of every file

Visible only when whole: the ranks write into a staging directory beside ``path``
(``staging_path``: ``<path>.partial-<nonce>``, the same file system), rank 0 adds the manifest
once ``dcp.save`` has returned (DCP's last phase gathers every rank's write results before
it returns, so every shard is on disk by then), and renames the directory to ``path`` (one
``rename(2)``: atomic on a POSIX file system). A reader sees no directory or a whole one; a
failed save leaves ``<path>.partial-*`` behind, which nothing reads. A load also checks that
every file the manifest names is there with its size (a torn copy is refused), and that the
checkpoint's state names and shapes are the model's (``first_difference``); rank 0 checks and
tells the others before any rank loads anything, so a refused load leaves the group sound.

Durable storage: ``path`` may also be a URI ``pyarrow.fs`` understands (``s3://bucket/dir``,
``gs://bucket/dir``, with options as query parameters), the location a group job on several
machines needs. The ranks then stage on their node's disk (``local_staging``), rank 0 uploads
the shards and ``.metadata`` to ``path`` and writes the manifest last: an object store has
no rename, so the manifest is the commit (a reader takes a directory only with its manifest
and every file it names at its size; a save that failed leaves shards without a manifest).
A load downloads the checkpoint to a node-local directory first (rank 0; the others read the
same directory, as the group is on one node), and removes it after.

Resharding: each rank asks ``get_state_dict`` for the state of the model and optimizer it
holds, laid out as the *loading* group shards it (FSDP2 DTensor shards of 1/W', or whole
tensors under DDP), and ``dcp.load`` fills each of those tensors from whichever saved chunks
overlap it (DCP's ``.metadata`` records the offsets of each chunk); ``set_state_dict`` then
hands the optimizer its state. All ranks must see the same directory: the group's ranks are
on one node (``ReplicaGroup.start`` packs them), or ``path`` is on a shared file system.

The pure parts (manifest, comparisons, staging names) are apart from the rank-side I/O
(``save_state``, ``load_state``), which the ``GroupRank`` actor calls.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass

import pyarrow.fs as pafs
import torch

FORMAT = "moshray-group-checkpoint"
VERSION = 1
MANIFEST = "moshray.json"


class CheckpointError(ValueError):
    """A checkpoint cannot be written or read here; ``str()`` is one line."""


# -- the manifest and the checks (pure) --------------------------------------------------------


@dataclass(frozen=True)
class CheckpointManifest:
    """What a checkpoint holds, written last (see module docstring). ``state``: the unsharded
    shape of each model entry, in the model's order; ``files``: each file's size in bytes."""

    step: int
    world_size: int
    parallel: str
    optimizer: str
    state: tuple[tuple[str, tuple[int, ...]], ...]
    files: tuple[tuple[str, int], ...] = ()

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "version": VERSION, "step": self.step,
                           "world_size": self.world_size, "parallel": self.parallel,
                           "optimizer": self.optimizer,
                           "state": [[k, list(s)] for k, s in self.state],
                           "files": [[f, n] for f, n in self.files]}, indent=1)

    @classmethod
    def from_json(cls, text: str, where: str = "checkpoint") -> CheckpointManifest:
        """Parse a manifest; ``CheckpointError`` (one line) for another format or version."""
        try:
            d = json.loads(text)
            if d.get("format") != FORMAT or d.get("version") != VERSION:
                raise CheckpointError(f"{where}: format {d.get('format')!r} version "
                                      f"{d.get('version')!r}, expected {FORMAT!r} {VERSION}")
            return cls(int(d["step"]), int(d["world_size"]), str(d["parallel"]),
                       str(d["optimizer"]), tuple((k, tuple(s)) for k, s in d["state"]),
                       tuple((f, int(n)) for f, n in d["files"]))
        except (ValueError, KeyError, TypeError) as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"{where}: unreadable manifest ({type(exc).__name__}: "
                                  f"{exc})") from None


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
    for name, size in saved.files:
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
    under ``base``, or None; a torn or partial one is passed over for an older one."""
    for location in list_checkpoints(base):
        try:
            read_manifest(location)
        except CheckpointError:
            continue
        return location
    return None


# -- the rank side (I/O; every rank of the group calls these, in the same order) ---------------


def _dcp():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    return dcp, get_state_dict, set_state_dict


def _files(fs: pafs.FileSystem, root: str) -> dict[str, int]:
    """name -> size of the files directly in ``root`` (empty if it does not exist)."""
    infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    return {i.base_name: i.size for i in infos if i.type == pafs.FileType.File}


def read_manifest(path: str) -> CheckpointManifest:
    """The manifest of the checkpoint at ``path`` (a path or a URI), its files checked
    against it; ``CheckpointError`` (one line) when there is none (not a whole checkpoint),
    it is torn, or the storage cannot be read."""
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
        raise CheckpointError(f"{path}: unreadable ({type(exc).__name__}: "
                              f"{' '.join(str(exc).split())[:200]})") from None
    torn = torn_file(manifest, present)
    if torn:
        raise CheckpointError(f"{path}: torn checkpoint: {torn}")
    return manifest


def exists(location: str) -> bool:
    """Whether a checkpoint ``location`` is taken: a local directory, or for a remote one a
    manifest (an object store's shards without one are a failed save's leftovers)."""
    if is_remote(location):
        fs, root = resolve(location)
        return fs.get_file_info(f"{root}/{MANIFEST}").type == pafs.FileType.File
    return os.path.exists(resolve(location)[1])


def save_state(model: torch.nn.Module, opt: torch.optim.Optimizer, staging: str, final: str,
               manifest: CheckpointManifest, rank: int) -> str | None:
    """Write this rank's shard of ``model`` and ``opt`` into ``staging``; rank 0 then adds
    the manifest (``manifest`` with the shapes and files filled in) and renames ``staging``
    to ``final``, or for a remote ``final`` uploads the files and writes the manifest
    there last (module docstring). A collective: every rank calls it. Returns ``None``, or
    on rank 0 why ``final`` was not written (it appeared meanwhile; the staging directory
    is removed). Storage errors (``OSError``) propagate."""
    dcp, get_state_dict, _ = _dcp()
    msd, osd = get_state_dict(model, opt)  # FSDP2: DTensor shards, DDP: whole tensors
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=staging)
    if rank:
        return None
    files = tuple(sorted((e.name, e.stat().st_size) for e in os.scandir(staging)
                         if e.is_file()))
    manifest = CheckpointManifest(manifest.step, manifest.world_size, manifest.parallel,
                                  manifest.optimizer, state_shapes(model.state_dict()), files)
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
    for name, _ in manifest.files:
        pafs.copy_files(os.path.join(staging, name), f"{root}/{name}",
                        source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
    with fs.open_output_stream(f"{root}/{MANIFEST}") as out:
        out.write(manifest.to_json().encode())
    return None


def fetch(path: str, into: str) -> str:
    """A remote checkpoint's files (those its manifest names, and the manifest) copied into
    the local directory ``into``; returns ``into``. ``OSError`` from the storage."""
    fs, root = resolve(path)
    manifest = read_manifest(path)
    os.makedirs(into, exist_ok=True)
    for name in [f for f, _ in manifest.files] + [MANIFEST]:
        pafs.copy_files(f"{root}/{name}", os.path.join(into, name), source_filesystem=fs,
                        destination_filesystem=pafs.LocalFileSystem())
    return into


def load_state(model: torch.nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    """Fill ``model`` and ``opt`` (sharded as this group shards them) from the checkpoint at
    ``path`` (a local directory: a remote checkpoint is ``fetch``ed first), resharding as
    needed (see module docstring). A collective: every rank calls it, after
    ``read_manifest`` and ``first_difference`` found nothing wrong."""
    dcp, get_state_dict, set_state_dict = _dcp()
    msd, osd = get_state_dict(model, opt)  # a fresh optimizer gets zero state to fill here
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=resolve(path)[1])
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
