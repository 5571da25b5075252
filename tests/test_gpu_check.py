"""`moshray bench gpu` (jobs/bench/gpu.py) on a machine without CUDA: the CPU path of the
parts that need no Ray, the one JSON line and --out, bad arguments, and the runner's handling
of a part that hangs or dies (the part is stopped, its error recorded, the check goes on).
The group and replicas parts start Ray: tests/test_replica_group.py covers the group, and
`moshray bench gpu` itself runs the replicas part."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moshray.jobs.bench import gpu
from moshray.jobs.examples.lm import tasks
from moshray.jobs.examples.lm.model import ModelConfig

NO_CUDA = not torch.cuda.is_available()


def test_the_lm_windows_are_next_byte_pairs_from_the_corpus():
    import numpy as np

    x, y = tasks.lm_windows(np.random.default_rng(0), 4, 16)
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one byte
    again, _ = tasks.lm_windows(np.random.default_rng(0), 4, 16)
    assert torch.equal(x, again)


@pytest.mark.parametrize("sizes", [gpu.Sizes.cuda(), gpu.Sizes.cpu()], ids=["cuda", "cpu"])
def test_both_size_profiles_make_valid_models(sizes):
    ModelConfig(**sizes.model_config)  # raises on a bad shape
    assert sizes.moe_d_model > 0 and sizes.batch % 2 == 0  # the group splits the batch in 2


def test_unknown_parts_are_refused_in_one_line():
    assert gpu.parse_parts("group,steprate") == ["steprate", "group"]  # run in PARTS order
    with pytest.raises(gpu.BenchError, match="unknown part 'gpus'; use some of steprate,"):
        gpu.parse_parts("steprate,gpus")
    proc = subprocess.run([sys.executable, "-m", "moshray.jobs.bench.gpu", "--parts", "x"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "moshray bench gpu: --parts: unknown part 'x'; use some of "
        "steprate,allreduce,experts,replicas,group"]


@pytest.mark.skipif(not NO_CUDA, reason="checks the path of a machine without CUDA")
def test_without_cuda_the_check_says_so_and_prints_one_json_line(tmp_path: Path):
    out = tmp_path / "check" / "gpu.json"
    proc = subprocess.run([sys.executable, "-m", "moshray.jobs.bench.gpu", "--parts",
                           "allreduce", "--out", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    summary = json.loads(lines[0])
    assert json.loads(out.read_text()) == summary
    assert summary["cuda"] is False and "no CUDA" in summary["note"]
    assert "no CUDA device" in proc.stderr
    assert list(summary["parts"]) == ["allreduce"]
    allreduce = summary["parts"]["allreduce"]
    assert allreduce["ok"] and allreduce["device"] == "cpu", allreduce
    assert allreduce["peers_bitwise_equal"] and allreduce["max_abs_error"] < 1e-5
    assert summary["ok"] is True and summary["replica_vs_plain"] is None  # no replicas part


def test_the_plain_loop_and_the_experts_parts_on_cpu():
    sizes = gpu.Sizes.cpu()
    plain = gpu.part_steprate(sizes)
    assert plain["device"] == "cpu" and not plain["amp_bf16"] and plain["samples_per_s"] > 0
    experts = gpu.part_experts(sizes)
    assert "error" not in experts, experts
    assert experts["expert_device"] == "cpu" and experts["layer_device"] == "cpu"
    assert experts["max_abs_diff_vs_cpu_experts"] == 0.0  # the same experts, the same device


def test_a_part_that_hangs_is_stopped_and_its_error_recorded():
    seen = []
    child = ("import os, sys, time; print('pid', os.getpid(), flush=True); "
             "print('still working', file=sys.stderr, flush=True); time.sleep(300)")
    out = gpu.run_part("steprate", 2.0, "cpu", seen.append, argv=[sys.executable, "-c", child])
    assert out["ok"] is False
    assert out["error"] == "timed out after 2 s; its output ends: still working"
    pid = int(out["log_tail"].split()[1])  # "pid N" was the first line
    with pytest.raises(ProcessLookupError):  # the whole process group was stopped
        os.kill(pid, 0)
    assert seen and "[steprate] FAILED" in seen[-1]


def test_a_part_that_dies_records_its_exit_code_and_output():
    child = "import sys; print('boom: no device', file=sys.stderr); sys.exit(3)"
    out = gpu.run_part("experts", 60.0, "cpu", lambda *_: None,
                       argv=[sys.executable, "-c", child])
    assert out == {"ok": False, "error": "exited 3; its output ends: boom: no device",
                   "log_tail": "boom: no device\n", "wall_s": out["wall_s"]}


def test_session_autocast_is_off_on_cpu_unless_asked_and_bf16_when_asked():
    from moshray.actors.replica.session import Session
    from moshray.jobs.config import TrainConfig

    session = Session("p0", TrainConfig(), torch.device("cpu"), None, None, None, None)
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with session.autocast():  # the CPU default: full precision
        assert layer(x).dtype == torch.float32
    with session.autocast(True):  # CPU autocast, asked for
        assert layer(x).dtype == torch.bfloat16


def test_a_partial_of_a_module_function_ships_to_the_replicas():
    """fit's ship_by_value looks behind a functools.partial (part (a) passes partials as the
    loop and the data); before, it shipped functools itself by value, which cannot pickle."""
    import functools

    import ray.cloudpickle

    from moshray.jobs.fit import ship_by_value

    shard = functools.partial(tasks.lm_shard, seq_len=8, batch=2)
    try:
        ship_by_value(shard, functools.partial(gpu.replica_loop, lr=0.1))
        back = ray.cloudpickle.loads(ray.cloudpickle.dumps(shard))
    finally:
        try:  # leave no module registered by value behind for the other tests
            ray.cloudpickle.unregister_pickle_by_value(functools)
        except ValueError:
            pass
    assert back.func is tasks.lm_shard and back.keywords == {"seq_len": 8, "batch": 2}


def test_a_replica_without_a_gpu_from_ray_trains_on_the_cpu():
    from moshray.actors.replica.device import pick_device

    assert pick_device([]).type == "cpu"  # Ray gave none, whatever CUDA shows
    assert pick_device(["0"]).type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert pick_device().type == ("cuda" if torch.cuda.is_available() else "cpu")
