"""The `moshray` command's conventions (jobs/cli.py, jobs/config/cli.py): ``--version``,
every ``--help`` with each option described and its default shown, and one line on stderr
with exit status 2 for each bad input. No Ray cluster is started: every bad input is
refused before one would be."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import subprocess
import sys

import pytest

import moshray
from moshray.jobs.cli import COMMANDS, _module_available, build_parser, main
from moshray.jobs.config.fields import ConfigError
from moshray.jobs.ray_address import check_address, split_address

# moshray train refuses each of these before it starts anything; a subprocess is bounded by
# this timeout (the RAY_ADDRESS check itself gives up after 5 s).
BOUND_S = 120


def _moshray(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run([sys.executable, "-m", "moshray.jobs.cli", *argv],
                          capture_output=True, text=True, timeout=BOUND_S,
                          env={**base, **(env or {})})


def _help_of(words: tuple[str, ...]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exc:
        main([*words, "--help"])
    assert exc.value.code == 0
    return out.getvalue()


def _parser_of(words: tuple[str, ...]) -> argparse.ArgumentParser:
    parser = build_parser(list(words))
    for word in words:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return parser


COMMAND_WORDS = [c.words for c in COMMANDS if _module_available(c.module)]
GROUPS = sorted({c.words[0] for c in COMMANDS if len(c.words) > 1})


def test_version_names_the_installed_build():
    proc = _moshray("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"moshray {moshray.__version__}"


def test_top_level_and_group_help():
    text = _help_of(())
    assert "--version" in text
    for words in COMMAND_WORDS:
        assert words[0] in text
    for group in GROUPS:
        assert all(w[1] in _help_of((group,)) for w in COMMAND_WORDS if w[0] == group)


@pytest.mark.parametrize("words", COMMAND_WORDS, ids=" ".join)
def test_every_help_describes_every_option_with_its_default(words):
    text = _help_of(words)
    parser = _parser_of(words)
    assert parser.description and parser.description in " ".join(text.split())
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = action.option_strings[0] if action.option_strings else action.dest
        assert (action.help or "").strip(), f"moshray {' '.join(words)} {name}: no help"
        if action.option_strings and action.default not in (None, False):
            formatted = parser.formatter_class(prog="x")._get_help_string(action)
            assert "default" in formatted.lower(), f"{name}: default not shown"


def test_train_help_shows_the_config_defaults_and_trace_off():
    text = " ".join(_help_of(("train",)).split())
    assert "cluster.local_nodes: embedded cluster's spot nodes when no trace is replayed " \
           "(default: 2)" in text
    assert "(default: 0)" in text  # metrics.port, from the schema
    assert "off (nodes never go)" in text and "--dashboard" in text


def _one_line_exit_2(proc: subprocess.CompletedProcess, *words: str) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def test_bad_set_item_is_one_line_exit_2():
    _one_line_exit_2(_moshray("train", "--set", "training.lr"), "--set", "KEY=VALUE")


def test_unknown_setting_is_one_line_exit_2():
    _one_line_exit_2(_moshray("train", "--set", "training.nosuch=1"), "training.nosuch")


def test_bad_flag_value_is_one_line_exit_2():
    _one_line_exit_2(_moshray("train", "--max-steps", "many"), "training.max_steps", "many")


def test_missing_trace_file_is_one_line_exit_2(tmp_path):
    missing = tmp_path / "no-such-trace.csv"
    _one_line_exit_2(_moshray("train", "--trace", str(missing)), "cluster.trace",
                     str(missing))


def test_malformed_trace_file_is_one_line_exit_2(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("0,add,node0\n10,remove,node0\n5,add,node1\n")  # time goes backwards
    _one_line_exit_2(_moshray("train", "--trace", str(trace)), "cluster.trace",
                     f"{trace}:3")


def test_unknown_codec_is_one_line_exit_2():
    _one_line_exit_2(_moshray("train", "--set", "training.compression=zstd"),
                     "training.compression", "zstd")
    _one_line_exit_2(_moshray("bench", "allreduce", "--compression", "zstd"),
                     "--compression", "zstd")


def test_unknown_command_and_option_are_one_line_exit_2():
    _one_line_exit_2(_moshray("trian"), "trian", "--help")
    _one_line_exit_2(_moshray("train", "--max-stepz", "3"), "--max-stepz")


def test_unreachable_ray_address_is_refused_within_seconds_with_what_to_check():
    # a port nothing listens on (bound, never listening): refused at once
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        proc = _moshray("train", "--max-steps", "1", env={"RAY_ADDRESS": f"127.0.0.1:{port}"})
    line = _one_line_exit_2(proc, "RAY_ADDRESS", f"127.0.0.1:{port}", "ray start --head")
    assert "8265" in line and "not a GCS address" in line


def test_job_submit_address_in_ray_address_is_one_line_exit_2():
    proc = _moshray("train", "--max-steps", "1", env={"RAY_ADDRESS": "http://127.0.0.1:8265"})
    _one_line_exit_2(proc, "RAY_ADDRESS", "job-submission", "ray job submit")


def test_address_forms():
    assert split_address("10.0.0.5:6379") == ("10.0.0.5", 6379)
    assert split_address("ray://head:10001") == ("head", 10001)
    assert split_address("[::1]:6379") == ("::1", 6379)
    assert split_address("auto") is None
    for bad in ("10.0.0.5", "head:port", "head:0", ":6379"):
        with pytest.raises(ValueError, match="host:port"):
            split_address(bad)


def test_address_check_is_bounded_and_names_the_setting():
    seen = []

    def never_answers(where, timeout):
        seen.append((where, timeout))
        raise TimeoutError("timed out")

    with pytest.raises(ConfigError) as exc:
        check_address("10.9.9.9:6379", "cluster.address", timeout_s=3.0, connect=never_answers)
    assert seen == [(("10.9.9.9", 6379), 3.0)]  # one try, with the bound
    assert str(exc.value).startswith("cluster.address: no Ray cluster answers at "
                                     "10.9.9.9:6379 within 3 s (timed out)")
    check_address("auto", "RAY_ADDRESS", connect=never_answers)  # Ray resolves it
    assert len(seen) == 1


def test_dashboard_flag_sets_the_cluster_setting():
    from moshray.jobs.config import config_from_args

    parser = _parser_of(("train",))
    assert config_from_args(parser.parse_args(["--dashboard"])).cluster.dashboard is True
    assert config_from_args(parser.parse_args([])).cluster.dashboard is False
