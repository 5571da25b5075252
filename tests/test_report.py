"""Report, evaluate, log; fit() says what it takes.

Pure parts first: ``session.report``'s argument check, the leader rule (``leader_of``), the
``ReportedEvent`` and its Prometheus gauge, the Coordinator sink's row log, the driver's
``ReportedLog`` (summary, TensorBoard files, the ``on_report`` hook), ``fit``'s signature
and default stop rule. Then real runs of ``moshray.fit`` on the embedded cluster
(``idiom_scenarios.py``, one process each, under the Ray test lock): torch's idiom with
user clipping, fp16 ``GradScaler``, bf16 autocast and the old ``opt.step(loss)``; reports
in the summary and TensorBoard; evaluation on the leader; ``max_epochs``; the
double-backward mistake; the leader's handover when it is lost.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moshray
from moshray.actors.errors import UserError
from moshray.actors.replica.session import leader_of, metric_values
from moshray.cluster import metrics
from moshray.cluster.coordinator.metrics_sink import MetricsSink
from moshray.jobs.fit import SHORTCUTS, build_config, with_stop_rule
from moshray.jobs.reported import ReportedLog

SCENARIOS = Path(__file__).with_name("idiom_scenarios.py")


def tb_scalars(path: Path) -> list[tuple[str, int, float]]:
    """``(tag, step, value)`` of the scalars in one TensorBoard event file (TFRecord
    framing: length, its CRC, the ``Event`` proto, its CRC)."""
    import struct

    from tensorboardX.proto import event_pb2

    data, out, at = path.read_bytes(), [], 0
    while at < len(data):
        (length,) = struct.unpack("<Q", data[at:at + 8])
        event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
        at += 12 + length + 4
        out += [(v.tag, event.step, round(v.simple_value, 6)) for v in event.summary.value]
    return out


# -- pure ----------------------------------------------------------------------------------


def test_metric_values_take_numbers_and_one_element_tensors():
    values = metric_values({"loss": torch.tensor(0.25), "acc": 1, "lr": 3e-4,
                            "nan": float("nan")})
    assert values == (("loss", 0.25), ("acc", 1.0), ("lr", 3e-4))  # NaN left out


@pytest.mark.parametrize("bad,message", [
    ([1.0], "report: expected a dict of name -> number, got list"),
    ({"": 1.0}, "report: metric names must be strings of 1 to 200 characters, got ''"),
    ({3: 1.0}, "report: metric names must be strings of 1 to 200 characters, got 3"),
    ({"x": "high"}, "report: 'x' must be a number, got str"),
    ({"x": True}, "report: 'x' must be a number, got bool"),
    ({"x": torch.ones(3)}, "report: 'x' is a tensor of shape (3,): report a number "
                           "(e.g. .mean())"),
])
def test_bad_reports_are_one_line_user_errors(bad, message):
    with pytest.raises(UserError) as err:
        metric_values(bad)
    assert str(err.value) == message


def test_the_leader_is_the_lowest_ready_peer_not_leaving():
    ready = ("replica-b-10", "replica-b-2", "replica-a-7")
    assert leader_of(ready) == "replica-a-7"
    assert leader_of(ready, leaving=("replica-a-7",)) == "replica-b-2"  # digits as numbers
    assert leader_of(("replica-b-10",), leaving=()) == "replica-b-10"
    assert leader_of((), ()) is None and leader_of(("a",), ("a",)) is None
    # Every replica reading the same membership agrees, in any order.
    assert {leader_of(p) for p in (ready, ready[::-1], sorted(ready))} == {"replica-a-7"}


def test_reported_event_validates_its_rows():
    metrics.ReportedEvent("p0", (("val loss", 3, 0.5),))
    with pytest.raises(ValueError, match="must be a finite float"):
        metrics.ReportedEvent("p0", (("x", 3, float("inf")),))
    with pytest.raises(ValueError, match="reported step must be an integer >= 0"):
        metrics.ReportedEvent("p0", (("x", -1, 1.0),))
    with pytest.raises(ValueError, match="triples"):
        metrics.ReportedEvent("p0", (("x", 1),))


def test_the_exporter_keeps_the_newest_steps_value_per_name_in_a_label():
    exporter = metrics.MetricsExporter()
    exporter.apply(metrics.ReportedEvent("p0", (('val "loss"', 4, 0.5), ("acc", 4, 0.9))))
    exporter.apply(metrics.ReportedEvent("p1", (('val "loss"', 3, 9.0),)))  # older: ignored
    text = exporter.render()
    assert 'moshray_reported{name="val \\"loss\\""} 0.5' in text
    assert 'moshray_reported{name="acc"} 0.9' in text
    assert 'moshray_reported_step{name="acc"} 4.0' in text


def test_the_sink_keeps_rows_in_order_for_a_reader_with_a_cursor():
    sink = MetricsSink(metrics.Prices(), lambda: None, reported_keep=3)
    sink.record((metrics.ReportedEvent("p0", (("a", 1, 1.0), ("b", 1, 2.0))),))
    assert sink.reported(0) == (2, [("p0", "a", 1, 1.0), ("p0", "b", 1, 2.0)])
    sink.record((metrics.ReportedEvent("p1", (("a", 2, 3.0), ("a", 3, 4.0))),))
    total, rows = sink.reported(2)
    assert total == 4 and rows == [("p1", "a", 2, 3.0), ("p1", "a", 3, 4.0)]
    assert sink.reported(0)[1][0] == ("p0", "b", 1, 2.0)  # the oldest fell out (keep=3)


def test_reported_log_summary_tensorboard_and_hook(tmp_path: Path):
    calls = []
    log = ReportedLog(str(tmp_path), lambda step, m: calls.append((step, m)))
    rows = [("p0", "loss", 2, 0.5), ("p1", "loss", 1, 0.9), ("p0", "val_acc", 2, 0.8)]
    assert log.poll(lambda since: (3, rows[since:])) == 3
    assert log.poll(lambda since: (3, rows[since:])) == 0  # nothing read twice
    assert log.summary() == {"loss": {"value": 0.5, "step": 2},  # the newest step's
                             "val_acc": {"value": 0.8, "step": 2}}
    assert sorted(calls, key=str) == sorted([(2, {"loss": 0.5, "val_acc": 0.8}),
                                             (1, {"loss": 0.9})], key=str)
    log.close()
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and log.tensorboard_dir == str(tmp_path / "tensorboard")
    assert tb_scalars(events[0]) == [("loss", 2, 0.5), ("loss", 1, 0.9), ("val_acc", 2, 0.8)]


def test_a_raising_hook_is_logged_and_dropped(tmp_path: Path):
    def hook(step, values):
        raise ConnectionError("mlflow is down")

    log = ReportedLog(None, hook)
    log.add([("p0", "loss", 1, 0.5)])
    assert log.on_report is None and log.summary()["loss"]["value"] == 0.5


def test_fit_names_every_argument_with_its_type_and_doc():
    params = inspect.signature(moshray.fit).parameters
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    assert set(SHORTCUTS) <= set(params)  # every config shortcut is a real keyword
    doc = moshray.fit.__doc__
    for name, p in params.items():
        assert p.annotation is not inspect.Parameter.empty, name
        assert name in doc, f"fit's docstring does not describe {name}"
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_epoch'"):
        moshray.fit(lambda s: None, [], max_epoch=1)


def test_fit_stops_after_one_epoch_unless_told_otherwise():
    assert with_stop_rule(build_config()).training.max_epochs == 1
    for bound in ({"max_steps": 5}, {"max_seconds": 5.0}, {"max_epochs": 3}):
        cfg = with_stop_rule(build_config(**bound))
        assert cfg.training.max_epochs == bound.get("max_epochs")


# -- on the embedded cluster ---------------------------------------------------------------


def scenario(name: str, tmp: Path, timeout: int = 300) -> dict:
    proc = subprocess.run([sys.executable, str(SCENARIOS), name, str(tmp)],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.cluster
def test_torch_idiom_amp_clipping_reports_evaluation_and_max_epochs(tmp_path: Path):
    out = scenario("idiom", tmp_path)
    summary = out["summary"]
    assert summary["replicas_consistent"] is True and summary["steps"] >= 3
    # max_epochs=1 ended the run (no other bound was given): every shard was handed out
    # (tiny shards: the replicas read on for up to a poll and a stop's latency).
    assert summary["data_epochs"] >= 1.0
    counts = out["counts"]
    assert counts and all(c["fp16_steps"] > 0 and c["bf16"] > 0 and c["old_form"] > 0
                          for c in counts.values())
    # the user's clip held on every micro-batch (moshray clipped nothing itself)
    assert max(c["max_norm_after_clip"] for c in counts.values()) <= 0.5 + 1e-4
    # torch's StepLR on the optimizer prepare returns, stepped after every micro-batch,
    # moved once per global step on every replica (several micro-batches per step)
    from idiom_scenarios import LR_GAMMA

    for c in counts.values():
        assert c["global_step"] >= 3
        assert c["lr"] == pytest.approx(1e-2 * LR_GAMMA ** c["global_step"]), c
    reported = summary["reported"]
    assert reported["loss"]["value"] > 0 and 0 <= reported["loss"]["step"] <= summary["steps"]
    assert "val_loss" in reported and reported["val_loss"]["step"] % 2 == 0
    assert summary["final_loss"] is not None  # the reported "loss" feeds the console's
    assert out["evaluators"] and len(out["evaluators"]) == 1  # one leader did it
    assert out["hook_steps"] and all("val_loss" in m for m in out["hook_values"])
    assert set(out["tensorboard_tags"]) >= {"loss", "val_loss", "val_accuracy"}


@pytest.mark.cluster
def test_a_double_backward_through_fit_stops_the_job_with_one_line(tmp_path: Path):
    out = scenario("double-backward", tmp_path)
    assert out == {"type": "UserError",
                   "error": "optimizer: loss.backward() was called and opt.step(loss) would "
                            "backpropagate again: write loss.backward(); opt.step(); "
                            "opt.zero_grad()"}


@pytest.mark.cluster
def test_the_leader_is_handed_over_when_it_is_lost(tmp_path: Path):
    out = scenario("leader-loss", tmp_path)
    lost = out["lost"]
    assert lost is not None, "the leader never raised"
    assert lost in out["before"]  # it was the leader (it raised because it was)
    # Another replica took over (the lost one never came back: a replacement is a new peer).
    assert out["after"] and lost not in out["after"]
