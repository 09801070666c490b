"""``hvdrun -np N -H host1:2,host2:2 command`` (or ``--hostfile``): ranks on several hosts.

Each rank starts over ssh (keys as the user has them; ``--ssh-port``,
``--ssh-identity-file``, extra ssh arguments in ``HVD_SPARK_SSH_OPTS``) as
``python -m hvd_spark.runner.local.remote_rank command``, which receives the rank's
environment on stdin: this process's exportable environment (as Horovod forwards it),
the user's and the rank's variables. Ranks on this machine (``localhost``, its hostname)
start without ssh the same way. Output lines come back prefixed with the rank; when one
rank fails, every ssh session is closed, which stops the remote ranks.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence

from hvd_spark import _env
from hvd_spark.errors import ConfigError
from hvd_spark.runner.local import hosts as hostlist
from hvd_spark.runner.local.local_launcher import LocalJob
from hvd_spark.runner.rendezvous import RankInfo
from hvd_spark.runner.run_config import RunConfig
from hvd_spark.runner.tied_child import WORKER_COMMAND, start_tied

SSH_OPTS = "HVD_SPARK_SSH_OPTS"
_CHECK_TIMEOUT_S = 20.0
# Not forwarded (as Horovod): shell functions, the old directory, another job's GPUs; and
# what describes this machine or session rather than the job.
_NOT_FORWARDED = re.compile(
    r"^(BASH_FUNC_.*|OLDPWD|PWD|.*CUDA_VISIBLE_DEVICES|HOSTNAME|SHLVL|_|SSH_.*|"
    r"HVD_SPARK_(RANK|SIZE|LOCAL_.*|CROSS_.*|RENDEZVOUS_ADDR|SECRET|HOSTNAME)|"
    r"HOROVOD_(RANK|SIZE|LOCAL_.*|CROSS_.*|HOSTNAME|SECRET_KEY))$")


def forwarded_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The launcher's variables every rank receives."""
    environ = dict(os.environ if environ is None else environ)
    return {k: v for k, v in environ.items() if not _NOT_FORWARDED.match(k)}


def ssh_argv(host: str, port: int | None, identity: str | None) -> list[str]:
    """``ssh`` and its options for ``host``: never prompts (no hang), bounded connect."""
    argv = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
            "-o", f"ConnectTimeout={int(_CHECK_TIMEOUT_S)}", "-o", "ServerAliveInterval=10"]
    if port is not None:
        argv += ["-p", str(port)]
    if identity is not None:
        argv += ["-i", identity]
    return argv + shlex.split(os.environ.get(SSH_OPTS, "")) + [host]


def route_source(host: str) -> str:
    """This machine's address on the route to ``host`` (what ranks there dial back).

    Raises:
        ConfigError: ``host`` does not resolve or there is no route to it.
    """
    try:
        addr = socket.gethostbyname(host)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((addr, 9))  # UDP connect sends nothing: it only picks a route
            return probe.getsockname()[0]
    except OSError as exc:
        raise ConfigError(f"host {host!r} (from -H/--hostfile): cannot resolve it or find a "
                          f"route to it ({exc.strerror or exc})") from None


class SshJob(LocalJob):
    """Ranks on the given hosts; the rendezvous store listens on every interface.

    Args:
        config: The run's settings (``num_proc`` is the placement's length).
        placement: RankInfo per rank (``hosts.place_ranks``).
        ssh_port, ssh_identity: Passed to ssh for every remote host.
    """

    def __init__(self, config: RunConfig, placement: list[RankInfo],
                 ssh_port: int | None = None, ssh_identity: str | None = None) -> None:
        remote = [h for h in dict.fromkeys(i.host for i in placement) if not hostlist.is_local(h)]
        # Local ranks dial the store on loopback unless remote peers must reach them.
        self._dial = {h: route_source(h) for h in remote}
        self._local_addr = next(iter(self._dial.values()), "127.0.0.1")
        super().__init__(config.with_num_proc(len(placement)),
                         bind_host="0.0.0.0" if remote else "127.0.0.1")
        self.placement = placement
        self.ssh_port, self.ssh_identity = ssh_port, ssh_identity

    def host_of(self, rank: int) -> str:
        return self.placement[rank].host

    def rank_env(self, info: RankInfo, store_host: str = "") -> dict[str, str]:
        """Everything rank ``info.rank`` receives on stdin: this process's exportable
        environment too. Rank 0's host may be another: its ``remote_rank`` probes the
        torch.distributed master's port there and publishes it."""
        store = store_host or self._dial.get(info.host, self._local_addr)
        env = {**forwarded_env(), **super().rank_env(info, store)}
        if store != "127.0.0.1" and hostlist.is_local(info.host) and not env.get(_env.IFACE):
            env.setdefault(_env.ADVERTISE_ADDR, store)  # remote peers must reach it
        return env

    def command_for(self, info: RankInfo, command: Sequence[str]) -> list[str]:
        """The local argv that starts rank ``info.rank`` on its host."""
        supervised = [sys.executable, "-m", "hvd_spark.runner.local.remote_rank", *command]
        if hostlist.is_local(info.host):
            return supervised
        remote = f"cd {shlex.quote(os.getcwd())} 2>/dev/null; exec {shlex.join(supervised)}"
        return [*ssh_argv(info.host, self.ssh_port, self.ssh_identity), remote]

    def check_hosts(self) -> None:
        """Fail before starting anything when a remote host does not answer ssh.

        Raises:
            ConfigError: Naming every host ssh could not run a command on, and why.
        """
        remote = sorted({i.host for i in self.placement if not hostlist.is_local(i.host)})

        def probe(host: str) -> str | None:
            argv = [*ssh_argv(host, self.ssh_port, self.ssh_identity), "true"]
            try:
                done = subprocess.run(argv, capture_output=True, text=True,
                                      stdin=subprocess.DEVNULL, timeout=_CHECK_TIMEOUT_S + 5)
            except subprocess.TimeoutExpired:
                return f"{host}: ssh did not answer within {_CHECK_TIMEOUT_S:.0f} s"
            if done.returncode != 0:
                lines = done.stderr.strip().splitlines()
                return f"{host}: {lines[-1] if lines else f'ssh exited with {done.returncode}'}"
            return None

        with concurrent.futures.ThreadPoolExecutor(max(1, min(16, len(remote)))) as pool:
            problems = [p for p in pool.map(probe, remote) if p]
        if problems:
            port = f" -p {self.ssh_port}" if self.ssh_port else ""
            raise ConfigError(
                f"cannot start ranks over ssh{port} on {len(problems)} host(s): "
                + "; ".join(problems) + ". hvdrun needs passwordless ssh to every host "
                "(check --ssh-port, --ssh-identity-file, HVD_SPARK_SSH_OPTS)")

    def start(self, command: Sequence[str] | None = None) -> None:
        """Start every rank (``command``, default the published function); each one's
        environment goes down its stdin."""
        self._expect_reports = command is None
        command = WORKER_COMMAND if command is None else command
        for info in self.placement:
            proc = start_tied(
                self.command_for(info, command), signal.SIGTERM, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(self.rank_env(info)).encode() + b"\n")
            proc.stdin.flush()  # stdin stays open: closing it stops the rank
            self._follow(info.rank, proc)


def add_host_arguments(parser: argparse.ArgumentParser) -> None:
    """hvdrun's options for several hosts, in Horovod's spelling."""
    group = parser.add_argument_group("hosts", "start ranks on other hosts over ssh")
    group.add_argument("-H", "--hosts", default=None,
                       help="hosts and their slots, e.g. host1:2,host2:2")
    group.add_argument("-hostfile", "--hostfile", default=None,
                       help="file with one 'hostname slots=N' per line")
    group.add_argument("-p", "--ssh-port", type=int, default=None, help="ssh port on the hosts")
    group.add_argument("-i", "--ssh-identity-file", default=None, help="ssh private key file")
    group.add_argument("--network-interface", "--network-interfaces", dest="nics",
                       action="append", default=None,
                       help="interface(s) the ranks talk over, e.g. eth0 (sets "
                            f"{_env.IFACE}; the first one a host has is used)")


def host_slots_from(args: argparse.Namespace) -> list[hostlist.HostSlots] | None:
    """The hosts of ``-H``/``--hostfile`` (None when neither was given: local ranks).

    Raises:
        ConfigError: Both given, or either one malformed.
    """
    if args.hosts and args.hostfile:
        raise ConfigError("give -H/--hosts or --hostfile, not both")
    if (args.hosts or args.hostfile) and getattr(args, "mpi", False):
        raise ConfigError("-H/--hostfile start ranks over ssh; with --mpi give mpirun its "
                          "hosts instead (e.g. mpirun -H host1:2,host2:2 python train.py)")
    if (args.hosts or args.hostfile) and getattr(args, "elastic", False):
        raise ConfigError("-H/--hostfile cannot be combined with the elastic options yet: "
                          "elastic jobs run on one host or on Spark (hvd_spark.run_elastic)")
    if args.hosts:
        return hostlist.parse_hosts(args.hosts)
    if args.hostfile:
        return hostlist.parse_hostfile(args.hostfile)
    return None


def hosts_job(host_slots: list[hostlist.HostSlots], config: RunConfig,
              ssh_port: int | None = None, ssh_identity: str | None = None) -> SshJob:
    """An ``SshJob`` of ``config.num_proc`` ranks placed on ``host_slots``, its hosts checked.

    Raises:
        ConfigError: Too few slots, an unknown host, or a host that does not answer ssh.
    """
    if ssh_identity is not None and not os.path.isfile(ssh_identity):
        raise ConfigError(f"--ssh-identity-file {ssh_identity}: no such file")
    if config.num_proc is None:
        raise ConfigError("num_proc must be a positive integer, got None")
    job = SshJob(config, hostlist.place_ranks(host_slots, config.num_proc), ssh_port,
                 ssh_identity)
    try:
        job.check_hosts()
    except BaseException:
        job.close()
        raise
    return job
