"""The `moshray` command: `moshray bench allreduce ...`, `moshray train ...`.

Subcommands are thin: each parses its arguments and hands over to the module that owns
the job (``jobs/bench_allreduce.py``, ``jobs/train.py``). Exit codes: 0 success, 2 bad
arguments or configuration (one line on stderr saying what to fix), 1 anything else.
"""

from __future__ import annotations

import argparse
import sys

from . import bench_allreduce, train


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moshray",
        description="Preemption-tolerant training on spot GPUs with Ray.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="benchmarks (figures side by side with a baseline)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    allreduce = bench_sub.add_parser(
        "allreduce", help="Moshpit All-Reduce over the object store vs torch.distributed gloo"
    )
    bench_allreduce.add_arguments(allreduce)
    allreduce.set_defaults(handler=bench_allreduce.main)

    train_parser = sub.add_parser("train", help="run the elastic training job")
    train.add_arguments(train_parser)
    train_parser.set_defaults(handler=train.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
