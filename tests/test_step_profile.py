"""The step profile's arithmetic (cluster/coordinator/step_profile.py): pure, with a fake clock."""

import pytest

from moshray.cluster.coordinator.step_profile import PhaseClock, StepPhases, StepProfile


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t

    def advance(self, s):
        self.t += s


def test_phases_split_the_wall_time_between_two_steps():
    clock = FakeClock()
    pc = PhaseClock(clock)
    pc.enter()  # first micro-batch handed over: nothing measured before it
    clock.advance(0.01)
    pc.leave()  # 0.01 control
    clock.advance(0.05)
    pc.enter()  # 0.05 compute
    clock.advance(0.002)
    pc.plan_arrived()
    clock.advance(0.003)
    pc.leave()  # 0.005 control
    clock.advance(0.04)
    pc.enter()  # 0.04 compute
    clock.advance(0.001)
    pc.step_begins()  # 0.001 control; the plan waited 0.044 in the replica
    clock.advance(0.1)
    phases = pc.step_ends(epoch=3, round_s=0.08, samples=16, micro=2)
    assert phases.compute_s == pytest.approx(0.09)
    assert phases.control_s == pytest.approx(0.016)
    assert phases.round_s == pytest.approx(0.08)
    assert phases.apply_s == pytest.approx(0.02)
    assert phases.plan_lag_s == pytest.approx(0.044)
    assert phases.wall_s == pytest.approx(0.206)
    # the next step starts counting where this one ended
    clock.advance(0.003)
    pc.leave()
    clock.advance(0.05)
    pc.enter()
    nxt = pc.step_ends(epoch=4, round_s=0.0, samples=8, micro=1, overlapped=True)
    assert nxt.wall_s == pytest.approx(0.053)
    assert nxt.compute_s == pytest.approx(0.05) and nxt.control_s == pytest.approx(0.003)
    assert nxt.plan_lag_s == 0.0 and nxt.round_s == 0.0


def test_profile_summary_gives_medians_shares_and_skips_early_steps():
    profile = StepProfile(keep=3)
    assert profile.summary()["steps"] == 0
    for epoch, compute in [(1, 9.0), (2, 0.1), (3, 0.2), (4, 0.3)]:  # keep=3 drops epoch 1
        profile.add(StepPhases(epoch, wall_s=compute + 0.1, compute_s=compute, control_s=0.0,
                               round_s=0.1, apply_s=0.0, plan_lag_s=0.0, samples=8, micro=1,
                               round_phases=(("put", 0.01),), rounds=1 + epoch % 2))
    s = profile.summary(since_epoch=2)
    assert s["rounds_max"] == 2  # epoch 3's grid took two rounds, epoch 4's one
    assert s["steps"] == 2
    assert s["median_s"]["compute_s"] == pytest.approx(0.25)
    assert s["share"]["round_s"] == pytest.approx(0.2 / 0.7)
    assert s["round_phases_median_s"] == {"put": 0.01}


def test_negative_seconds_are_refused():
    with pytest.raises(ValueError, match="round_s"):
        StepPhases(1, 1.0, 0.5, 0.0, -0.1, 0.0, 0.0, 8, 1)


def test_bench_step_rejects_bad_node_counts_with_one_line(capsys):
    import argparse

    import moshray.jobs.bench.step as bench_step
    assert bench_step.parse_counts("4,1,2,2") == [1, 2, 4]
    parser = argparse.ArgumentParser()
    bench_step.add_arguments(parser)
    assert bench_step.main(parser.parse_args(["--nodes", "1,x"])) == 2
    err = capsys.readouterr().err.strip()
    assert err == "moshray bench step: --nodes wants counts like 1,2,4; got 'x'"
