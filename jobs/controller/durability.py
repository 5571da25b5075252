"""Whether a job's checkpoints and data survive the loss of a machine, decided again each
time the cluster shows a machine it had not shown before.

On one machine its disk is everyone's: node-local paths (no scheme, or ``file://``) work and
checkpoints are optional. Once the job has seen two machines (distinct node addresses, not
node ids: several raylets may share a host), a node-local ``checkpoint.uri`` or no
checkpoint location at all is switched to the cluster's durable location
(``MOSHRAY_CHECKPOINT_URI`` of the driver's environment, which on a real cluster is the
head's), or the job stops with one line saying how to set one (``checkpoint.optional`` runs
without, with a warning); a node-local data path (``data.paths`` or a Parquet source's
files) stops the job, as no other machine can read it.

``decide_durability`` is the pure decision; ``DurabilityGuard`` is the driver's memory of
the machines seen, which applies it (at start, and on each supervision tick).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TextIO

from moshray.actors.errors import UserError

from moshray.jobs.config import ConfigError, TrainConfig

CHECKPOINT_ENV = "MOSHRAY_CHECKPOINT_URI"  # the cluster's durable checkpoint location


def is_node_local(uri: str) -> bool:
    """A path only the machine that writes it can read (no scheme, or ``file://``)."""
    return "://" not in uri or uri.startswith("file://")


@dataclass(frozen=True)
class Keep:
    """The config stands as it is."""


@dataclass(frozen=True)
class Switch:
    """Checkpoints go to ``uri`` (the cluster's durable location) from now on."""

    uri: str


@dataclass(frozen=True)
class Stop:
    """The job cannot go on here: raise ``error`` (a one-line ``ConfigError`` for a setting,
    ``UserError("data", ...)`` for a data source the user passed)."""

    error: ValueError

    @property
    def message(self) -> str:
        return str(self.error)


Durability = Keep | Switch | Stop


def decide_durability(config: TrainConfig, hosts: int, cluster_default: str | None,
                      data_uris: Sequence[str] = ()) -> Durability:
    """What a job on a cluster of ``hosts`` machines does with ``config``. Pure.

    ``cluster_default``: the cluster's durable checkpoint location (None or "" if it has
    none; a node-local one does not count); ``data_uris``: the files of the job's data
    source (a Parquet source's), beside ``config.data.paths``. One machine: ``Keep``. More:
    a node-local data path -> ``Stop``; a durable ``checkpoint.uri`` -> ``Keep``; a node-local
    or missing one -> ``Switch(cluster_default)`` if usable, else ``Keep`` when none was
    given and ``checkpoint.optional``, else ``Stop`` saying how to set one."""
    if hosts <= 1:
        return Keep()
    for path in config.data.paths:
        if is_node_local(path):
            return Stop(ConfigError("data.paths", f"{path!r} is on one machine's disk but this "
                                    f"cluster has {hosts}: use s3:// or gs:// URIs"))
    for uri in data_uris:
        if is_node_local(uri):
            return Stop(UserError("data", f"{uri!r} is on one machine's disk but this cluster "
                                  f"has {hosts}: pass s3:// or gs:// URIs to "
                                  f"moshray.data.parquet"))
    given = config.checkpoint.uri
    if given and not is_node_local(given):
        return Keep()
    if cluster_default and not is_node_local(cluster_default):
        return Switch(cluster_default)
    if given:
        return Stop(ConfigError("checkpoint.uri", f"{given!r} is on one machine's disk but "
                                f"this cluster has {hosts}: use durable storage "
                                f"(s3://bucket/path or gs://bucket/path), or set "
                                f"{CHECKPOINT_ENV} where the head runs `ray start`"))
    if config.checkpoint.optional:
        return Keep()
    return Stop(ConfigError("checkpoint.uri", f"this cluster has {hosts} machines and no "
                            f"durable checkpoint location (a lost head would lose the run): "
                            f"pass --checkpoint s3://bucket/path (or gs://), or set "
                            f"{CHECKPOINT_ENV} where the head runs `ray start`; --set "
                            f"checkpoint.optional=true runs without"))


def durability_warning(config: TrainConfig, machines: int) -> str | None:
    """One line to print when a run on several machines keeps no checkpoints (a lost head
    node then loses the run; with ``checkpoint.uri`` a resubmitted job resumes). Pure."""
    if machines > 1 and not config.checkpoint.uri:
        return (f"warning: checkpoints are off on a cluster of {machines} machines; set "
                f"checkpoint.uri (s3://bucket/path or gs://bucket/path) so a resubmitted "
                f"job resumes from the last one")
    return None


class DurabilityGuard:
    """The driver's view of the machines its job has seen, and the config that follows.

    ``update(addresses)`` (the node addresses alive now) re-decides whenever a machine not
    seen before appears (machines seen are never forgotten: a cluster that shrinks back to
    one may grow again); ``add_data(uris)`` re-decides with the job's data files once the
    job is made. Each returns the config to use from then on; a ``Stop`` is raised (its
    one-line error); a ``Switch`` and the checkpoints-off warning print one line to ``out``.
    """

    def __init__(self, config: TrainConfig, cluster_default: str | None,
                 out: TextIO | None = None):
        self.submitted = config  # as the user gave it: what names the job (its fingerprint)
        self.config = config
        self.cluster_default = cluster_default or None
        self.out = out
        self.hosts: frozenset[str] = frozenset()
        self.data_uris: tuple[str, ...] = ()
        self._warned = False

    def update(self, addresses: Iterable[str]) -> TrainConfig:
        seen = self.hosts | {a for a in addresses if a}
        if seen == self.hosts:
            return self.config
        self.hosts = seen
        return self._apply()

    def adopt_location(self, uri: str | None) -> TrainConfig:
        """An adopted swarm checkpoints to ``uri`` (its lease's record: where its earlier
        driver's guard had switched it, maybe before this driver saw as many machines):
        that location stays; later machines re-decide from it. None or "" changes nothing."""
        if uri and uri != self.config.checkpoint.uri:
            self.config = replace(self.config,
                                  checkpoint=replace(self.config.checkpoint, uri=uri))
            self._say(f"checkpoints go to {uri}, where the adopted swarm keeps them")
        return self.config

    def add_data(self, uris: Iterable[str]) -> TrainConfig:
        self.data_uris = tuple(uris)
        return self._apply()

    def _apply(self) -> TrainConfig:
        hosts = len(self.hosts)
        decision = decide_durability(self.config, hosts, self.cluster_default, self.data_uris)
        if isinstance(decision, Stop):
            raise decision.error
        if isinstance(decision, Switch):
            was = self.config.checkpoint.uri
            self.config = replace(self.config,
                                  checkpoint=replace(self.config.checkpoint, uri=decision.uri))
            self._say(f"{hosts} machines: checkpoints go to {decision.uri} ({CHECKPOINT_ENV})"
                      + (f" instead of the node-local {was!r}" if was else ""))
        warning = durability_warning(self.config, hosts)
        if warning and not self._warned:
            self._warned = True
            self._say(warning)
        return self.config

    def _say(self, line: str) -> None:
        if self.out is not None:
            print(line, file=self.out, flush=True)
