"""The baselines a user would run instead of moshray, their pure parts: Ray Train + torchft's
checkpoints and fragments, DDP's communication hooks, and how the benches report a baseline
that is missing. The runs themselves are in the goodput and links benches' cluster tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moshray.jobs.bench import raytrain_baseline as rb


def _config(**kw) -> rb.BaselineConfig:
    base = dict(train={}, files=("a.txt",), max_workers=2, deadline_unix=0.0,
                storage_path="/tmp/x", recorder="r")
    return rb.BaselineConfig(**{**base, **kw})


@pytest.mark.parametrize("kw,match", [
    ({"comm_hook": "int8"}, "comm_hook must be one of none, fp16, powersgd"),
    ({"torchft_mode": "hsdp"}, "torchft_mode must be one of ddp, diloco, streaming_diloco"),
    ({"torchft": True, "comm_hook": "fp16"}, "comm_hook is for DDP runs"),
    ({"sync_every": 1}, "sync_every must be >= 2"),
])
def test_a_baseline_config_that_cannot_run_says_what_to_fix(kw, match):
    with pytest.raises(ValueError, match=match):
        _config(**kw)
    assert _config(torchft=True, torchft_mode="streaming_diloco", steady_seconds=5.0).torchft


def _small_model():
    from moshray.jobs.examples.lm.model import ModelConfig, build_model

    return build_model(ModelConfig(vocab_size=256, d_model=16, n_heads=2, n_layers=3, d_ff=32,
                                   seq_len=8), seed=0)


def test_torchft_checkpoints_are_whole_weights_only_and_the_two_newest_are_kept(tmp_path):
    import torch

    model = _small_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    root = str(tmp_path / "run")
    assert rb._checkpoint_dirs(root) == []  # no folder yet: nothing to resume
    for step in (20, 40, 60):
        rb._write_checkpoint(root, model, optimizer, step)
    rb._write_checkpoint(root, model, optimizer, 60)  # the same step twice: kept as it was
    dirs = rb._checkpoint_dirs(root)
    assert [Path(d).name for d in dirs] == ["checkpoint_0000000040", "checkpoint_0000000060"]
    assert not [p for p in os.listdir(root) if p.startswith(".partial-")]
    # what a restarted worker and the bench read: weights only, no code
    state = torch.load(Path(dirs[-1]) / rb.STATE_FILE, weights_only=True)
    assert state["step"] == 60 and set(state["model"]) == set(model.state_dict())
    from moshray.jobs.bench.goodput_runs import latest_persisted

    assert latest_persisted(str(tmp_path)) == str(Path(dirs[-1]) / rb.STATE_FILE)


def test_streaming_diloco_fragments_cover_every_parameter_once():
    model = _small_model()
    fragments = rb._fragments(model)
    assert len(fragments) == 2
    seen = [id(p) for f in fragments for p in f.parameters()]
    assert len(seen) == len(set(seen))  # no parameter in both (the tied head goes with its
    assert set(seen) == {id(p) for p in model.parameters()}  # embedding), none left out


HOOK_STEPS = """
import json, os, sys
import torch
import torch.distributed as dist
import torch.nn.functional as F
from moshray.jobs.bench import raytrain_baseline as rb
from moshray.jobs.examples.lm.model import ModelConfig, build_model

store = dist.FileStore(sys.argv[2], 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
model = torch.nn.parallel.DistributedDataParallel(build_model(ModelConfig(
    vocab_size=256, d_model=16, n_heads=2, n_layers=3, d_ff=32, seq_len=8), seed=0))
rb._register_comm_hook(model, sys.argv[1])
x = torch.randint(0, 256, (4, 8))
for _ in range(rb.POWERSGD_START_ITER + 2):  # past PowerSGD's plain warm-up steps
    model.zero_grad()
    logits = model(x)
    F.cross_entropy(logits.reshape(-1, logits.size(-1)), x.reshape(-1)).backward()
grads = [p.grad for p in model.parameters() if p.grad is not None]
print(json.dumps({"grads": len(grads), "finite": all(bool(torch.isfinite(g).all())
                                                     for g in grads)}), flush=True)
os._exit(0)  # (no teardown of the group: see the test's docstring)
"""


@pytest.mark.parametrize("hook", ["fp16", "powersgd"])
def test_ddp_comm_hooks_train_a_step_of_the_bench_model(hook, tmp_path):
    """The hook is registered on a real DDP model (a gloo group of one) and a backward
    through it yields finite gradients. In a process of its own, which ends without
    tearing the group down: torch's gloo group, freed by the DDP reducer while a hook's
    callback still waits for the GIL on a gloo thread, can deadlock in its destructor (a
    run of the fast tier hung there)."""
    import json

    done = subprocess.run([sys.executable, "-c", HOOK_STEPS, hook, str(tmp_path / "store")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["grads"] > 0 and result["finite"] is True


def test_the_baseline_driver_refuses_a_hook_with_torchft_in_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "moshray.jobs.bench.raytrain_baseline", "--address",
         "127.0.0.1:1", "--duration", "5", "--torchft", "--comm-hook", "fp16"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("raytrain_baseline: --comm-hook is for DDP runs, not "
                                   "--torchft")


def test_a_missing_torchft_is_one_line_and_its_figures_are_none(monkeypatch):
    from moshray.jobs.bench import goodput, links

    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft -> ImportError
    why = goodput.torchft_missing()
    assert why == "torchft is not installed (pip install 'moshray[bench]')"
    assert links._baseline_missing("torchft_diloco") == why
    assert links._baseline_missing("ddp_powersgd") is None
    figures = goodput.torchft_figures(None, None, None, None, None, why)
    assert figures["raytrain_torchft_missing"] == why
    assert figures["moshray_vs_raytrain_torchft"] is None
    assert all(v is None for k, v in figures.items() if k != "raytrain_torchft_missing")


def test_a_fit_that_fails_mid_run_is_called_again_until_the_deadline(monkeypatch):
    """``fit_until_deadline``: a ``fit()`` that raised after running a while is called again
    (a job-level retry), one that failed at once or near the deadline is not."""
    import time
    from types import SimpleNamespace

    outcomes = [RuntimeError("ControllerError: node gone"), RuntimeError("again"),
                SimpleNamespace(checkpoint=SimpleNamespace(path="/ck"))]
    calls = []

    def fake_run(cfg):
        calls.append(cfg.name)
        out = outcomes[len(calls) - 1]
        if isinstance(out, Exception):
            raise out
        return out

    monkeypatch.setattr(rb, "run_baseline", fake_run)
    monkeypatch.setattr(rb, "FIT_RETRY_MIN_S", 0.0)
    cfg = _config(deadline_unix=time.time() + 3600)
    error, errors, path = rb.fit_until_deadline(cfg)
    assert error is None and path == os.path.join("/ck", rb.STATE_FILE)
    assert errors == ["RuntimeError: ControllerError: node gone", "RuntimeError: again"]
    assert calls == [cfg.name] * 3  # the same run: the next attempt resumes its checkpoint

    calls.clear()
    near = _config(deadline_unix=time.time() + rb.FIT_RETRY_MARGIN_S / 2)
    error, errors, path = rb.fit_until_deadline(near)
    assert error == "RuntimeError: ControllerError: node gone" and len(calls) == 1
    monkeypatch.setattr(rb, "FIT_RETRY_MIN_S", 3600.0)  # failed at once: a bad setup
    calls.clear()
    error, _, _ = rb.fit_until_deadline(cfg)
    assert error is not None and len(calls) == 1
