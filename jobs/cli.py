"""The `moshray` command: `moshray bench allreduce ...`, `moshray train ...`, and friends.

Subcommands are thin: each names the module that owns the job; that module provides
``add_arguments(parser)`` and ``main(args) -> int``. Modules are imported only when their
subcommand's parser is built, so one command's heavy imports do not slow the others.
Exit codes: 0 success, 2 bad arguments or configuration (one line on stderr saying what to fix),
1 anything else. ``moshray --version`` prints the installed build; every ``--help`` shows each
option's default (:class:`HelpFormatter`).

To add a subcommand, add one row to :data:`COMMANDS`. Arguments several subcommands share
are added by helpers here (:func:`add_train_bench_arguments`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    """One subcommand: its words after ``moshray``, the owning module and a one-line help."""

    words: tuple[str, ...]
    module: str
    help: str
    entry: str = ""  # the module's functions: <entry>add_arguments / <entry>main


COMMANDS: tuple[Command, ...] = (
    Command(("train",), "moshray.jobs.train", "run the elastic training job"),
    Command(("bench", "allreduce"), "moshray.jobs.bench.allreduce",
            "Moshpit All-Reduce over the object store vs torch.distributed gloo"),
    Command(("bench", "moe"), "moshray.jobs.bench.moe",
            "DMoE layer with remote experts vs the same experts in-process"),
    Command(("bench", "goodput"), "moshray.jobs.bench.goodput",
            "goodput under a spot trace: moshray vs Ray Train vs the ideal"),
    Command(("bench", "recovery"), "moshray.jobs.bench.recovery",
            "recovery times: notice, hard kill, join, expert re-spawn"),
    Command(("bench", "overlap"), "moshray.jobs.bench.overlap",
            "overlapped averaging (one step of delay) vs synchronous steps: speed and loss"),
    Command(("bench", "links"), "moshray.jobs.bench.links",
            "time to a loss over shaped links: moshray's modes vs Ray Train DDP"),
    Command(("bench", "step"), "moshray.jobs.bench.step",
            "where a failure-free global step's time goes, per node count"),
    Command(("bench", "chaos"), "moshray.jobs.bench.chaos",
            "a seeded storm of node, Coordinator and bad-replica faults; invariants checked"),
    Command(("bench", "gpu"), "moshray.jobs.bench.gpu",
            "the GPU check: CUDA replicas, a replica group, CUDA all-reduce, experts, step rate"),
    Command(("bench", "groups"), "moshray.jobs.bench.groups",
            "replica groups on CPU: 2 groups x 2 ranks vs 4 single-rank groups, memory "
            "per rank sharded vs replicated"),
    Command(("bench", "scale"), "moshray.jobs.bench.scale",
            "the Coordinator and the collective at 16 to 1,024 simulated peers, in-process"),
    Command(("bench", "report"), "moshray.jobs.bench.report",
            "render docs/performance.md and the README's table from docs/results"),
    Command(("config", "table"), "moshray.jobs.config.table",
            "write docs/settings.md's settings table from the config schema (--check: compare)"),
    Command(("watch",), "moshray.autoscaler.watch",
            "run the spot-notice watcher of this node"),
    Command(("jobs",), "moshray.jobs.manage",
            "list the training jobs of the cluster: name, state, step, nodes"),
    Command(("stop",), "moshray.jobs.manage", "end one training job of the cluster cleanly",
            entry="stop_"),
)

GROUP_HELP = {"bench": "benchmarks (figures side by side with a baseline)",
              "config": "the configuration schema"}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help with each option's default: ``(default: X)`` is added where the help does not
    already say it and there is one to say (not None, not a flag's False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or action.default in (None, False, argparse.SUPPRESS) \
                or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """A usage error is one line on stderr (what is wrong, and where the help is), exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def version() -> str:
    """``moshray <version>``: the build setuptools-scm derived from git at install time."""
    from moshray import __version__

    return f"moshray {__version__}"


def _module_available(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def build_parser(argv_hint: list[str] | None = None) -> argparse.ArgumentParser:
    """The full parser. Only the module of the subcommand named in ``argv_hint`` is imported."""
    parser = Parser(
        prog="moshray", description="Preemption-tolerant training on spot GPUs with Ray.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=version(),
                        help="print the installed build and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    hint = tuple(argv_hint or ())
    for command in COMMANDS:
        if not _module_available(command.module):
            continue
        parent = sub
        if len(command.words) > 1:
            group = command.words[0]
            if group not in groups:
                group_parser = sub.add_parser(group, help=GROUP_HELP.get(group),
                                              description=GROUP_HELP.get(group),
                                              formatter_class=HelpFormatter)
                groups[group] = group_parser.add_subparsers(dest=group, required=True)
            parent = groups[group]
        child = parent.add_parser(command.words[-1], help=command.help,
                                  description=command.help, formatter_class=HelpFormatter)
        child.set_defaults(module=command.module, entry=command.entry)
        if hint[: len(command.words)] == command.words:
            module = importlib.import_module(command.module)
            getattr(module, command.entry + "add_arguments")(child)
    return parser


def add_train_bench_arguments(parser: argparse.ArgumentParser, *, out: str,
                               runs: str) -> None:
    """``--config``, ``--set``, ``--out`` and ``--json`` of a bench that runs the training job
    with one JSON line of figures (``bench step``, ``bench overlap``): ``out`` is ``--out``'s
    default directory, ``runs`` says in ``--set``'s help which runs it applies to."""
    parser.add_argument("--config", metavar="FILE", help="TrainConfig file (TOML or JSON)")
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=None,
                        help=f"override a TrainConfig setting ({runs}; repeatable)")
    parser.add_argument("--out", default=out, metavar="DIR",
                        help="directory for the result files")
    parser.add_argument("--json", action="store_true", help="one JSON line on stdout")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    args.argv = tuple(argv)  # the words as typed, for a bench's result file (bench/results.py)
    module = importlib.import_module(args.module)
    return int(getattr(module, args.entry + "main")(args) or 0)


def run_module(module: str) -> int:
    """Entry point for ``python -m <module>``: the same arguments as its ``moshray`` command."""
    command = next(c for c in COMMANDS if c.module == module and not c.entry)
    return main(list(command.words) + sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
