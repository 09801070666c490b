"""Frozen, validated configuration objects.

Values come from the environment the launchers set (``from_env``); each dataclass
checks itself in ``__post_init__`` so a bad value fails at start-up with its name.
"""

from __future__ import annotations

import dataclasses
import math
import os
import secrets
import socket

from hvd_spark import _env
from hvd_spark.errors import ConfigError

DEFAULT_TIMEOUT_S = 600.0
DEFAULT_START_TIMEOUT_S = 600.0
DEFAULT_FUSION_THRESHOLD = 64 * 1024 * 1024
DEFAULT_CYCLE_TIME_MS = 1.0
DEFAULT_CHUNK_BYTES = 1024 * 1024
# Allreduces up to this size travel with their negotiation messages (see EngineConfig).
DEFAULT_EAGER_BYTES = 64 * 1024
# A synchronous allreduce waits alone (nothing submitted after it can join its ring), so it
# rides up to EAGER_BUDGET_BYTES / (size - 1), never below DEFAULT_EAGER_BYTES: rank 0's
# negotiation carries size - 1 tensors in and results out where a ring moves each rank's
# tensor about twice. Measured on one host, 2 ranks: 0.81-0.83x the ring's time at
# 128-256 KB, 0.94x (in place) to 1.12x (out of place) at 512 KB, so the crossover is near
# 512 KB there and the budget stops short of it. Asynchronous and grouped ones keep
# DEFAULT_EAGER_BYTES: many of them fuse into one ring pass, which beat riding at 512 KB
# (the ResNet-50 set grouped: 5-15% slower with the larger limit).
EAGER_BUDGET_BYTES = 256 * 1024
DEFAULT_OUTPUT_POOL_BYTES = 512 * 1024 * 1024
# A rank waiting for its operation polls this long before it sleeps in the kernel: a
# wake-up from a sleep costs 50-140 us on a VM, a poll a microsecond or two.
DEFAULT_SPIN_US = 1000.0
# Two ranks on one host: the largest synchronous allreduce whose tensor crosses through
# shared memory with its request (collectives.tcp.express_lane); each rank maps two
# buffers of it for sending. Each rank reduces the whole tensor, where the ring reduces
# half: at 8 MB the lane still won here, at 16 MB the ring did (alternating runs).
DEFAULT_EXPRESS_LANE_BYTES = 4 * 1024 * 1024
# All ranks on one host: an allreduce's piece in the host arena (collectives.tcp.arena).
# 1 MB beat 4 MB from 4 MB up with 2-4 ranks (it stays in cache); 512 KB did no better.
DEFAULT_ARENA_BYTES = 1024 * 1024
DEFAULT_STALL_WARNING_S = 60.0
TIMELINE_DYNAMIC = "DYNAMIC"  # HOROVOD_TIMELINE's value for "no file yet: start_timeline() later"
# Horovod's autotuning defaults (samples per candidate is its fixed SAMPLES).
DEFAULT_AUTOTUNE_WARMUP_SAMPLES = 3
DEFAULT_AUTOTUNE_STEPS_PER_SAMPLE = 10
DEFAULT_AUTOTUNE_SAMPLES = 5
DEFAULT_AUTOTUNE_MAX_CANDIDATES = 20
DEFAULT_AUTOTUNE_MARGIN = 0.05
# Largest ring chunk the autotuner tries (hvd_spark.collectives.autotune.CHUNK_GRID's).
AUTOTUNE_MAX_CHUNK_BYTES = 4 << 20


@dataclasses.dataclass(frozen=True)
class AutotuneConfig:
    """How rank 0 tunes fusion threshold, cycle time and chunk size (see ``autotune``).

    Attributes:
        warmup_samples: Samples discarded before the first score.
        steps_per_sample: Training steps per sample (a step ends where a tensor name
            comes round again).
        samples: Samples per candidate; its score is their median.
        max_candidates: Most parameter sets measured before the best is frozen.
        margin: Relative gain a candidate needs over the best so far (noise).
        log_path: CSV file of every candidate's score and the choice ("" : none).
        fixed: Parameters the user set explicitly: they are not tuned.
    """

    warmup_samples: int = DEFAULT_AUTOTUNE_WARMUP_SAMPLES
    steps_per_sample: int = DEFAULT_AUTOTUNE_STEPS_PER_SAMPLE
    samples: int = DEFAULT_AUTOTUNE_SAMPLES
    max_candidates: int = DEFAULT_AUTOTUNE_MAX_CANDIDATES
    margin: float = DEFAULT_AUTOTUNE_MARGIN
    log_path: str = ""
    fixed: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        for value, least, name in (
                (self.warmup_samples, 0, _env.AUTOTUNE_WARMUP_SAMPLES),
                (self.steps_per_sample, 1, _env.AUTOTUNE_STEPS_PER_SAMPLE),
                (self.samples, 1, _env.AUTOTUNE_SAMPLES),
                (self.max_candidates, 1, _env.AUTOTUNE_MAX_CANDIDATES)):
            if value < least:
                raise ConfigError(f"{_env.source(name)} must be >= {least}, got {value}")
        if not 0 <= self.margin < 1:
            raise ConfigError(f"the autotune margin must be in [0, 1), got {self.margin}")

    @classmethod
    def from_env(cls) -> AutotuneConfig | None:
        """The settings when HVD_SPARK_AUTOTUNE / HOROVOD_AUTOTUNE is on, else None."""
        if not _env.get_bool(_env.AUTOTUNE):
            return None
        knobs = {"fusion_threshold": _env.FUSION_THRESHOLD, "cycle_time_ms": _env.CYCLE_TIME,
                 "chunk_bytes": _env.CHUNK_BYTES}
        return cls(
            warmup_samples=_env.get_int(_env.AUTOTUNE_WARMUP_SAMPLES,
                                        DEFAULT_AUTOTUNE_WARMUP_SAMPLES),
            steps_per_sample=_env.get_int(_env.AUTOTUNE_STEPS_PER_SAMPLE,
                                          DEFAULT_AUTOTUNE_STEPS_PER_SAMPLE),
            samples=_env.get_int(_env.AUTOTUNE_SAMPLES, DEFAULT_AUTOTUNE_SAMPLES),
            max_candidates=_env.get_int(_env.AUTOTUNE_MAX_CANDIDATES,
                                        DEFAULT_AUTOTUNE_MAX_CANDIDATES),
            log_path=_env.get_str(_env.AUTOTUNE_LOG, "") or "",
            fixed=frozenset(k for k, var in knobs.items() if _env.lookup(var) is not None),
        )


def usable_cpus(cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup",
                ) -> int:
    """The CPUs this process can use at once: its affinity, capped by its cgroup's CPU quota.

    A container's CPU limit (Kubernetes ``resources.limits.cpu``, YARN with CGroups,
    ``docker --cpus``) is a quota, not an affinity: ``os.cpu_count()`` and the affinity
    still show the whole node, and ranks that spin on a quota smaller than their number
    take each other's time.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root, proc_cgroup)
    return cpus if quota is None else max(1, min(cpus, math.ceil(quota)))


def cgroup_cpu_quota(cgroup_root: str = "/sys/fs/cgroup",
                     proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """CPUs' worth of time per period that this process's cgroup (and those above it)
    allow, from cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``; None without a quota."""
    try:
        with open(proc_cgroup) as f:
            entries = [line.strip().split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        return None
    for _, controllers, path in entries:
        if controllers == "":  # v2: one hierarchy
            mount, read = cgroup_root, _quota_v2
        elif "cpu" in controllers.split(","):
            mount, read = os.path.join(cgroup_root, "cpu"), _quota_v1
        else:
            continue
        # With a cgroup namespace the path is "/" and the mount is this cgroup; without
        # one the mount is the host's root and the path leads down to this cgroup.
        leaf = os.path.join(mount, path.lstrip("/"))
        folder = leaf if os.path.isdir(leaf) else mount
        quotas = []
        while True:  # the tightest quota on the way up to the mount applies
            quota = read(folder)
            if quota is not None:
                quotas.append(quota)
            if os.path.normpath(folder) == os.path.normpath(mount):
                break
            folder = os.path.dirname(folder)
        return min(quotas) if quotas else None
    return None


def _quota_v2(folder: str) -> float | None:
    try:
        with open(os.path.join(folder, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _quota_v1(folder: str) -> float | None:
    try:
        with open(os.path.join(folder, "cpu.cfs_quota_us")) as f:
            quota = int(f.read())
        with open(os.path.join(folder, "cpu.cfs_period_us")) as f:
            period = int(f.read())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the collectives engine batches and waits.

    Attributes:
        timeout: Seconds any collective may wait for its peers before failing.
        fusion_threshold: Most bytes of allreduce tensors executed as one fused operation.
        cycle_time_ms: Most milliseconds the coordinator waits, after a tensor is ready
            on all ranks, for other half-submitted tensors to join the same fused
            operation (a lone operation never waits).
        chunk_bytes: Bytes per pipelined ring chunk at start (see ``slot_bytes``).
        use_shm: Use shared memory between ranks on the same host.
        stall_warning: Seconds after which a tensor some ranks have not submitted is logged
            (``math.inf``: never, as with HOROVOD_STALL_CHECK_DISABLE=1).
        stall_shutdown: Seconds after which such a stalled tensor fails the job
            (0: never, Horovod's default).
        timeline_path: Chrome-trace timeline file to write from ``init()`` ("" : none).
        timeline_mark_cycles: Mark each engine cycle in the timeline.
        timeline_dynamic: The timeline variable was ``DYNAMIC``: no file at start,
            ``start_timeline()`` opens one later (Horovod requires this to call it).
        eager_bytes: Allreduces of CPU tensors up to this many bytes ride on the
            negotiation: every rank sends its tensor with its request, rank 0 reduces
            them in rank order and sends the result with the response, so a small
            allreduce costs one round trip instead of a round trip plus a ring (0: off;
            None: the defaults, see ``eager_limit``).
        autotune: Tune fusion threshold, cycle time and chunk size on rank 0 from measured
            throughput (None: off).
        spin_us: Microseconds a thread waiting for its operation polls its sockets before
            it blocks (0: block at once). None: ``DEFAULT_SPIN_US`` unless this host has
            more ranks than CPUs, where a spinning rank would take a CPU from the rank it
            waits for (see ``spin_seconds``).
        express_lane_bytes: With two ranks on one host, a synchronous CPU allreduce up to
            this many bytes crosses through shared memory with its request and both ranks
            reduce it at once, no ring (0: off; see ``collectives.tcp.express_lane``).
        arena_bytes: With 3+ ranks all on one host, CPU allreduces go through shared memory
            all ranks map, in pieces of this many bytes, instead of the ring (0: off; see
            ``collectives.tcp.arena``).
    """

    timeout: float = DEFAULT_TIMEOUT_S
    fusion_threshold: int = DEFAULT_FUSION_THRESHOLD
    cycle_time_ms: float = DEFAULT_CYCLE_TIME_MS
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    use_shm: bool = True
    stall_warning: float = DEFAULT_STALL_WARNING_S
    stall_shutdown: float = 0.0
    timeline_path: str = ""
    timeline_mark_cycles: bool = False
    timeline_dynamic: bool = False
    eager_bytes: int | None = None
    output_pool_bytes: int = DEFAULT_OUTPUT_POOL_BYTES
    autotune: AutotuneConfig | None = None
    spin_us: float | None = None
    express_lane_bytes: int = DEFAULT_EXPRESS_LANE_BYTES
    arena_bytes: int = DEFAULT_ARENA_BYTES

    def spin_seconds(self, local_ranks: int) -> float:
        """How long a waiting caller polls before blocking, with ``local_ranks`` ranks on
        this host: the setting, else the default where every rank has a CPU, else 0."""
        if self.spin_us is not None:
            return self.spin_us / 1e6
        return DEFAULT_SPIN_US / 1e6 if local_ranks <= usable_cpus() else 0.0

    def eager_limit(self, size: int, lone: bool = False) -> int:
        """The largest eager allreduce in a job of ``size`` ranks: the setting, else
        ``DEFAULT_EAGER_BYTES``, or for a ``lone`` (synchronous) one
        ``EAGER_BUDGET_BYTES / (size - 1)`` and at least that."""
        if self.eager_bytes is not None:
            return self.eager_bytes
        if not lone:
            return DEFAULT_EAGER_BYTES
        return max(DEFAULT_EAGER_BYTES, EAGER_BUDGET_BYTES // max(1, size - 1))

    @property
    def slot_bytes(self) -> int:
        """The shared-memory slot size: the chunk, or the largest chunk the autotuner may
        choose (slots are sized once, at setup; a chunk must fit one)."""
        if self.autotune is not None and "chunk_bytes" not in self.autotune.fixed:
            return max(self.chunk_bytes, AUTOTUNE_MAX_CHUNK_BYTES)
        return self.chunk_bytes

    def __post_init__(self) -> None:
        # Messages name the variable that supplied the value (ours or Horovod's).
        if self.timeout <= 0:
            raise ConfigError(
                f"{_env.source(_env.TIMEOUT)} must be positive seconds, got {self.timeout}")
        if self.fusion_threshold < 0:
            raise ConfigError(f"{_env.source(_env.FUSION_THRESHOLD)} must be >= 0 bytes, "
                              f"got {self.fusion_threshold}")
        if self.cycle_time_ms < 0:
            raise ConfigError(
                f"{_env.source(_env.CYCLE_TIME)} must be >= 0 ms, got {self.cycle_time_ms}")
        if self.eager_bytes is not None and self.eager_bytes < 0:
            raise ConfigError(f"{_env.EAGER_BYTES} must be >= 0 bytes (0: off), "
                              f"got {self.eager_bytes}")
        if self.output_pool_bytes < 0:
            raise ConfigError(f"{_env.OUTPUT_POOL_BYTES} must be >= 0 bytes (0: off), "
                              f"got {self.output_pool_bytes}")
        if self.spin_us is not None and not 0 <= self.spin_us <= 1e6:
            raise ConfigError(f"{_env.SPIN_US} must be 0..1000000 microseconds (0: never "
                              f"spin), got {self.spin_us}")
        if self.express_lane_bytes < 0:
            raise ConfigError(f"{_env.EXPRESS_LANE_BYTES} must be >= 0 bytes (0: off), "
                              f"got {self.express_lane_bytes}")
        if self.arena_bytes != 0 and self.arena_bytes < 4096:
            raise ConfigError(f"{_env.ARENA_BYTES} must be at least 4096 bytes (0: off), "
                              f"got {self.arena_bytes}")
        if self.chunk_bytes < 4096:
            raise ConfigError(f"{_env.CHUNK_BYTES} must be at least 4096, got {self.chunk_bytes}")
        if not self.stall_warning > 0:
            raise ConfigError(f"{_env.source(_env.STALL_WARNING)} must be positive seconds, "
                              f"got {self.stall_warning}")
        if self.stall_shutdown < 0:
            raise ConfigError(f"{_env.source(_env.STALL_SHUTDOWN)} must be >= 0 seconds "
                              f"(0: never), got {self.stall_shutdown}")
        if 0 < self.stall_shutdown < self.stall_warning:
            raise ConfigError(
                f"{_env.source(_env.STALL_SHUTDOWN)}={self.stall_shutdown:g} is shorter than the "
                f"stall warning time ({self.stall_warning:g} s, "
                f"{_env.source(_env.STALL_WARNING)}): make it at least as long, or 0 for never")

    @classmethod
    def from_env(cls) -> EngineConfig:
        """Build the configuration from HVD_SPARK_* variables (Horovod's names where ours
        are unset), defaults elsewhere."""
        stall_off = _env.get_bool(_env.STALL_CHECK_DISABLE)
        timeline = _env.get_str(_env.TIMELINE, "") or ""
        dynamic = timeline.strip() == TIMELINE_DYNAMIC
        return cls(
            timeout=_env.get_float(_env.TIMEOUT, DEFAULT_TIMEOUT_S),
            fusion_threshold=_env.get_int(_env.FUSION_THRESHOLD, DEFAULT_FUSION_THRESHOLD),
            cycle_time_ms=_env.get_float(_env.CYCLE_TIME, DEFAULT_CYCLE_TIME_MS),
            chunk_bytes=_env.get_int(_env.CHUNK_BYTES, DEFAULT_CHUNK_BYTES),
            use_shm=not _env.get_bool(_env.DISABLE_SHM),
            stall_warning=(math.inf if stall_off
                           else _env.get_float(_env.STALL_WARNING, DEFAULT_STALL_WARNING_S)),
            stall_shutdown=0.0 if stall_off else _env.get_float(_env.STALL_SHUTDOWN, 0.0),
            timeline_path="" if dynamic else timeline,
            timeline_mark_cycles=_env.get_bool(_env.TIMELINE_MARK_CYCLES),
            timeline_dynamic=dynamic,
            eager_bytes=_env.get_int(_env.EAGER_BYTES, None),
            output_pool_bytes=_env.get_int(_env.OUTPUT_POOL_BYTES, DEFAULT_OUTPUT_POOL_BYTES),
            autotune=AutotuneConfig.from_env(),
            spin_us=_env.get_float(_env.SPIN_US, None),
            express_lane_bytes=_env.get_int(_env.EXPRESS_LANE_BYTES,
                                            DEFAULT_EXPRESS_LANE_BYTES),
            arena_bytes=_env.get_int(_env.ARENA_BYTES, DEFAULT_ARENA_BYTES),
        )


# Set by other launchers (horovodrun, mpirun, torchrun): ranks started by them cannot
# join an hvd_spark job, and must not silently train alone as one-rank jobs.
_FOREIGN_SIZE_VARS = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "WORLD_SIZE")


@dataclasses.dataclass(frozen=True)
class RankPlace:
    """Where one rank sits in the job: what a launcher assigns (``runner.rendezvous.RankInfo``)
    and what the rank itself reads back (``WorldInfo``).

    Attributes:
        rank: Global rank, 0..size-1.
        size: Number of ranks.
        local_rank: Rank among the ranks on this host.
        local_size: Number of ranks on this host.
        cross_rank: Index of this host among the hosts (ranks with the same local_rank).
        cross_size: Number of hosts.
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ConfigError(f"{_env.SIZE} must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ConfigError(f"{_env.RANK}={self.rank} is outside 0..{self.size - 1}")
        if not 0 <= self.local_rank < self.local_size:
            raise ConfigError(
                f"{_env.LOCAL_RANK}={self.local_rank} is outside 0..{self.local_size - 1}"
            )
        if not 0 <= self.cross_rank < self.cross_size:
            raise ConfigError(
                f"{_env.CROSS_RANK}={self.cross_rank} is outside 0..{self.cross_size - 1}"
            )

    def variables(self, hostname: str) -> dict[str, str]:
        """This place under every name a launcher exports (``_env.rank_variables``)."""
        return _env.rank_variables(self.rank, self.size, self.local_rank, self.local_size,
                                   self.cross_rank, self.cross_size, hostname)


@dataclasses.dataclass(frozen=True)
class WorldInfo(RankPlace):
    """Where this process sits in the job, as the launcher assigned it (its ``RankPlace``)
    and how it reaches the others.

    Attributes:
        rendezvous_addr: ``host:port`` of the launcher's authenticated rendezvous store
            ("" when standalone).
        secret: The job's random secret (bytes); proves membership on every connection.
        hostname: Name used to group ranks by host.
        advertise_addr: Address peers should dial to reach this rank; empty means the
            local address of the connection to the rendezvous store.
        standalone: No launcher started this process (a plain ``python train.py``):
            a one-rank job with nobody to connect to.
    """

    rendezvous_addr: str
    secret: bytes
    hostname: str
    advertise_addr: str = ""
    standalone: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.secret) < 16:
            raise ConfigError(f"{_env.SECRET} must hold at least 16 random bytes (hex encoded)")
        if self.standalone and self.size != 1:
            raise ConfigError(f"a standalone world has one rank, got size={self.size}")

    @classmethod
    def standalone_world(cls) -> WorldInfo:
        """The one-rank world of a process no launcher started."""
        return cls(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1,
                   rendezvous_addr="", secret=secrets.token_bytes(32),
                   hostname=socket.gethostname(), advertise_addr="", standalone=True)

    @classmethod
    def from_env(cls) -> WorldInfo:
        """Read the launcher-set variables.

        With none of them set (no launcher), this is a standalone one-rank world, as
        in Horovod, unless another launcher's variables say there are more ranks.

        Raises:
            ConfigError: A launcher variable is missing or malformed (naming it), or the
                process was started by another launcher for more than one rank.
        """
        if not any(_env.get_str(var) for var in _env.LAUNCHER_VARS):
            _refuse_foreign_launcher()
            return cls.standalone_world()
        size = _env_int(_env.SIZE)
        rank = _env_int(_env.RANK)
        secret_hex = _env.require_str(_env.SECRET)
        try:
            secret = bytes.fromhex(secret_hex)
        except ValueError:
            raise ConfigError(f"{_env.SECRET} is not hex-encoded") from None
        return cls(
            rank=rank,
            size=size,
            local_rank=_env.get_int(_env.LOCAL_RANK, rank),
            local_size=_env.get_int(_env.LOCAL_SIZE, size),
            cross_rank=_env.get_int(_env.CROSS_RANK, 0),
            cross_size=_env.get_int(_env.CROSS_SIZE, 1),
            rendezvous_addr=_env.require_str(_env.RENDEZVOUS_ADDR),
            secret=secret,
            hostname=_env.get_str(_env.HOSTNAME) or socket.gethostname(),
            advertise_addr=advertise_addr(),
        )


def _env_int(name: str) -> int:
    value = _env.require_str(name)
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer") from None


def _refuse_foreign_launcher() -> None:
    for var in _FOREIGN_SIZE_VARS:
        value = _env.get_str(var) or ""
        if value.strip().isdigit() and int(value) > 1:
            raise ConfigError(
                f"{var}={value} says another launcher started this process as one of "
                f"{value} ranks, but hvd_spark ranks must be started by hvdrun, "
                "hvd_spark.run or hvd_spark.runner.run_local (e.g. hvdrun -np "
                f"{value} python train.py); without them each process would train alone")


def advertise_addr() -> str:
    """HVD_SPARK_ADVERTISE_ADDR, else the IPv4 address of HVD_SPARK_IFACE /
    HOROVOD_GLOO_IFACE, else "" (the address the rendezvous store sees)."""
    addr = _env.get_str(_env.ADVERTISE_ADDR)
    if addr:
        return addr
    found = _env.lookup(_env.IFACE)
    if found is None:
        return ""
    var, names = found
    for name in (n.strip() for n in names.split(",")):
        address = interface_address(name)
        if address:
            return address
    known = [name for _, name in socket.if_nameindex()]
    raise ConfigError(
        f"{var}={names!r}: no such network interface with an IPv4 address on "
        f"{socket.gethostname()}; interfaces here: {known}")


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` ("" when it has none or is unknown)."""
    import fcntl
    import struct

    siocgifaddr = 0x8915  # Linux ioctl: get the interface's address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), siocgifaddr,
                                 struct.pack("256s", name.encode()[:15]))
        except OSError:
            return ""
    return socket.inet_ntoa(packed[20:24])
