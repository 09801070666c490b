"""``hvdrun -np N [--timeout S] python script.py args...``: N local ranks, no Spark."""

from __future__ import annotations

import argparse
import sys

from hvd_spark import _env
from hvd_spark.errors import WorkerFailedError
from hvd_spark.runner.local_launcher import run_command


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse hvdrun's options; everything after them is the command."""
    parser = argparse.ArgumentParser(
        prog="hvdrun", description="Run a command as N local ranks of an hvd_spark job."
    )
    parser.add_argument("-np", "--num-proc", type=int, required=True, help="number of ranks")
    parser.add_argument(
        "--timeout", type=float, default=None,
        help="seconds ranks may wait for each other, at start-up and in any collective",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command each rank runs")
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("give the command to run, e.g. hvdrun -np 2 python train.py")
    if args.num_proc < 1:
        parser.error(f"-np must be at least 1, got {args.num_proc}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hvdrun`` console script."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    env = {}
    if args.timeout is not None:
        env[_env.TIMEOUT] = str(args.timeout)
        env[_env.START_TIMEOUT] = str(args.timeout)
    failures = run_command(args.command, args.num_proc, env)
    if failures:
        print(f"hvdrun: {WorkerFailedError(failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
