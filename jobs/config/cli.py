"""The configuration on the command line: ``--config``, ``--set KEY=VALUE`` and convenience flags.

Contract: :func:`add_config_arguments` adds the arguments (values stay strings, so a bad one
is a :class:`ConfigError` naming the field, not an argparse usage error);
:func:`config_from_args` resolves them with the precedence file < ``--set`` (later wins) <
flags; :func:`exit_on_config_error` turns a ``ConfigError`` (or a ``UserError``) raised by a
CLI entry point into one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from moshray.jobs.config.fields import ConfigError
from moshray.jobs.config.load import _build
from moshray.actors.replica.strategies import strategy_names
from moshray.jobs.config.sections import TrainConfig


# argparse dest -> dotted config key for the convenience flags.
_FLAG_KEYS = {
    "name": "name",
    "local_nodes": "cluster.local_nodes",
    "trace": "cluster.trace",
    "time_scale": "cluster.time_scale",
    "max_nodes": "cluster.max_nodes",
    "max_steps": "training.max_steps",
    "max_seconds": "training.max_seconds",
    "data": "data.paths",
    "checkpoint": "checkpoint.uri",
    "metrics_port": "metrics.port",
    "mode": "training.mode",
    "dashboard": "cluster.dashboard",
    "json": "json",
}


def _default(key: str) -> str:
    """``key``'s default in the schema, as help text shows it (None: ``unset``)."""
    value: Any = TrainConfig().to_dict()
    for part in key.split("."):
        value = value[part]
    return "unset" if value is None else str(value)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--config``, repeatable ``--set KEY=VALUE`` and the convenience flags, each
    described with the setting it stands for and that setting's default.

    Flag values stay strings here and are parsed by :func:`config_from_args`,
    so a bad value is reported as a :class:`ConfigError` naming the field
    (not as an argparse usage error).
    """
    def key_help(key: str, text: str) -> str:
        return f"{key}: {text} (default: {_default(key)})"

    group = parser.add_argument_group("configuration (file < --set < flags)")
    group.add_argument("--config", metavar="FILE",
                       help="TOML or JSON config file (default: none, the built-in defaults)")
    group.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=None,
        help="override one setting, e.g. --set training.lr=1e-3 (repeatable; docs/settings.md "
             "lists every key)",
    )
    group.add_argument("--name", metavar="NAME",
                       help="name: the job's name on the cluster; resubmitting a name resumes "
                            "(or adopts) that job, and no two running jobs share one (default: "
                            "a unique name, job-<UTC time>-<hex>)")
    group.add_argument("--local-nodes", metavar="N",
                       help=key_help("cluster.local_nodes",
                                     "embedded cluster's spot nodes when no trace is replayed"))
    group.add_argument(
        "--trace", metavar="FILE|NAME|off",
        help="cluster.trace: spot-availability trace the embedded cluster replays: a CSV "
             "file, a shipped trace's name, or off (nodes never go) (default: the shipped "
             "AWS trace on the embedded cluster; none on a cluster address)",
    )
    group.add_argument("--time-scale", metavar="X",
                       help=key_help("cluster.time_scale", "trace seconds per wall second"))
    group.add_argument("--max-nodes", metavar="N",
                       help=key_help("cluster.max_nodes", "spot nodes asked for and trained on"))
    group.add_argument("--max-steps", metavar="N",
                       help=key_help("training.max_steps", "stop after N global steps"))
    group.add_argument("--max-seconds", metavar="S",
                       help=key_help("training.max_seconds", "stop after S wall seconds"))
    group.add_argument(
        "--data", metavar="URI", action="append", default=None,
        help="data.paths: file, directory, s3:// or gs:// URI (repeatable) (default: the "
             "built-in corpus)",
    )
    group.add_argument(
        "--checkpoint", metavar="URI",
        help=key_help("checkpoint.uri", "where checkpoints go: local dir, s3:// or gs://"),
    )
    group.add_argument("--metrics-port", metavar="PORT",
                       help=key_help("metrics.port", "the Prometheus exporter's port on the "
                                     "head (0: any free port)"))
    group.add_argument("--mode", metavar="MODE",
                       help=key_help("training.mode", ", ".join(strategy_names())
                                     + " or auto (picked from the measured links)"))
    group.add_argument("--dashboard", action="store_true", default=None,
                       help="cluster.dashboard: the embedded cluster starts Ray's dashboard "
                            "on 127.0.0.1 and prints its URL (default: off)")
    group.add_argument("--json", action="store_true", default=None,
                       help="JSON-lines output; the last line on stdout is the summary "
                            "(default: off)")
    group.add_argument(
        "--moe", action="store_true", default=None,
        help="Decentralized Mixture-of-Experts layers (model.moe_layers, default every other "
             "block; model.moe_grid, model.moe_k) served by expert actors on the spot nodes "
             "(default: off)",
    )


def parse_set(items: Sequence[str] | None) -> dict[str, str]:
    """``--set KEY=VALUE`` items as ``{key: value}`` (later wins), ready for
    :func:`load_config`; ``ConfigError`` for an item without ``=``."""
    out: dict[str, str] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError("--set", f"expected KEY=VALUE, got {item!r}")
        out[key.strip()] = value
    return out


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Resolve the :class:`TrainConfig` from arguments added by :func:`add_config_arguments`.

    Precedence: file (``--config``) < ``--set`` (in order, later wins) <
    convenience flags. Raises :class:`ConfigError` like :func:`load_config`,
    plus for a ``--set`` without ``=``.
    """
    overrides: list[tuple[str, Any, bool]] = [
        (key, value, True) for key, value in parse_set(getattr(args, "set", None)).items()]
    for dest, key in _FLAG_KEYS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if dest == "data":
            overrides.append((key, tuple(value), False))  # already a list: no comma splitting
        elif dest in ("json", "dashboard"):
            overrides.append((key, bool(value), False))
        else:
            overrides.append((key, value, True))
    config = _build(getattr(args, "config", None), overrides)
    if getattr(args, "moe", None):
        config = replace(config, model=config.model.with_default_moe())
    return config


F = TypeVar("F", bound=Callable[..., Any])


def exit_on_config_error(fn: F) -> F:
    """Decorate a CLI entry point: a :class:`ConfigError` prints
    ``moshray: config error: <one line>`` to stderr and exits with status 2; so does a
    ``UserError`` (the training code or data is at fault), with its own prefix.
    Other exceptions pass through unchanged.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ConfigError as exc:
            print(f"moshray: config error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        except ValueError as exc:
            from moshray.actors.errors import UserError

            if not isinstance(exc, UserError):
                raise
            print(f"moshray: error in the training code or data: {exc}", file=sys.stderr)
            raise SystemExit(2) from None

    return wrapper  # type: ignore[return-value]
