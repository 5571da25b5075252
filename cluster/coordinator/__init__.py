"""The Coordinator: one actor on the head node, made of small services (one module each).

- ``steps.py``: steps and membership (``StepService``: register, report, plans, donors),
  over ``membership.py``, ``progress.py`` (its eligible peers counted in ``eligible.py``),
  ``quarantine.py`` and ``step_samples.py``;
- ``notices.py``: preemption notices and their rebalance clock (``NoticeBook``);
- ``shard_ledger.py``: the job's data position (``ShardService``);
- ``expert_registry.py``: the DMoE expert hosts (``ExpertRegistry``);
- ``metrics_sink.py``: metrics events, the Prometheus exporter and ``step_profile.py``;
- ``core.py``: ``CoordinatorCore`` composes the pure services; ``actor.py``: the Ray actor
  (``Coordinator``, ``get_or_create``) adds the metrics sink and saves the state;
- ``durable.py``: what survives a restart, in Ray's GCS key-value store.
"""
