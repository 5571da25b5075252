"""DMoE expert configuration: the shape of one expert, how a host batches, and the expert set.

Contract: frozen dataclasses that validate on construction and raise ``ValueError`` naming
the bad field (``ExpertSpec``, ``BatchConfig``, ``ExpertSetConfig``), and ``layout_shards``,
which cuts an expert set into ``{host_id: uids}`` shards (pure; no torch, no Ray).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moshray.cluster.coordinator.expert_registry import grid_uids, parse_uid

__all__ = ["BatchConfig", "ExpertSetConfig", "ExpertSpec", "layout_shards"]


@dataclass(frozen=True)
class ExpertSpec:
    """Shape and optimizer of every expert: ``d_model -> d_hidden -> d_model`` with GELU.

    Initial weights depend only on ``(seed, uid)``, so the same expert built in two
    processes is bitwise identical. Raises ``ValueError`` naming the bad field.
    """

    d_model: int = 256
    d_hidden: int = 1024
    lr: float = 1e-3
    weight_decay: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("d_model", "d_hidden"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ExpertSpec.{name}: must be a positive integer, got {value!r}")
        for name in ("lr", "weight_decay"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"ExpertSpec.{name}: must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class BatchConfig:
    """How an ExpertActor batches concurrent requests for the same expert.

    After the first queued request it takes every request already queued and waits up to
    ``max_wait_s`` for more, until the batch holds ``max_rows`` rows (one request larger than
    that runs alone, never split).
    """

    max_rows: int = 8192
    max_wait_s: float = 0.001

    def __post_init__(self) -> None:
        if not isinstance(self.max_rows, int) or self.max_rows < 1:
            raise ValueError(f"BatchConfig.max_rows: must be a positive integer, "
                             f"got {self.max_rows!r}")
        if not math.isfinite(self.max_wait_s) or self.max_wait_s < 0:
            raise ValueError(f"BatchConfig.max_wait_s: must be >= 0, got {self.max_wait_s!r}")


@dataclass(frozen=True)
class ExpertSetConfig:
    """Every expert of a model's DMoE layers, how they are sharded, and how they recover.

    ``layers`` x ``grid`` give the uids (``<layer>.<i>.<j>``); they are cut into shards of
    ``experts_per_host`` experts (one ExpertActor each), unless ``shards`` lists the layout
    explicitly as ``((host_id, (uid, ...)), ...)``. ``snapshot_uri`` ("" = none) is the durable
    snapshot location (local dir, ``file://``, ``s3://``, ``gs://``); snapshots are taken every
    ``snapshot_interval_s``.
    """

    layers: tuple[str, ...] = ("moe0",)
    grid: tuple[int, ...] = (4, 4)
    spec: ExpertSpec = ExpertSpec()
    experts_per_host: int = 4
    shards: tuple[tuple[str, tuple[str, ...]], ...] = ()
    batch: BatchConfig = BatchConfig()
    snapshot_uri: str = ""
    snapshot_interval_s: float = 30.0
    heartbeat_s: float = 1.0
    check_interval_s: float = 0.5
    spawn_timeout_s: float = 120.0
    num_cpus: float = 0.5

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "grid", tuple(self.grid))
        object.__setattr__(self, "shards", tuple((h, tuple(u)) for h, u in self.shards))
        if not self.layers:
            raise ValueError("ExpertSetConfig.layers: needs at least one layer name")
        grid_uids(self.layers[0], self.grid)  # validates the grid
        if not isinstance(self.experts_per_host, int) or self.experts_per_host < 1:
            raise ValueError(f"ExpertSetConfig.experts_per_host: must be a positive integer, "
                             f"got {self.experts_per_host!r}")
        for name in ("snapshot_interval_s", "heartbeat_s", "check_interval_s", "spawn_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"ExpertSetConfig.{name}: must be a positive number, "
                                 f"got {value!r}")
        if self.num_cpus < 0:
            raise ValueError(f"ExpertSetConfig.num_cpus: must be >= 0, got {self.num_cpus!r}")
        seen: set[str] = set()
        for host_id, uids in self.shards:
            for uid in uids:
                parse_uid(uid)
                if uid in seen:
                    raise ValueError(f"ExpertSetConfig.shards: expert {uid} is in two shards")
                seen.add(uid)


def layout_shards(config: ExpertSetConfig) -> dict[str, tuple[str, ...]]:
    """``{host_id: uids}``: the explicit ``shards``, else each layer's grid cut in order."""
    if config.shards:
        return dict(config.shards)
    out: dict[str, tuple[str, ...]] = {}
    for layer in config.layers:
        uids = grid_uids(layer, config.grid)
        n = config.experts_per_host
        for start in range(0, len(uids), n):
            out[f"{layer}-h{start // n}"] = uids[start:start + n]
    return out
