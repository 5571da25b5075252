"""Tests for moshray.jobs.config: defaults, precedence, typed errors, round trip."""

from __future__ import annotations

import argparse
import dataclasses
import json
import pickle
import re

import pytest

from moshray.jobs.examples.lm.model import ModelConfig
from moshray.jobs.config import (
    ConfigError,
    ModelSection,
    TrainConfig,
    TrainingSection,
    add_config_arguments,
    config_from_args,
    exit_on_config_error,
    load_config,
    valid_keys,
)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return parser.parse_args(argv)


def test_defaults_are_valid_and_match_the_brief():
    cfg = load_config(None, {})
    assert cfg == TrainConfig()
    assert cfg.training.mode == "collaborative"
    assert cfg.training.target_batch_size == 256 and cfg.training.batch_size == 16
    assert cfg.cluster.local_nodes == 2 and cfg.cluster.time_scale == 60.0
    assert cfg.metrics.port == 0 and cfg.run_dir is None and cfg.name is None and cfg.json is False


def test_model_section_mirrors_model_config():
    section_fields = [(f.name, f.default) for f in dataclasses.fields(ModelSection)]
    config_fields = [(f.name, f.default) for f in dataclasses.fields(ModelConfig)]
    assert section_fields == config_fields
    assert ModelSection(d_model=64).to_model_config() == ModelConfig(d_model=64)


def test_round_trip_through_dict_and_json():
    cfg = load_config(None, {"data.paths": "a.txt,s3://b/c", "training.max_steps": "7"})
    as_json = json.loads(json.dumps(cfg.to_dict()))
    assert TrainConfig.from_dict(as_json) == cfg
    assert as_json["data"]["paths"] == ["a.txt", "s3://b/c"]
    assert pickle.loads(pickle.dumps(cfg)) == cfg


def test_toml_file_then_set_then_flags(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        "run_dir = 'runs/x'\n"
        "[training]\nlr = 0.01\nbatch_size = 8\nmode = 'local_sgd'\n"
        "[cluster]\nlocal_nodes = 3\nmax_nodes = 6\n"
    )
    args = _parse(
        [
            "--config", str(path),
            "--set", "training.lr=0.02",
            "--set", "cluster.local_nodes=4",
            "--set", "cluster.local_nodes=5",  # later --set wins
            "--local-nodes", "1",  # flags win over --set
            "--data", "a,b.txt", "--data", "c.txt",
            "--json",
        ]
    )
    cfg = config_from_args(args)
    assert cfg.run_dir == "runs/x"
    assert cfg.training.lr == 0.02  # --set over file
    assert cfg.training.batch_size == 8 and cfg.training.mode == "local_sgd"  # file over default
    assert cfg.cluster.local_nodes == 1 and cfg.cluster.max_nodes == 6
    assert cfg.data.paths == ("a,b.txt", "c.txt")  # flag paths are not comma-split
    assert cfg.json is True


def test_json_file_and_overrides(tmp_path):
    path = tmp_path / "run.json"
    document = {"training": {"lr": 1, "max_seconds": None}, "metrics": {"port": 0}}
    path.write_text(json.dumps(document))
    cfg = load_config(str(path), {"training.max_seconds": "30", "checkpoint.uri": "s3://b/p"})
    assert cfg.training.lr == 1.0 and isinstance(cfg.training.lr, float)  # int accepted
    assert cfg.training.max_seconds == 30.0
    assert cfg.metrics.port == 0
    assert cfg.checkpoint.uri == "s3://b/p"


def test_unset_flags_do_not_override_the_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("json = true\n[cluster]\ntrace = 'spot.csv'\n")
    cfg = config_from_args(_parse(["--config", str(path)]))
    assert cfg.json is True and cfg.cluster.trace == "spot.csv"


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("training.max_steps", "none", None),
        ("training.max_steps", "12", 12),
        ("training.compression", "blockwise8", "blockwise8"),
        ("json", "yes", True),
        ("json", "off", False),
        ("data.paths", "", ()),
        ("cluster.address", "ray://head:10001", "ray://head:10001"),
        ("training.weight_decay", "0", 0.0),
    ],
)
def test_override_string_parsing(key, value, expected):
    cfg = load_config(None, {key: value})
    section, _, name = key.rpartition(".")
    assert getattr(getattr(cfg, section) if section else cfg, name) == expected


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("training.lr", "-1", "training.lr: must be a positive number, got -1.0"),
        ("training.lr", "fast", "training.lr: must be a number, got 'fast'"),
        ("training.lr", "nan", "training.lr: must be a positive number, got nan"),
        ("cluster.local_nodes", "2.5", "cluster.local_nodes: must be an integer, got '2.5'"),
        ("cluster.local_nodes", "0", "cluster.local_nodes: must be a positive integer, got 0"),
        ("training.mode", "sync", "training.mode: must be one of 'collaborative', 'local_sgd'"),
        ("json", "maybe", "json: must be true or false, got 'maybe'"),
        ("training.max_steps", "-3", "training.max_steps: must be a positive integer, got -3"),
        ("training.max_steps", "x", "training.max_steps: must be an integer or none, got 'x'"),
        ("training.outer_momentum", "1.0", "training.outer_momentum: must be a number in [0, 1)"),
        ("model.d_model", "30", "model.d_model: must be divisible by model.n_heads (4), got 30"),
        ("metrics.port", "70000", "metrics.port: must be in [0, 65535], got 70000"),
        ("run_dir", " ", "run_dir: must be a non-empty string"),
        ("data.cache_dir", "", "data.cache_dir: must be a non-empty string"),
    ],
)
def test_bad_override_values_name_the_field(key, value, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, {key: value})
    assert str(info.value).startswith(message)
    assert info.value.field_path == key
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "document, path, fragment",
    [
        ({"training": {"lr": "0.1"}}, "training.lr", "must be a number, got '0.1'"),
        ({"training": {"batch_size": True}}, "training.batch_size", "must be an integer"),
        ({"training": {"seed": 1.5}}, "training.seed", "must be an integer"),
        ({"data": {"paths": "a.txt"}}, "data.paths", "must be a list of strings"),
        ({"data": {"paths": ["a", 3]}}, "data.paths", "must be a list of strings"),
        ({"cluster": 3}, "cluster", "must be a table of settings"),
    ],
)
def test_wrong_types_in_file_say_what_is_allowed(tmp_path, document, path, fragment):
    file = tmp_path / "c.json"
    file.write_text(json.dumps(document))
    with pytest.raises(ConfigError) as info:
        load_config(str(file), {})
    assert info.value.field_path == path
    assert fragment in str(info.value)


def test_unknown_key_lists_the_valid_ones(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(None, {"training.learning_rate": "0.1"})
    text = str(info.value)
    assert text.startswith("training.learning_rate: unknown key; valid keys:")
    assert "training.lr" in text and "training.max_steps" in text

    with pytest.raises(ConfigError, match=r"^optim\.lr: unknown key; valid sections: model, "):
        load_config(None, {"optim.lr": "0.1"})

    file = tmp_path / "c.toml"
    file.write_text("[cluster]\nnodes = 3\n")
    with pytest.raises(ConfigError, match=r"^cluster\.nodes: unknown key; .*cluster\.local_nodes"):
        load_config(str(file), {})

    file.write_text("epochs = 3\n")
    with pytest.raises(ConfigError, match=r"^epochs: unknown key; valid keys: model, .*run_dir"):
        load_config(str(file), {})


def test_valid_keys_cover_every_field():
    keys = valid_keys()
    assert "training.lr" in keys and "cluster.time_scale" in keys and "json" in keys
    for key in keys:
        assert isinstance(key, str) and key.count(".") <= 1


@pytest.mark.parametrize(
    "name, content, fragment",
    [
        ("c.toml", "[training\nlr = 1", "invalid TOML"),
        ("c.json", "{not json", "invalid JSON"),
        ("c.json", "[1, 2]", "top level"),
        ("c.yaml", "a: 1", "unsupported file type '.yaml'"),
    ],
)
def test_bad_files_are_config_errors(tmp_path, name, content, fragment):
    file = tmp_path / name
    file.write_text(content)
    with pytest.raises(ConfigError) as info:
        load_config(str(file), {})
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read .*nope.toml"):
        load_config(str(tmp_path / "nope.toml"), {})


def test_bad_set_syntax_and_bad_flag_value():
    with pytest.raises(ConfigError, match=r"^--set: expected KEY=VALUE, got 'training.lr'"):
        config_from_args(_parse(["--set", "training.lr"]))
    with pytest.raises(ConfigError, match=r"^cluster.time_scale: must be a number, got 'fast'"):
        config_from_args(_parse(["--time-scale", "fast"]))
    with pytest.raises(ConfigError, match=r"^training.mode: must be one of"):
        config_from_args(_parse(["--mode", "async"]))


def test_sections_validate_on_direct_construction():
    assert TrainingSection(lr=1).lr == 1.0
    with pytest.raises(ConfigError, match=r"^training.grad_clip: must be a non-negative number"):
        TrainingSection(grad_clip=-0.5)
    with pytest.raises(ConfigError, match=r"^run_dir: must be a non-empty string"):
        TrainConfig(run_dir="")


def test_config_error_is_a_value_error_and_pickles():
    err = ConfigError("training.lr", "must be a positive number,\n got -1.0")
    assert isinstance(err, ValueError)
    assert str(err) == "training.lr: must be a positive number, got -1.0"
    clone = pickle.loads(pickle.dumps(err))
    assert (clone.field_path, str(clone)) == (err.field_path, str(err))


def test_exit_on_config_error_prints_one_line_and_exits_2(capsys):
    @exit_on_config_error
    def main(argv):
        return config_from_args(_parse(argv))

    with pytest.raises(SystemExit) as info:
        main(["--set", "training.lr=-1"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err == "moshray: config error: training.lr: must be a positive number, got -1.0\n"
    assert isinstance(main([]), TrainConfig)  # success passes the result through


def test_moe_settings_and_the_moe_flag():
    dense = config_from_args(_parse([]))
    assert dense.model.moe is False and dense.model.to_model_config().moe_layers == ()
    cfg = config_from_args(_parse(["--moe"]))
    assert cfg.model.moe_layers == (1, 3)  # every other block of the default 4
    assert cfg.model.to_model_config().moe_layers == (1, 3)
    cfg = config_from_args(_parse(["--moe", "--set", "model.moe_layers=0",
                                   "--set", "model.moe_grid=2,3", "--set", "model.moe_k=2"]))
    assert (cfg.model.moe_layers, cfg.model.moe_grid, cfg.model.moe_k) == ((0,), (2, 3), 2)
    one = config_from_args(_parse(["--moe", "--set", "model.n_layers=1"]))
    assert one.model.moe_layers == (0,)
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("model.moe_layers", "4", "model.moe_layers: must be distinct block indices in [0, model.n_layers=4)"),
        ("model.moe_layers", "1,1", "must be distinct block indices"),
        ("model.moe_layers", "x", "model.moe_layers: must be a list of integers"),
        ("model.moe_grid", "0,4", "model.moe_grid: must be one or more positive integers"),
        ("model.moe_k", "17", "model.moe_k: must be an integer in [1, 16]"),
        ("model.moe_aux_weight", "-1", "model.moe_aux_weight: must be a non-negative number"),
        ("cluster.notice_s", "-5", "cluster.notice_s: must be a non-negative number"),
    ],
)
def test_bad_moe_and_notice_values_name_the_field(key, value, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, {key: value})


def test_notice_is_scaled_like_the_trace():
    cfg = load_config(None, {"cluster.time_scale": "150", "cluster.notice_s": "120"})
    assert cfg.cluster.wall_notice_s == pytest.approx(0.8)


def test_adaptive_deadline_settings_make_the_averagers_policy():
    from moshray.jobs.config import ConfigError, load_config, parse_set

    config = load_config(None, parse_set(["training.deadline_margin=2",
                                          "training.deadline_floor_s=1.5"]))
    policy = config.training.deadline_policy()
    assert (policy.margin, policy.floor_s, policy.quantile) == (2.0, 1.5, 0.9)
    off = load_config(None, parse_set(["training.adaptive_deadline=false"]))
    assert off.training.deadline_policy() is None  # every round waits round_timeout_s
    for bad, says in (("training.deadline_quantile=1.5", "must be in (0, 1]"),
                      ("training.deadline_margin=0.5", "must be >= 1")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            load_config(None, parse_set([bad]))
