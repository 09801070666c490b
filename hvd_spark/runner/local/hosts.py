"""Host lists in Horovod's syntax (``-H host1:2,host2:2``, ``--hostfile``) and slot filling.

Ranks fill the hosts in the order given, each host up to its slots, so ranks on a host
are consecutive; ``local_rank`` and ``cross_rank`` follow ``rendezvous.assign_ranks``.
"""

from __future__ import annotations

import dataclasses
import re
import socket

from hvd_spark.errors import ConfigError
from hvd_spark.runner.rendezvous import RankInfo, TaskSlot, assign_ranks

_HOSTFILE_LINE = re.compile(r"^(?P<host>\S+)(?:\s+slots\s*=\s*(?P<slots>\S+))?\s*$")
_LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}


@dataclasses.dataclass(frozen=True)
class HostSlots:
    """A host and how many ranks it may run."""

    host: str
    slots: int


def _slots(text: str, where: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"{where}: slots must be a positive integer, got {text!r}")
    return int(text)


def parse_hosts(text: str) -> list[HostSlots]:
    """Parse ``-H``: ``host1:2,host2:2`` (a host without ``:N`` has one slot).

    Raises:
        ConfigError: An empty list, a bad slot count or a host named twice.
    """
    entries = [part.strip() for part in text.split(",") if part.strip()]
    if not entries:
        raise ConfigError(f"-H/--hosts {text!r} names no host; e.g. -H host1:2,host2:2")
    hosts = []
    for entry in entries:
        host, sep, slots = entry.rpartition(":")
        if not sep:
            host, slots = entry, "1"
        hosts.append(HostSlots(host, _slots(slots, f"-H/--hosts entry {entry!r}")))
    return _unique(hosts, "-H/--hosts")


def parse_hostfile(path: str) -> list[HostSlots]:
    """Parse a hostfile: one ``hostname [slots=N]`` per line; ``#`` starts a comment.

    Raises:
        ConfigError: The file cannot be read, a line is malformed, or it names no host.
    """
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError as exc:
        raise ConfigError(f"--hostfile {path}: cannot read it ({exc.strerror or exc})") from None
    hosts = []
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _HOSTFILE_LINE.match(line)
        if match is None:
            raise ConfigError(f"--hostfile {path}, line {number}: {line!r} is not "
                              "'hostname slots=N'")
        slots = match.group("slots") or "1"
        hosts.append(HostSlots(match.group("host"),
                               _slots(slots, f"--hostfile {path}, line {number}")))
    if not hosts:
        raise ConfigError(f"--hostfile {path} names no host")
    return _unique(hosts, f"--hostfile {path}")


def _unique(hosts: list[HostSlots], where: str) -> list[HostSlots]:
    seen: set[str] = set()
    for entry in hosts:
        if entry.host in seen:
            raise ConfigError(f"{where} names host {entry.host!r} twice; give its slots once")
        seen.add(entry.host)
    return hosts


def place_ranks(hosts: list[HostSlots], num_proc: int) -> list[RankInfo]:
    """Place ``num_proc`` ranks on the hosts in order; RankInfo per rank, in rank order.

    Raises:
        ConfigError: More ranks than the hosts' slots.
    """
    total = sum(h.slots for h in hosts)
    if num_proc > total:
        listed = ",".join(f"{h.host}:{h.slots}" for h in hosts)
        raise ConfigError(f"-np {num_proc} is more than the {total} slots of the hosts "
                          f"({listed}); add hosts or slots, or lower -np")
    slots: list[TaskSlot] = []
    for entry in hosts:
        for _ in range(min(entry.slots, num_proc - len(slots))):
            slots.append(TaskSlot(partition=len(slots), host=entry.host))
    infos = assign_ranks(slots)
    return [infos[p] for p in range(num_proc)]


def is_local(host: str) -> bool:
    """True for names of this machine (its ranks start without ssh)."""
    return host in _LOCAL_NAMES or host == socket.gethostname()
