"""The faults the chaos soak injects into namespace hosts, each with its undo.

A fault picks its victim on a host (``hostprocs``), acts, and returns an ``Injected``
whose ``undo`` (resume a stopped rank, bring a link up, drop a netem qdisc, empty
/dev/shm) a timer calls after the fault's duration; ``undo`` is idempotent, so the soak
can also call it at once when it stops early. Faults that need something the kernel
lacks (``netem``) say so through ``unavailable``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from hvd_spark.bench.chaos import hostprocs

if TYPE_CHECKING:
    from netns_cluster.hosts import NetnsHosts

STOP_S = 20.0
LINK_DOWN_S = 5.0
NETEM_S = 10.0
SHM_FULL_S = 15.0
_CMD_S = 20.0
_SHM_SIZE = "2g"  # what netns_cluster.hosts mounts


@dataclasses.dataclass
class Injected:
    """One injected fault: what, where, when (``time.time()``), and how to end it."""

    kind: str
    where: str
    at: float
    duration: float = 0.0
    undo: Callable[[], None] = lambda: None
    in_recovery: bool = False


class NoTarget(Exception):
    """The fault found nothing to act on (no rank or executor runs on any host)."""


def _sh(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=_CMD_S)


def _once(fn: Callable[[], None]) -> Callable[[], None]:
    lock = threading.Lock()
    done: list[bool] = []

    def run() -> None:
        with lock:
            if done:
                return
            done.append(True)
        fn()

    return run


def _pick(net: NetnsHosts, rng: random.Random, mark: bytes) -> tuple[int, int]:
    """A random (host, pid) among the hosts' processes whose command line has ``mark``."""
    found = [(i, pid) for i in range(net.count) for pid in hostprocs.matching(net, i, mark)]
    if not found:
        raise NoTarget(mark.decode())
    return rng.choice(sorted(found))


def kill_executor(net: NetnsHosts, rng: random.Random) -> Injected:
    """SIGKILL a Spark executor JVM (a preempted node; its worker starts a new one)."""
    i, pid = _pick(net, rng, hostprocs.EXECUTOR_MARK)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return Injected("executor-kill", f"{net.hostnames[i]} pid {pid}", time.time())


def kill_rank(net: NetnsHosts, rng: random.Random) -> Injected:
    """SIGKILL one rank process (the OOM killer's way)."""
    i, pid = _pick(net, rng, hostprocs.RANK_MARK)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return Injected("rank-kill", f"{net.hostnames[i]} pid {pid}", time.time())


def stop_rank(net: NetnsHosts, rng: random.Random) -> Injected:
    """SIGSTOP one rank for ``STOP_S`` seconds, then SIGCONT (a long GC or swap storm)."""
    i, pid = _pick(net, rng, hostprocs.RANK_MARK)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGSTOP)

    def resume() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)

    return Injected("rank-stop", f"{net.hostnames[i]} pid {pid}", time.time(), STOP_S,
                    _once(resume))


def link_down(net: NetnsHosts, rng: random.Random) -> Injected:
    """Take a host's link down for ``LINK_DOWN_S`` seconds (a switch port flaps)."""
    i = rng.randrange(net.count)
    net.set_link(i, up=False)
    return Injected("link-down", net.hostnames[i], time.time(), LINK_DOWN_S,
                    _once(lambda: net.set_link(i, up=True)))


def _qdisc_both(net: NetnsHosts, i: int, args: list[str]) -> list[list[str]]:
    return [["tc", "qdisc", *args[:1], "dev", net.veths[i], *args[1:]],
            ["ip", "netns", "exec", net.namespaces[i], "tc", "qdisc", *args[:1], "dev",
             "eth0", *args[1:]]]


def _shape_for(kind: str, qdisc: list[str], seconds: float) -> Callable:
    def inject(net: NetnsHosts, rng: random.Random) -> Injected:
        i = rng.randrange(net.count)
        for argv in _qdisc_both(net, i, ["replace", "root", *qdisc]):
            done = _sh(argv)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")

        def restore() -> None:
            for argv in _qdisc_both(net, i, ["del", "root"]):
                _sh(argv)

        return Injected(kind, net.hostnames[i], time.time(), seconds, _once(restore))

    return inject


#: 5 % loss and 50 ms delay both ways for ``NETEM_S`` seconds.
netem = _shape_for("netem", ["netem", "loss", "5%", "delay", "50ms", "limit", "100000"],
                   NETEM_S)
#: Where the kernel has no netem: a 1 Mbit/s link for ``NETEM_S`` seconds instead.
slow_link = _shape_for("slow-link", ["tbf", "rate", "1mbit", "burst", "16kb", "latency",
                                     "400ms"], NETEM_S)


def fill_shm(net: NetnsHosts, rng: random.Random) -> Injected:
    """Fill a host's /dev/shm for ``SHM_FULL_S`` seconds.

    The tmpfs is first shrunk to what it holds plus 32 MB, then a file takes the rest:
    full for everyone on the host, without taking gigabytes of the machine's memory.
    """
    hosts = [i for i in range(net.count) if hostprocs.worker_pid(net, i) is not None]
    if not hosts:
        raise NoTarget("Spark worker")
    i = rng.choice(hosts)
    pid = hostprocs.worker_pid(net, i)
    enter = ["nsenter", "-t", str(pid), "-m", "--"]
    fill = (f"used=$(df -k --output=used /dev/shm | tail -1); "
            f"mount -o remount,size=$((used + 32768))k /dev/shm && "
            f"dd if=/dev/zero of=/dev/shm/{hostprocs.FILL_NAME} bs=1M 2>/dev/null; "
            f"df -k --output=avail /dev/shm | tail -1")
    done = _sh([*enter, "sh", "-c", fill])
    if done.returncode != 0 or done.stdout.strip() != "0":
        raise RuntimeError(f"filling /dev/shm on {net.hostnames[i]} failed: "
                           f"{done.stdout.strip()} {done.stderr.strip()}")

    def empty() -> None:
        _sh([*enter, "sh", "-c", f"rm -f /dev/shm/{hostprocs.FILL_NAME}; "
             f"mount -o remount,size={_SHM_SIZE} /dev/shm"])

    return Injected("shm-full", net.hostnames[i], time.time(), SHM_FULL_S, _once(empty))


def netem_problem(net: NetnsHosts) -> str | None:
    """Why netem cannot be used on these hosts (None when it can)."""
    probe = ["ip", "netns", "exec", net.namespaces[0], "tc", "qdisc"]
    done = _sh([*probe, "add", "dev", "lo", "root", "netem", "delay", "1ms"])
    if done.returncode == 0:
        _sh([*probe, "del", "dev", "lo", "root"])
        return None
    return f"this kernel has no netem qdisc (sch_netem): {done.stderr.strip()}"


#: Fault kind -> injector, in the order the issue lists them.
KINDS: dict[str, Callable[[NetnsHosts, random.Random], Injected]] = {
    "executor-kill": kill_executor,
    "rank-kill": kill_rank,
    "rank-stop": stop_rank,
    "link-down": link_down,
    "netem": netem,
    "shm-full": fill_shm,
}
#: Drawn like a kind: the next fault lands while the cluster recovers from the previous.
IN_RECOVERY = "in-recovery"
