"""``hvdrun -np N [--timeout S] [--start-timeout S] [--mpi] python script.py args...``: N
local ranks, no Spark."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import sys

from hvd_spark import _env
from hvd_spark._version import __version__
from hvd_spark.errors import ConfigError, ElasticJobError, WorkerFailedError
from hvd_spark.runner.elastic.elastic_local import DEFAULT_COOLDOWN_S, ElasticLocalJob
from hvd_spark.runner.launcher import Launcher
from hvd_spark.runner.local import ssh_launcher
from hvd_spark.runner.local.local_launcher import LocalJob
from hvd_spark.runner.local.mpi_launcher import MpiJob
from hvd_spark.runner.run_config import ElasticConfig, RunConfig

# What a shell exits with for a command it cannot find / cannot execute.
EXIT_NOT_FOUND = 127
EXIT_NOT_EXECUTABLE = 126


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse hvdrun's options; everything after them is the command."""
    parser = argparse.ArgumentParser(
        prog="hvdrun", description="Run a command as N local ranks of an hvd_spark job.",
        epilog="hvdrun exits with the exit code of the rank whose failure is the root cause "
               "(128+N when it was killed by signal N), 127 when the command is not found.",
    )
    parser.add_argument("--version", action="version", version=f"hvdrun (hvd_spark) {__version__}")
    parser.add_argument("-np", "--num-proc", type=int, required=True, help="number of ranks")
    parser.add_argument(
        "--timeout", type=float, default=None,
        help="seconds ranks may wait for each other, at start-up and in any collective",
    )
    parser.add_argument(
        "--start-timeout", type=float, default=None,
        help="seconds the ranks have to start and connect, as horovodrun's --start-timeout "
             "(default: --timeout, else 600)",
    )
    parser.add_argument(
        "--mpi", action="store_true", default=_env.get_str(_env.HVDRUN_LAUNCHER) == "mpi",
        help="start the ranks with mpirun; collectives then run over MPI (mpi4py), as "
             f"horovodrun --mpi (default when {_env.HVDRUN_LAUNCHER}=mpi)")
    elastic = parser.add_argument_group(
        "elastic training", "a lost rank is not fatal while --min-np remain (the script uses "
        "hvd.elastic.run); replacements start in freed slots up to --max-np")
    elastic.add_argument("--min-np", type=int, default=None, help="fewest ranks to go on with")
    elastic.add_argument("--max-np", type=int, default=None, help="most ranks at once")
    elastic.add_argument("--elastic-timeout", type=float, default=None,
                         help="seconds to wait for survivors to rejoin or for replacements "
                              "(default 600)")
    elastic.add_argument("--reset-limit", type=int, default=None,
                         help="most times the ring may re-form (default: no limit)")
    elastic.add_argument("--cooldown", type=float, default=None,
                         help="seconds after a loss before a replacement starts "
                              f"(default {DEFAULT_COOLDOWN_S:g}; negative: never replace)")
    ssh_launcher.add_host_arguments(parser)  # -H, --hostfile, ssh, --network-interface
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command each rank runs")
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("give the command to run, e.g. hvdrun -np 2 python train.py")
    if args.num_proc < 1:
        parser.error(f"-np must be at least 1, got {args.num_proc}")
    try:
        args.config = run_config(args)
    except ConfigError as exc:
        start_flag = "--start-timeout" if args.start_timeout is not None else "--timeout"
        parser.error(re.sub(r"\bstart_timeout must", f"{start_flag} must",
                            re.sub(r"\btimeout must", "--timeout must", str(exc))))
    args.elastic = any(v is not None for v in (
        args.min_np, args.max_np, args.elastic_timeout, args.reset_limit, args.cooldown))
    if args.elastic and args.mpi:
        parser.error("--mpi cannot be combined with the elastic options: MPI jobs have a fixed "
                     "size")
    if args.elastic:
        try:
            args.settings = ElasticConfig.from_kwargs(
                args.num_proc, args.min_np, args.max_np,
                start_timeout=args.config.timeouts.start_timeout_s,
                elastic_timeout=args.elastic_timeout, reset_limit=args.reset_limit)
        except ConfigError as exc:
            parser.error(str(exc).replace("min_np", "--min-np").replace("max_np", "--max-np")
                         .replace("num_proc", "-np").replace("elastic_timeout",
                                                             "--elastic-timeout"))
    return args


def run_config(args: argparse.Namespace) -> RunConfig:
    """hvdrun's options as a ``RunConfig`` (built by ``RunConfig.from_kwargs``, as every
    launcher's): ``--timeout`` bounds every collective and, unless ``--start-timeout`` says
    otherwise, the start (the ranks read both from their environment);
    ``--network-interface`` names the ranks' interface.

    Raises:
        ConfigError: A timeout that is not positive seconds.
    """
    start = args.start_timeout if args.start_timeout is not None else args.timeout
    env = {}
    if args.timeout is not None:
        env[_env.TIMEOUT] = str(args.timeout)
    if start is not None:
        env[_env.START_TIMEOUT] = str(start)
    if args.nics:
        env[_env.IFACE] = ",".join(args.nics)
    config = RunConfig.from_kwargs(where="hvdrun", num_proc=args.num_proc, env=env,
                                   start_timeout=start)
    return dataclasses.replace(config, timeouts=dataclasses.replace(
        config.timeouts, collective_timeout_s=args.timeout))


def _command_problem(program: str) -> tuple[int, str] | None:
    """Why ``program`` cannot be started (exit code and one line), or None when it can."""
    if os.sep in program:
        if not os.path.exists(program):
            return EXIT_NOT_FOUND, f"{program}: no such file"
        if os.path.isdir(program) or not os.access(program, os.X_OK):
            return EXIT_NOT_EXECUTABLE, f"{program}: not an executable file"
        return None
    if shutil.which(program) is None:
        return EXIT_NOT_FOUND, f"{program}: command not found on PATH"
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hvdrun`` console script."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    problem = _command_problem(args.command[0])
    if problem is not None:
        code, line = problem
        print(f"hvdrun: cannot run {line}", file=sys.stderr)
        return code
    try:
        job = _launcher(args)
    except ConfigError as exc:  # no mpirun, a bad host list, a host ssh cannot reach
        print(f"hvdrun: {exc}", file=sys.stderr)
        return 2
    try:
        with job:
            job.start(args.command)
            failures = job.watch()
    except OSError as exc:  # the program vanished or lost its permissions after the check
        print(f"hvdrun: cannot run {args.command[0]}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_NOT_FOUND if isinstance(exc, FileNotFoundError) else EXIT_NOT_EXECUTABLE
    except ElasticJobError as exc:
        print(f"hvdrun: elastic job failed: {exc}", file=sys.stderr)
        return 1
    if failures:
        error = WorkerFailedError(failures)
        print(f"hvdrun: {error}", file=sys.stderr)
        return error.root_cause.shell_exit_code()
    return 0


def _launcher(args: argparse.Namespace) -> Launcher:
    """The launcher hvdrun's options ask for: hosts over ssh, an elastic job, mpirun, or
    local processes.

    Raises:
        ConfigError: -H with --mpi or the elastic options, no mpirun, or a host that does
            not answer ssh.
    """
    host_slots = ssh_launcher.host_slots_from(args)
    if host_slots is not None:
        return ssh_launcher.hosts_job(host_slots, args.config, args.ssh_port,
                                      args.ssh_identity_file)
    if args.elastic:
        cooldown = DEFAULT_COOLDOWN_S if args.cooldown is None else args.cooldown
        return ElasticLocalJob(args.settings, dict(args.config.env),
                               cooldown=None if cooldown < 0 else cooldown)
    if args.mpi:
        return MpiJob(args.config)
    return LocalJob(args.config)


if __name__ == "__main__":
    sys.exit(main())
