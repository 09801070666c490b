"""Several "hosts" on one machine: network namespaces on a bridge, for tests and benchmarks.

Each host is a network namespace with its own address in a private /24, its own
hostname (a UTS namespace) and its own /dev/shm (so ranks on different hosts cannot
fall back to shared memory), joined to the other hosts and to the machine's root
namespace through a Linux bridge. Each link can be shaped with ``tc`` in both directions
(``tbf`` for a rate, ``netem`` for a delay) and taken down and up again.
``netns_cluster.services`` starts Spark standalone daemons and sshd on the hosts.

Needs root, ``ip`` (iproute2), ``tc``, ``unshare`` and ``mount``; ``problem()`` says why
it cannot run here. Everything is removed by ``close()``; namespaces that a killed
process left behind are removed by the next ``NetnsHosts.start()``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from hvd_spark.errors import ConfigError, HvdSparkError

NS_PREFIX = "hvdmh"
_SUBNET_BASE = "10.213.{}.0/24"
_CMD_TIMEOUT_S = 30.0
_NETNS_ETC = "/etc/netns"


class HarnessError(HvdSparkError):
    """The multi-host harness could not build or start its hosts."""


@dataclasses.dataclass(frozen=True)
class LinkShape:
    """How every host's link is shaped with ``tc``, in each direction.

    Attributes:
        bandwidth: A tc rate such as ``1gbit`` or ``10gbit`` (None: unshaped).
        delay: One-way delay such as ``100us`` or ``1ms`` (None: none added).

    Raises:
        ConfigError: A rate or delay tc would not understand (checked before any set-up).
    """

    bandwidth: str | None = None
    delay: str | None = None

    def __post_init__(self) -> None:
        if self.bandwidth:
            rate_bits(self.bandwidth)
        if self.delay and not re.fullmatch(r"\d+(\.\d+)?(us|ms|s)", self.delay.strip()):
            raise ConfigError(f"delay {self.delay!r} is not a time such as 100us or 1ms")

    def qdisc_args(self) -> list[str]:
        """``tc qdisc add ... root`` arguments after ``root`` (empty when unshaped).

        A delay needs ``netem`` (which also applies the rate); a rate alone uses ``tbf``,
        which every kernel with traffic control has (some, e.g. minimal VM kernels, lack
        ``sch_netem``).
        """
        if self.delay:
            rate = ["rate", self.bandwidth] if self.bandwidth else []
            # The default queue (1000 packets) drops under a fast sender with a delay.
            return ["netem", "delay", self.delay, *rate, "limit", "100000"]
        if self.bandwidth:
            # Burst: 1 ms at the rate, at least two 64 KB GSO packets; queue: 50 ms.
            burst = max(rate_bits(self.bandwidth) // 8 // 1000, 2 * 65536)
            return ["tbf", "rate", self.bandwidth, "burst", str(burst), "latency", "50ms"]
        return []

    def describe(self) -> str:
        """E.g. ``1gbit, 100us`` or ``unshaped``."""
        return ", ".join(x for x in (self.bandwidth, self.delay) if x) or "unshaped"


_RATE_UNITS = {"gbit": 10**9, "mbit": 10**6, "kbit": 10**3, "bit": 1}


def rate_bits(text: str) -> int:
    """A tc rate (``1gbit``, ``100mbit``, ``10Gbit``) in bits per second.

    Raises:
        ConfigError: The text is not a number followed by gbit, mbit, kbit or bit.
    """
    low = text.strip().lower()
    for unit, scale in _RATE_UNITS.items():
        if low.endswith(unit):
            try:
                return int(float(low[: -len(unit)]) * scale)
            except ValueError:
                break
    raise ConfigError(f"bandwidth {text!r} is not a rate such as 1gbit, 500mbit or 10gbit")


def problem() -> str | None:
    """Why namespaces cannot be made here (None when they can)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    for tool in ("ip", "tc", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"{tool!r} is not installed (apt-get install iproute2 util-linux mount)"
    return None


def sh(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    """Run a short administrative command (``ip``, ``tc``, ``ssh-keygen``) with a deadline.

    Raises:
        HarnessError: It failed (``check``) or did not finish in time.
    """
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise HarnessError(f"{' '.join(argv)} did not finish in {_CMD_TIMEOUT_S} s") from None
    if check and done.returncode != 0:
        raise HarnessError(f"{' '.join(argv)} failed: {done.stderr.strip()}")
    return done


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Delete this harness's namespaces and bridges whose creating process is gone."""
    removed = []
    listing = sh(["ip", "netns", "list"], check=False).stdout.split()
    for name in listing:
        if not name.startswith(NS_PREFIX) or "-" not in name:
            continue
        owner = name[len(NS_PREFIX):].split("-")[0]
        if owner.isdigit() and not _pid_alive(int(owner)):
            sh(["ip", "netns", "del", name], check=False)
            shutil.rmtree(os.path.join(_NETNS_ETC, name), ignore_errors=True)
            removed.append(name)
    # Bridges and veth ends of dead owners (a deleted namespace's are freed lazily).
    for link in os.listdir("/sys/class/net"):
        match = re.match(r"hv[bv](\d+)", link)
        if match and not _pid_alive(int(match.group(1))):
            sh(["ip", "link", "del", link], check=False)
            removed.append(link)
    return removed


def _used_subnets() -> set[str]:
    out = sh(["ip", "-o", "-4", "addr", "show"], check=False).stdout
    nets = set()
    for line in out.splitlines():
        parts = line.split()
        if "inet" in parts:
            cidr = parts[parts.index("inet") + 1]
            nets.add(str(ipaddress.ip_interface(cidr).network))
    return nets


class NetnsHosts:
    """``count`` namespaces on one bridge; host ``i`` is ``hostnames[i]`` at ``addrs[i]``.

    Args:
        count: Number of hosts (1..200).
        shape: Rate and delay of every host's link (None: unshaped veth).
    """

    def __init__(self, count: int, shape: LinkShape | None = None) -> None:
        if not 1 <= count <= 200:
            raise ConfigError(f"hosts must be between 1 and 200, got {count}")
        self.count = count
        self.shape = shape or LinkShape()
        self.tag = str(os.getpid())
        self.bridge = f"hvb{self.tag}"
        self.namespaces = [f"{NS_PREFIX}{self.tag}-{i}" for i in range(count)]
        self.hostnames = [f"hvdhost{i + 1}" for i in range(count)]
        self.veths = [f"hvv{self.tag}x{i}" for i in range(count)]
        self.bridge_addr = ""
        self.addrs: list[str] = []
        self._extra_bridges: list[str] = []
        self._extra_veths: list[str] = []
        self.interfaces: dict[str, list[str]] = {}  # added interface -> address per host
        self._holders: dict[int, subprocess.Popen] = {}
        self._started = False
        self._taken: set[str] = set()

    # ------------------------------------------------------------------ set-up
    def start(self) -> NetnsHosts:
        """Create the bridge, the namespaces and their links (idempotent on failure: close())."""
        why = problem()
        if why:
            raise HarnessError(why)
        remove_stale()
        if os.path.exists(f"/sys/class/net/{self.bridge}"):
            raise HarnessError(f"bridge {self.bridge} exists: this process already has hosts")
        self._started = True
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _pick_subnet(self) -> ipaddress.IPv4Network:
        used = _used_subnets() | self._taken
        first = int(self.tag) % 200
        for k in range(200):
            net = _SUBNET_BASE.format((first + k) % 200 + 20)
            if net not in used:
                self._taken.add(net)
                return ipaddress.ip_network(net)
        raise HarnessError("no free 10.213.x.0/24 subnet for the hosts")

    def _build(self) -> None:
        net = self._pick_subnet()
        hosts = list(net.hosts())
        self.bridge_addr = str(hosts[0])
        self.addrs = [str(hosts[10 + i]) for i in range(self.count)]
        sh(["ip", "link", "add", self.bridge, "type", "bridge"])
        sh(["ip", "addr", "add", f"{self.bridge_addr}/24", "dev", self.bridge])
        sh(["ip", "link", "set", self.bridge, "up"])
        etc_hosts = "127.0.0.1 localhost\n" + "".join(
            f"{a} {h}\n" for a, h in zip(self.addrs, self.hostnames))
        for i, ns in enumerate(self.namespaces):
            self._build_host(i, ns, etc_hosts, net.prefixlen)

    def _build_host(self, i: int, ns: str, etc_hosts: str, prefixlen: int) -> None:
        # ip netns exec bind-mounts /etc/netns/NS/* over /etc: names resolve without DNS.
        etc = os.path.join(_NETNS_ETC, ns)
        os.makedirs(etc, exist_ok=True)
        with open(os.path.join(etc, "hosts"), "w") as f:
            f.write(etc_hosts)
        with open(os.path.join(etc, "resolv.conf"), "w") as f:
            f.write("# no DNS inside the test hosts\n")
        with open(os.path.join(etc, "hostname"), "w") as f:
            f.write(self.hostnames[i] + "\n")
        sh(["ip", "netns", "add", ns])
        outer, inner = self.veths[i], f"hvi{self.tag}x{i}"
        sh(["ip", "link", "add", outer, "type", "veth", "peer", "name", inner])
        sh(["ip", "link", "set", inner, "netns", ns])
        sh(["ip", "-n", ns, "link", "set", inner, "name", "eth0"])
        sh(["ip", "-n", ns, "addr", "add", f"{self.addrs[i]}/{prefixlen}", "dev", "eth0"])
        sh(["ip", "-n", ns, "link", "set", "lo", "up"])
        sh(["ip", "-n", ns, "link", "set", "eth0", "up"])
        sh(["ip", "link", "set", outer, "master", self.bridge])
        sh(["ip", "link", "set", outer, "up"])
        sh(["ip", "-n", ns, "route", "add", "default", "via", self.bridge_addr])
        qdisc = self.shape.qdisc_args()
        if qdisc:  # both directions: host -> bridge and bridge -> host
            self._shape(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0",
                         "root", *qdisc])
            self._shape(["tc", "qdisc", "add", "dev", outer, "root", *qdisc])
    def _shape(self, argv: list[str]) -> None:
        done = sh(argv, check=False)
        if done.returncode == 0:
            return
        if "netem" in argv and "unknown" in done.stderr:
            raise HarnessError(
                f"cannot add a delay of {self.shape.delay}: this kernel has no netem qdisc "
                "(sch_netem); shape the bandwidth alone (no delay) or use a kernel with netem")
        raise HarnessError(f"{' '.join(argv)} failed: {done.stderr.strip()}")

    def add_network(self, iface: str) -> list[str]:
        """Join every host to a second bridge through interface ``iface``; its addresses.

        A host then has two interfaces that reach the other hosts (``eth0`` and
        ``iface``): what interface selection chooses between.
        """
        net = self._pick_subnet()
        hosts = list(net.hosts())
        bridge = f"hvb{self.tag}n{len(self._extra_bridges) + 1}"
        sh(["ip", "link", "add", bridge, "type", "bridge"])
        self._extra_bridges.append(bridge)
        sh(["ip", "link", "set", bridge, "up"])
        addrs = [str(hosts[10 + i]) for i in range(self.count)]
        for i, ns in enumerate(self.namespaces):
            outer = f"hvv{self.tag}n{len(self._extra_bridges)}x{i}"
            self._extra_veths.append(outer)
            sh(["ip", "link", "add", outer, "type", "veth", "peer", "name", iface,
                 "netns", ns])
            sh(["ip", "-n", ns, "addr", "add", f"{addrs[i]}/{net.prefixlen}", "dev", iface])
            sh(["ip", "-n", ns, "link", "set", iface, "up"])
            sh(["ip", "link", "set", outer, "master", bridge])
            sh(["ip", "link", "set", outer, "up"])
        self.interfaces[iface] = addrs
        return addrs

    def add_dummy(self, iface: str) -> list[str]:
        """Give every host an interface ``iface`` with an address no other host can reach."""
        addrs = []
        for i, ns in enumerate(self.namespaces):
            addr = f"172.31.{i + 1}.1"
            # A veth pair with both ends here (some kernels have no dummy interfaces).
            sh(["ip", "-n", ns, "link", "add", iface, "type", "veth", "peer", "name",
                 f"{iface[:12]}p"])
            sh(["ip", "-n", ns, "link", "set", f"{iface[:12]}p", "up"])
            sh(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", iface])
            sh(["ip", "-n", ns, "link", "set", iface, "up"])
            addrs.append(addr)
        self.interfaces[iface] = addrs
        return addrs

    # ------------------------------------------------------------------ use
    def argv(self, i: int, command: Sequence[str]) -> list[str]:
        """``command`` wrapped to run on host ``i``: its namespace, hostname and /dev/shm."""
        setup = (f"hostname {self.hostnames[i]} && "
                 "mount -t tmpfs -o size=2g,mode=1777 hvdshm /dev/shm && exec \"$@\"")
        return ["ip", "netns", "exec", self.namespaces[i], "unshare", "--uts", "--mount",
                "sh", "-c", setup, "sh", *command]

    def joined_argv(self, i: int, command: Sequence[str]) -> list[str]:
        """``command`` wrapped to run on host ``i`` inside its one long-lived set of
        namespaces, so that every process run this way on a host shares its /dev/shm
        (``argv`` gives each command a fresh one)."""
        holder = self._holders.get(i)
        if holder is None or holder.poll() is not None:
            holder = self._holders[i] = self.popen(i, ["sleep", "infinity"])
            deadline = time.monotonic() + 10
            while not self._entered(holder.pid, i):
                if time.monotonic() > deadline or holder.poll() is not None:
                    raise HarnessError(f"the namespace holder of {self.hostnames[i]} did not "
                                       "start")
                time.sleep(0.05)
        return ["nsenter", "-t", str(holder.pid), "-m", "-u", "-n", *command]

    def _entered(self, pid: int, i: int) -> bool:
        # The holder has exec'd its way into sleep (after hostname and mount): ready.
        try:
            with open(f"/proc/{pid}/comm") as f:
                return f.read().strip() == "sleep"
        except OSError:
            return False

    def popen(self, i: int, command: Sequence[str], env: dict[str, str] | None = None,
              log_path: str | None = None, **kwargs: Any) -> subprocess.Popen:
        """Start ``command`` on host ``i`` in its own process group (see ``stop``)."""
        out: Any = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            return subprocess.Popen(
                self.argv(i, command), env=env, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT if log_path else subprocess.DEVNULL,
                start_new_session=True, **kwargs)
        finally:
            if log_path:
                out.close()

    def run(self, i: int, command: Sequence[str], timeout: float = _CMD_TIMEOUT_S
            ) -> subprocess.CompletedProcess:
        """Run ``command`` on host ``i`` to completion (with a deadline)."""
        return subprocess.run(self.argv(i, command), capture_output=True, text=True,
                              timeout=timeout)

    def set_link(self, i: int, up: bool) -> None:
        """Take host ``i``'s link down (it is cut off from every other host) or up."""
        sh(["ip", "link", "set", self.veths[i], "up" if up else "down"])

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Remove the namespaces (their links go with them), the bridge and /etc/netns files."""
        if not self._started:
            return
        self._started = False
        for holder in self._holders.values():
            stop(holder)
        self._holders.clear()
        for ns in self.namespaces:
            sh(["ip", "netns", "del", ns], check=False)
            shutil.rmtree(os.path.join(_NETNS_ETC, ns), ignore_errors=True)
        # Normally gone with their namespace's peer, but the kernel frees a deleted
        # namespace later: delete them now so nothing outlives close().
        for veth in [*self.veths, *self._extra_veths]:
            if os.path.exists(f"/sys/class/net/{veth}"):
                sh(["ip", "link", "del", veth], check=False)
        for bridge in [self.bridge, *self._extra_bridges]:
            sh(["ip", "link", "del", bridge], check=False)
        self._extra_bridges.clear()
        self._extra_veths.clear()

    def __enter__(self) -> NetnsHosts:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def stop(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM ``proc``'s process group, then SIGKILL it after ``grace`` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, grace)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def free_port(addr: str) -> int:
    """A TCP port free on ``addr`` right now."""
    with socket.socket() as sock:
        sock.bind((addr, 0))
        return sock.getsockname()[1]
