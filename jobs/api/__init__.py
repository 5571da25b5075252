"""moshray: elastic training on spot and preemptible GPUs, on Ray.

The public API (this file is the ``moshray`` package itself)::

    import moshray

    def loop(session):                       # runs inside every replica
        model = Net()
        opt = session.prepare(model, torch.optim.Adam(model.parameters(), 1e-3))
        for x, y in session.batches():       # this replica's shards, until the job stops
            loss = loss_fn(model(x), y)
            loss.backward()                  # clip / unscale / inspect gradients here
            stepped = opt.step()             # True when moshray took a global step
            opt.zero_grad()
            session.report({"loss": loss})   # summary, Prometheus, TensorBoard
            if stepped and session.global_step % 100 == 0 and session.is_leader:
                evaluate(model)              # once per swarm, not once per replica

    result = moshray.fit(loop, moshray.data.from_fn(my_batches), max_nodes=4, max_epochs=3)

- ``fit`` (``help(moshray.fit)``: every argument, its default and the stop rule),
  ``Result``, ``build_config``: ``moshray.jobs.fit``.
- ``Session`` (``report``, ``is_leader``, ``autocast``, ``global_step``), ``ElasticOptimizer``:
  ``moshray.actors.replica.session``.
- ``data``: sources (``from_fn``, ``parquet``, ``from_dataset``, ``from_torch``):
  ``moshray.actors.replica.data_sources``.
- ``TrainConfig``, ``ConfigError``, ``UserError``: settings and the two kinds of bad input.
- ``moe``: Decentralized Mixture-of-Experts layers for your model (``moshray.actors.moe.layer``).
- ``__version__``: this build's version, derived from git when the wheel was built; a
  replica whose node has another build refuses to run (``moshray.actors.replica.build_check``).
"""

import importlib

# Loaded on first use (PEP 562), so that importing a submodule such as moshray.cluster.collective.grid
# stays light (no torch, no Ray).
_EXPORTS = {
    "fit": ("moshray.jobs.fit", "fit"), "Result": ("moshray.jobs.fit", "Result"),
    "build_config": ("moshray.jobs.fit", "build_config"),
    "Session": ("moshray.actors.replica.session", "Session"),
    "ElasticOptimizer": ("moshray.actors.replica.session", "ElasticOptimizer"),
    "data": ("moshray.actors.replica.data_sources", None), "moe": ("moshray.actors.moe.layer", None),
    "UserError": ("moshray.actors.errors", "UserError"),
    "TrainConfig": ("moshray.jobs.config", "TrainConfig"),
    "ConfigError": ("moshray.jobs.config", "ConfigError"),
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name == "__version__":  # the build (git-derived, pyproject [tool.setuptools_scm])
        from moshray.actors.replica.build_check import installed_build

        globals()[name] = installed_build()
        return globals()[name]
    if name not in _EXPORTS:
        raise AttributeError(f"module 'moshray' has no attribute {name!r}")
    module_name, attr = _EXPORTS[name]
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
