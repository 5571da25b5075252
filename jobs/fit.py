"""``moshray.fit``: train the user's own model elastically, on any Ray cluster.

    result = moshray.fit(loop, data, max_nodes=3, max_seconds=120)

``loop(session)`` runs inside every replica (``actors/replica/session.py``); ``data`` is anything
``actors.data_sources.as_source`` takes: a function ``(shard, num_shards, seed) ->
batches``, Parquet URIs, a source, or a zero-argument function returning a Ray Dataset
(called on the driver once it is connected). With ``RAY_ADDRESS`` set (as under
``ray job submit``) or ``address=``, the job runs on that cluster; otherwise on the
embedded local cluster. Unlike ``moshray train``, ``fit`` replays no spot trace there
unless ``trace=`` names one (a file, or the shipped
``"aws-g4dn-xlarge-us-east-1c-2020-11-20"``): a run of your own code stays reproducible.
Everything ``moshray train`` does applies: elastic replicas, donors, notices,
checkpoints, metrics.

Settings are the ``TrainConfig``'s: pass ``config`` (a ``TrainConfig``, a dict of
sections or a TOML path) and/or ``fit``'s keyword arguments (``SHORTCUTS`` maps each to
its setting; a keyword given wins over ``config``). A bad setting raises
``ConfigError``, bad training code or data ``UserError``, each with one line. Any other
exception the loop raises is retried on a fresh replica up to ``training.max_failures``
times across the job (the same error from two nodes: not retried); then ``fit`` raises
that exception (its ``str()`` holds the replica's traceback) after releasing the job's
capacity and replicas. Failing checkpoint saves end the job too (``JobFailed``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
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
    "max_steps": "training.max_steps", "max_epochs": "training.max_epochs",
    "mode": "training.mode",
    "target_batch_size": "training.target_batch_size", "batch_size": "training.batch_size",
    "seed": "training.seed", "round_timeout_s": "training.round_timeout_s",
    "max_failures": "training.max_failures",
    "checkpoint_uri": "checkpoint.uri", "checkpoint_every": "checkpoint.every_steps",
    "metrics_port": "metrics.port", "run_dir": "run_dir", "json": "json", "name": "name",
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
    modules (nodes are separate machines). Installed, standard-library and moshray modules
    go by name; for a ``functools.partial`` it is the module of the function inside."""
    import functools
    import sys
    import sysconfig

    import ray.cloudpickle

    # The standard library too: a functools.partial names functools as its module, and
    # functools shipped by value cannot be pickled.
    installed = {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib",
                                                    "platstdlib")}
    for obj in objects:
        fn = getattr(obj, "fn", obj)  # a FunctionSource carries the user's function
        fn = getattr(fn, "dataset", fn)  # a TorchSource, the user's Dataset (or its factory)
        while isinstance(fn, functools.partial):  # the user's function behind a partial
            fn = fn.func
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


def _group_job(loop, data):
    """The ``LoopTask`` of a job of replica groups (``cluster.replica = "node"``): the loop
    and ``moshray.data.by_step`` data; ``UserError`` for other data."""
    from moshray.actors.replica.data_sources import StepBatches, TorchSource, by_step
    from moshray.actors.replica.group_loop import LoopTask

    if isinstance(data, TorchSource):
        data = by_step(data)
    if not isinstance(data, StepBatches):
        raise UserError("data", "replica groups (cluster.replica = \"node\") take "
                        "moshray.data.by_step(fn), fn(step) -> the global batch of that step, "
                        "or moshray.data.from_torch(dataset, global_batch), "
                        f"got {type(data).__name__}")
    ship_by_value(loop, data)
    return LoopTask(loop, data)


def fit(
    loop: Callable[[Any], Any],
    data: Any,
    config: Any = None,
    *,
    name: str | None = None,
    max_epochs: int | None = None,
    max_steps: int | None = None,
    max_seconds: float | None = None,
    max_nodes: int | None = None,
    min_nodes: int | None = None,
    address: str | None = None,
    local_nodes: int | None = None,
    local_gpus: int | None = None,
    trace: str | None = None,
    time_scale: float | None = None,
    notice_s: float | None = None,
    mode: str | None = None,
    target_batch_size: int | None = None,
    batch_size: int | None = None,
    seed: int | None = None,
    round_timeout_s: float | None = None,
    max_failures: int | None = None,
    checkpoint_uri: str | None = None,
    checkpoint_every: int | None = None,
    metrics_port: int | None = None,
    run_dir: str | None = None,
    json: bool | None = None,
    on_report: Callable[[int, dict], None] | None = None,
) -> Result:
    """Train ``loop(session)`` on ``data`` elastically; returns a ``Result``.

    ``loop``: runs in every replica (``moshray.Session``; torch's idiom:
    ``loss.backward(); opt.step(); opt.zero_grad()``). ``data``: a function ``(shard,
    num_shards, seed) -> batches`` (``moshray.data.from_fn``), Parquet URIs, a source, or
    a zero-argument function returning a Ray Dataset. ``config``: a ``TrainConfig``, a
    dict of sections or a TOML path. Every other argument is a keyword; None leaves the
    config's value (the default in brackets).

    When to stop (the first bound reached ends the run):
      max_epochs: passes over the data source's shards (``training.max_epochs``: checked
        twice a second, so tiny shards may be read past it until the replicas stop). With
        none of max_epochs, max_steps and max_seconds given here or in ``config``, fit
        stops after 1 epoch, so that a run always ends (a data function whose shards
        never end needs max_steps or max_seconds).
      max_steps: global steps. max_seconds: wall seconds of training.
    The cluster:
      max_nodes / min_nodes: worker nodes the job asks for [4 / 1]. address: a Ray
        cluster (else ``RAY_ADDRESS``, else the embedded local cluster).
      local_nodes / local_gpus: the embedded cluster's nodes and declared GPUs [2 / 0].
      trace: spot trace the embedded cluster replays (a CSV file or a shipped trace's
        name; default none: no preemptions, unlike ``moshray train``); time_scale: trace
        seconds per wall second [60]; notice_s: a notice's lead in trace seconds [120].
    The steps:
      mode: ``"collaborative"`` or ``"local_sgd"``; target_batch_size: samples per global
        step [256]; batch_size: samples per micro-batch, for sources that batch [16];
        seed [0]; round_timeout_s: one averaging round's deadline [10];
        max_failures: loops that raised replaced across the job [3].
    Outputs:
      checkpoint_uri / checkpoint_every: where and every how many steps to checkpoint.
      metrics_port: Prometheus port on the head node (0: any). run_dir: summary.json,
        training.png and TensorBoard files of reported metrics [runs/<name>].
      json: print the summary as JSON. on_report: ``fn(step, {name: value})`` on this
        driver for what loops report (``session.report``): the hook for MLflow / W&B
        (e.g. ``lambda step, m: mlflow.log_metrics(m, step=step)``).

    Raises ``ConfigError`` (a bad setting) or ``UserError`` (bad training code or data),
    each one line; see the module docstring for what happens when the loop raises."""
    from dataclasses import replace

    from moshray.jobs.controller.elastic import JobFailed
    from moshray.jobs.train import run

    settings = dict(
        max_epochs=max_epochs, max_steps=max_steps, max_seconds=max_seconds,
        max_nodes=max_nodes, min_nodes=min_nodes, address=address, local_nodes=local_nodes,
        local_gpus=local_gpus, trace=trace, time_scale=time_scale, notice_s=notice_s,
        mode=mode, target_batch_size=target_batch_size, batch_size=batch_size, seed=seed,
        round_timeout_s=round_timeout_s, max_failures=max_failures,
        checkpoint_uri=checkpoint_uri, checkpoint_every=checkpoint_every,
        metrics_port=metrics_port, run_dir=run_dir, json=json, name=name)
    cfg = with_stop_rule(build_config(config, **settings))
    if cfg.cluster.trace == "off":
        cfg = replace(cfg, cluster=replace(cfg.cluster, trace=None))
    job = _group_job(loop, data) if cfg.cluster.replica == "node" \
        else _job(loop, data, cfg.training.batch_size)
    try:
        summary = run(cfg, job, on_report=on_report)
    except JobFailed as failed:  # the user's own exception, with its remote traceback
        if failed.error is None:
            raise
        failed.error.add_note(f"moshray: the job failed: {failed.reason}")
        raise failed.error from None
    state = summary.pop("final_state", None)
    return Result(summary, state, summary.pop("statuses", []))


def with_stop_rule(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with ``training.max_epochs = 1`` if it bounds the run in no way (no
    max_epochs, max_steps or max_seconds): ``fit``'s default stop rule."""
    from dataclasses import replace

    t = cfg.training
    if t.max_epochs is None and t.max_steps is None and t.max_seconds is None:
        return replace(cfg, training=replace(t, max_epochs=1))
    return cfg
