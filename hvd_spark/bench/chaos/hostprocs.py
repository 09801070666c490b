"""What runs on a namespace host: its processes, /dev/shm segments and listening ports.

A process is on host ``i`` when its network namespace is the host's (the same nsfs
inode as ``/run/netns/<name>``); a host's ``/dev/shm`` is read through its Spark
worker's mount namespace (``/proc/<pid>/root``), since every host mounts its own.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from netns_cluster.hosts import NetnsHosts

#: hvd_spark's rank process (``hvd_spark.runner.tied_child.WORKER_COMMAND``).
RANK_MARK = b"hvd_spark.runner.worker"
EXECUTOR_MARK = b"CoarseGrainedExecutorBackend"
WORKER_MARK = b"deploy.worker.Worker"
#: Files of this bench's own /dev/shm fault (``faults.ShmFull``).
FILL_NAME = "hvd-chaos-fill"


def _ns_inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def cmdline(pid: int) -> bytes:
    """The process's command line (NUL-separated), empty when it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def host_pids(net: NetnsHosts, i: int) -> list[int]:
    """Every process whose network namespace is host ``i``'s."""
    want = _ns_inode(f"/run/netns/{net.namespaces[i]}")
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and want is not None and _ns_inode(f"/proc/{entry}/ns/net") == want:
            found.append(int(entry))
    return found


def matching(net: NetnsHosts, i: int, mark: bytes) -> list[int]:
    """Host ``i``'s processes whose command line contains ``mark``."""
    return [pid for pid in host_pids(net, i) if mark in cmdline(pid)]


def worker_pid(net: NetnsHosts, i: int) -> int | None:
    """The Spark worker JVM of host ``i`` (its mount namespace holds the host's /dev/shm)."""
    pids = matching(net, i, WORKER_MARK)
    return pids[0] if pids else None


def shm_files(net: NetnsHosts, i: int) -> list[str]:
    """The names in host ``i``'s /dev/shm (empty when its worker is gone)."""
    pid = worker_pid(net, i)
    if pid is None:
        return []
    with contextlib.suppress(OSError):
        return sorted(os.listdir(f"/proc/{pid}/root/dev/shm"))
    return []


def _socket_owners() -> dict[str, int]:
    """Socket inode -> a pid holding it, over every process."""
    owners: dict[str, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{entry}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{entry}/fd/{fd}")
                    if target.startswith("socket:["):
                        owners[target[8:-1]] = int(entry)
    return owners


def listening(pid: int) -> list[tuple[int, str]]:
    """(port, inode) of the TCP sockets listening in ``pid``'s network namespace."""
    found = []
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                parts = line.split()
                if parts[3] == "0A":  # LISTEN
                    found.append((int(parts[1].rsplit(":", 1)[1], 16), parts[9]))
    return found


def leftovers(net: NetnsHosts) -> list[str]:
    """What a finished workload left on the hosts: rank processes, /dev/shm files and
    listening ports of anything but the Spark daemons (JVMs) and pyspark's workers."""
    found = []
    owners = _socket_owners()
    for i, host in enumerate(net.hostnames):
        pids = host_pids(net, i)
        for pid in pids:
            if RANK_MARK in cmdline(pid):
                found.append(f"{host}: rank process {pid} still runs")
        found += [f"{host}: /dev/shm/{name} remains" for name in shm_files(net, i)]
        if not pids:
            continue
        for port, inode in listening(pids[0]):
            owner = owners.get(inode)
            cmd = cmdline(owner) if owner else b""
            if b"java" in cmd or b"pyspark" in cmd:
                continue  # the worker, its executor, pyspark's daemon
            who = cmd.replace(b"\0", b" ").decode(errors="replace")[:80] or "no process"
            found.append(f"{host}: port {port} listens ({who})")
    return found


def own_listening() -> set[int]:
    """Ports this process (the driver) listens on: a run's services must close theirs."""
    mine = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{fd}")
                if target.startswith("socket:["):
                    mine.add(target[8:-1])
    return {port for port, inode in listening(os.getpid()) if inode in mine}
