"""Frozen, validated configuration objects.

Values come from the environment the launchers set (``from_env``); each dataclass
checks itself in ``__post_init__`` so a bad value fails at start-up with its name.
"""

from __future__ import annotations

import dataclasses

from hvd_spark import _env
from hvd_spark.errors import ConfigError

DEFAULT_TIMEOUT_S = 600.0
DEFAULT_START_TIMEOUT_S = 600.0
DEFAULT_FUSION_THRESHOLD = 64 * 1024 * 1024
DEFAULT_CYCLE_TIME_MS = 1.0
DEFAULT_CHUNK_BYTES = 1024 * 1024
DEFAULT_STALL_WARNING_S = 60.0


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the collectives engine batches and waits.

    Attributes:
        timeout: Seconds any collective may wait for its peers before failing.
        fusion_threshold: Most bytes of allreduce tensors executed as one fused operation.
        cycle_time_ms: Most milliseconds the coordinator waits, after a tensor is ready
            on all ranks, for other half-submitted tensors to join the same fused
            operation (a lone operation never waits).
        chunk_bytes: Bytes per pipelined ring chunk (also the shared-memory slot size).
        use_shm: Use shared memory between ranks on the same host.
        stall_warning: Seconds after which a tensor some ranks have not submitted is logged.
    """

    timeout: float = DEFAULT_TIMEOUT_S
    fusion_threshold: int = DEFAULT_FUSION_THRESHOLD
    cycle_time_ms: float = DEFAULT_CYCLE_TIME_MS
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    use_shm: bool = True
    stall_warning: float = DEFAULT_STALL_WARNING_S

    def __post_init__(self) -> None:
        if self.timeout <= 0:
            raise ConfigError(f"{_env.TIMEOUT} must be positive seconds, got {self.timeout}")
        if self.fusion_threshold < 0:
            raise ConfigError(
                f"{_env.FUSION_THRESHOLD} must be >= 0 bytes, got {self.fusion_threshold}"
            )
        if self.cycle_time_ms < 0:
            raise ConfigError(f"{_env.CYCLE_TIME} must be >= 0 ms, got {self.cycle_time_ms}")
        if self.chunk_bytes < 4096:
            raise ConfigError(f"{_env.CHUNK_BYTES} must be at least 4096, got {self.chunk_bytes}")

    @classmethod
    def from_env(cls) -> EngineConfig:
        """Build the configuration from HVD_SPARK_* variables, defaults elsewhere."""
        return cls(
            timeout=_env.get_float(_env.TIMEOUT, DEFAULT_TIMEOUT_S),
            fusion_threshold=_env.get_int(_env.FUSION_THRESHOLD, DEFAULT_FUSION_THRESHOLD),
            cycle_time_ms=_env.get_float(_env.CYCLE_TIME, DEFAULT_CYCLE_TIME_MS),
            chunk_bytes=_env.get_int(_env.CHUNK_BYTES, DEFAULT_CHUNK_BYTES),
            use_shm=not _env.get_bool(_env.DISABLE_SHM),
            stall_warning=_env.get_float(_env.STALL_WARNING, DEFAULT_STALL_WARNING_S),
        )


@dataclasses.dataclass(frozen=True)
class WorldInfo:
    """Where this process sits in the job, as the launcher assigned it.

    Attributes:
        rank: Global rank, 0..size-1.
        size: Number of ranks.
        local_rank: Rank among the ranks on this host.
        local_size: Number of ranks on this host.
        cross_rank: Index of this host among the hosts (ranks with the same local_rank).
        cross_size: Number of hosts.
        rendezvous_addr: ``host:port`` of the launcher's authenticated rendezvous store.
        secret: The job's random secret (bytes); proves membership on every connection.
        hostname: Name used to group ranks by host.
        advertise_addr: Address peers should dial to reach this rank; empty means the
            local address of the connection to the rendezvous store.
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    rendezvous_addr: str
    secret: bytes
    hostname: str
    advertise_addr: str = ""

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
        if len(self.secret) < 16:
            raise ConfigError(f"{_env.SECRET} must hold at least 16 random bytes (hex encoded)")

    @classmethod
    def from_env(cls) -> WorldInfo:
        """Read the launcher-set variables; a ConfigError says which one is missing."""
        import socket

        size = int(_env.require_str(_env.SIZE))
        rank = int(_env.require_str(_env.RANK))
        try:
            secret = bytes.fromhex(_env.require_str(_env.SECRET))
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
            advertise_addr=_env.get_str(_env.ADVERTISE_ADDR) or "",
        )
