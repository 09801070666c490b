"""Child processes that die with the thread that started them, with no Python run between
fork and exec.

The kernel's parent-death signal (Linux ``PR_SET_PDEATHSIG``) must be requested by the
child. ``Popen(preexec_fn=...)`` would do it in the forked child before exec, but that runs
Python in a copy of a threaded process: CPython tears down the other threads' states there
and their finalizers run in the child. py4j's finalizer of a thread's JVM connection calls
``shutdown()`` on the socket, which the child shares with its parent, so starting ranks
from a Spark driver cut the driver's own JVM connections (and a ``dlopen`` in the child can
deadlock on a loader lock another thread held at fork). So the child asks itself, after
exec: hvd_spark's worker calls :func:`arm_from_env` first thing; any other command is
started through a few lines of ``python -I -S`` that arm and then exec it (the setting
survives ``execve``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from hvd_spark import _env

_PR_SET_PDEATHSIG = 1
#: The command of hvd_spark's own rank process, which arms itself.
WORKER_COMMAND = (sys.executable, "-m", "hvd_spark.runner.worker")

# Runs in the child's interpreter before the command: no hvd_spark import (a user's
# command may run in an environment without it on the path), nothing but the standard
# library. The parent's pid guards the race where the parent dies before the child arms.
_ARM_THEN_EXEC = f"""
import ctypes, os, sys
pid, sig = map(int, os.environ.pop({_env.DIE_WITH_PARENT!r}).split(":"))
try:
    ctypes.CDLL(None, use_errno=True).prctl({_PR_SET_PDEATHSIG}, sig)
except (AttributeError, OSError):
    pass
if os.getppid() != pid:
    os.kill(os.getpid(), sig)
try:
    os.execvp(sys.argv[1], sys.argv[1:])
except OSError as exc:  # a shell's codes: 127 not found, 126 not runnable
    sys.stderr.write(f"cannot run {{sys.argv[1]}}: {{exc.strerror or exc}}\\n")
    sys.exit(127 if isinstance(exc, FileNotFoundError) else 126)
"""


def start_tied(command: Sequence[str], sig: signal.Signals, env: dict[str, str] | None = None,
               **popen_kwargs: Any) -> subprocess.Popen:
    """Start ``command`` in its own session; the kernel sends it ``sig`` when the calling
    thread ends (Linux; elsewhere it is not tied).

    Args:
        command: The program and its arguments.
        sig: The signal the child gets when its starter dies (SIGTERM lets a rank flush,
            SIGKILL is for a Spark task's worker, which must not outlive the task).
        env: The child's whole environment (default: this process's).
        **popen_kwargs: Passed to ``subprocess.Popen`` (pipes, cwd).

    Returns:
        The started process.
    """
    env = {**(os.environ if env is None else env),
           _env.DIE_WITH_PARENT: f"{os.getpid()}:{int(sig)}"}
    command = list(command)
    if tuple(command[:3]) != WORKER_COMMAND:
        command = [sys.executable, "-I", "-S", "-c", _ARM_THEN_EXEC, *command]
    return subprocess.Popen(command, env=env, start_new_session=True, **popen_kwargs)


def arm_from_env() -> None:
    """In a child :func:`start_tied` started: ask for the parent-death signal now.

    Nothing when the variable is absent (a worker started some other way). The variable is
    removed, so what this process starts in turn is not tied to this process's parent.
    """
    value = os.environ.pop(_env.DIE_WITH_PARENT, None)
    if value is None:
        return
    pid, sig = (int(part) for part in value.split(":"))
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    except (AttributeError, OSError):  # not Linux: the child is not tied
        return
    if os.getppid() != pid:  # the starter died before we asked: the signal never comes
        os.kill(os.getpid(), sig)
