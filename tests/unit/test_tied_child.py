"""Children that die with their starter, started without running Python between fork and
exec (hvd_spark.runner.tied_child). Real processes, signals and sockets."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import threading

from hvd_spark import _env
from hvd_spark.runner.tied_child import start_tied

_ARMED_CHILD = ("from hvd_spark.runner.tied_child import arm_from_env; import time; "
                "arm_from_env(); print('armed', flush=True); time.sleep(60)")


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_all_exit(pidfds: list[int], timeout: float) -> None:
    """Block until every process behind ``pidfds`` has exited (a pidfd turns readable)."""
    pending = list(pidfds)
    while pending:
        ready, _, _ = select.select(pending, [], [], timeout)
        assert ready, f"{len(pending)} process(es) still running after {timeout} s"
        pending = [fd for fd in pending if fd not in ready]


def test_children_die_when_their_starter_is_killed():
    # The starter: one command through start_tied (armed by the small exec wrapper), and
    # one Python child that arms itself with arm_from_env, as hvd_spark's worker does.
    starter_code = textwrap.dedent(f"""
        import os, signal, subprocess, sys
        from hvd_spark.runner.tied_child import start_tied
        # The wrapper arms before it execs: "started" proves the command is armed.
        sleeper = start_tied(["sh", "-c", "echo started; exec sleep 60"], signal.SIGTERM,
                             stdout=subprocess.PIPE, text=True)
        assert sleeper.stdout.readline() == "started\\n"
        env = {{**os.environ, {_env.DIE_WITH_PARENT!r}: f"{{os.getpid()}}:{{int(signal.SIGTERM)}}"}}
        armed = subprocess.Popen([sys.executable, "-c", {_ARMED_CHILD!r}], env=env,
                                 stdout=subprocess.PIPE, text=True)
        assert armed.stdout.readline() == "armed\\n"
        print(sleeper.pid, armed.pid, flush=True)
        signal.pause()
    """)
    starter = subprocess.Popen([sys.executable, "-c", starter_code], stdout=subprocess.PIPE,
                               text=True)
    pidfds: list[int] = []
    try:
        pids = [int(p) for p in starter.stdout.readline().split()]
        assert len(pids) == 2 and not any(_gone(p) for p in pids)
        pidfds = [os.pidfd_open(p) for p in pids]  # both armed: the starter printed after
    finally:
        starter.kill()
        starter.wait(10)
    try:
        _wait_all_exit(pidfds, 10)
    finally:
        for fd in pidfds:
            os.close(fd)
    assert all(_gone(p) for p in pids), [p for p in pids if not _gone(p)]


def test_a_child_whose_starter_died_before_it_armed_ends_itself():
    # The pid is not this child's parent: the starter "died" before the child asked.
    env = {**os.environ, _env.DIE_WITH_PARENT: f"1:{int(signal.SIGTERM)}"}
    child = subprocess.run([sys.executable, "-c", _ARMED_CHILD], env=env, timeout=30,
                           capture_output=True, text=True)
    assert child.returncode == -signal.SIGTERM and "armed" not in child.stdout


def test_the_command_runs_with_its_arguments_and_without_the_variable():
    proc = start_tied(["sh", "-c", f'echo "$0 ${{{_env.DIE_WITH_PARENT}:-unset}} $USER_VAR"',
                       "first"], signal.SIGTERM, {**os.environ, "USER_VAR": "u v"},
                      stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and out == "first unset u v\n"
    assert os.getsid(0) != proc.pid  # it had its own session (we are not its leader)


def test_a_command_that_cannot_run_ends_with_the_shells_code_and_says_why():
    proc = start_tied(["no-such-command-here"], signal.SIGTERM, stderr=subprocess.PIPE,
                      text=True)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 127
    assert err == "cannot run no-such-command-here: No such file or directory\n"


class _Finalized:
    """Shuts a socket down when collected: what py4j's connection finalizer does."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def __del__(self) -> None:
        if self.sock is not None:
            self.sock.shutdown(socket.SHUT_RDWR)


def _connection_of_a_thread_survives(start) -> bool:
    """Whether a socket held by another thread's thread-local survives ``start()``."""
    ours, theirs = socket.socketpair()
    local = threading.local()
    ready, done = threading.Event(), threading.Event()

    def hold():  # like a py4j thread: a thread-local owns the connection's finalizer
        local.finalizer = _Finalized(ours)
        ready.set()
        done.wait(30)
        local.finalizer.sock = None  # the thread ends without shutting the socket

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    ready.wait(30)
    try:
        start().wait(30)
        ours.sendall(b"x")
        return theirs.recv(1) == b"x"
    except OSError:
        return False
    finally:
        done.set()
        thread.join(30)
        ours.close()
        theirs.close()


def test_starting_a_child_leaves_other_threads_connections_alone():
    assert _connection_of_a_thread_survives(lambda: start_tied(["true"], signal.SIGTERM))
    # The hazard it avoids, on the same harness: Python run in the forked child (a
    # preexec_fn) finalizes the other thread's objects there and cuts the shared socket.
    assert not _connection_of_a_thread_survives(
        lambda: subprocess.Popen(["true"], preexec_fn=lambda: None))
