"""`jobs/bench/run_cpu.py`: a run's CPU by role (the roles, the bookkeeping, a real sample)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from moshray.jobs.bench.join_profile import ProcSample
from moshray.jobs.bench.run_cpu import RUN_ROLES, CpuAccount, CpuSampler, RunCpu, run_role


@pytest.mark.parametrize("title, role", [
    ("ray::ReplicaActor.run", "training"),
    ("ray::ReplicaActor", "training"),
    ("ray::RayTrainWorker.run_train_fn", "training"),
    ("ray::Coordinator", "control"),
    ("ray::NoticeWatcher.watch", "watchers"),
    ("ray::TrainController.run", "control"),
    ("ray::IDLE", "ray_daemons"),
    ("ray::DashboardAgent", "ray_daemons"),
    ("ray::RuntimeEnvAgent", "ray_daemons"),
    ("/usr/lib/python3/site-packages/ray/core/src/ray/raylet/raylet --raylet_socket_name=x",
     "ray_daemons"),
    ("/x/ray/core/src/ray/gcs/gcs_server --gcs_server_port=1", "ray_daemons"),
    ("/usr/bin/python -u /x/ray/dashboard/agent.py --node-ip-address=127.0.0.1",
     "ray_daemons"),
    ("/usr/bin/python -m ray.util.client.server --address=127.0.0.1:1", "ray_daemons"),
    ("/usr/bin/python -m moshray.jobs.bench.goodput_moshray --config c.json", "drivers"),
    ("/usr/bin/python -m moshray.jobs.bench.raytrain_baseline --duration 60", "drivers"),
    # a driver's options may name anything: only the program decides
    ("/usr/bin/python -m moshray.jobs.train --set run_dir=/tmp/agent/dashboard", "drivers"),
])
def test_roles_come_from_the_ray_title(title, role):
    assert run_role(title) == role


def _p(pid, cpu, title="ray::ReplicaActor", started=100):
    return ProcSample(pid, 1, started, title, cpu)


def test_account_counts_from_the_first_sample_and_new_processes_from_zero():
    acc = CpuAccount()
    acc.add({1: _p(1, 50.0), 2: _p(2, 7.0, "raylet")}, {1, 2})  # the baseline
    assert acc.by_role == dict.fromkeys(RUN_ROLES, 0.0)
    acc.add({1: _p(1, 52.5), 2: _p(2, 7.5, "raylet"), 3: _p(3, 1.25, "ray::IDLE")}, {1, 2, 3})
    assert acc.by_role["training"] == pytest.approx(2.5)
    assert acc.by_role["ray_daemons"] == pytest.approx(0.5 + 1.25)  # 3 started meanwhile


def test_account_keeps_out_of_scope_processes_and_counts_a_reused_pid_anew():
    acc = CpuAccount()
    acc.add({1: _p(1, 10.0), 9: _p(9, 100.0, "python other")}, {1})
    acc.add({1: _p(1, 3.0, started=200), 9: _p(9, 180.0, "python other")}, {1})
    assert acc.by_role["training"] == pytest.approx(3.0)  # pid 1 is another process now
    assert acc.by_role["drivers"] == 0.0  # pid 9 is not below the bench


def test_run_cpu_reports_cores_and_a_line():
    cpu = RunCpu(100.0, 2, {"training": 150.0, "control": 5.0, "watchers": 1.0,
                            "ray_daemons": 30.0, "drivers": 2.0})
    assert cpu.cores("training") == pytest.approx(1.5)
    out = cpu.to_json()
    assert out["cores"]["ray_daemons"] == pytest.approx(0.3) and out["cpus"] == 2
    assert cpu.line().startswith("training 150 CPU-s (1.50 cores), control 5 CPU-s")
    assert cpu.line().endswith("; 188 of 200 CPU-s")


def test_sampler_counts_a_child_process_cpu():
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\n"
    with CpuSampler(interval_s=0.1) as sampler:
        subprocess.run([sys.executable, "-c", burn], check=True, timeout=60)
    cpu = sampler.result
    assert cpu is not None and cpu.wall_s >= 0.6
    # the child ran between two samples at most 0.1 s apart, so most of its CPU is seen
    assert cpu.cpu_s["drivers"] >= 0.4, cpu


def test_sampler_without_proc_reports_nothing(tmp_path):
    with CpuSampler(interval_s=0.05, proc_root=str(tmp_path / "none")) as sampler:
        pass
    assert sampler.result is None
