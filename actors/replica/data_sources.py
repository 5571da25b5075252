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
- ``from_torch(dataset, batch_size)``: a map-style torch ``Dataset`` (or a function that
  builds one on the replica), shards of contiguous index ranges read through torch's
  ``DataLoader``; for replica groups its ``by_step`` batches walk a seeded permutation.
- ``by_step(fn)``: for replica groups (``cluster.replica = "node"``) only, not a source:
  ``fn(step)`` is the global batch of each step, which the swarm splits among the groups
  and their ranks (``actors/replica/group_loop.py``).

``as_source`` turns what a user passes (a source, a function, URIs, a Ray Dataset, a torch
Dataset or DataLoader) into one.
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


_LOADER_KEYS = frozenset({"collate_fn", "num_workers", "pin_memory", "drop_last",
                          "persistent_workers", "prefetch_factor", "worker_init_fn", "timeout"})


@dataclass(frozen=True)
class TorchSource:
    """``from_torch``: a map-style torch ``Dataset`` of ``size`` samples in ``num_shards``
    shards of contiguous index ranges; ``open(shard, seed)`` reads one through a torch
    ``DataLoader`` (its order permuted by ``seed`` when ``shuffle``). The shard ledger hands
    every shard out once per data epoch, so no sample is read twice in an epoch. ``dataset``
    is the Dataset itself or a function of no argument that builds it (called once per
    process that reads it: a replica builds its own, e.g. opening files by URI)."""

    dataset: Any
    size: int
    batch_size: int
    num_shards: int
    shuffle: bool = True
    loader: tuple = ()  # DataLoader keyword arguments, as (name, value) pairs

    def _built(self):
        built = self.__dict__.get("_built_dataset")
        if built is None:
            import torch.utils.data as tud

            built = self.dataset if isinstance(self.dataset, tud.Dataset) else self.dataset()
            if len(built) != self.size:
                raise UserError("data", f"from_torch: the dataset built here has {len(built)} "
                                f"samples, the driver's {self.size}: build the same dataset "
                                f"everywhere")
            object.__setattr__(self, "_built_dataset", built)
        return built

    def __getstate__(self):  # (the dataset built in one process never travels)
        return {k: v for k, v in self.__dict__.items() if k != "_built_dataset"}

    def __setstate__(self, state):
        self.__dict__.update(state)

    def bounds(self, shard: int) -> tuple[int, int]:
        """The index range ``[start, stop)`` of ``shard`` (sizes differ by at most one)."""
        return (shard * self.size // self.num_shards,
                (shard + 1) * self.size // self.num_shards)

    def open(self, shard: int, seed: int) -> Iterator[Any]:
        import torch
        import torch.utils.data as tud

        start, stop = self.bounds(shard)
        indices = list(range(start, stop))
        if self.shuffle:
            g = torch.Generator().manual_seed(seed * 1_000_003 + shard)
            indices = [indices[i] for i in torch.randperm(len(indices), generator=g).tolist()]
        loader = tud.DataLoader(tud.Subset(self._built(), indices),
                                batch_size=self.batch_size, shuffle=False, **dict(self.loader))
        return iter(loader)

    def step_batch(self, step: int) -> Any:
        """The global batch of ``step`` for replica groups (``by_step``): ``batch_size``
        samples at ``step * batch_size`` of the walk through a permutation per data epoch
        (seeded by the epoch), so each epoch reads every sample once before the next
        starts, the same on every rank."""
        import torch
        import torch.utils.data as tud

        data, picked, at = self._built(), [], step * self.batch_size
        while len(picked) < self.batch_size:
            epoch, offset = divmod(at, self.size)
            order = (torch.randperm(self.size, generator=torch.Generator().manual_seed(epoch))
                     if self.shuffle else torch.arange(self.size))
            take = order[offset:offset + self.batch_size - len(picked)].tolist()
            picked += take
            at += len(take)
        collate = dict(self.loader).get("collate_fn") or tud.default_collate
        return collate([data[i] for i in picked])


def from_torch(dataset: Any, batch_size: int | None = None, num_shards: int | None = None,
               shuffle: bool = True, size: int | None = None, **loader: Any) -> TorchSource:
    """A source over a map-style torch ``Dataset`` (``__getitem__`` and ``__len__``), or a
    ``DataLoader`` (its dataset, batch size and collate function are taken), or a function
    of no argument that builds the Dataset where it is read (``size``: its length, else it
    is built once here to read it). ``batch_size``: the micro-batch of one replica (for
    replica groups, ``by_step``'s global batch of a step); a DataLoader's own by default.
    ``num_shards``: default ``size // batch_size`` (whole batches per shard), at most 64.
    ``loader``: ``DataLoader`` settings (``collate_fn``, ``num_workers``, ``pin_memory``,
    ``drop_last``, ...). ``UserError`` (one line) for an
    ``IterableDataset``, an empty dataset or bad sizes."""
    import torch.utils.data as tud

    if isinstance(dataset, tud.DataLoader):
        loader = {"collate_fn": dataset.collate_fn, "drop_last": dataset.drop_last, **loader}
        batch_size = batch_size if batch_size is not None else dataset.batch_size
        dataset = dataset.dataset
    if isinstance(dataset, tud.IterableDataset):
        raise UserError("data", "from_torch: an IterableDataset cannot be split into shards: "
                        "pass a map-style Dataset, or moshray.data.from_fn(fn) with fn "
                        "yielding the batches of one shard")
    unknown = sorted(set(loader) - _LOADER_KEYS)
    if unknown:
        raise UserError("data", f"from_torch: unknown DataLoader setting(s) {unknown}; "
                        f"allowed: {sorted(_LOADER_KEYS)}")
    if not isinstance(dataset, tud.Dataset):
        if not callable(dataset):
            raise UserError("data", f"from_torch: expected a torch Dataset, a DataLoader or a "
                            f"function building a Dataset, got {type(dataset).__name__}")
        if size is None:
            size = len(dataset())
    elif size is None:
        try:
            size = len(dataset)
        except TypeError:
            raise UserError("data", "from_torch: the Dataset has no __len__: give size=") \
                from None
    if int(size) < 1 or not batch_size or int(batch_size) < 1:
        raise UserError("data", f"from_torch: needs at least one sample and batch_size >= 1, "
                        f"got {size} samples and batch_size {batch_size}")
    shards = (int(num_shards) if num_shards
              else max(1, min(DEFAULT_SHARDS, int(size) // int(batch_size))))
    if not 1 <= shards <= int(size):
        raise UserError("data", f"from_torch: num_shards must be in [1, {size}], got {shards}")
    return TorchSource(dataset, int(size), int(batch_size), shards, bool(shuffle),
                       tuple(sorted(loader.items())))


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
    train it. ``fn`` may be a ``from_torch`` source (``TorchSource.step_batch``).
    ``UserError`` if ``fn`` is no function of one argument."""
    if isinstance(fn, TorchSource):
        return StepBatches(fn.step_batch)
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
    import torch.utils.data as tud

    if isinstance(data, tud.DataLoader):  # (it keeps its own batch size)
        return from_torch(data)
    if isinstance(data, tud.Dataset):
        return from_torch(data, batch_size or 32)
    if callable(data):
        return from_fn(data)
    raise UserError("data", f"expected a function (shard, num_shards, seed) -> batches, "
                    f"Parquet URIs, a Ray Dataset or a torch Dataset / DataLoader, got "
                    f"{type(data).__name__}")

