"""``moshray.fit``: train the user's own model elastically, on any Ray cluster.

    result = moshray.fit(loop, data, max_nodes=3, max_seconds=120)

``loop(session)`` runs inside every replica (``actors/replica/session.py``); ``data`` is anything
``actors.data_sources.as_source`` takes: a function ``(shard, num_shards, seed) ->
batches``, Parquet URIs, a source, or a zero-argument function returning a Ray Dataset
(called on the driver once it is connected). With ``RAY_ADDRESS`` set (as under
``ray job submit``) or ``address=``, the job runs on that cluster; otherwise on the
embedded local cluster, which ``trace=`` makes preempt nodes. Everything ``moshray train``
does applies: elastic replicas, donors, notices, checkpoints, metrics.

Settings are the ``TrainConfig``'s: pass ``config`` (a ``TrainConfig``, a dict of
sections or a TOML path) and/or the keyword shortcuts below. A bad setting raises
``ConfigError``, bad training code or data ``UserError``, each with one line.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from moshray.actors.replica.data_sources import as_source
from moshray.actors.errors import UserError
from moshray.actors.replica.actor import Job

from moshray.jobs.config import ConfigError, TrainConfig, load_config

SHORTCUTS = {
    "max_nodes": "cluster.max_nodes", "min_nodes": "cluster.min_nodes",
    "local_nodes": "cluster.local_nodes", "local_gpus": "cluster.local_gpus",
    "address": "cluster.address", "trace": "cluster.trace", "time_scale": "cluster.time_scale",
    "notice_s": "cluster.notice_s", "max_seconds": "training.max_seconds",
    "max_steps": "training.max_steps", "mode": "training.mode",
    "target_batch_size": "training.target_batch_size", "batch_size": "training.batch_size",
    "seed": "training.seed", "round_timeout_s": "training.round_timeout_s",
    "checkpoint_uri": "checkpoint.uri", "checkpoint_every": "checkpoint.every_steps",
    "metrics_port": "metrics.port", "run_dir": "run_dir", "json": "json",
}


@dataclass
class Result:
    """What ``fit`` returns: the run's ``summary`` (as ``moshray train --json`` prints it),
    ``state``, the final state of a staying replica (``model``, ``optimizer``, ``extra``,
    ``epoch``, ...; load ``state["model"]`` into your model) and the replicas' last
    ``statuses`` (epoch, checksum, data position, the extra state's scalars and digest)."""

    summary: dict
    state: dict | None
    statuses: list = field(default_factory=list)  # each replica's last status

    @property
    def model_state(self) -> dict | None:
        return self.state["model"] if self.state else None


def build_config(config: Any = None, **settings: Any) -> TrainConfig:
    """The run's ``TrainConfig`` from ``config`` plus keyword shortcuts (``SHORTCUTS``)."""
    unknown = sorted(set(settings) - set(SHORTCUTS))
    if unknown:
        raise ConfigError(unknown[0], f"unknown setting; use one of {', '.join(SHORTCUTS)} "
                          f"or pass config={{section: {{key: value}}}}")
    if isinstance(config, TrainConfig):
        tree = config.to_dict()
    elif isinstance(config, str):
        tree = load_config(config).to_dict()
    elif isinstance(config, dict) or config is None:
        tree = TrainConfig.from_dict(config or {}).to_dict()
    else:
        raise ConfigError("config", f"expected a TrainConfig, a dict or a TOML path, got "
                          f"{type(config).__name__}")
    for name, value in settings.items():
        if value is None:
            continue
        *sections, key = SHORTCUTS[name].split(".")
        node = tree
        for section in sections:
            node = node.setdefault(section, {})
        node[key] = value
    return TrainConfig.from_dict(tree)


def ship_by_value(*objects: Any) -> None:
    """Send the code of the user's modules that ``objects`` come from to the replicas by
    value: a worker node has the installed packages but not the user's script or test
    modules (nodes are separate machines). Installed and moshray modules go by name."""
    import sys
    import sysconfig

    import ray.cloudpickle

    installed = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    for obj in objects:
        fn = getattr(obj, "fn", obj)  # a FunctionSource carries the user's function
        name = getattr(fn, "__module__", None)
        module = sys.modules.get(name or "")
        path = getattr(module, "__file__", None) or ""
        if module is None or name == "__main__" or name.split(".")[0] in ("moshray", "torch") \
                or not path or any(path.startswith(p) for p in installed):
            continue
        ray.cloudpickle.register_pickle_by_value(module)


def _job(loop, data, batch_size: int):
    """The ``Job``, or a function of the connected driver that makes it (a Ray Dataset)."""
    if not callable(loop):
        raise UserError("loop", f"expected a function loop(session), got {type(loop).__name__}")
    ship_by_value(loop, data)
    if callable(data) and not hasattr(data, "open"):
        try:
            lazy = len(inspect.signature(data).parameters) == 0
        except (TypeError, ValueError):
            lazy = False
        if lazy:
            return lambda: Job(loop, as_source(data(), batch_size), return_state=True)
    return Job(loop, as_source(data, batch_size), return_state=True)


def fit(loop, data, config: Any = None, **settings: Any) -> Result:
    """Train with ``loop`` on ``data`` (see module docstring); returns a ``Result``."""
    from moshray.jobs.train import run

    cfg = build_config(config, **settings)
    if cfg.cluster.trace == "off":
        from dataclasses import replace

        cfg = replace(cfg, cluster=replace(cfg.cluster, trace=None))
    summary = run(cfg, _job(loop, data, cfg.training.batch_size))
    state = summary.pop("final_state", None)
    return Result(summary, state, summary.pop("statuses", []))
