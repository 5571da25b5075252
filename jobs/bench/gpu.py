"""`moshray bench gpu`: the GPU check, one JSON line in under 5 minutes.

Five parts, each in a process of its own with its own timeout (a part that fails, hangs or
crashes records ``ok: false``, its ``error`` and the tail of its output, and the check goes
on); they run in ``PARTS`` order (steprate, allreduce, experts, replicas, group) within a
wall-clock budget (``--budget-s``, default 290 s):

- ``replicas`` (a): ``moshray.fit`` on the embedded cluster, one node with one GPU and two
  replicas sharing it (0.5 GPU each), training the example LM with bf16 autocast on CUDA
  for a bounded number of global steps; each replica's loop reports its device and its
  micro-batch rate.
- ``group`` (b): a replica group (``actors/replica/group*.py``) of 2 ranks sharing the GPU
  (gloo with CUDA tensors), FSDP2 and then DDP, a few steps of the LM; its unsharded
  parameters against a single-process reference on the same GPU.
- ``allreduce`` (c): two ``Averager``s in one process (the replicas' all-reduce, with the
  in-process transport) averaging CUDA tensors; the averager moves them to host memory and
  back, and the check times those copies apart from the whole round.
- ``experts`` (d): a DMoE layer on the GPU with its experts on the GPU (``ExpertHostCore``
  on CUDA, called in-process) against the same experts on the CPU: tokens/s of forward +
  backward, and the outputs of both compared.
- ``steprate`` (e): part (a)'s model in a plain single-process torch loop on the same GPU;
  ``replica_vs_plain`` divides (a)'s samples/s (both replicas) by it.

Without CUDA every part runs on the CPU with tiny sizes (the harness is checked, not the
speed), ``cuda`` is false and ``note`` says so. Exit code: 0 when every part is ok, 1 when
one failed (the JSON line is printed either way), 2 on bad arguments. ``--out FILE`` writes
the JSON there too.
The parent process never imports torch's CUDA state: each part is ``python -m
moshray.jobs.bench.gpu --run-part NAME`` writing its result to a file; the parent kills
the part's whole process group at its timeout and records the tail of its output.
Needs ``moshray`` importable (``pip install -e .``) and, for the GPU figures, torch with CUDA.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from moshray.jobs.examples.lm.tasks import lm_build, lm_loss, lm_shard, lm_task, lm_windows

ERROR_TAIL = 1500  # characters of a failed part's stderr kept in its error field


class BenchError(ValueError):
    """Bad arguments (exit 2, one line)."""


# -- sizes ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """How big each part is: the LM (``ModelConfig`` fields), its micro-batch, steps, the
    all-reduce's floats and the DMoE layer's shape. ``cuda()`` and ``cpu()`` are the two
    profiles; the CPU one only checks that the harness works."""

    model: tuple[tuple[str, int], ...]
    batch: int
    fit_steps: int  # global steps of part (a)
    fit_seconds: float  # ... and its wall-clock cap
    group_steps: int
    plain_steps: int
    allreduce_floats: int
    allreduce_reps: int
    moe_tokens: int
    moe_d_model: int
    moe_d_hidden: int
    moe_grid: tuple[int, int]
    moe_steps: int

    @classmethod
    def cuda(cls) -> Sizes:
        return cls(model=(("seq_len", 256), ("d_model", 384), ("n_layers", 6), ("n_heads", 6),
                          ("d_ff", 1536)),
                   batch=32, fit_steps=40, fit_seconds=75.0, group_steps=12, plain_steps=40,
                   allreduce_floats=16 * 1024 * 1024, allreduce_reps=3, moe_tokens=4096,
                   moe_d_model=512, moe_d_hidden=2048, moe_grid=(4, 4), moe_steps=10)

    @classmethod
    def cpu(cls) -> Sizes:
        return cls(model=(("seq_len", 32), ("d_model", 32), ("n_layers", 2), ("n_heads", 2),
                          ("d_ff", 64)),
                   batch=8, fit_steps=3, fit_seconds=45.0, group_steps=4, plain_steps=5,
                   allreduce_floats=256 * 1024, allreduce_reps=2, moe_tokens=64,
                   moe_d_model=32, moe_d_hidden=64, moe_grid=(2, 2), moe_steps=2)

    @property
    def model_config(self) -> dict:
        return dict(self.model)


def replica_loop(session, *, model_config: dict, lr: float, report_dir: str,
                 warmup: int = 3) -> None:
    """Part (a)'s ``loop(session)``: the example LM with bf16 autocast on CUDA; writes this
    replica's device and micro-batch rate to ``report_dir/<peer>.json`` when it ends."""
    import torch

    model = lm_build(model_config, seed=session.seed)
    opt = session.prepare(model, torch.optim.AdamW(model.parameters(), lr=lr))
    amp = False
    micro, samples, t0, losses = 0, 0, None, []
    for x, y in session.batches():
        with session.autocast():  # bf16 on a CUDA device that has it, off on the CPU
            try:
                amp = torch.is_autocast_enabled(session.device.type)
            except TypeError:  # torch < 2.4: no argument, CUDA's flag
                amp = torch.is_autocast_enabled()
            loss = lm_loss(model, (x, y))
        opt.step(loss)  # reads the loss's value: the step's kernels are done
        micro += 1
        losses.append(float(loss.detach()))
        if micro == warmup:
            t0 = time.perf_counter()
        elif micro > warmup:
            samples += int(x.shape[0])
    seconds = time.perf_counter() - t0 if t0 is not None else 0.0
    report = {"peer": session.peer_id, "device": str(session.device),
              "param_device": str(next(model.parameters()).device), "amp_bf16": amp,
              "micro_batches": micro, "timed_micro_batches": max(0, micro - warmup),
              "seconds": seconds, "samples_per_s": samples / seconds if seconds > 0 else None,
              "first_loss": losses[0] if losses else None,
              "last_loss": losses[-1] if losses else None}
    Path(report_dir, f"{session.peer_id}.json").write_text(json.dumps(report))


# -- the parts ----------------------------------------------------------------------------------


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _start_ray(cuda: bool) -> None:
    from moshray.jobs.local.cluster import pin_loopback

    pin_loopback()
    import ray

    ray.init(address="local", num_cpus=4, num_gpus=1 if cuda else 0, include_dashboard=False,
             log_to_driver=True, configure_logging=False)


def part_replicas(sizes: Sizes) -> dict:
    """(a): two replicas sharing one GPU through ``moshray.fit``."""
    import moshray

    cuda = _device() == "cuda"
    with tempfile.TemporaryDirectory(prefix="moshray-gpu-") as tmp:
        reports = Path(tmp, "replicas")
        reports.mkdir()
        mc = sizes.model_config
        loop = functools.partial(replica_loop, model_config=mc, lr=1e-3, report_dir=str(reports))
        data = moshray.data.from_fn(functools.partial(lm_shard, seq_len=mc["seq_len"],
                                                      batch=sizes.batch), num_shards=64)
        result = moshray.fit(
            loop, data, local_nodes=1, local_gpus=1 if cuda else 0, max_nodes=1, min_nodes=1,
            max_steps=sizes.fit_steps, max_seconds=sizes.fit_seconds, batch_size=sizes.batch,
            target_batch_size=2 * sizes.batch, round_timeout_s=30.0, metrics_port=0,
            run_dir=str(Path(tmp, "run")), config={"cluster": {"replicas_per_node": 2}})
        replicas = [json.loads(p.read_text()) for p in sorted(reports.glob("*.json"))]
    s = result.summary
    rates = [r["samples_per_s"] for r in replicas if r.get("samples_per_s")]
    out = {k: s.get(k) for k in ("steps", "samples", "wall_s", "samples_per_s", "initial_loss",
                                 "final_loss", "replicas", "replicas_consistent", "devices",
                                 "replica_gpus", "lost_steps")}
    out.update(replica_reports=replicas, replica_samples_per_s=sum(rates) if rates else None,
               loss_decreased=(s.get("final_loss") is not None and s.get("initial_loss")
                               is not None and s["final_loss"] < s["initial_loss"]))
    problems = []
    if cuda and not all(r["param_device"].startswith("cuda") for r in replicas):
        problems.append("a replica's model is not on CUDA")
    if cuda and not all(r["amp_bf16"] for r in replicas):
        problems.append("bf16 autocast was off on a replica")
    if len(replicas) < 2:
        problems.append(f"{len(replicas)} replica reports, expected 2")
    if not s.get("steps"):
        problems.append("no global step was committed")
    if problems:
        out["error"] = "; ".join(problems)
    return out


def part_group(sizes: Sizes) -> dict:
    """(b): a replica group of 2 ranks sharing the GPU (gloo), FSDP2 then DDP. On one shared
    GPU FSDP2 cannot run (NCCL refuses two ranks on one GPU; gloo has no CUDA reduce-scatter
    and crashed the rank): there it is reported as refused with that reason, and FSDP2 is
    checked on CPU ranks instead; DDP runs on the shared GPU."""
    import ray
    import torch

    from moshray.actors.replica.group import ReplicaGroup
    from moshray.actors.replica.group_spec import GroupConfig, reference_train

    device = _device()
    cuda = device == "cuda"
    _start_ray(cuda)
    task = lm_task(sizes.model_config, sizes.group_steps, 2 * sizes.batch, amp=False)
    ref_losses, ref_state = reference_train(task, device)
    out: dict = {"reference_losses": ref_losses}
    errors = []
    try:
        for parallel in ("fsdp", "ddp"):
            on_gpu = cuda and parallel == "ddp"
            if cuda and parallel == "fsdp":
                out["fsdp_shared_gpu"] = (
                    "refused: fsdp on CUDA ranks needs nccl with one GPU per rank; "
                    "gloo has no CUDA reduce-scatter (checked on CPU ranks instead)")
            group = ReplicaGroup(GroupConfig(world_size=2, parallel=parallel, backend="auto",
                                             gpus_per_rank=0.5 if on_gpu else 0.0,
                                             timeout_s=60.0, name=parallel))
            try:
                group.start()
                report = group.train(task)
                full = group.full_state()
            except Exception as exc:  # noqa: BLE001 - recorded; the other one still runs
                out[parallel] = {"ok": False, "error": _one_line(exc)}
                errors.append(f"{parallel}: {_one_line(exc)[:300]}")
                continue
            finally:
                group.close()
            diff = max(float((full[k] - ref_state[k]).abs().max()) for k in ref_state)
            r = report.to_dict() | {"max_abs_diff_vs_reference": diff,
                                    "loss_decreased": report.losses[-1] < report.losses[0]}
            r["ok"] = bool(report.consistent and r["loss_decreased"] and diff < 1e-2)
            if not r["ok"]:
                errors.append(f"{parallel}: consistent={report.consistent} "
                              f"loss_decreased={r['loss_decreased']} diff={diff:.3g}")
            out[parallel] = r
    finally:
        ray.shutdown()
    out["torch"] = torch.__version__
    if errors:
        out["error"] = "; ".join(errors)
    return out


def part_allreduce(sizes: Sizes) -> dict:
    """(c): two Averagers in one event loop average device tensors; host copies timed."""
    import asyncio
    import statistics

    import torch

    from moshray.cluster.collective.averager import Averager, flatten
    from moshray.cluster.collective.transport import LocalNetwork
    from moshray.cluster.coordinator.membership import Membership, MembershipConfig
    from moshray.cluster.messages import PeerInfo

    device = _device()
    n = sizes.allreduce_floats
    g = torch.Generator().manual_seed(0)
    tensors = {f"p{i}": torch.randn(n, generator=g).to(device) for i in range(2)}
    weights = {"p0": 1.0, "p1": 3.0}
    network = LocalNetwork()
    membership = Membership(MembershipConfig(min_part=1))
    averagers = {}
    for pid in tensors:
        averagers[pid] = Averager(pid, transport=network.transport(pid))
        network.add(pid, averagers[pid])
        membership.register(PeerInfo(pid, pid), now=0.0)

    async def rounds() -> tuple[list, list, list, list]:
        """The rounds in one event loop (the averagers' mailboxes belong to it)."""
        times, d2h, h2d, results = [], [], [], []
        for rep in range(sizes.allreduce_reps + 1):  # the first is warm-up
            plan = membership.plan(now=float(rep))
            _sync(device)
            t0 = time.perf_counter()
            results = await asyncio.gather(*(
                averagers[p].all_reduce([tensors[p]], weights[p], plan, 60.0) for p in tensors))
            _sync(device)
            t1 = time.perf_counter()
            flat = flatten([tensors["p0"]])  # device -> host, as the averager does
            t2 = time.perf_counter()
            torch.from_numpy(flat).to(device)  # host -> device, as it does with the result
            _sync(device)
            t3 = time.perf_counter()
            if rep:
                times.append(t1 - t0)
                d2h.append(t2 - t1)
                h2d.append(t3 - t2)
        return times, d2h, h2d, results

    times, d2h, h2d, results = asyncio.run(rounds())
    expected = (tensors["p0"] * 1.0 + tensors["p1"] * 3.0) / 4.0
    outs = [r[0][0] for r in results]
    mb = n * 4 / 1e6
    out = {"floats": n, "mb": mb, "peers": 2, "device": device,
           "result_device": str(outs[0].device),
           "round_s": statistics.median(times), "d2h_s": statistics.median(d2h),
           "h2d_s": statistics.median(h2d),
           "d2h_gb_per_s": mb / 1e3 / statistics.median(d2h),
           "h2d_gb_per_s": mb / 1e3 / statistics.median(h2d),
           "max_abs_error": float((outs[0] - expected).abs().max()),
           "peers_bitwise_equal": bool(torch.equal(outs[0], outs[1]))}
    out["copies_share_of_round"] = 2 * (out["d2h_s"] + out["h2d_s"]) / out["round_s"]
    if out["result_device"].split(":")[0] != device or not out["peers_bitwise_equal"] \
            or out["max_abs_error"] > 1e-4:
        out["error"] = (f"result on {out['result_device']}, bitwise equal "
                        f"{out['peers_bitwise_equal']}, max error {out['max_abs_error']:.3g}")
    return out


def part_experts(sizes: Sizes) -> dict:
    """(d): a DMoE layer on the device, experts on the device vs the same experts on CPU."""
    import inspect

    import torch

    from moshray.actors.moe import RemoteMixtureOfExperts
    from moshray.actors.moe.backends import LocalExpertBackend
    from moshray.actors.moe.config import MoEConfig
    from moshray.actors.moe.expert_config import ExpertSetConfig, ExpertSpec, layout_shards
    from moshray.actors.moe.expert_core import ExpertHostCore

    device = _device()
    spec = ExpertSpec(d_model=sizes.moe_d_model, d_hidden=sizes.moe_d_hidden, lr=1e-4)
    experts = sizes.moe_grid[0] * sizes.moe_grid[1]
    config = ExpertSetConfig(layers=("gpu",), grid=sizes.moe_grid, spec=spec,
                             experts_per_host=experts // 2)
    if "device" not in inspect.signature(ExpertHostCore).parameters:
        raise RuntimeError("ExpertHostCore takes no device: experts cannot be placed on the GPU")

    def backend(on: str) -> LocalExpertBackend:
        return LocalExpertBackend({h: ExpertHostCore(u, spec, device=on)
                                   for h, u in layout_shards(config).items()})

    g = torch.Generator().manual_seed(0)
    x_cpu = torch.randn(sizes.moe_tokens, sizes.moe_d_model, generator=g)
    target_cpu = torch.randn(sizes.moe_tokens, sizes.moe_d_model, generator=g)
    k = min(4, experts)

    def run(expert_device: str) -> tuple[float, torch.Tensor, str]:
        torch.manual_seed(1)  # the same gate both times
        layer = RemoteMixtureOfExperts(MoEConfig("gpu", sizes.moe_grid, sizes.moe_d_model, k=k),
                                       backend(expert_device)).to(device)
        x = x_cpu.to(device).requires_grad_(True)
        target = target_cpu.to(device)
        first = layer(x).detach().float().cpu()
        core = next(iter(layer.backend.hosts.values()))
        held = str(core.experts[core.uids[0]].up.weight.device)
        seconds = 0.0
        for step in range(sizes.moe_steps + 1):
            x.grad = None
            _sync(device)
            t0 = time.perf_counter()
            (layer(x) * target).sum().backward()
            _sync(device)
            if step:
                seconds += time.perf_counter() - t0
        if not bool(torch.isfinite(x.grad).all()):
            raise RuntimeError(f"non-finite input gradient with experts on {expert_device}")
        return sizes.moe_tokens * sizes.moe_steps / seconds, first, held

    on_device, first_dev, held = run(device)
    on_cpu, first_cpu, _ = run("cpu")
    diff = float((first_dev - first_cpu).abs().max())
    out = {"layer_device": device, "expert_device": held, "experts": experts, "k": k,
           "tokens": sizes.moe_tokens, "tokens_per_s": on_device,
           "cpu_experts_tokens_per_s": on_cpu, "speedup_vs_cpu_experts": on_device / on_cpu,
           "max_abs_diff_vs_cpu_experts": diff}
    if held.split(":")[0] != device or diff > 1e-2:
        out["error"] = f"experts held on {held}, output differs from CPU experts by {diff:.3g}"
    return out


def part_steprate(sizes: Sizes) -> dict:
    """(e): part (a)'s model and micro-batch in a plain torch loop on this device."""
    import numpy as np
    import torch

    device = _device()
    amp = device == "cuda" and torch.cuda.is_bf16_supported()
    mc = sizes.model_config
    model = lm_build(mc).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)
    warmup = 3
    seconds = 0.0
    losses = []
    for step in range(warmup + sizes.plain_steps):
        x, y = (t.to(device) for t in lm_windows(rng, sizes.batch, mc["seq_len"]))
        t0 = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=amp):
            loss = lm_loss(model, (x, y))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))  # a sync, as the replica's opt.step has
        if step >= warmup:
            seconds += time.perf_counter() - t0
    rate = sizes.plain_steps / seconds
    return {"device": device, "amp_bf16": amp, "steps_per_s": rate,
            "samples_per_s": rate * sizes.batch, "batch": sizes.batch,
            "first_loss": losses[0], "last_loss": losses[-1]}


@dataclass(frozen=True)
class Part:
    """One part of the check: its function and its timeout (seconds) with CUDA and on CPU."""

    run: Callable[[Sizes], dict]
    timeout_cuda_s: float
    timeout_cpu_s: float


PARTS: dict[str, Part] = {  # in the order they run: the cheap ones first, the group last
    "steprate": Part(part_steprate, 45, 60),
    "allreduce": Part(part_allreduce, 45, 60),
    "experts": Part(part_experts, 60, 60),
    "replicas": Part(part_replicas, 180, 150),
    "group": Part(part_group, 150, 120),
}


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:ERROR_TAIL]


# -- the runner -----------------------------------------------------------------------------------


def run_part_here(name: str, result_path: str, sizes: Sizes) -> int:
    """Child process: run one part, write ``{"ok", ...}`` to ``result_path``. Exit 0 even when
    the part failed (the file says so); a crash leaves no file, which the parent reports."""
    t0 = time.monotonic()
    try:
        out = PARTS[name].run(sizes)
        out["ok"] = "error" not in out
    except Exception as exc:  # noqa: BLE001 - the part's failure is its result
        import traceback

        traceback.print_exc()
        out = {"ok": False, "error": _one_line(exc)}
    out["seconds"] = round(time.monotonic() - t0, 2)
    Path(result_path).write_text(json.dumps(out, default=str))
    return 0


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the part's process group (it is a session of its own), then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_part(name: str, timeout_s: float, sizes_profile: str, log,
             argv: list[str] | None = None) -> dict:
    """Run part ``name`` in a child process (its own session) for at most ``timeout_s``;
    the part's result, or ``{"ok": False, "error": ...}`` when it timed out or died (with
    the tail of its output). ``argv`` replaces the child's command (tests)."""
    with tempfile.TemporaryDirectory(prefix=f"moshray-gpu-{name}-") as tmp:
        result, err_path = Path(tmp, "result.json"), Path(tmp, "stderr.log")
        argv = argv or [sys.executable, "-m", "moshray.jobs.bench.gpu", "--run-part", name,
                        "--result", str(result), "--sizes", sizes_profile]
        t0 = time.monotonic()
        with open(err_path, "wb") as err:
            proc = subprocess.Popen(argv, stdout=err, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                rc, timed_out = proc.returncode, True
        seconds = round(time.monotonic() - t0, 2)
        tail = err_path.read_bytes()[-ERROR_TAIL:].decode(errors="replace")
        if result.exists() and not timed_out:
            out = json.loads(result.read_text())
        else:
            why = f"timed out after {timeout_s:g} s" if timed_out else f"exited {rc}"
            last = next((ln for ln in reversed(tail.splitlines()) if ln.strip()), "")
            out = {"ok": False, "error": f"{why}; its output ends: {last.strip()[:300]}"}
        if not out.get("ok"):
            out.setdefault("log_tail", tail)
        out["wall_s"] = seconds
        log(f"[{name}] {'ok' if out.get('ok') else 'FAILED'} in {seconds:.1f} s"
            + ("" if out.get("ok") else f": {out.get('error', '')[:500]}"))
        return out


def probe_cuda() -> dict:
    """``{"cuda": bool, ...}`` from a child process (the parent stays free of CUDA state);
    never raises."""
    code = ("import json, torch; c = torch.cuda.is_available(); print(json.dumps({'cuda': c, "
            "'torch': torch.__version__, 'device_name': torch.cuda.get_device_name(0) if c "
            "else None, 'bf16': bool(c and torch.cuda.is_bf16_supported()), "
            "'device_count': torch.cuda.device_count() if c else 0}))")
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120)
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError, OSError) as exc:
        return {"cuda": False, "probe_error": _one_line(exc)}


def run_check(parts: list[str], budget_s: float, log, force_cpu_sizes: bool = False) -> dict:
    """The whole check: probe, then each part (within what is left of ``budget_s``)."""
    started = time.monotonic()
    probe = probe_cuda()
    cuda = bool(probe.get("cuda"))
    profile = "cuda" if cuda and not force_cpu_sizes else "cpu"
    log(f"CUDA: {probe}" if cuda else "no CUDA device: checking the CPU parts only")
    summary: dict = {"check": "moshray bench gpu", "cuda": cuda, "sizes": profile, **probe,
                     "parts": {}}
    if not cuda:
        summary["note"] = "no CUDA device on this machine: the parts ran on the CPU"
    for name in parts:
        part = PARTS[name]
        left = budget_s - (time.monotonic() - started)
        timeout = min(part.timeout_cuda_s if cuda else part.timeout_cpu_s, left)
        if timeout < 15:
            summary["parts"][name] = {"ok": False, "error": f"skipped: {left:.0f} s left of "
                                      f"the {budget_s:g} s budget"}
            continue
        log(f"[{name}] running (timeout {timeout:.0f} s)")
        summary["parts"][name] = run_part(name, timeout, profile, log)
    p = summary["parts"]
    plain = p.get("steprate", {}).get("samples_per_s")
    replica = p.get("replicas", {}).get("replica_samples_per_s")
    summary["replica_vs_plain"] = replica / plain if plain and replica else None
    summary["ok"] = all(v.get("ok") for v in p.values())
    summary["wall_s"] = round(time.monotonic() - started, 1)
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", metavar="FILE", help="also write the JSON line to FILE")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated parts to run (default: all: {','.join(PARTS)})")
    parser.add_argument("--budget-s", type=float, default=290.0, metavar="S",
                        help="wall-clock budget of the whole check; a part that would start "
                             "with under 15 s left is skipped (default 290)")
    parser.add_argument("--cpu-sizes", action="store_true",
                        help="use the tiny CPU sizes even where CUDA is available")
    # The child process of one part (internal).
    parser.add_argument("--run-part", choices=list(PARTS), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", choices=("cuda", "cpu"), default="cpu",
                        help=argparse.SUPPRESS)


def parse_parts(text: str) -> list[str]:
    """The ``--parts`` list in ``PARTS`` order; ``BenchError`` naming an unknown part."""
    asked = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in asked if p not in PARTS]
    if unknown or not asked:
        raise BenchError(f"--parts: unknown part {unknown[0]!r}; use some of "
                         f"{','.join(PARTS)}" if unknown else "--parts: name at least one part")
    return [p for p in PARTS if p in asked]


def main(args: argparse.Namespace) -> int:
    if args.run_part:
        sizes = Sizes.cuda() if args.sizes == "cuda" else Sizes.cpu()
        return run_part_here(args.run_part, args.result, sizes)
    try:
        parts = parse_parts(args.parts)
        if not args.budget_s > 0:
            raise BenchError("--budget-s must be > 0")
    except BenchError as exc:
        print(f"moshray bench gpu: {exc}", file=sys.stderr)
        return 2

    def log(*a):
        print(*a, file=sys.stderr, flush=True)

    summary = run_check(parts, args.budget_s, log, args.cpu_sizes)
    line = json.dumps(summary, default=str)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(line + "\n")
    print(line, flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    from moshray.jobs.cli import run_module

    sys.exit(run_module("moshray.jobs.bench.gpu"))
