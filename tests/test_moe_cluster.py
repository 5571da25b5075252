"""DMoE on a real multi-node Ray cluster (the session's head + 4 spot raylets on 127.0.0.1).

One expert set for the module: layer ``moe0`` on a 4x5 grid (20 experts) in four shards of
2, 6, 6 and 6 experts, one ExpertActor per shard spread over the spot nodes, supervised from
the head node with snapshots every 2 s. Killing the 2-expert shard is losing 10% of experts.
Tests run in file order; each starts by waiting until every shard serves again.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import ray
import torch

from moshray.actors.moe import (
    ExpertActor,
    ExpertInputError,
    ExpertRejectReason,
    ExpertSetConfig,
    ExpertSpec,
    spawn_expert_set,
)
from moshray.jobs.examples.lm.model import ModelConfig, build_model
from moshray.actors.moe import LocalExpertBackend, MoEConfig, RayExpertBackend, \
    RemoteMixtureOfExperts
import moshray.cluster.coordinator.actor as coordinator_mod
from moshray.cluster import placement
from moshray.cluster.coordinator.expert_registry import grid_uids

pytestmark = pytest.mark.timeout(300)

SPEC = ExpertSpec(d_model=16, d_hidden=32, lr=3e-3)
GRID = (4, 5)
UIDS = grid_uids("moe0", GRID)
SHARDS = (("moe0-h0", UIDS[:2]), ("moe0-h1", UIDS[2:8]), ("moe0-h2", UIDS[8:14]),
          ("moe0-h3", UIDS[14:]))
SHARD_OF = {u: h for h, uids in SHARDS for u in uids}


class ExpertSet:
    def __init__(self, coordinator, supervisor, config):
        self.coordinator, self.supervisor, self.config = coordinator, supervisor, config

    def hosts(self) -> dict:
        return ray.get(self.supervisor.hosts.remote(), timeout=30)

    def handle(self, host_id: str):
        return self.hosts()[host_id]["handle"]

    def events(self) -> list:
        return ray.get(self.supervisor.events.remote(), timeout=30)

    def wait_event(self, host_id: str, event: str, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while (host_id, event) not in [(e[1], e[2]) for e in self.events()]:
            assert time.monotonic() < deadline, f"no {event} event for {host_id}"
            time.sleep(0.2)

    def wait_all_registered(self, timeout_s: float = 90.0) -> dict:
        """Every shard started and every uid registered by its current instance."""
        assert ray.get(self.supervisor.wait_healthy.remote(timeout_s), timeout=timeout_s + 10)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            hosts = self.hosts()
            records = ray.get(self.coordinator.lookup_experts.remote("moe0."), timeout=30)
            current = {r.host_id: r.instance for r in records}
            if all(current.get(h) == info["instance"] for h, info in hosts.items()) and \
                    sum(len(r.uids) for r in records) == len(UIDS):
                return hosts
            time.sleep(0.2)
        raise AssertionError(f"not every expert registered after {timeout_s} s")


@pytest.fixture(scope="module")
def experts(local_cluster, tmp_path_factory):
    coordinator = coordinator_mod.get_or_create(name="moshray-coordinator-test-moe")
    config = ExpertSetConfig(layers=("moe0",), grid=GRID, spec=SPEC, shards=SHARDS,
                             snapshot_uri=str(tmp_path_factory.mktemp("expert-snapshots")),
                             snapshot_interval_s=2.0, heartbeat_s=0.5, check_interval_s=0.5,
                             num_cpus=0.25)
    supervisor = spawn_expert_set(config, coordinator, timeout_s=180)
    try:
        yield ExpertSet(coordinator, supervisor, config)
    finally:
        ray.get(supervisor.stop.remote(), timeout=60)
        ray.kill(supervisor)
        ray.kill(coordinator)


def layer(backend, **kwargs) -> RemoteMixtureOfExperts:
    torch.manual_seed(0)
    cfg = MoEConfig("moe0", GRID, d_model=SPEC.d_model, **{"k": 4, **kwargs})
    return RemoteMixtureOfExperts(cfg, backend)


def used_uids(moe: RemoteMixtureOfExperts) -> set[str]:
    flat, mask = moe.last_routing
    return {moe.uids[int(f)] for f in flat[mask]}


def test_remote_forward_backward_match_local(experts):
    hosts = experts.wait_all_registered()
    states = {h: ray.get(info["handle"].snapshot.remote(durable=False), timeout=60)
              for h, info in hosts.items()}
    local_backend = LocalExpertBackend.from_states(states, SPEC)
    remote = layer(RayExpertBackend(experts.coordinator))
    local = layer(local_backend)
    local.load_state_dict(remote.state_dict())
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 40, SPEC.d_model, generator=g)
    target = torch.randn(3, 40, SPEC.d_model, generator=g)
    xr, xl = x.clone().requires_grad_(True), x.clone().requires_grad_(True)

    yr, yl = remote(xr), local(xl)
    assert remote.last_stats["answered"] == remote.last_stats["calls"] == 4
    torch.testing.assert_close(yr, yl, atol=1e-6, rtol=1e-5)
    assert torch.equal(remote.last_routing[0], local.last_routing[0])
    (yr * target).sum().backward()
    (yl * target).sum().backward()
    assert remote.last_stats["backward_answered"] == 4
    torch.testing.assert_close(xr.grad, xl.grad, atol=1e-6, rtol=1e-5)
    for a, b in zip(remote.gate.parameters(), local.gate.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5)
    # The remote experts updated themselves exactly like the local copies.
    used = used_uids(remote)
    for h, info in hosts.items():
        after = ray.get(info["handle"].snapshot.remote(durable=False), timeout=60)
        core = local_backend.hosts[h]
        for uid in info["uids"]:
            assert after["updates"][uid] == core.updates[uid] == \
                states[h]["updates"][uid] + (uid in used)
            for name, value in core.experts[uid].state_dict().items():
                torch.testing.assert_close(after["experts"][uid][name], value, atol=1e-6,
                                           rtol=1e-5)


def test_kill_expert_mid_forward_completes_and_routes_around(experts):
    hosts = experts.wait_all_registered()
    victim = "moe0-h2"
    handle, old_instance = hosts[victim]["handle"], hosts[victim]["instance"]
    backend = RayExpertBackend(experts.coordinator, ttl_s=0.5)
    moe = layer(backend, k=4, k_min=1, forward_timeout_s=30.0, timeout_after_k_min_s=20.0)
    x = torch.randn(128, SPEC.d_model, generator=torch.Generator().manual_seed(7),
                    requires_grad=True)
    ray.get(handle.set_delay.remote(3.0), timeout=30)
    result = {}

    def run():
        t0 = time.monotonic()
        result["y"] = moe(x)
        result["seconds"] = time.monotonic() - t0

    worker = threading.Thread(target=run)
    worker.start()
    time.sleep(1.0)  # the victim's request is sleeping inside the actor now
    ray.kill(handle)
    worker.join(timeout=60)
    assert not worker.is_alive()
    # Done long before the 20 s extra wait or the 30 s cap: the dead host failed fast.
    assert result["seconds"] < 15.0
    stats = moe.last_stats
    assert stats["failed"] == 1 and stats["answered"] == stats["calls"] - 1
    assert set(stats["masked_uids"]) <= set(dict(SHARDS)[victim])
    assert not used_uids(moe) & set(dict(SHARDS)[victim])
    assert torch.isfinite(result["y"]).all()
    result["y"].pow(2).sum().backward()  # backward goes only to the experts that answered
    assert moe.last_stats["backward_failed"] == 0 and torch.isfinite(x.grad).all()

    moe(x.detach())  # a later call: the dead host is blacklisted, no failure, no wait
    assert moe.last_stats["failed"] == 0 and moe.last_stats["late"] == 0
    assert not used_uids(moe) & set(dict(SHARDS)[victim])

    # The supervisor re-spawns the shard from its latest snapshot; routing finds it again.
    experts.wait_event(victim, "respawned")
    assert experts.wait_all_registered()[victim]["instance"] != old_instance
    deadline = time.monotonic() + 30
    while not used_uids(moe) & set(dict(SHARDS)[victim]) and time.monotonic() < deadline:
        time.sleep(0.3)
        moe(x.detach())
    assert used_uids(moe) & set(dict(SHARDS)[victim])
    assert moe.last_stats["failed"] == 0
    assert (victim, "lost") in [(e[1], e[2]) for e in experts.events()]


def train(model, steps: int, on_step=None) -> list[float]:
    text = np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 8, np.uint8)
    data = torch.from_numpy(text.astype(np.int64))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    losses = []
    for step in range(steps):
        if on_step:
            on_step(step)
        starts = torch.randint(0, len(data) - 17, (8,), generator=g)
        batch = torch.stack([data[s:s + 17] for s in starts])
        loss = model.loss(batch[:, :-1], batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_training_with_dmoe_lowers_loss_also_with_10pct_experts_killed(experts):
    hosts = experts.wait_all_registered()
    config = ModelConfig(seq_len=16, d_model=SPEC.d_model, n_layers=2, n_heads=2,
                         d_ff=SPEC.d_hidden, moe_layers=(0,), moe_grid=GRID, moe_k=2)
    backend = RayExpertBackend(experts.coordinator, ttl_s=0.5)
    model = build_model(config, seed=0, experts=backend)
    before = {h: ray.get(info["handle"].stats.remote(), timeout=30)["updates"]
              for h, info in hosts.items()}
    victim = "moe0-h0"  # 2 of 20 experts
    assert len(hosts[victim]["uids"]) / len(UIDS) == pytest.approx(0.10)
    failures = []

    def chaos(step):
        moe = model.blocks[0].mlp
        if step > 0:
            failures.append(moe.last_stats.get("failed", 0))
        if step == 30:
            ray.kill(hosts[victim]["handle"])

    losses = train(model, 60, on_step=chaos)
    first, before_kill, last = np.mean(losses[:3]), np.mean(losses[25:30]), np.mean(losses[-5:])
    assert before_kill < 0.75 * first, losses
    assert last < before_kill, losses  # still learning after 10% of experts died
    assert sum(failures) >= 1  # the kill was felt (and masked), not skipped
    after = {h: ray.get(info["handle"].stats.remote(), timeout=30)["updates"]
             for h, info in hosts.items() if h != victim}
    trained = sum(after[h][u] - before[h][u] for h in after for u in after[h])
    assert trained > 0  # the remote experts learned too


def test_preempted_node_experts_respawned_and_used(experts, local_cluster):
    host_id = "moe0-h1"
    for attempt in range(3):
        # The host as registered now; on a loaded machine the supervisor may have replaced
        # it meanwhile (heartbeats late: a re-spawn from its snapshot, which the earlier
        # tests cover); then the notice goes to the host that replaced it.
        hosts = experts.wait_all_registered()
        old = hosts[host_id]
        try:
            before = ray.get(old["handle"].stats.remote(), timeout=30)["updates"]
            reply = ray.get(old["handle"].on_notice.remote({"node_id": old["node_id"]}),
                            timeout=120)
            break
        except ray.exceptions.ActorDiedError:
            if attempt == 2:
                raise
    slot = next(s for s in local_cluster.live_slots() if local_cluster.node_id(s) == old["node_id"])
    try:
        assert reply["replacement"] != old["node_id"]
        local_cluster.remove_node(slot)
        hosts = experts.wait_all_registered()
        new = hosts[host_id]
        assert new["node_id"] != old["node_id"] and new["instance"] != old["instance"]
        assert all(info["node_id"] != old["node_id"] for info in hosts.values())
        stats = ray.get(new["handle"].stats.remote(), timeout=30)
        assert stats["restored_from"].startswith("object store step")
        assert stats["updates"] == before  # the state came over with the notice snapshot
        located = ray.get(experts.coordinator.expert_locations.remote(), timeout=30)
        assert {located[u] for u in new["uids"]} == {(host_id, new["node_id"])}

        moe = layer(RayExpertBackend(experts.coordinator), k=4)
        x = torch.randn(256, SPEC.d_model, generator=torch.Generator().manual_seed(9),
                        requires_grad=True)
        moe(x).sum().backward()
        assert moe.last_stats["failed"] == 0 and moe.last_stats["backward_failed"] == 0
        assert used_uids(moe) & set(new["uids"])
        after = ray.get(new["handle"].stats.remote(), timeout=30)["updates"]
        assert sum(after.values()) > sum(before.values())  # the re-spawned experts trained
    finally:
        if slot not in local_cluster.live_slots():
            local_cluster.add_node(slot)


def test_bad_inputs_get_typed_rejection_and_actor_survives(experts):
    hosts = experts.wait_all_registered()
    handle = hosts["moe0-h3"]["handle"]
    uid = hosts["moe0-h3"]["uids"][0]
    good = np.zeros((4, SPEC.d_model), np.float32)
    bad = {
        ExpertRejectReason.BAD_SHAPE: ((uid,), (np.zeros((4, 3), np.float32),)),
        ExpertRejectReason.BAD_DTYPE: ((uid,), (good.astype(np.float64),)),
        ExpertRejectReason.NON_FINITE: ((uid,), (np.full_like(good, np.inf),)),
        ExpertRejectReason.UNKNOWN_EXPERT: (("moe0.0.0",), (good,)),
        ExpertRejectReason.BAD_REQUEST: ((uid, uid), (good,)),
    }
    for reason, (uids, inputs) in bad.items():
        with pytest.raises(ExpertInputError) as info:
            ray.get(handle.forward.remote(uids, inputs), timeout=30)
        assert info.value.reason is reason
        assert reason.value in str(info.value)
    with pytest.raises(ExpertInputError, match="NaN or inf"):
        ray.get(handle.backward.remote((uid,), (good,), (np.full_like(good, np.nan),)),
                timeout=30)
    [out] = ray.get(handle.forward.remote((uid,), (good,)), timeout=30)
    assert out.shape == good.shape and np.isfinite(out).all()
    rejected = ray.get(handle.stats.remote(), timeout=30)["rejected"]
    assert sum(rejected.values()) == 6


def test_durable_snapshot_restores_a_fresh_actor(experts):
    hosts = experts.wait_all_registered()
    steps = ray.get(experts.supervisor.snapshot_all.remote(), timeout=120)
    host_id = "moe0-h3"
    info = hosts[host_id]
    expected = ray.get(info["handle"].stats.remote(), timeout=30)["updates"]
    # No coordinator: the copy never registers, so nothing routes to it.
    clone = ExpertActor.options(**placement.on_spot(0.25)).remote(
        host_id, info["uids"], SPEC, snapshot_uri=experts.config.snapshot_uri)
    try:
        got = ray.get(clone.stats.remote(), timeout=120)
        source, step = got["restored_from"].rsplit(" ", 1)
        assert source == "durable step"
        assert int(step) >= steps[host_id]  # this one, or a periodic snapshot taken since
        assert got["updates"] == expected
        x = np.random.default_rng(3).standard_normal((5, SPEC.d_model)).astype(np.float32)
        uids = tuple(info["uids"])
        a = ray.get(clone.forward.remote(uids, (x,) * len(uids)), timeout=30)
        b = ray.get(info["handle"].forward.remote(uids, (x,) * len(uids)), timeout=30)
        for u, v in zip(a, b):
            np.testing.assert_array_equal(u, v)
    finally:
        ray.kill(clone)
