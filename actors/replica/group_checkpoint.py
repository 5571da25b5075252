"""Sharded checkpoints of a replica group (issue 47, item 3): every rank writes its own shard
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
from collections.abc import Mapping
from dataclasses import dataclass

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


def staging_path(path: str, nonce: str) -> str:
    """Where a save writes before the rename: beside ``path``, so on its file system."""
    return f"{os.path.normpath(path)}.partial-{nonce}"


# -- the rank side (I/O; every rank of the group calls these, in the same order) ---------------


def _dcp():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    return dcp, get_state_dict, set_state_dict


def read_manifest(path: str) -> CheckpointManifest:
    """The manifest of the checkpoint at ``path``, its files checked against it;
    ``CheckpointError`` (one line) when there is none (not a whole checkpoint) or torn."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = CheckpointManifest.from_json(f.read(), path)
    except FileNotFoundError:
        what = "no such directory" if not os.path.isdir(path) else \
            f"no {MANIFEST}, not a whole group checkpoint"
        raise CheckpointError(f"{path}: {what}") from None
    present = {e.name: e.stat().st_size for e in os.scandir(path) if e.is_file()}
    torn = torn_file(manifest, present)
    if torn:
        raise CheckpointError(f"{path}: torn checkpoint: {torn}")
    return manifest


def save_state(model: torch.nn.Module, opt: torch.optim.Optimizer, staging: str, final: str,
               manifest: CheckpointManifest, rank: int) -> str | None:
    """Write this rank's shard of ``model`` and ``opt`` into ``staging``; rank 0 then adds
    the manifest (``manifest`` with the shapes and files filled in) and renames ``staging``
    to ``final``. A collective: every rank calls it. Returns ``None``, or on rank 0 why
    ``final`` was not written (it appeared meanwhile; the staging directory is removed)."""
    dcp, get_state_dict, _ = _dcp()
    msd, osd = get_state_dict(model, opt)  # FSDP2: DTensor shards, DDP: whole tensors
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=staging)
    if rank:
        return None
    files = tuple(sorted((e.name, e.stat().st_size) for e in os.scandir(staging)
                         if e.is_file()))
    manifest = CheckpointManifest(manifest.step, manifest.world_size, manifest.parallel,
                                  manifest.optimizer, state_shapes(model.state_dict()), files)
    _write_synced(os.path.join(staging, MANIFEST), manifest.to_json())
    if os.path.exists(final):  # rename(2) would replace an empty directory silently
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
        return f"{final}: exists (written meanwhile); not replaced"
    os.rename(staging, final)
    _fsync_dir(os.path.dirname(os.path.abspath(final)))
    return None


def load_state(model: torch.nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    """Fill ``model`` and ``opt`` (sharded as this group shards them) from the checkpoint at
    ``path``, resharding as needed (see module docstring). A collective: every rank calls
    it, after ``read_manifest`` and ``first_difference`` found nothing wrong."""
    dcp, get_state_dict, set_state_dict = _dcp()
    msd, osd = get_state_dict(model, opt)  # a fresh optimizer gets zero state to fill here
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
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
