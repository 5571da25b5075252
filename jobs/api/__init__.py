"""moshray: elastic training on spot and preemptible GPUs, on Ray.

The public API (this file is the ``moshray`` package itself)::

    import moshray

    def loop(session):                       # runs inside every replica
        model = Net()
        opt = session.prepare(model, torch.optim.Adam(model.parameters(), 1e-3))
        for x, y in session.batches():       # this replica's shards, until the job stops
            opt.step(loss_fn(model(x), y))   # moshray decides when a global step happens

    result = moshray.fit(loop, moshray.data.from_fn(my_batches), max_nodes=4)

- ``fit``, ``Result``, ``build_config``: ``moshray.jobs.fit``.
- ``Session``, ``ElasticOptimizer``: ``moshray.actors.session``.
- ``data``: sources (``from_fn``, ``parquet``, ``from_dataset``): ``moshray.actors.data_sources``.
- ``TrainConfig``, ``ConfigError``, ``UserError``: settings and the two kinds of bad input.
- ``moe``: Decentralized Mixture-of-Experts layers for your model (``moshray.actors.moe``).
"""

from moshray.actors import data_sources as data
from moshray.actors import moe
from moshray.actors.errors import UserError
from moshray.actors.session import ElasticOptimizer, Session
from moshray.jobs.config import ConfigError, TrainConfig
from moshray.jobs.fit import Result, build_config, fit

__all__ = ["fit", "Result", "build_config", "Session", "ElasticOptimizer", "data", "moe",
           "TrainConfig", "ConfigError", "UserError"]
