"""``python -m hvd_spark.runner.local.remote_rank COMMAND...``: one rank on a host, under ssh.

hvdrun starts this on every host (over ssh, or directly on its own machine). It reads
one JSON line from stdin, the rank's environment (kept off the command line, where
``ps`` would show the job's secret), starts ``COMMAND`` with it in a process group of
its own, and exits with the command's exit code (128+N when killed by signal N).
When stdin closes (hvdrun stopped the rank, or hvdrun or its ssh connection died),
the whole process group is terminated: no rank outlives its launcher.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading

from hvd_spark.runner import torch_world
from hvd_spark.runner.run_config import DEFAULT_STOP_GRACE_S

_ENV_READ_TIMEOUT_S = 60.0


def _stop_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(DEFAULT_STOP_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue


def _watch_stdin(proc: subprocess.Popen) -> None:
    # Nothing more is ever sent: a read returns empty only when the launcher's end closes.
    with contextlib.suppress(OSError):
        while os.read(0, 4096):
            pass
    _stop_group(proc)


def _read_env() -> dict[str, str]:
    timer = threading.Timer(_ENV_READ_TIMEOUT_S, os._exit, args=(124,))
    timer.daemon = True
    timer.start()  # a launcher that never sends the environment must not leave us waiting
    line = b""
    try:
        # Unbuffered, byte by byte: nothing past the newline may be consumed here.
        while not line.endswith(b"\n"):
            byte = os.read(0, 1)
            if not byte:
                break
            line += byte
    finally:
        timer.cancel()
    if not line:
        sys.stderr.write("hvd_spark.runner.local.remote_rank: the launcher sent no environment\n")
        sys.exit(2)
    env = json.loads(line)
    return {str(k): str(v) for k, v in env.items()}


def main(argv: list[str]) -> int:
    """Run ``argv`` as the rank; return its exit code in a shell's convention."""
    if not argv:
        sys.stderr.write("usage: python -m hvd_spark.runner.local.remote_rank COMMAND...\n")
        return 2
    env = {**os.environ, **_read_env()}
    torch_world.fill_master(env, _ENV_READ_TIMEOUT_S)
    try:
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    except OSError as exc:
        sys.stderr.write(f"hvdrun: cannot run {argv[0]}: {exc.strerror or exc}\n")
        return 127 if isinstance(exc, FileNotFoundError) else 126
    threading.Thread(target=_watch_stdin, args=(proc,), daemon=True).start()
    # ssh delivers SIGHUP/SIGTERM here when the session ends: pass it to the rank's group.
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, lambda *_: threading.Thread(
            target=_stop_group, args=(proc,), daemon=True).start())
    code = proc.wait()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # not sys.exit: the stdin watcher thread may still be blocked in read
