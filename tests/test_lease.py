"""The job lease's pure decisions (jobs/controller/lease.py): who adopts a running swarm,
and when a swarm whose driver is gone ends by itself. No Ray."""

from __future__ import annotations

from moshray.jobs.config import TrainConfig
from moshray.jobs.controller.lease import (
    Adopt,
    Fresh,
    JobRecord,
    Replace,
    decide_claim,
    fingerprint,
    reap_reason,
    replica_actor_name,
)

CONFIG = TrainConfig().to_dict()
RECORD = JobRecord(run_id="r1", fingerprint=fingerprint(CONFIG), holder="01000000",
                   lease_s=60.0)


def test_the_same_job_adopts_a_swarm_whose_driver_is_gone():
    assert decide_claim(RECORD, "02000000", RECORD.fingerprint, holder_alive=False) \
        == Adopt(RECORD)
    # the same driver (a second run in one process) adopts too
    assert decide_claim(RECORD, "01000000", RECORD.fingerprint, holder_alive=True) \
        == Adopt(RECORD)


def test_another_job_a_live_driver_or_a_stopping_swarm_is_replaced():
    assert decide_claim(None, "02000000", RECORD.fingerprint, False) == Fresh()
    other = fingerprint({**CONFIG, "model": {**CONFIG["model"], "d_model": 32}})
    assert decide_claim(RECORD, "02000000", other, False) == \
        Replace("a job with another config holds the cluster")
    assert isinstance(decide_claim(RECORD, "02000000", RECORD.fingerprint, True), Replace)
    stopping = JobRecord(**{**RECORD.__dict__, "stopping": True})
    assert decide_claim(stopping, "02000000", RECORD.fingerprint, False) == \
        Replace("the previous job was stopping")


def test_the_fingerprint_ignores_the_runs_bounds_and_outputs():
    longer = {**CONFIG, "training": {**CONFIG["training"], "max_steps": 500}, "json": True}
    assert fingerprint(longer) == fingerprint(CONFIG)
    assert fingerprint({**CONFIG, "run_dir": "another-run"}) != fingerprint(CONFIG)
    assert fingerprint({**CONFIG, "training": {**CONFIG["training"], "lr": 0.1}}) \
        != fingerprint(CONFIG)


def test_a_swarm_ends_when_the_lease_lapses_or_a_stopped_driver_is_gone():
    assert reap_reason(None, 1e9, False) is None
    assert reap_reason(RECORD, 59.0, holder_alive=False) is None  # within the lease
    assert "did not renew the lease for 61 s" in reap_reason(RECORD, 61.0, True)
    stopping = JobRecord(**{**RECORD.__dict__, "stopping": True})
    assert reap_reason(stopping, 1.0, holder_alive=True) is None  # still finishing itself
    assert reap_reason(stopping, 1.0, holder_alive=False) == \
        "its driver was stopped and is gone"


def test_replica_names_carry_the_run():
    assert replica_actor_name("r1", "replica-0-3") == "moshray-replica:r1:replica-0-3"
