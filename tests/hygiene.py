"""What a test may not leave behind, read from this process and /proc.

``State.now()`` takes a snapshot; ``State.leaked_since(before)`` says what appeared after
it and is still there. tests/conftest.py's autouse fixture compares the two around every
test, with a grace period for things that end on their own (threads saying goodbye,
processes being reaped, sockets closing).
"""

from __future__ import annotations

import gc
import glob
import os
import re
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path

ENV_PREFIXES = ("HVD_SPARK_", "HOROVOD_")
# Threads that legitimately outlive a test: the Spark job thread of a module-scoped
# session's last run ends with the job, and a store connection ends when its client does.
THREADS_ALLOWED = ("hvd-spark-job", "hvd-store-conn", "hvd-out-", "hvd-log")

_PROC = Path("/proc")


def hvd_threads() -> dict[int, str]:
    """Return ``{ident: name}`` of the running hvd threads that must not outlive a test."""
    return {t.ident: t.name for t in threading.enumerate()
            if t.name.startswith("hvd-") and not t.name.startswith(THREADS_ALLOWED)}


def hvd_env() -> dict[str, str]:
    """Return the HVD_SPARK_*/HOROVOD_* environment variables of this process."""
    return {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}


def shm_segments() -> set[str]:
    """Return the hvd_spark shared-memory files under /dev/shm."""
    return set(glob.glob("/dev/shm/hvd_spark_*"))


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:  # the process or descriptor went away while we looked
        return ""


def _process(pid: int) -> tuple[str, str, str] | None:
    """Return ``(start time, state, command line)`` of ``pid``, or None once it is gone."""
    stat = _read(_PROC / str(pid) / "stat")
    if not stat:
        return None
    # Fields after the parenthesised command name: state is the first, start time the 20th.
    fields = stat[stat.rindex(")") + 2:].split()
    cmdline = _read(_PROC / str(pid) / "cmdline").replace("\0", " ").strip()
    return fields[19], fields[0], cmdline


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in glob.glob(f"/proc/{pid}/task/*/children"):
        found.update(int(c) for c in _read(Path(task)).split())
    return found


def child_processes(known: dict[tuple[int, str], str] | None = None
                    ) -> dict[tuple[int, str], str]:
    """Return ``{(pid, start time): command line}`` of this process's living descendants.

    A process in ``known`` (an earlier snapshot) is listed but not descended into: what a
    process that was already there starts (the Spark JVM of a module-scoped session forks
    Python workers and executors on demand) is that process's business, not the test's.
    Zombies are left out: they hold nothing but a process-table entry until reaped.
    """
    found: dict[tuple[int, str], str] = {}
    stack = list(_children(os.getpid()))
    while stack:
        pid = stack.pop()
        info = _process(pid)
        if info is None or info[1] == "Z":
            continue
        key = (pid, info[0])
        found[key] = info[2]
        if known is None or key not in known:
            stack.extend(_children(pid))
    return found


def open_fds() -> dict[int, str]:
    """Return ``{fd: what it points to}`` for this process's open file descriptors."""
    fds: dict[int, str] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the descriptor of the listing itself, closed by now
            continue
    return fds


@dataclass
class State:
    """One snapshot of what a test could leak."""

    threads: dict[int, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    segments: set[str] = field(default_factory=set)
    children: dict[tuple[int, str], str] = field(default_factory=dict)
    fds: dict[int, str] = field(default_factory=dict)

    @classmethod
    def now(cls, known: dict[tuple[int, str], str] | None = None) -> State:
        """Take a snapshot (children below ``known`` processes are not descended into)."""
        return cls(hvd_threads(), hvd_env(), shm_segments(), child_processes(known),
                   open_fds())

    def leaked_since(self, before: State) -> list[str]:
        """Say what is here now and was not in ``before`` (empty when nothing)."""
        problems = []
        threads = sorted(n for i, n in self.threads.items() if i not in before.threads)
        if threads:
            problems.append(f"threads still running: {threads}")
        changed = sorted(k for k in set(before.env) | set(self.env)
                         if before.env.get(k) != self.env.get(k))
        if changed:
            problems.append(f"environment variables changed: {changed} (use monkeypatch.setenv)")
        segments = sorted(self.segments - before.segments)
        if segments:
            problems.append(f"shared-memory files left: {segments}")
        # No exclusions: every process that a test run here started (the JVMs and
        # Connect servers of module-scoped fixtures) existed before the tests that use it.
        children = sorted(f"{pid} {cmd[:120]}" for (pid, start), cmd in self.children.items()
                          if (pid, start) not in before.children)
        if children:
            problems.append(f"child processes still running: {children}")
        new_fds = {fd: target for fd, target in self.fds.items()
                   if before.fds.get(fd) != target and not _fd_allowed(target)}
        sockets = [t for t in new_fds.values() if t.startswith("socket:[")]
        if sockets:
            # A connection to a process that was there before the test belongs to the
            # fixture that started it, and lives as long as it: the driver's py4j and
            # accumulator connections with a module's Spark JVM (made lazily at its first
            # job or concurrent call), a Spark Connect client's channel to its server.
            ours = _peers_in(sockets, {pid for pid, _ in before.children})
            new_fds = {fd: t for fd, t in new_fds.items() if t not in ours}
        held = {}
        if any(t.startswith("socket:[") for t in new_fds.values()):
            # Python code (hvd_spark's, and pyspark's py4j) makes its sockets through the
            # socket module. A descriptor that no socket object holds was made by a C
            # library's own threads (gRPC's core under Spark Connect, ZMQ's I/O thread
            # under a notebook kernel's client), which open and retry connections on
            # their own schedule: not a test's leak.
            held = _python_sockets()
            new_fds = {fd: t for fd, t in new_fds.items()
                       if not t.startswith("socket:[") or fd in held}
        if new_fds:
            table = _tcp_rows()
            fds = sorted(f"{fd} -> {target}{_describe_socket(target, table)}"
                         f"{' ' + describe_holders(held[fd], held) if fd in held else ''}"
                         for fd, target in new_fds.items())
            problems.append(f"file descriptors still open: {fds}")
        return problems


# Descriptors that legitimately outlive a test, each checked by looking at what stayed open:
_FDS_ALLOWED = (
    # MLflow keeps one SQLAlchemy engine per store URI for the process's life
    # (SqlAlchemyStore._engine_map), and with it the sqlite files of the tests' stores.
    re.compile(r"/mlflow\.db(-journal|-wal|-shm)?$"),
    # matplotlib caches each font it drew with (FT2Font objects keep the file open).
    re.compile(r"/mpl-data/fonts/.*\.(ttf|otf|afm)$"),
    # The AWS SDK in pyarrow's S3 filesystem starts one event loop per process (epoll,
    # eventfds, /dev/urandom) on first use. hvd_spark itself opens no epoll or eventfd.
    re.compile(r"^anon_inode:\[(eventpoll|eventfd)\]$"),
    re.compile(r"^/dev/u?random$"),
)


def _tcp_table() -> dict[int, tuple[str, str]]:
    """``{socket inode: (local port, remote port)}`` of this network namespace's TCP
    sockets. Ports only: a JVM's end of a loopback connection is an IPv6 socket (an
    IPv4-mapped address) while Python's is IPv4."""
    return {inode: (local, remote) for inode, (local, remote, _) in _tcp_rows().items()}


def _tcp_rows() -> dict[int, tuple[str, str, str]]:
    """``{socket inode: (local port, remote port, state)}``, hex as /proc writes them."""
    table = {}
    for name in ("tcp", "tcp6"):
        for line in _read(_PROC / "self" / "net" / name).splitlines()[1:]:
            fields = line.split()
            table[int(fields[9])] = (fields[1].rsplit(":", 1)[1], fields[2].rsplit(":", 1)[1],
                                     fields[3])
    return table


_TCP_STATES = {"01": "ESTABLISHED", "06": "TIME_WAIT", "08": "CLOSE_WAIT", "0A": "LISTEN",
               "04": "FIN_WAIT1", "05": "FIN_WAIT2", "07": "CLOSE", "09": "LAST_ACK"}


def _describe_socket(target: str, table: dict[int, tuple[str, str, str]]) -> str:
    """What a leaked socket is: its TCP ports and state and who holds the other end."""
    if not target.startswith("socket:["):
        return ""
    ends = table.get(int(target[8:-1]))
    if ends is None:
        for line in _read(_PROC / "self" / "net" / "unix").splitlines()[1:]:
            fields = line.split()
            if fields[6] == target[8:-1]:
                return f" (unix socket {fields[7] if len(fields) > 7 else 'unnamed'})"
        return " (neither TCP nor unix)"
    local, remote, state = ends
    text = (f" (tcp local port {int(local, 16)}, remote port {int(remote, 16)},"
            f" {_TCP_STATES.get(state, state)}")
    peers = [inode for inode, (l2, r2, _) in table.items() if (l2, r2) == (remote, local)]
    owners = [_holder(inode) for inode in peers]
    return text + (f", other end held by {owners})" if owners else ", no other end here)")


def _holder(inode: int) -> str:
    """``pid command`` of the process holding socket ``inode`` (any process), or "?"."""
    wanted = f"socket:[{inode}]"
    for link in glob.glob("/proc/[0-9]*/fd/*"):
        try:
            if os.readlink(link) == wanted:
                pid = link.split("/")[2]
                return f"{pid} {_read(_PROC / pid / 'cmdline').replace(chr(0), ' ')[:80]}"
        except OSError:
            continue
    return "?"


def describe_holders(sock: socket.socket, *ignore: object) -> str:
    """``repr(sock)``, whether it listens, and what holds it (two steps up the referrers):
    a frame names its function and line, an instance dict its class, so the report says
    which code kept the socket."""
    try:
        listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    except OSError:
        listening = 0
    holders = []
    for ref in _referrers(sock, ignore):
        above = [_name(r) for r in _referrers(ref, ignore)][:3]
        holders.append(_name(ref) + (f" <- {', '.join(above)}" if above else ""))
    return (f"{sock!r}{' listening' if listening else ''}, held by "
            f"[{'; '.join(holders[:4]) or 'nothing but a cycle'}]")


def _referrers(obj: object, ignore: tuple) -> list:
    """What refers to ``obj``, leaving out ``ignore`` and this module's own frames."""
    skip = {id(o) for o in ignore}
    return [r for r in gc.get_referrers(obj)
            if id(r) not in skip
            and not (type(r).__name__ == "frame" and r.f_code.co_filename == __file__)]


def _name(obj: object) -> str:
    """A short description of a referrer: a frame by its code, a dict by its owner."""
    if type(obj).__name__ == "frame":
        code = obj.f_code
        return f"frame {code.co_qualname} ({os.path.basename(code.co_filename)}:{obj.f_lineno})"
    if isinstance(obj, dict):
        for owner in gc.get_referrers(obj):
            if getattr(owner, "__dict__", None) is obj:
                return f"{type(owner).__qualname__} attributes"
        return f"dict of {len(obj)} keys"
    return type(obj).__qualname__


def _python_sockets() -> dict[int, socket.socket]:
    """``{fd: socket object}`` of this process's open Python sockets."""
    found = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), socket.socket):  # type(): no proxy's __class__ hook
            try:
                fd = obj.fileno()
            except OSError:
                continue
            if fd >= 0:
                found[fd] = obj
    return found


def _socket_inodes(pids: set[int]) -> set[int]:
    """The inodes of the sockets the processes ``pids`` hold open."""
    inodes = set()
    for pid in pids:
        for link in glob.glob(f"/proc/{pid}/fd/*"):
            try:
                target = os.readlink(link)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    return inodes


def _peers_in(targets: list[str], pids: set[int]) -> set[str]:
    """Those of the socket ``targets`` (``socket:[inode]``) whose other end (on this
    machine) one of ``pids`` holds."""
    table = _tcp_table()
    wanted = {}
    for target in targets:
        ends = table.get(int(target[8:-1]))
        if ends is not None:
            wanted[(ends[1], ends[0])] = target  # the peer's (local, remote)
    if not wanted:
        return set()
    theirs = _socket_inodes(pids)
    return {wanted[ends] for inode, ends in table.items()
            if inode in theirs and ends in wanted}


def _fd_allowed(target: str) -> bool:
    """Whether a descriptor that outlives a test is one that legitimately persists."""
    return any(pattern.search(target) for pattern in _FDS_ALLOWED)
