"""DMoE experts: the torch core, the ExpertActor that serves it, and the supervisor that keeps
every shard of experts alive on spot nodes.

Learning@home semantics: an expert is a small feed-forward network with its *own* optimizer.
``forward`` returns its outputs; ``backward`` gets the same inputs again with the gradient of
the loss with respect to its outputs, recomputes the forward, returns the gradient with respect
to the inputs, and applies one optimizer step to its own parameters. Nothing is kept between
the two calls, so an expert can die, or be re-spawned from a snapshot, between any two calls.

This module re-exports the public names of the modules that implement it, one per role:

- ``expert_config``: ``ExpertSpec``, ``BatchConfig``, ``ExpertSetConfig``, ``layout_shards``.
- ``expert_errors``: ``ExpertInputError`` and ``ExpertRejectReason``.
- ``expert_core``: ``ExpertHostCore`` (torch, no Ray): the experts of one shard, validation,
  forward/backward, ``state()`` / ``load()``. In-process backends and the actor both use it.
- ``expert_host``: ``ExpertActor`` (async Ray actor on a spot node): batches concurrent
  requests per expert up to ``BatchConfig.max_rows`` rows or ``max_wait_s`` seconds, computes
  on one worker thread (so updates of one expert never race), registers its experts with the
  Coordinator and heartbeats, snapshots on request, and on a preemption notice hands its
  shard over.
- ``expert_supervisor``: ``ExpertSupervisor`` (async Ray actor on the head node): places
  shards over spot nodes, takes periodic snapshots (kept in the object store, owned by the
  supervisor on the head node, and written durably by each expert through
  ``CheckpointStore``), and re-spawns a lost shard on another node from its latest snapshot;
  ``spawn_expert_set`` starts it.

Bad requests (unknown expert, wrong shape or dtype, NaN/inf) raise ``ExpertInputError`` with a
``ExpertRejectReason``; it pickles cleanly, so the caller gets the typed error and the actor
keeps serving.
"""

from __future__ import annotations

from moshray.actors.moe.expert_config import BatchConfig, ExpertSetConfig, ExpertSpec, layout_shards  # noqa: F401
from moshray.actors.moe.expert_core import STATE_VERSION, Array, ExpertFFN, ExpertHostCore, build_expert  # noqa: F401
from moshray.actors.moe.expert_errors import ExpertInputError, ExpertRejectReason  # noqa: F401
from moshray.actors.moe.expert_host import ExpertActor  # noqa: F401
from moshray.actors.moe.expert_supervisor import (  # noqa: F401
    ExpertSupervisor,
    notice_node_id,
    spawn_expert_set,
    spot_nodes,
    uids_of,
)

__all__ = [
    "BatchConfig",
    "ExpertActor",
    "ExpertFFN",
    "ExpertHostCore",
    "ExpertInputError",
    "ExpertRejectReason",
    "ExpertSetConfig",
    "ExpertSpec",
    "ExpertSupervisor",
    "layout_shards",
    "spawn_expert_set",
]
from moshray.actors.moe.backends import (  # noqa: F401
    MAX_KEPT_CALLS,
    ExpertBackend,
    LocalExpertBackend,
    RayExpertBackend,
)
from moshray.actors.moe.config import MoEConfig
from moshray.actors.moe.dispatch import (  # noqa: F401
    CallOutcome,
    call_outcomes,
    gather_with_deadlines,
)
from moshray.actors.moe.routing import (  # noqa: F401
    HostCall,
    beam_search,
    gate_scores,
    load_balancing_loss,
    masked_gate_weights,
    plan_calls,
)
from moshray.actors.moe.layer import RemoteMixtureOfExperts  # noqa: F401
