"""The public API's decisions, without Ray: bad input, the data ledger and feed, the state
that travels (extra state, data position, RNG), settings."""

from __future__ import annotations

import random
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import moshray
from moshray.actors.replica.data_sources import as_source, from_fn, parquet
from moshray.actors.errors import UserError, find_user_error
from moshray.actors.replica.state import TrainState, extra_digest
from moshray.actors.replica.session import batch_size_of, check_loss, check_optimizer
from moshray.actors.replica.shard_feed import ShardFeed
from moshray.cluster.coordinator.shard_ledger import ShardLedger, shard_of


def test_public_api_is_importable_as_moshray():
    for name in ("fit", "Session", "ElasticOptimizer", "data", "TrainConfig", "UserError"):
        assert hasattr(moshray, name), name
    assert moshray.data.from_fn is from_fn


# -- bad input: one line that says what to fix ------------------------------------------------

def test_a_loss_that_is_not_a_scalar_is_refused():
    model = torch.nn.Linear(3, 2)
    with pytest.raises(UserError, match=r"loss: must be a scalar, got shape \(4, 2\)"):
        check_loss(model(torch.randn(4, 3)))
    with pytest.raises(UserError, match="loss: opt.step.loss. needs a tensor"):
        check_loss(1.5)
    with pytest.raises(UserError, match="does not depend on the model"):
        check_loss(torch.tensor(1.0))


def test_an_optimizer_the_wrapper_cannot_handle_is_refused():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    with pytest.raises(UserError, match="optimizer: LBFGS"):
        check_optimizer(model, torch.optim.LBFGS(model.parameters()))
    with pytest.raises(UserError, match="expected a torch.optim.Optimizer"):
        check_optimizer(model, "adam")
    with pytest.raises(UserError, match="2 of the model's 4 trainable parameters are not in it"):
        check_optimizer(model, torch.optim.SGD(model[0].parameters(), lr=0.1))
    with pytest.raises(UserError, match="not parameters of the model"):
        check_optimizer(model, torch.optim.SGD([torch.nn.Parameter(torch.zeros(1)),
                                                *model.parameters()], lr=0.1))
    check_optimizer(model, torch.optim.AdamW(model.parameters()))  # fine


def test_errors_are_one_line_and_cross_actor_boundaries():
    import pickle

    err = UserError("data", "shard 3 of 8\n yielded   nothing")
    assert str(err) == "data: shard 3 of 8 yielded nothing"
    again = pickle.loads(pickle.dumps(err))
    assert isinstance(again, UserError) and str(again) == str(err)

    class Wrapped(Exception):
        cause = err

    found = find_user_error(Wrapped())
    assert type(found) is UserError and str(found) == str(err)
    assert find_user_error(ValueError("x")) is None


def _granter(ledger: ShardLedger, peer: str = "p"):
    def grant(floor: int) -> Future:
        f: Future = Future()
        f.set_result(ledger.grant(peer, 1, floor))
        return f
    return grant


def test_a_data_function_that_yields_nothing_is_refused():
    source = from_fn(lambda shard, num_shards, seed: iter(()), num_shards=4)
    feed = ShardFeed(source, seed=0, grant=_granter(ShardLedger()))
    with pytest.raises(UserError, match=r"data: shard \d of 4 \(seed 0\) yielded no batches"):
        feed.next()


def test_bad_data_arguments_are_refused():
    with pytest.raises(UserError, match="must take .shard, num_shards, seed."):
        from_fn(lambda x: [x])
    with pytest.raises(UserError, match="num_shards must be at least 1"):
        from_fn(lambda a, b, c: [], num_shards=0)
    with pytest.raises(UserError, match="got int"):
        as_source(42)
    with pytest.raises(UserError, match="does not exist"):
        parquet(["/nonexistent/moshray/data.parquet"], batch_size=4)


# -- the data position ------------------------------------------------------------------------

def test_shards_of_one_data_epoch_are_each_opened_once_in_a_seeded_order():
    for epoch in range(3):
        numbers = range(epoch * 8, (epoch + 1) * 8)
        opened = [shard_of(n, 8, seed=5) for n in numbers]
        assert sorted(s for s, _ in opened) == list(range(8))
        assert {seed for _, seed in opened} == {5 + epoch}
    assert [shard_of(n, 8, 5) for n in range(8)] != [shard_of(n, 8, 6) for n in range(8)]


def _ids(shard: int, num_shards: int, seed: int):
    """Two batches per shard of sample ids, tagged with the data epoch's seed."""
    ids = [seed * 1000 + i for i in range(shard, 40, num_shards)]
    yield torch.tensor(ids[: len(ids) // 2])
    yield torch.tensor(ids[len(ids) // 2:])


def test_feeds_of_replicas_that_come_and_go_never_repeat_a_sample():
    """Three replicas share one ledger; one dies with its shard half read, a joiner starts
    from the donor's position, then the Coordinator restarts (a new ledger) and learns the
    position again from the floors: within a data epoch no sample is taken twice."""
    source = from_fn(_ids, num_shards=8)
    ledger = ShardLedger()
    feeds = {p: ShardFeed(source, 0, _granter(ledger, p)) for p in "abc"}
    seen: list[int] = []
    rng = random.Random(0)
    for turn in range(60):
        if turn == 20:
            del feeds["c"]  # died mid-shard: the rest of its shard is skipped, never repeated
            feeds["d"] = ShardFeed(source, 0, _granter(ledger, "d"))
            feeds["d"].load_state_dict(feeds["a"].state_dict())  # from its donor
        if turn == 40:  # a restarted Coordinator: an empty ledger, told the positions
            ledger = ShardLedger()  # by the replicas as they rejoin (see next test)
            for p, f in feeds.items():
                ledger.raise_floor(f.position)
                f.grant = _granter(ledger, p)
                f._pending = None  # the grant asked of the old one is lost
        seen += feeds[rng.choice(sorted(feeds))].next().tolist()
    by_epoch: dict[int, list[int]] = {}
    for i in seen:
        by_epoch.setdefault(i // 1000, []).append(i)
    assert len(by_epoch) >= 2  # the run went through more than one data epoch
    for epoch, ids in by_epoch.items():
        assert len(ids) == len(set(ids)), f"epoch {epoch} repeated {len(ids) - len(set(ids))}"


def test_a_restarted_coordinator_grants_no_shard_before_it_heard_the_positions():
    from moshray.cluster.coordinator.core import REJOIN_GRACE_S, CoordinatorCore
    from moshray.cluster.coordinator.membership import MembershipConfig

    now = [100.0]
    core = CoordinatorCore(MembershipConfig(), clock=lambda: now[0])
    assert core.grant_shards("a", 1, 0) == ()  # not registered: ask again later
    core.register("a", "a", "node-a")
    assert core.grant_shards("a", 1, 0) == (0,)  # a first start grants at once
    fresh = CoordinatorCore(MembershipConfig(), clock=lambda: now[0])  # after a restart
    fresh.rejoin("a", "a", "node-a", 4, data_position=9)
    assert fresh.grant_shards("a", 1, 3) == ()  # the others may hold later shards
    fresh.rejoin("b", "b", "node-b", 4, data_position=12)
    now[0] += REJOIN_GRACE_S
    assert fresh.grant_shards("a", 1, 3) == (12,)  # past every position it heard
    assert fresh.data_position() == 13


# -- the state that travels -------------------------------------------------------------------

class Feed:
    def __init__(self, position: int = 0):
        self.position = position

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, s):
        self.position = max(self.position, s["position"])


def _state(seed: int = 0, position: int = 0) -> TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    ema = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    return TrainState(model, opt, {"steps": 0, "ema": ema}, Feed(position), {})


def test_a_joiner_receives_model_optimizer_extra_state_data_position_and_rng():
    donor = _state(position=17)
    donor.model(torch.randn(3, 4)).sum().backward()
    donor.optimizer.step()
    donor.extra["steps"] = 5
    with torch.no_grad():
        donor.extra["ema"].weight.fill_(0.25)
    donor.epoch = 5
    torch.manual_seed(123)
    snap = donor.snapshot()
    expected_draw = torch.rand(3)

    joiner = _state(position=2)
    ema_object = joiner.extra["ema"]
    joiner.load(snap, from_donor=True)
    assert joiner.epoch == 5 and joiner.extra["steps"] == 5
    assert joiner.extra["ema"] is ema_object  # loaded in place: the loop's object stays valid
    assert torch.equal(ema_object.weight, torch.full((2, 4), 0.25))
    assert joiner.feed.position == 17
    assert joiner.optimizer.state_dict()["state"]  # Adam's moments came along
    assert torch.equal(torch.rand(3), expected_draw)  # the RNG continues the donor's stream
    assert extra_digest(joiner.extra) == extra_digest(donor.extra)
    assert torch.equal(joiner.model.weight, donor.model.weight)


def test_a_model_built_differently_on_another_replica_is_refused():
    donor = _state(seed=0)
    other = _state(seed=1)  # the user's code did not build the model deterministically
    with pytest.raises(UserError, match="model: its initial parameters differ between "
                                        "replicas"):
        other.load(donor.snapshot(), from_donor=True)
    other.load(donor.snapshot(), from_donor=False)  # a checkpoint may come from other code


def test_a_state_that_does_not_fit_the_model_is_refused():
    snap = _state().snapshot()
    torch.manual_seed(0)
    wider = torch.nn.Linear(4, 3)
    target = TrainState(wider, torch.optim.Adam(wider.parameters()), {}, Feed(), {})
    before = {k: v.clone() for k, v in wider.state_dict().items()}
    with pytest.raises(UserError) as err:
        target.load(snap, from_donor=False)
    # one line naming the first tensor that differs; nothing of the state was copied in
    assert str(err.value) == ("model: the checkpoint's model is not this one: 'weight' is "
                              "[2, 4] float32 in the stored model but [3, 4] float32 in this "
                              "one (train the model it was saved from, or start a new run: "
                              "another checkpoint.run_id)")
    assert all(torch.equal(before[k], v) for k, v in wider.state_dict().items())


def test_a_users_other_model_of_another_dtype_or_names_is_refused_by_name():
    """Two users' models differ in what config_mismatch cannot see (their own modules): the
    fingerprint (names, shapes, dtypes) tells, also where torch's load would cast or pass."""
    snap = _state().snapshot()
    half = torch.nn.Linear(4, 2).to(torch.float64)  # same names and shapes, other dtype
    target = TrainState(half, torch.optim.SGD(half.parameters(), lr=0.1), {}, Feed(), {})
    with pytest.raises(UserError, match="'weight' is \\[2, 4\\] float32 in the stored model "
                                        "but \\[2, 4\\] float64 in this one"):
        target.load(snap, from_donor=True)
    renamed = torch.nn.Sequential(torch.nn.Linear(4, 2))
    target = TrainState(renamed, torch.optim.SGD(renamed.parameters(), lr=0.1), {}, Feed(), {})
    with pytest.raises(UserError, match="'weight' is in the stored model but not in this one"):
        target.load(snap, from_donor=False)


def test_batch_sizes_are_read_from_the_first_tensor():
    assert batch_size_of((torch.zeros(7, 3), torch.zeros(7))) == 7
    assert batch_size_of({"x": torch.zeros(5, 2)}) == 5
    assert batch_size_of(torch.zeros(())) == 1 and batch_size_of("text") == 1


# -- settings and sources -----------------------------------------------------------------------

def test_settings_map_onto_the_config_and_unknown_ones_are_refused():
    cfg = moshray.build_config({"training": {"lr": 0.01}}, max_nodes=3, mode="local_sgd",
                               checkpoint_uri="s3://b/run")
    assert (cfg.cluster.max_nodes, cfg.training.mode, cfg.training.lr, cfg.checkpoint.uri) == \
        (3, "local_sgd", 0.01, "s3://b/run")
    with pytest.raises(moshray.ConfigError, match="max_node: unknown setting"):
        moshray.build_config(max_node=3)
    with pytest.raises(moshray.ConfigError, match="training.lr"):
        moshray.build_config(None, **{}) and None or moshray.build_config({"training": {"lr": -1}})


def test_parquet_sources_stream_row_groups_as_shards(tmp_path: Path):
    for f in range(2):
        table = pa.table({"x": np.arange(f * 100, f * 100 + 100, dtype=np.float32),
                          "label": np.arange(100) % 3})
        pq.write_table(table, tmp_path / f"part-{f}.parquet", row_group_size=25)
    source = as_source(str(tmp_path), batch_size=10)
    assert source.num_shards == 8  # 2 files x 4 row groups
    batches = list(source.open(5, seed=0))
    assert [len(b["x"]) for b in batches] == [10, 10, 5]
    assert batches[0]["x"].dtype == torch.float32 and batches[0]["label"].dtype == torch.int64
    every = torch.cat([b["x"] for s in range(8) for b in source.open(s, 0)])
    assert sorted(every.tolist()) == list(range(200))
