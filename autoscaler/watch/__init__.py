"""The spot-notice watcher: one Ray actor per spot node, and ``moshray watch``.

Each role has its own module; this one re-exports their public names (imports, the
``moshray watch`` command and ``python -m moshray.autoscaler.watch`` keep working):

* ``config.py``: ``WatcherConfig`` (where notices come from, whom the watcher
  tells) and the watcher's actor name.
* ``watcher.py``: the ``NoticeWatcher`` actor, pinned to its node. On a termination
  notice it records ``running -> noticed``, tells the Coordinator (``note_notice``) and asks
  Ray to drain the node (``drain.py``), records ``noticed -> draining`` and hands off
  (``on_notice.remote(notice)`` on every actor registered with it). A rebalance
  recommendation (AWS) only records ``running -> at_risk``. Also ``start_watcher``,
  ``get_watcher``, ``deliver_notice``, ``wait_rebalanced``.
* ``fleet.py``: driver side, ``WatcherFleet`` starts one watcher per live spot node
  of a running cluster, delivers simulated notices (trace replay: a removal becomes a notice,
  then the node is removed at its deadline), records how each node ended (``gone`` after a
  notice, ``lost`` without one) and summarizes the lifecycles with the Coordinator's
  rebalance times.
* ``cli.py``: ``moshray watch`` runs the watcher of the node it is started on (a real
  cloud node): ``moshray watch`` (``--source auto``, the default, detects the node's cloud;
  ``--source aws`` / ``gcp`` name it) connects with ``ray.init(address="auto")``, starts the
  watcher actor on this node (or uses the one a job started there until that job removes
  it) and stays until the node's deadline has passed.

``WatcherFleet`` and ``moshray watch`` stop only the watchers they started, as the job's
controller does: a node's watcher that someone else started is used, never removed.
"""

from __future__ import annotations

from moshray.autoscaler.watch.watcher import (  # noqa: F401 - re-exported
    NoticeWatcher,
    deliver_notice,
    get_watcher,
    start_watcher,
    wait_rebalanced,
)
# re-exported: the `moshray watch` command
from moshray.autoscaler.watch.cli import add_arguments, main  # noqa: F401
from moshray.autoscaler.watch.config import (  # noqa: F401 - re-exported
    POOL_ENV,
    WATCHER_PREFIX,
    WatcherConfig,
    watcher_name,
)
from moshray.autoscaler.watch.fleet import WatcherFleet, spot_nodes  # noqa: F401 - re-exported
