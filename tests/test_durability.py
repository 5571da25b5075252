"""Durability follows the cluster (``jobs/controller/durability.py``): the pure decision for every kind
of checkpoint and data location as machines appear, and the driver's guard fed node tables
as ``ray.nodes()`` gives them (every node of this repo's clusters is on 127.0.0.1, so
machines here are addresses written into the rows)."""

from __future__ import annotations

import io
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moshray.actors.replica.data_sources import parquet
from moshray.actors.errors import UserError
from moshray.jobs.config import ConfigError, TrainConfig, load_config
from moshray.jobs.controller.durability import (
    DurabilityGuard,
    Keep,
    Stop,
    Switch,
    decide_durability,
)

BARE = load_config(None)
LOCAL = load_config(None, {"checkpoint.uri": "/tmp/ckpt"})
FILE = load_config(None, {"checkpoint.uri": "file:///tmp/ckpt"})
DURABLE = load_config(None, {"checkpoint.uri": "gs://mine/run"})
OPTIONAL = load_config(None, {"checkpoint.optional": "true"})
LOCAL_DATA = TrainConfig.from_dict({"data": {"paths": ["/data/x.parquet"]},
                                    "checkpoint": {"uri": "s3://b/run"}})


@pytest.mark.parametrize("config", [BARE, LOCAL, FILE, DURABLE, OPTIONAL, LOCAL_DATA])
@pytest.mark.parametrize("default", [None, "", "s3://cluster/ckpt", "/head/ckpt"])
def test_one_machine_keeps_every_config(config, default):
    assert decide_durability(config, 1, default, ("/local/a.parquet",)) == Keep()
    assert decide_durability(config, 0, default) == Keep()


@pytest.mark.parametrize("config,default,expected", [
    (DURABLE, "s3://cluster/ckpt", Keep()),  # the user's durable location wins
    (DURABLE, None, Keep()),
    (BARE, "s3://cluster/ckpt", Switch("s3://cluster/ckpt")),  # checkpoints come on
    (LOCAL, "s3://cluster/ckpt", Switch("s3://cluster/ckpt")),  # a node-local one is moved
    (FILE, "gs://cluster/ckpt", Switch("gs://cluster/ckpt")),
    (OPTIONAL, "s3://cluster/ckpt", Switch("s3://cluster/ckpt")),
    (OPTIONAL, None, Keep()),  # runs without, with a warning
    (OPTIONAL, "/head/ckpt", Keep()),  # a node-local cluster default does not count
])
def test_two_machines_keep_or_switch(config, default, expected):
    assert decide_durability(config, 2, default) == expected


@pytest.mark.parametrize("config,default,field,words", [
    (BARE, None, "checkpoint.uri", "no durable checkpoint location"),
    (BARE, "", "checkpoint.uri", "MOSHRAY_CHECKPOINT_URI"),
    (BARE, "/head/ckpt", "checkpoint.uri", "--checkpoint s3://"),
    (LOCAL, None, "checkpoint.uri", "'/tmp/ckpt' is on one machine's disk"),
    (FILE, "file:///head", "checkpoint.uri", "durable storage"),
    (LOCAL_DATA, "s3://cluster/ckpt", "data.paths", "'/data/x.parquet' is on one machine"),
])
def test_two_machines_stop_with_one_line_saying_what_to_set(config, default, field, words):
    decision = decide_durability(config, 3, default)
    assert isinstance(decision, Stop) and isinstance(decision.error, ConfigError)
    assert decision.error.field_path == field
    assert words in decision.message and "\n" not in decision.message
    assert "has 3" in decision.message or "has 3 machines" in decision.message


def test_node_local_parquet_files_stop_a_job_of_several_machines(tmp_path: Path):
    pq.write_table(pa.table({"x": [1.0, 2.0]}), tmp_path / "a.parquet", row_group_size=1)
    source = parquet(str(tmp_path), batch_size=1)
    assert source.uris == (str(tmp_path / "a.parquet"),)  # two row groups, one file
    assert decide_durability(DURABLE, 1, None, source.uris) == Keep()
    decision = decide_durability(DURABLE, 2, "s3://cluster/ckpt", source.uris)
    assert isinstance(decision, Stop) and isinstance(decision.error, UserError)
    assert str(decision.error).startswith(f"data: '{tmp_path / 'a.parquet'}' is on one "
                                          f"machine's disk but this cluster has 2")
    for durable in (("s3://bucket/a.parquet",), ("gs://bucket/a.parquet",)):
        assert decide_durability(DURABLE, 2, None, durable) == Keep()
    assert isinstance(decide_durability(DURABLE, 2, None, ("file:///x.parquet",)), Stop)


def _rows(*addresses: str, dead: tuple[str, ...] = ()) -> list[dict]:
    """Node rows as ``ray.nodes()`` gives them (the fields the driver reads)."""
    return [{"NodeID": f"{i:056x}", "NodeManagerAddress": a, "Alive": True}
            for i, a in enumerate(addresses)] + \
        [{"NodeID": f"{99:056x}", "NodeManagerAddress": a, "Alive": False} for a in dead]


def _alive(rows: list[dict]) -> list[str]:
    return [r["NodeManagerAddress"] for r in rows if r["Alive"]]


def test_a_job_started_on_one_machine_switches_when_a_second_joins():
    out = io.StringIO()
    guard = DurabilityGuard(LOCAL, "s3://cluster/ckpt", out)
    # the head alone, then two raylets on the same machine: still one machine
    assert guard.update(_alive(_rows("10.0.0.1"))) is LOCAL
    assert guard.update(_alive(_rows("10.0.0.1", "10.0.0.1", dead=("10.0.0.9",)))) is LOCAL
    assert out.getvalue() == ""
    switched = guard.update(_alive(_rows("10.0.0.1", "10.0.0.2")))
    assert switched.checkpoint.uri == "s3://cluster/ckpt"
    assert out.getvalue().strip().splitlines() == [
        "2 machines: checkpoints go to s3://cluster/ckpt (MOSHRAY_CHECKPOINT_URI) instead of "
        "the node-local '/tmp/ckpt'"]
    # the second machine leaves and another comes: machines seen are never forgotten
    assert guard.update(_alive(_rows("10.0.0.1"))) is switched
    assert guard.update(_alive(_rows("10.0.0.1", "10.0.0.3"))) is switched
    assert len(out.getvalue().strip().splitlines()) == 1


def test_a_job_without_a_durable_location_stops_when_a_second_machine_joins():
    guard = DurabilityGuard(BARE, None, io.StringIO())
    assert guard.update(["10.0.0.1"]) is BARE
    with pytest.raises(ConfigError, match=r"^checkpoint.uri: this cluster has 2 machines"):
        guard.update(["10.0.0.1", "10.0.0.2"])


def test_optional_checkpoints_warn_once_when_a_second_machine_joins():
    out = io.StringIO()
    guard = DurabilityGuard(OPTIONAL, None, out)
    guard.update(["10.0.0.1"])
    guard.update(["10.0.0.1", "10.0.0.2"])
    guard.update(["10.0.0.1", "10.0.0.2", "10.0.0.3"])
    lines = out.getvalue().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: checkpoints are off")


def test_parquet_files_given_after_the_start_are_checked_on_the_machines_seen():
    guard = DurabilityGuard(DURABLE, None, io.StringIO())
    guard.update(["10.0.0.1"])
    assert guard.add_data(["/data/a.parquet"]) is DURABLE  # one machine: its disk works
    with pytest.raises(UserError, match="^data: '/data/a.parquet' is on one machine's disk"):
        guard.update(["10.0.0.1", "10.0.0.2"])
    other = DurabilityGuard(DURABLE, None, io.StringIO())
    other.update(["10.0.0.1", "10.0.0.2"])
    with pytest.raises(UserError, match="moshray.data.parquet"):
        other.add_data(["/data/a.parquet"])


def test_the_job_is_named_by_its_config_as_submitted_not_as_the_guard_switched_it():
    """A resubmitted driver that sees two machines at its start (the guard switches at
    once) fingerprinted the switched config: not the first driver's job, so it replaced the
    swarm it should have adopted. The guard keeps the config as submitted for the name."""
    from moshray.jobs.controller.lease import fingerprint

    first = DurabilityGuard(LOCAL, "s3://cluster/ckpt", io.StringIO())
    first.update(["10.0.0.1"])  # the first driver started on one machine
    again = DurabilityGuard(LOCAL, "s3://cluster/ckpt", io.StringIO())
    switched = again.update(["10.0.0.1", "10.0.0.2"])  # the resubmission sees two
    assert switched.checkpoint.uri == "s3://cluster/ckpt"
    assert fingerprint(switched.to_dict()) != fingerprint(first.config.to_dict())
    assert again.submitted is LOCAL and first.submitted is LOCAL
    assert fingerprint(again.submitted.to_dict()) == fingerprint(first.submitted.to_dict())


def test_an_adopted_swarm_keeps_the_location_its_checkpoints_were_switched_to():
    out = io.StringIO()
    guard = DurabilityGuard(LOCAL, "s3://cluster/ckpt", out)
    guard.update(["10.0.0.1"])  # this driver has seen one machine so far
    adopted = guard.adopt_location("s3://cluster/ckpt")  # where the swarm's lease says
    assert adopted.checkpoint.uri == "s3://cluster/ckpt"
    assert out.getvalue().strip() == \
        "checkpoints go to s3://cluster/ckpt, where the adopted swarm keeps them"
    # more machines later: the location is durable already, it stays (no second line)
    assert guard.update(["10.0.0.1", "10.0.0.2"]).checkpoint.uri == "s3://cluster/ckpt"
    assert len(out.getvalue().strip().splitlines()) == 1
    assert guard.adopt_location(None) is guard.config  # a record without one: unchanged
    assert guard.adopt_location("s3://cluster/ckpt") is guard.config
