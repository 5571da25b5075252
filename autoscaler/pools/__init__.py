"""Where to launch the next spot nodes: pool selection as a pure policy.

A *pool* is one place capacity comes from: a registered cloud (``autoscaler/clouds``), an
instance (machine) type, a zone and a market (spot or on-demand). Spot capacity runs out and
comes back per pool, so the NodeProviders (``clouds/aws/provider.py``,
``clouds/gcp/provider.py``) do not launch "an instance type": they ask a
:class:`PoolSelector` for an ordered list of pools, try the first, record what happened as a
:class:`PoolEvent`, and ask again. The selector reads only the plain data it is given (events
with timestamps, the current time, the on-demand nodes in use); it calls no cloud and reads no
clock, so every rule below is testable with plain data (``tests/test_pools.py``).

Rules:

* Spot pools come first, the most stable first: fewest preemptions within
  ``preemption_window_s``, then fewest capacity errors in that window, then the configured
  order (put the cheapest or most wanted pool first).
* A pool that just refused a launch (capacity, spot price or quota error) is skipped for a
  cool-down: ``capacity_cooldown_s`` after the first error, doubling with each further error
  in a row (no successful launch in between), capped at ``max_cooldown_s``.
* On-demand pools come after all spot pools and only within the :class:`OnDemandBudget`
  (nodes and/or USD per hour); a pool over budget is skipped with the reason.
* Back to spot: spot pools are always tried first again once their cool-down ends; and
  :meth:`PoolSelector.on_demand_to_release` names one on-demand node to give back when some
  spot pool has been free of trouble for ``spot_stable_s`` (at most one per ``spot_stable_s``,
  so a spot pool that fails again costs at most one node swap per period).

The pool *key* (:func:`encode_pool`) is the value of the ``moshray-pool`` tag/label
(:data:`moshray.autoscaler.tags.POOL_TAG`): valid as an AWS tag value and as a GCP label value
(lowercase letters, digits, ``-`` and ``_``, at most 63 characters), and reversible with
:func:`decode_pool`.

Each role has its own module; the package's public names are declared here:

* ``records.py``: ``Market``, ``Pool``, ``encode_pool`` / ``decode_pool``,
  ``EventKind``, ``PoolEvent``.
* ``budget.py``: ``OnDemandBudget``.
* ``selector.py``: ``SelectorConfig``, ``Observations``, ``PoolStats``, ``SkipReason``,
  ``Candidate``, ``Skipped``, ``LaunchPlan``, ``RunningNode``, ``PoolSelector``.
"""

from __future__ import annotations

from moshray.autoscaler.pools.budget import OnDemandBudget  # noqa: F401 - re-exported
from moshray.autoscaler.pools.records import (  # noqa: F401 - re-exported
    LABEL_MAX,
    EventKind,
    Market,
    Pool,
    PoolEvent,
    decode_pool,
    encode_pool,
)
from moshray.autoscaler.pools.selector import (  # noqa: F401 - re-exported
    Candidate,
    LaunchPlan,
    Observations,
    PoolSelector,
    PoolStats,
    RunningNode,
    SelectorConfig,
    Skipped,
    SkipReason,
)
