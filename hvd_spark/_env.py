"""Every environment variable the package reads, named once and read at the edges.

Launchers write the ``HVD_SPARK_*`` rank variables for each rank (and Horovod's and
torch's names for tools that read those); the collectives read them in ``init()``.
Users tune the engine through the other ``HVD_SPARK_*`` variables or, for code
ported from Horovod, through Horovod's ``HOROVOD_*`` names: a Horovod name is read
only where its ``HVD_SPARK_*`` counterpart is unset (see ``HOROVOD_FALLBACKS``).
A ``HOROVOD_*`` setting this package cannot honour is named in one warning
(``warn_unsupported_horovod_vars``).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from hvd_spark.errors import ConfigError

# Set by the launchers (hvdrun / hvd_spark.run) for every rank.
RANK = "HVD_SPARK_RANK"
SIZE = "HVD_SPARK_SIZE"
LOCAL_RANK = "HVD_SPARK_LOCAL_RANK"
LOCAL_SIZE = "HVD_SPARK_LOCAL_SIZE"
CROSS_RANK = "HVD_SPARK_CROSS_RANK"
CROSS_SIZE = "HVD_SPARK_CROSS_SIZE"
RENDEZVOUS_ADDR = "HVD_SPARK_RENDEZVOUS_ADDR"
SECRET = "HVD_SPARK_SECRET"
RUN_ID = "HVD_SPARK_RUN_ID"
HOSTNAME = "HVD_SPARK_HOSTNAME"
ADVERTISE_ADDR = "HVD_SPARK_ADVERTISE_ADDR"
# Set by hvd_spark.run's Spark tasks: the comma-separated GPU addresses Spark gave the
# task ("" for none); the rank has no TaskContext of its own (hvd_spark.task reads it).
TASK_GPUS = "HVD_SPARK_TASK_GPUS"
# Set with them when the rank's GPU is known: the CUDA device index of the rank's own GPU
# under its CUDA_VISIBLE_DEVICES (hvd_spark.task.device_index; the Estimators pin it).
GPU_INDEX = "HVD_SPARK_GPU_INDEX"
# Set by hvd_spark.run's Spark tasks, which start the rank's process while they register:
# the process reads the variables of its rank (rank, host, GPUs) as one JSON line on stdin.
RANK_ENV_ON_STDIN = "HVD_SPARK_RANK_ENV_ON_STDIN"
# "pid:signal": the process that started this one, and the signal to ask for when it dies
# (hvd_spark.runner.tied_child; read and removed by the child).
DIE_WITH_PARENT = "HVD_SPARK_DIE_WITH_PARENT"

# The launcher variables whose absence means "no launcher: a one-rank job".
LAUNCHER_VARS = (RANK, SIZE, RENDEZVOUS_ADDR, SECRET)

# Tuning knobs a user may set.
BACKEND = "HVD_SPARK_BACKEND"
TIMEOUT = "HVD_SPARK_TIMEOUT"
START_TIMEOUT = "HVD_SPARK_START_TIMEOUT"
FUSION_THRESHOLD = "HVD_SPARK_FUSION_THRESHOLD"
CYCLE_TIME = "HVD_SPARK_CYCLE_TIME"
EAGER_BYTES = "HVD_SPARK_EAGER_BYTES"
SPIN_US = "HVD_SPARK_SPIN_US"
EXPRESS_LANE_BYTES = "HVD_SPARK_EXPRESS_LANE_BYTES"
ARENA_BYTES = "HVD_SPARK_ARENA_BYTES"
OUTPUT_POOL_BYTES = "HVD_SPARK_OUTPUT_POOL_BYTES"
CHUNK_BYTES = "HVD_SPARK_CHUNK_BYTES"
DISABLE_SHM = "HVD_SPARK_DISABLE_SHM"
STALL_WARNING = "HVD_SPARK_STALL_WARNING_TIME"
STALL_CHECK_DISABLE = "HVD_SPARK_STALL_CHECK_DISABLE"
STALL_SHUTDOWN = "HVD_SPARK_STALL_SHUTDOWN_TIME"
TIMELINE = "HVD_SPARK_TIMELINE"
TIMELINE_MARK_CYCLES = "HVD_SPARK_TIMELINE_MARK_CYCLES"
LOG_LEVEL = "HVD_SPARK_LOG_LEVEL"
IFACE = "HVD_SPARK_IFACE"
HIERARCHICAL_ALLREDUCE = "HVD_SPARK_HIERARCHICAL_ALLREDUCE"
HEARTBEAT = "HVD_SPARK_HEARTBEAT_S"
# Autotuning (see hvd_spark.collectives.autotune): on/off, its CSV log, its sampling.
AUTOTUNE = "HVD_SPARK_AUTOTUNE"
AUTOTUNE_LOG = "HVD_SPARK_AUTOTUNE_LOG"
AUTOTUNE_WARMUP_SAMPLES = "HVD_SPARK_AUTOTUNE_WARMUP_SAMPLES"
AUTOTUNE_STEPS_PER_SAMPLE = "HVD_SPARK_AUTOTUNE_STEPS_PER_SAMPLE"
AUTOTUNE_SAMPLES = "HVD_SPARK_AUTOTUNE_SAMPLES"
AUTOTUNE_MAX_CANDIDATES = "HVD_SPARK_AUTOTUNE_MAX_CANDIDATES"
# How CUDA tensors travel: nccl (NCCL / CUDA IPC on the device), host (staged), auto.
GPU_BACKEND = "HVD_SPARK_GPU_BACKEND"
# hvdrun's launcher when --mpi is not given: "mpi" starts the ranks with mpirun.
HVDRUN_LAUNCHER = "HVD_SPARK_HVDRUN_LAUNCHER"

# Set by the elastic launchers: the worker joins generations instead of reading a fixed rank.
ELASTIC = "HVD_SPARK_ELASTIC"
#: run(fn, df=...): where the rank's task wrote its share of the DataFrame, and the
#: smallest share's row count (``hvd_spark.data.rank_share``).
SHARE_PATH = "HVD_SPARK_SHARE_PATH"
SHARE_MIN_ROWS = "HVD_SPARK_SHARE_MIN_ROWS"
#: Not a variable: the launcher store's key where a Spark run publishes the smallest share
#: (``("ok", rows)``, or ``("error", why)``) once every task wrote its own, for ranks
#: started without ``SHARE_MIN_ROWS`` (they start while the shares are written).
SHARE_MIN_ROWS_KEY = "share.min_rows"
#: "1": ranks serve ``import horovod...`` through ``hvd_spark.compat`` (HorovodRunner sets it).
HOROVOD_ALIAS = "HVD_SPARK_HOROVOD_ALIAS"
WORKER_ID = "HVD_SPARK_WORKER_ID"
ELASTIC_TIMEOUT = "HVD_SPARK_ELASTIC_TIMEOUT"

# Horovod's worker environment and torch's names, exported by the launchers for
# tools that read them (never read back by this package).
HOROVOD_RANK = "HOROVOD_RANK"
HOROVOD_SIZE = "HOROVOD_SIZE"
HOROVOD_LOCAL_RANK = "HOROVOD_LOCAL_RANK"
HOROVOD_LOCAL_SIZE = "HOROVOD_LOCAL_SIZE"
HOROVOD_CROSS_RANK = "HOROVOD_CROSS_RANK"
HOROVOD_CROSS_SIZE = "HOROVOD_CROSS_SIZE"
HOROVOD_HOSTNAME = "HOROVOD_HOSTNAME"
TORCH_RANK = "RANK"
TORCH_WORLD_SIZE = "WORLD_SIZE"
TORCH_LOCAL_RANK = "LOCAL_RANK"
TORCH_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"


def rank_variables(rank: int, size: int, local_rank: int, local_size: int, cross_rank: int,
                   cross_size: int, hostname: str) -> dict[str, str]:
    """A rank's place in the job under every name a launcher exports.

    Ours (``HVD_SPARK_*``, read by ``init()``), Horovod's worker environment
    (``HOROVOD_RANK``, ...) and torch's (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``LOCAL_WORLD_SIZE``), so tools that read those see the same values.
    """
    values = {
        (RANK, HOROVOD_RANK, TORCH_RANK): rank,
        (SIZE, HOROVOD_SIZE, TORCH_WORLD_SIZE): size,
        (LOCAL_RANK, HOROVOD_LOCAL_RANK, TORCH_LOCAL_RANK): local_rank,
        (LOCAL_SIZE, HOROVOD_LOCAL_SIZE, TORCH_LOCAL_WORLD_SIZE): local_size,
        (CROSS_RANK, HOROVOD_CROSS_RANK): cross_rank,
        (CROSS_SIZE, HOROVOD_CROSS_SIZE): cross_size,
        (HOSTNAME, HOROVOD_HOSTNAME): hostname,
    }
    return {name: str(value) for names, value in values.items() for name in names}


def launcher_variables(rendezvous_addr: str, secret: bytes, heartbeat_s: float,
                       run_id: str) -> dict[str, str]:
    """How a rank reaches its launcher: the store's address, the job's secret, the
    heartbeat limit and the run's id (every launcher's ranks get these, elastic or not)."""
    return {RENDEZVOUS_ADDR: rendezvous_addr, SECRET: secret.hex(), HEARTBEAT: str(heartbeat_s),
            RUN_ID: run_id, "PYTHONUNBUFFERED": "1"}



# torchrun's worker environment beyond the rank's own numbers (``rank_variables``): what
# torch.distributed's env:// rendezvous, Lightning, accelerate and the Trainer read.
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
TORCHRUN_NAMES = (MASTER_ADDR, MASTER_PORT, "GROUP_RANK", "NODE_RANK", "GROUP_WORLD_SIZE",
                  "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_RUN_ID",
                  "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                  "TORCHELASTIC_USE_AGENT_STORE")


def torchrun_variables(*, rank: int, size: int, node_rank: int, num_nodes: int, run_id: str,
                       master_addr: str | None = None, master_port: int | None = None
                       ) -> dict[str, str]:
    """The torchrun variables of one rank besides ``RANK``/``WORLD_SIZE``/``LOCAL_*``.

    Args:
        rank: The rank's global rank (torchrun's ``ROLE_RANK`` equals it: one role).
        size: The number of ranks.
        node_rank: Index of the rank's host among the job's hosts (``GROUP_RANK``, and
            Lightning's ``NODE_RANK``).
        num_nodes: Number of hosts (``GROUP_WORLD_SIZE``).
        run_id: The job's id (``TORCHELASTIC_RUN_ID``).
        master_addr: Rank 0's address as the other ranks reach it; None where the rank
            learns it as it starts (``runner.torch_world.exchange_master``).
        master_port: The port found free on rank 0's host; None likewise.
    """
    values: dict[str, Any] = {
        MASTER_ADDR: master_addr,
        MASTER_PORT: master_port,
        "GROUP_RANK": node_rank,
        "NODE_RANK": node_rank,
        "GROUP_WORLD_SIZE": num_nodes,
        "ROLE_RANK": rank,
        "ROLE_WORLD_SIZE": size,
        "ROLE_NAME": "default",
        "TORCHELASTIC_RUN_ID": run_id,
        # A fixed job: torch.distributed's restarts are ours (the Estimators' recovery).
        "TORCHELASTIC_RESTART_COUNT": 0,
        "TORCHELASTIC_MAX_RESTARTS": 0,
        # No agent hosts a store here: rank 0's init_process_group starts it on MASTER_PORT.
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }
    if master_addr is None or master_port is None:
        del values[MASTER_ADDR], values[MASTER_PORT]
    return {name: str(value) for name, value in values.items()}


# Horovod's names for our knobs, read (first one set wins) where ours is unset.
HOROVOD_FALLBACKS: dict[str, tuple[str, ...]] = {
    TIMEOUT: ("HOROVOD_GLOO_TIMEOUT_SECONDS",),
    START_TIMEOUT: ("HOROVOD_SPARK_START_TIMEOUT", "HOROVOD_START_TIMEOUT"),
    FUSION_THRESHOLD: ("HOROVOD_FUSION_THRESHOLD",),
    CYCLE_TIME: ("HOROVOD_CYCLE_TIME",),
    STALL_WARNING: ("HOROVOD_STALL_CHECK_TIME_SECONDS",),
    STALL_CHECK_DISABLE: ("HOROVOD_STALL_CHECK_DISABLE",),
    STALL_SHUTDOWN: ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",),
    TIMELINE: ("HOROVOD_TIMELINE",),
    TIMELINE_MARK_CYCLES: ("HOROVOD_TIMELINE_MARK_CYCLES",),
    LOG_LEVEL: ("HOROVOD_LOG_LEVEL",),
    IFACE: ("HOROVOD_GLOO_IFACE",),
    HIERARCHICAL_ALLREDUCE: ("HOROVOD_HIERARCHICAL_ALLREDUCE",),
    GPU_BACKEND: ("HOROVOD_GPU_OPERATIONS",),
    ELASTIC_TIMEOUT: ("HOROVOD_ELASTIC_TIMEOUT",),
    AUTOTUNE: ("HOROVOD_AUTOTUNE",),
    AUTOTUNE_LOG: ("HOROVOD_AUTOTUNE_LOG",),
    AUTOTUNE_WARMUP_SAMPLES: ("HOROVOD_AUTOTUNE_WARMUP_SAMPLES",),
    AUTOTUNE_STEPS_PER_SAMPLE: ("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE",),
    # Horovod's cap on Bayesian-optimisation samples caps the candidates here.
    AUTOTUNE_MAX_CANDIDATES: ("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",),
}


def lookup(name: str) -> tuple[str, str] | None:
    """Return ``(variable, value)`` of the first non-empty one of ``name`` and its
    Horovod fallbacks, or None when none is set."""
    for var in (name, *HOROVOD_FALLBACKS.get(name, ())):
        value = os.environ.get(var, "")
        if value:
            return var, value
    return None


def source(name: str) -> str:
    """The variable that supplies ``name``'s value (``name`` itself when none is set)."""
    found = lookup(name)
    return found[0] if found else name


def get_str(name: str, default: str | None = None) -> str | None:
    """Return the variable's value, or ``default`` when unset or empty."""
    found = lookup(name)
    return found[1] if found else default


def require_str(name: str) -> str:
    """Return the variable's value or raise a ConfigError saying who should have set it."""
    value = os.environ.get(name)
    if not value:
        raise ConfigError(
            f"{name} is not set: hvd_spark.collectives.init() must run inside a process started "
            "by hvdrun, hvd_spark.run or hvd_spark.runner.run_local"
        )
    return value


def get_int(name: str, default: int | None) -> int | None:
    """Return the variable as an int, with a ConfigError naming it when it does not parse."""
    found = lookup(name)
    if found is None:
        return default
    var, value = found
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{var}={value!r} is not an integer") from None


def get_float(name: str, default: float | None) -> float | None:
    """Return the variable as a float, with a ConfigError naming it when it does not parse."""
    found = lookup(name)
    if found is None:
        return default
    var, value = found
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{var}={value!r} is not a number") from None


def is_true(value: str) -> bool:
    """True for 1/true/yes/on and for positive integers (Horovod's reading of flags)."""
    value = value.strip().lower()
    if value in ("true", "yes", "on"):
        return True
    try:
        return int(value) > 0
    except ValueError:
        return False


def get_bool(name: str, default: bool = False) -> bool:
    """Return the variable as a bool (1/true/yes/on and positive integers are true)."""
    found = lookup(name)
    return default if found is None else is_true(found[1])


# HOROVOD_LOG_LEVEL's names -> Python levels (TRACE sits below DEBUG, FATAL is CRITICAL).
LOG_LEVELS = {
    "TRACE": 5, "DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING,
    "WARN": logging.WARNING, "ERROR": logging.ERROR, "FATAL": logging.CRITICAL,
    "CRITICAL": logging.CRITICAL,
}


def apply_log_level() -> int | None:
    """Set the ``hvd_spark`` logger's level from HVD_SPARK_LOG_LEVEL / HOROVOD_LOG_LEVEL.

    Returns:
        The level set, or None when neither variable is set (the level is left alone).

    Raises:
        ConfigError: The value is not one of TRACE, DEBUG, INFO, WARNING, ERROR, FATAL.
    """
    found = lookup(LOG_LEVEL)
    if found is None:
        return None
    var, value = found
    level = LOG_LEVELS.get(value.strip().upper())
    if level is None:
        raise ConfigError(
            f"{var}={value!r} is not a log level; use one of TRACE, DEBUG, INFO, WARNING, "
            "ERROR, FATAL")
    logging.getLogger("hvd_spark").setLevel(level)
    return level


# --- HOROVOD_* settings this package cannot honour -------------------------------

# Read by this package (through HOROVOD_FALLBACKS) or meaning what it always does.
_HONOURED = {var for names in HOROVOD_FALLBACKS.values() for var in names} | {
    "HOROVOD_DYNAMIC_PROCESS_SETS",  # process sets can always be added after init()
}
# Written by launchers (ours or horovodrun): they describe the process, they are no settings.
_LAUNCHER_OUTPUTS = {
    HOROVOD_RANK, HOROVOD_SIZE, HOROVOD_LOCAL_RANK, HOROVOD_LOCAL_SIZE, HOROVOD_CROSS_RANK,
    HOROVOD_CROSS_SIZE, HOROVOD_HOSTNAME, "HOROVOD_GLOO_RENDEZVOUS_ADDR",
    "HOROVOD_GLOO_RENDEZVOUS_PORT", "HOROVOD_SECRET_KEY", "HOROVOD_GLOO_GLOBAL_PREFIX",
    "HOROVOD_GLOO_LOCAL_PREFIX", "HOROVOD_GLOO_CROSS_PREFIX", "HOROVOD_GLOO_GET_RANK_AND_SIZE",
    "HOROVOD_ELASTIC",
}
# Read by Horovod's pip build only; images built for Horovod often keep them set.
_BUILD_PREFIXES = (
    "HOROVOD_WITH_", "HOROVOD_WITHOUT_", "HOROVOD_GPU", "HOROVOD_BUILD_", "HOROVOD_CUDA_",
    "HOROVOD_NCCL_", "HOROVOD_ROCM_", "HOROVOD_NVTX_", "HOROVOD_CMAKE", "HOROVOD_DEBUG",
    "HOROVOD_ALLOW_MIXED_GPU_IMPL", "HOROVOD_SKIP_COMPILE", "HOROVOD_LOCAL_VERSION",
    "HOROVOD_CPU_OPERATIONS_DEFAULT",
)
# Flags that are harmless when off (they ask for what this package does anyway).
_FLAGS_WHY = {
    "HOROVOD_HIERARCHICAL_ALLGATHER": "hierarchical allgather is not implemented",
    "HOROVOD_TORUS_ALLREDUCE": "torus allreduce is not implemented",
    "HOROVOD_ENABLE_XLA_OPS": "XLA ops are not provided",
    "HOROVOD_ENABLE_ASYNC_COMPLETION": "a GPU-only option of Horovod's NCCL path",
    "HOROVOD_BATCH_D2D_MEMCOPIES": "a GPU-only option of Horovod's NCCL path",
    "HOROVOD_DISABLE_GROUP_FUSION": "grouped collectives are always fused with others",
    "HOROVOD_MPI_THREADS_DISABLE": "the MPI backend needs MPI threads (its engine runs in a "
                                   "background thread)",
    "HOROVOD_DISABLE_NVTX_RANGES": "no NVTX ranges are emitted",
    "HOROVOD_LOG_HIDE_TIME": "log records go through Python logging: format them with a "
                             "handler",
}
# Settings with a value this package always has; any other value cannot be honoured.
_CHOICES_WHY = {
    "HOROVOD_CONTROLLER": (("gloo", "mpi"), "the controller is hvd_spark's own TCP coordinator, "
                           "or MPI in ranks started by mpirun (hvdrun --mpi)"),
    "HOROVOD_CPU_OPERATIONS": (("gloo", "mpi"), "CPU collectives run on hvd_spark's TCP backend, "
                               "or MPI in ranks started by mpirun (hvdrun --mpi)"),
}
# Settings that always ask for something not there.
_ALWAYS_WHY = {
    "HOROVOD_THREAD_AFFINITY": "the background thread is not pinned",
    # Any value, 0 (Horovod: cache off) included: the MPI cache cannot be turned off or resized.
    "HOROVOD_CACHE_CAPACITY": "the response cache's size is not a setting: the MPI backend's "
                              "cache is always on and holds up to 8192 kinds of request; the TCP "
                              "backend has none (rank 0 decides every round)",
    "HOROVOD_NUM_NCCL_STREAMS": "the NCCL path uses one stream per device",
    "HOROVOD_CCL_CACHE": "there is no oneCCL backend",
    "HOROVOD_ADASUM_MPI_CHUNK_SIZE": "Adasum gathers whole tensors; it is not chunked",
    "HOROVOD_SPARK_USE_LOCAL_RANK_GPU_INDEX": "hvd_spark.run(use_gpu=True) orders each host's "
                                              "GPUs so that device local_rank is the rank's own; "
                                              "the Estimators pin HVD_SPARK_GPU_INDEX",
    "HOROVOD_SPARK_WORK_DIR": "hvd_spark.run needs no work directory",
    "HOROVOD_SPARK_PYTHONPATH": "ranks inherit the executor's Python path",
}
_AUTOTUNE_PREFIX = "HOROVOD_AUTOTUNE_"

_warn_lock = threading.Lock()
_warned = False
log = logging.getLogger("hvd_spark")


def unsupported_horovod_vars(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The ``HOROVOD_*`` settings in ``environ`` this package cannot honour, with why.

    Args:
        environ: The environment to inspect (default ``os.environ``).

    Returns:
        ``{variable: reason}``, sorted by variable name; empty when all are honoured.
    """
    environ = os.environ if environ is None else environ
    found: dict[str, str] = {}
    for var in sorted(v for v in environ if v.startswith("HOROVOD_")):
        value = environ[var]
        if var in _HONOURED or var in _LAUNCHER_OUTPUTS or var.startswith(_BUILD_PREFIXES):
            continue
        if var in _FLAGS_WHY:
            if is_true(value):
                found[var] = _FLAGS_WHY[var]
        elif var in _CHOICES_WHY:
            allowed, why = _CHOICES_WHY[var]
            if value.strip().lower() not in ("", *allowed):
                found[var] = why
        elif var in _ALWAYS_WHY:
            found[var] = _ALWAYS_WHY[var]
        elif var.startswith(_AUTOTUNE_PREFIX):
            found[var] = ("the autotuner is a coordinate search, not Bayesian optimisation: "
                          "this setting has no counterpart")
        else:
            found[var] = "not a setting hvd_spark knows (a typo?)"
    return found


def warn_unsupported_horovod_vars() -> dict[str, str]:
    """Log one warning naming every ``HOROVOD_*`` setting that cannot be honoured.

    Warns at most once per process (later calls return what the first one found
    without logging). Call it from ``init()``.

    Returns:
        ``{variable: reason}`` as ``unsupported_horovod_vars`` finds them.
    """
    global _warned
    found = unsupported_horovod_vars()
    with _warn_lock:
        if _warned or not found:
            return found
        _warned = True
    listed = "; ".join(f"{var}={os.environ[var]!r} ({why})" for var, why in found.items())
    log.warning("hvd_spark ignores these Horovod settings: %s", listed)
    return found
