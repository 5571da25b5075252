"""Where a job's batches come from: sources split into shards, opened by the replicas.

Every source has ``num_shards`` and ``open(shard, seed) -> iterator of batches``. A replica
opens the shards the Coordinator hands it (``cluster/coordinator/shard_ledger.py``): sharding follows
the live replicas, and the data position survives joins and resumes. Sources travel to the
replicas inside the job spec, so they hold URIs or object-store refs, never a path only
the driver can open.

- ``from_fn(fn, num_shards)``: the user's ``fn(shard, num_shards, seed) -> iterator``.
- ``parquet(uris, batch_size)``: Parquet files (local, ``s3://``, ``gs://``; anything
  pyarrow opens), one shard per row group, streamed in record batches, never read whole.
  Local files only on one machine: the job refuses them once it sees a second one.
- ``from_dataset(ds, batch_size)``: a Ray Data ``Dataset``, its blocks in the object store.
- ``by_step(fn)``: for replica groups (``cluster.replica = "node"``) only, not a source:
  ``fn(step)`` is the global batch of each step, which the swarm splits among the groups
  and their ranks (``actors/replica/group_loop.py``).

``as_source`` turns what a user passes (a source, a function, URIs, a Dataset) into one.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from moshray.actors.errors import UserError

if TYPE_CHECKING:
    import pyarrow.fs as pafs

DEFAULT_SHARDS = 64


@runtime_checkable
class DataSource(Protocol):
    """``open(shard, seed)`` yields the batches of ``shard`` (0 <= shard < num_shards);
    ``seed`` changes with the data epoch so a source may reshuffle inside a shard."""

    num_shards: int

    def open(self, shard: int, seed: int) -> Iterator[Any]: ...


@dataclass(frozen=True)
class FunctionSource:
    """The user's function ``fn(shard, num_shards, seed) -> iterator of batches``."""

    fn: Callable[[int, int, int], Any]
    num_shards: int = DEFAULT_SHARDS

    def open(self, shard: int, seed: int) -> Iterator[Any]:
        return iter(self.fn(shard, self.num_shards, seed))


def from_fn(fn: Callable[[int, int, int], Any], num_shards: int = DEFAULT_SHARDS) -> FunctionSource:
    """A source from ``fn(shard, num_shards, seed) -> iterable of batches``; ``UserError``
    if ``fn`` cannot take those three arguments or ``num_shards`` < 1."""
    if not callable(fn):
        raise UserError("data", f"expected a function (shard, num_shards, seed) -> batches, "
                        f"got {type(fn).__name__}")
    try:
        inspect.signature(fn).bind(0, 1, 0)
    except TypeError:
        raise UserError("data", f"{getattr(fn, '__name__', fn)} must take (shard, num_shards, "
                        f"seed)") from None
    except ValueError:  # no signature (a builtin): let the first call tell
        pass
    if int(num_shards) < 1:
        raise UserError("data", f"num_shards must be at least 1, got {num_shards}")
    return FunctionSource(fn, int(num_shards))


def record_batch_to_tensors(batch) -> dict[str, Any]:
    """The default transform of Arrow record batches: ``{column: torch tensor}`` (numeric
    columns; others stay Python lists)."""
    import torch

    out: dict[str, Any] = {}
    for name, column in zip(batch.schema.names, batch.columns):
        try:
            out[name] = torch.from_numpy(column.to_numpy(zero_copy_only=False).copy())
        except (TypeError, ValueError):  # strings, nested types
            out[name] = column.to_pylist()
    return out


def _record_batches(batches, transform) -> Iterator[Any]:
    for rb in batches:
        if rb.num_rows:
            yield transform(rb)


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """``(filesystem, path)`` for a local path or a ``scheme://`` URI (pyarrow's
    filesystems: local, ``s3://``, ``gs://``...). Raises pyarrow's error for a URI whose
    scheme it cannot open."""
    import os

    import pyarrow.fs as pafs

    if "://" in uri:
        return pafs.FileSystem.from_uri(uri)
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))


def as_uri(fs: pafs.FileSystem, path: str, original: str) -> str:
    """Re-attach the scheme that ``FileSystem.from_uri`` stripped off ``path``."""
    import pyarrow.fs as pafs

    if isinstance(fs, pafs.LocalFileSystem):
        return path
    scheme = original.split("://", 1)[0]
    return f"{scheme}://{path}"


@dataclass(frozen=True)
class ParquetSource:
    """Row groups of Parquet files, each a shard, streamed ``batch_size`` rows at a time."""

    fragments: tuple[tuple[str, int], ...]  # (uri, row group)
    batch_size: int
    columns: tuple[str, ...] | None = None
    transform: Callable[[Any], Any] = record_batch_to_tensors

    @property
    def num_shards(self) -> int:
        return len(self.fragments)

    @property
    def uris(self) -> tuple[str, ...]:
        """The files read, each once (a node-local one is refused on a cluster of several
        machines: ``jobs/controller/durability.py``)."""
        return tuple(dict.fromkeys(uri for uri, _ in self.fragments))

    def open(self, shard: int, seed: int) -> Iterator[Any]:
        import pyarrow.parquet as pq


        uri, row_group = self.fragments[shard]
        fs, path = filesystem(uri)
        with fs.open_input_file(path) as handle:
            reader = pq.ParquetFile(handle)
            batches = reader.iter_batches(batch_size=self.batch_size, row_groups=[row_group],
                                          columns=list(self.columns) if self.columns else None)
            yield from _record_batches(batches, self.transform)


def parquet(uris: str | Sequence[str], batch_size: int, columns: Sequence[str] | None = None,
            transform: Callable[[Any], Any] | None = None) -> ParquetSource:
    """A source over Parquet files or directories (local paths, ``s3://``, ``gs://``); reads
    only the files' footers here, on the driver. ``UserError`` if nothing is found. A local
    path is read by every replica on its own machine: the job refuses it (one line) once
    its cluster has a second machine."""
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq


    if int(batch_size) < 1:
        raise UserError("data", f"batch_size must be at least 1, got {batch_size}")
    fragments: list[tuple[str, int]] = []
    for uri in [uris] if isinstance(uris, str) else list(uris):
        fs, path = filesystem(uri)
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.Directory:
            infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
            paths = sorted(i.path for i in infos if i.path.endswith(".parquet"))
        elif info.type == pafs.FileType.File:
            paths = [path]
        else:
            raise UserError("data", f"{uri} does not exist")
        for p in paths:
            with fs.open_input_file(p) as handle:
                groups = pq.ParquetFile(handle).metadata.num_row_groups
            fragments += [(as_uri(fs, p, uri), g) for g in range(groups)]
    if not fragments:
        raise UserError("data", f"no Parquet row groups found in {uris}")
    return ParquetSource(tuple(fragments), int(batch_size),
                         tuple(columns) if columns else None,
                         transform or record_batch_to_tensors)


@dataclass(frozen=True)
class ArrowRefsSource:
    """Arrow tables in Ray's object store (a Ray Data ``Dataset``'s blocks), one a shard.
    ``refs`` is a tuple inside a tuple so Ray passes the ObjectRefs through unresolved."""

    refs: tuple
    batch_size: int
    transform: Callable[[Any], Any] = record_batch_to_tensors

    @property
    def num_shards(self) -> int:
        return len(self.refs[0])

    def open(self, shard: int, seed: int) -> Iterator[Any]:
        import ray

        table = ray.get(self.refs[0][shard])
        yield from _record_batches(table.to_batches(max_chunksize=self.batch_size),
                                   self.transform)


def from_dataset(ds, batch_size: int, num_shards: int | None = None,
                 transform: Callable[[Any], Any] | None = None) -> ArrowRefsSource:
    """A source over a Ray Data ``Dataset`` (driver side, Ray connected): its blocks are
    materialized in the object store (``num_shards`` of them if given) and each replica
    fetches the ones it is handed."""
    if num_shards:
        ds = ds.repartition(int(num_shards))
    refs = tuple(ds.to_arrow_refs())
    if not refs:
        raise UserError("data", "the Ray Dataset has no blocks")
    return ArrowRefsSource((refs,), int(batch_size), transform or record_batch_to_tensors)


@dataclass(frozen=True)
class StepBatches:
    """``by_step(fn)``: the global batch of every step for replica groups; calling it with a
    step gives ``fn(step)`` checked to be a tuple of tensors (``UserError`` otherwise)."""

    fn: Callable[[int], Any]

    def __call__(self, step: int) -> tuple:
        batch = self.fn(step)
        if isinstance(batch, list):
            batch = tuple(batch)
        if not (isinstance(batch, tuple) and batch and all(
                hasattr(t, "shape") and hasattr(t, "tensor_split") for t in batch)):
            raise UserError("data", f"by_step: fn({step}) must return a tuple of tensors "
                            f"(inputs, targets, ...), got {type(batch).__name__}")
        return batch


def by_step(fn: Callable[[int], Any]) -> StepBatches:
    """The global batch of each step, ``fn(step) -> (tensor, ...)``, for replica groups
    (``cluster.replica = "node"``): step ``s``'s rows divide among the groups x ranks that
    train it. ``UserError`` if ``fn`` is no function of one argument."""
    if not callable(fn):
        raise UserError("data", f"by_step: expected a function step -> batch, got "
                        f"{type(fn).__name__}")
    try:
        inspect.signature(fn).bind(0)
    except TypeError:
        raise UserError("data", "by_step: the function must take one argument, the step") \
            from None
    except ValueError:  # no signature (a builtin): let the first call tell
        pass
    return StepBatches(fn)


def as_source(data: Any, batch_size: int | None = None) -> DataSource:
    """What ``moshray.fit`` accepts as ``data``, as a source (see module docstring)."""
    if isinstance(data, StepBatches):
        raise UserError("data", "moshray.data.by_step is for replica groups: set "
                        "cluster.replica = \"node\", or pass shards (from_fn) for one replica "
                        "per GPU")
    if isinstance(data, DataSource):
        return data
    if type(data).__name__ in ("Dataset", "MaterializedDataset") and hasattr(data, "to_arrow_refs"):
        return from_dataset(data, batch_size or 32)
    if isinstance(data, str) or (isinstance(data, (list, tuple)) and data
                                 and all(isinstance(u, str) for u in data)):
        return parquet(data, batch_size or 32)
    if callable(data):
        return from_fn(data)
    raise UserError("data", f"expected a function (shard, num_shards, seed) -> batches, "
                    f"Parquet URIs or a Ray Dataset, got {type(data).__name__}")
