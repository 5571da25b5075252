"""Replica groups averaged by shard (actors/replica/group_averaging.py), on
CPU ranks over gloo: two groups of 2 ranks (FSDP2, then DDP) train steps together, rank r of
each averaging only its own shard with rank r of the other through the swarm's Moshpit
collective; after every step both groups hold bitwise the same unsharded parameters, equal
to one process that averages the groups' batch gradients. A third group joins by shard
(rank r copies rank r's shard state through the object store) and the three train on, all
bitwise equal. A group whose peer dies between the phases applies nothing and says so.
Also the pure parts (the rank plans, completeness, layout checks)."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import ray
import torch

from moshray.actors.replica.group import ReplicaGroup
from moshray.actors.replica.group_spec import (
    OPTIMIZERS, GroupConfig, GroupError, digest, rank_slice,
)
from moshray.actors.replica.group_together import train_together
from moshray.actors.replica.group_averaging import (
    BatchPart, GroupPeers, ShardLayout, incomplete, layout_difference, rank_plan, rank_rows,
)
from moshray.cluster.messages import AllReduceReport, Rejection, RejectReason
from moshray.jobs.examples.lm.tasks import lm_task


# Dims 16, 32, 64, 256: FSDP2 shards every parameter over 2 ranks; rows=12 divides among
# 2 groups x 2 ranks and 3 groups x 2 ranks.
MODEL = {"seq_len": 16, "d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64}
ROWS = 12


def task(steps: int, optimizer: str = "sgd"):
    """SGD (lr 0.5) where the groups are compared with the reference: the parameters are
    linear in the averaged gradient, so float rounding stays at its own size. AdamW where
    its state must travel: its first steps move every element by about ``lr`` whatever the
    gradient's size, so an element whose gradient is at rounding level may move either way
    (1 of 1024 did, by 8e-5): compared to within a tenth of one step there."""
    if optimizer == "sgd":
        return replace(lm_task(MODEL, steps=steps, rows=ROWS, amp=False), optimizer="sgd",
                       lr=0.5)
    return lm_task(MODEL, steps=steps, rows=ROWS, amp=False, lr=3e-3)


def reference(t, groups_per_step: list[int]) -> list[dict[str, torch.Tensor]]:
    """One process: at each step, the gradient of each group's part of the batch, averaged
    weighted by the part's rows, then one optimizer step; the parameters after each step."""
    model = t.build_model()
    opt = OPTIMIZERS[t.optimizer](model.parameters(), lr=t.lr)
    states = []
    for step, n in enumerate(groups_per_step):
        batch, total, summed = t.batch(step), 0, None
        for part in range(n):
            rows = rank_slice(batch, part, n)
            opt.zero_grad(set_to_none=True)
            t.loss(model, rows).backward()
            weight = int(rows[0].shape[0])
            grads = [p.grad * weight for p in model.parameters()]
            summed = grads if summed is None else [a + b for a, b in zip(summed, grads)]
            total += weight
        for p, g in zip(model.parameters(), summed):
            p.grad = g / total
        opt.step()
        states.append({k: v.detach().clone() for k, v in model.named_parameters()})
    return states


def assert_like(full: dict, expected: dict, atol: float = 1e-5) -> None:
    assert set(full) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(full[name], value, rtol=1e-4, atol=atol,
                                   msg=lambda m, name=name: f"{name}: {m}")


# -- pure parts -----------------------------------------------------------------------------

def layout_by_group(plan):
    """The grid's groups of every round, members named by their group."""
    return [[tuple(m.split("/")[0] for m in g.members) for g in rs.groups]
            for rs in plan.grid.rounds]


def test_each_rank_averages_with_the_same_rank_of_the_other_groups_in_one_layout():
    groups = [GroupPeers(n, "fsdp", (f"{n}-h0", f"{n}-h1")) for n in ("b", "a", "a-x")]
    plans = [rank_plan(7, groups, r) for r in (0, 1)]
    for r, plan in enumerate(plans):
        assert plan.epoch == 7 and plan.grid.dims == (3,)
        assert set(plan.participants) == {f"b/r{r}", f"a/r{r}", f"a-x/r{r}"}
        assert dict(plan.handles) == {f"{n}/r{r}": f"{n}-h{r}" for n in ("b", "a", "a-x")}
        assert dict(plan.shares) == {p: 1.0 for p in plan.participants}
    # every rank's plan puts each group at the same place, so DDP ranks compute equal bytes
    assert layout_by_group(plans[0]) == layout_by_group(plans[1])
    many = [GroupPeers(f"g{i}", "ddp", tuple(f"g{i}-h{r}" for r in range(3)))
            for i in range(10)]
    grids = [rank_plan(3, many, r, max_group=4) for r in range(3)]
    assert len(grids[0].grid.rounds) >= 2  # a multi-round Moshpit grid
    assert layout_by_group(grids[0]) == layout_by_group(grids[1]) == layout_by_group(grids[2])
    assert rank_plan(4, many, 0, max_group=4).grid != grids[0].grid  # reshuffled by epoch
    assert rank_rows(BatchPart(1, 3), 1, 2) == (3, 6)


@pytest.mark.parametrize("groups,rank,match", [
    ([], 0, "no groups"),
    ([GroupPeers("a", "fsdp", (1, 2)), GroupPeers("a", "fsdp", (3, 4))], 0, "unique"),
    ([GroupPeers("a/b", "fsdp", (1, 2))], 0, "without '/'"),
    ([GroupPeers("a", "fsdp", (1, 2)), GroupPeers("b", "fsdp", (3,))], 0,
     r"same world size and parallel mode \(a: 2 x fsdp, b: 1 x fsdp\)"),
    ([GroupPeers("a", "fsdp", (1, 2)), GroupPeers("b", "ddp", (3, 4))], 0, "parallel mode"),
    ([GroupPeers("a", "fsdp", (1, 2))], 2, "rank 2 is not in groups of 2 ranks"),
])
def test_plans_of_groups_whose_shards_differ_are_refused_in_one_line(groups, rank, match):
    with pytest.raises(ValueError, match=match):
        rank_plan(0, groups, rank)


def test_a_step_is_complete_only_with_every_peers_whole_weight():
    plan = rank_plan(5, [GroupPeers(n, "fsdp", (n,)) for n in ("a", "b", "c")], 0)

    def report(contributors, partial=(), rejections=()):
        return AllReduceReport(5, "a/r0", contributors, partial, rejections, (), 0, 0, 0.0, 3.0)

    assert incomplete(report(("a/r0", "b/r0", "c/r0")), plan) is None
    assert incomplete(report(("a/r0", "c/r0")), plan) == \
        "epoch 5: averaged 2 of 3 peers (missing b/r0)"
    rejected = (Rejection("b/r0", 1, RejectReason.LATE),)
    assert "rejected b/r0 (late)" in incomplete(report(("a/r0", "b/r0", "c/r0"),
                                                       rejections=rejected), plan)
    assert incomplete(report(("a/r0", "c/r0"), partial=("b/r0",)), plan)


def test_a_join_checks_the_shard_layouts_first():
    donor = ShardLayout(2, "fsdp", "adamw", (("model/w", (8, 4)), ("optim/state/w/step", ())))
    assert layout_difference(donor, donor) is None
    assert layout_difference(donor, ShardLayout(3, "fsdp", "adamw", donor.entries)) == \
        "world_size: the donor has 2, this group 3"
    assert layout_difference(donor, ShardLayout(2, "fsdp", "sgd", donor.entries)) == \
        "optimizer: the donor has adamw, this group sgd"
    other = ShardLayout(2, "fsdp", "adamw", (("model/w", (4, 4)), ("optim/state/w/step", ())))
    assert layout_difference(donor, other) == \
        "'model/w' has local shape (8, 4) at the donor, (4, 4) here"
    extra = ShardLayout(2, "fsdp", "adamw", donor.entries + (("model/b", (4,)),))
    assert layout_difference(donor, extra) == \
        "'model/b' is in this rank's state, not in the donor's"


# -- groups on a local Ray ---------------------------------------------------------------------

@pytest.fixture
def ray_local(local_cluster):
    """The session's cluster (conftest.py): its driver connection is the process's only one."""
    local_cluster.connect()
    return ray


@contextlib.contextmanager
def started(parallel: str, names: list[str]):
    groups = [ReplicaGroup(GroupConfig(world_size=2, parallel=parallel, timeout_s=60.0,
                                       round_timeout_s=20.0, name=n)) for n in names]
    try:
        for g in groups:
            g.start()
        yield groups
    finally:
        for g in groups:
            g.close()


def full_states(groups) -> list[dict]:
    return [g.full_state() for g in groups]


@pytest.mark.parametrize("parallel", ["fsdp", "ddp"])
def test_two_groups_average_by_shard_and_stay_bitwise_equal(ray_local, parallel):
    t = task(3)
    expected = reference(t, [2, 2, 2])
    numel = sum(v.numel() for v in expected[0].values())
    with started(parallel, [f"{parallel}-a", f"{parallel}-b"]) as (a, b):
        for step in range(3):
            [done] = train_together([a, b], t, steps=1)
            assert done.step == step and a.step == b.step == step + 1
            fa, fb = full_states([a, b])
            assert digest(fa.values()) == digest(fb.values())  # bitwise the same model
            assert_like(fa, expected[step])
        assert len(set(done.losses)) == 2  # the groups trained on different rows
    if parallel == "fsdp":  # each rank averaged its own shard only: about half the model
        assert sum(done.rank_numel) == numel and max(done.rank_numel) < numel
    else:  # DDP: every rank holds (and averages) all of it
        assert done.rank_numel == (numel, numel)


def test_a_group_joins_by_shard_and_three_train_on_bitwise_equal(ray_local):
    t = task(3, "adamw")
    expected = reference(t, [2, 2, 3])
    with started("fsdp", ["j-a", "j-b", "j-c"]) as (a, b, c):
        train_together([a, b], t, steps=2)
        assert c.join_from(a, t) == 2 and c.step == 2 and c.epoch == a.epoch
        fa, fc = full_states([a, c])
        assert digest(fa.values()) == digest(fc.values())
        [done] = train_together([a, b, c], t, steps=1)
        assert done.groups == ("j-a", "j-b", "j-c") and done.step == 2
        states = full_states([a, b, c])
        assert len({digest(s.values()) for s in states}) == 1
        # equal after one more AdamW step: the optimizer state came across too
        assert_like(states[0], expected[2], atol=t.lr / 10)


def test_a_group_whose_peer_dies_between_the_phases_applies_nothing(ray_local):
    """Rank 1 of group b dies after the gradients: rank 1 of a averages alone (incomplete),
    so a's ranks vote the step down: a's state stays whole at its step, the error names
    the group and rank, and every call returns within the timeouts."""
    t = task(1)
    with started("fsdp", ["d-a", "d-b"]) as (a, b):
        peers = [a.peers(), b.peers()]
        for i, g in enumerate((a, b)):
            ray.get([r.compute_grads.remote(t, 0, BatchPart(i, 2)) for r in g.ranks],
                    timeout=60)
        before = a.full_state()
        ray.kill(b.ranks[1], no_restart=True)
        plans = [rank_plan(0, peers, r) for r in (0, 1)]
        b.ranks[0].average_and_apply.remote(plans[0], 6.0)  # then stuck in b's vote: killed
        outcomes = ray.get([r.average_and_apply.remote(plans[i], 6.0)
                            for i, r in enumerate(a.ranks)], timeout=60)
        assert [o.applied for o in outcomes] == [False, False]
        assert "missing d-b/r1" in outcomes[1].reason
        assert outcomes[0].reason == "another rank of the group did not get the whole average"
        assert digest(a.full_state().values()) == digest(before.values())
        # b's rank 0 may fail first (its gloo peer is gone): either rank is named
        with pytest.raises(GroupError, match="group d-b: rank [01] failed in compute_grads"):
            train_together([a, b], t, steps=1)
        assert b.broken and not a.broken  # close() kills b's ranks without asking
