"""What the engine contract asks of every rank: jobs each rank runs on its own engine.

A job takes a ``Rank`` (its engine, rank, size and array kit) and returns plain data
(numpy arrays, strings) for the test to check. The TCP harness runs a job on threads of
the test process, one per rank; the MPI harness in real rank processes under mpirun
(``mpi_engine_ranks``). Jobs are written for two ranks.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hvd_spark.collectives import messages as m
from hvd_spark.collectives.engine_core import EngineCore
from hvd_spark.collectives.operations import Entry, Handle
from hvd_spark.collectives.ops import ReduceOp
from hvd_spark.config import EngineConfig
from hvd_spark.errors import HvdSparkError, PeerDisconnectedError

# Threads an engine starts (its own, a backlog sender, the hierarchical helper): none may
# outlive its shutdown.
ENGINE_THREADS = ("hvd-engine", "hvd-send-", "hvd-hier-cross")


class HostKit:
    """Host (numpy) tensors."""

    device = "cpu"

    def put(self, array: np.ndarray) -> Any:
        return array

    def get(self, array: Any) -> np.ndarray:
        return np.asarray(array)


class CupyKit(HostKit):
    """CUDA tensors (cupy), for engines whose communicator has a device path."""

    device = "cuda"

    def __init__(self) -> None:
        import cupy

        self.cupy = cupy

    def put(self, array: np.ndarray) -> Any:
        return self.cupy.asarray(array)

    def get(self, array: Any) -> np.ndarray:
        return self.cupy.asnumpy(array)


@dataclasses.dataclass
class Rank:
    """One rank's side of a job."""

    engine: EngineCore
    rank: int
    size: int
    kit: HostKit = dataclasses.field(default_factory=HostKit)
    #: Threads alive before the engine was made (see ``shutdown_leaves_no_thread``).
    threads_before: frozenset = frozenset()

    def run(self, request: m.Request, array: Any) -> Any:
        """Submit one operation and wait for its result."""
        return self.engine.wait(self.submit(request, array))

    def submit(self, request: m.Request, array: Any) -> Handle:
        return self.engine.submit(Entry(request, Handle(request.name), array))

    def request(self, name: str, kind: str, array: Any, **fields) -> m.Request:
        return m.Request(name, kind, m.dtype_name(array.dtype), tuple(array.shape),
                         device=self.kit.device, **fields)

    def allreduce(self, name: str, host: np.ndarray, eager: bool = False) -> m.Request:
        """A sum allreduce of ``host``; ``eager``: its tensor rides on the request (host
        tensors only; two TCP ranks then decide it alone)."""
        eager = eager and self.kit.device == "cpu"
        return self.request(name, m.ALLREDUCE, host, op=int(ReduceOp.Sum),
                            payload=host.reshape(-1) if eager else None)


def _error(exc: BaseException) -> tuple[str, str]:
    return type(exc).__name__, str(exc)


def every_op(r: Rank) -> dict[str, Any]:
    """Every collective once, each result brought back to the host."""
    kit, rank, size = r.kit, r.rank, r.size
    out: dict[str, Any] = {}
    small = np.full(4, rank + 1, np.float32)
    out["allreduce_small"] = kit.get(r.run(r.allreduce("ar-small", small, eager=True),
                                           kit.put(small)))
    big = np.arange(100_000, dtype=np.float32) * (rank + 1)
    out["allreduce_big"] = kit.get(r.run(r.allreduce("ar-big", big), kit.put(big)))
    rows = np.full((rank + 1, 3), rank, np.int32)
    out["allgather"] = kit.get(r.run(r.request("ag", m.ALLGATHER, rows), kit.put(rows)))
    own = np.arange(5, dtype=np.float64) * (rank + 1)
    out["broadcast"] = kit.get(r.run(r.request("bc", m.BROADCAST, own, root=1), kit.put(own)))
    sent = np.arange(2 * size, dtype=np.int64) + 100 * rank
    received, splits = r.run(r.request("a2a", m.ALLTOALL, sent, splits=(2,) * size),
                             kit.put(sent))
    out["alltoall"] = (kit.get(received), np.asarray(splits))
    block = np.full((2 * size, 3), rank + 1.0, np.float32)
    out["reducescatter"] = kit.get(r.run(
        r.request("rs", m.REDUCESCATTER, block, op=int(ReduceOp.Sum)), kit.put(block)))
    r.run(m.Request("barrier", m.BARRIER), np.empty(0, np.uint8))
    return out


def out_of_order(r: Rank) -> dict[str, np.ndarray]:
    """The ranks submit the same operations in opposite orders, without waiting between."""
    kit = r.kit
    inputs = {"ooo-big": np.arange(50_000, dtype=np.float32),
              "ooo-small": np.arange(8, dtype=np.float32),
              "ooo-bcast": np.full(6, float(r.rank))}
    order = list(inputs) if r.rank == 0 else list(reversed(inputs))
    handles = {}
    for name in order:
        host = inputs[name]
        request = (r.request(name, m.BROADCAST, host, root=0) if name == "ooo-bcast"
                   else r.allreduce(name, host, eager=name == "ooo-small"))
        handles[name] = r.submit(request, kit.put(host))
    return {name: kit.get(r.engine.wait(handles[name])) for name in inputs}


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def stalled(r: Rank) -> dict[str, Any]:
    """Rank 0 submits two operations rank 1 never does (a small allreduce, which two TCP
    ranks would decide alone, and a broadcast): the stall policy warns, then fails them;
    the engine goes on working."""
    out: dict[str, Any] = {}
    if r.rank == 0:
        caught = _Warnings()
        logger = logging.getLogger("hvd_spark")
        logger.addHandler(caught)
        try:
            host = np.ones(4, np.float32)
            handles = {"lonely-small": r.submit(r.allreduce("lonely-small", host, eager=True),
                                                r.kit.put(host)),
                       "lonely-bcast": r.submit(r.request("lonely-bcast", m.BROADCAST, host,
                                                          root=0), r.kit.put(host))}
            for name, handle in handles.items():
                try:
                    r.engine.wait(handle)
                    out[name] = None
                except HvdSparkError as exc:
                    out[name] = _error(exc)
        finally:
            logger.removeHandler(caught)
        out["warnings"] = caught.messages
    else:
        # Past rank 0's failures, or "after" would stall (and fail) on rank 0's wait.
        time.sleep(STALL_SHUTDOWN_S + 0.5)
    after = np.ones(3, np.float32)
    out["after"] = r.kit.get(r.run(r.allreduce("after", after), r.kit.put(after)))
    return out


def failing_rank(r: Rank) -> Any:
    """Rank 1 fails while rank 0 waits for an operation: rank 0 gets an error naming it.

    Rank 0 submits that operation before an allreduce both run, and rank 1 fails only
    after it: the operation is in flight on rank 0 by then, whatever the timing.
    """
    ready = np.ones(1, np.float32)
    if r.rank == 1:
        r.run(r.allreduce("ready", ready), r.kit.put(ready))
        r.engine.abort(PeerDisconnectedError("rank 1 breaks on purpose"))
        return "aborted"
    host = np.ones(100_000, np.float32)
    start = time.monotonic()
    try:
        handle = r.submit(r.allreduce("never", host), r.kit.put(host))
        r.run(r.allreduce("ready", ready), r.kit.put(ready))
        r.engine.wait(handle)
    except HvdSparkError as exc:
        return (*_error(exc), time.monotonic() - start)
    return None


def shutdown_leaves_no_thread(r: Rank) -> list[str]:
    """After one operation both ranks shut down: no engine thread may stay (the names of
    those still alive after 5 s)."""
    host = np.ones(4, np.float32)
    r.run(r.allreduce("last", host), r.kit.put(host))
    r.engine.shutdown()
    deadline = time.monotonic() + 5.0
    while True:
        left = [t.name for t in threading.enumerate()
                if t not in r.threads_before and t.is_alive()
                and t.name.startswith(ENGINE_THREADS)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.01)


#: Every job, by name, in the order one MPI session runs them (a rank's failure last).
JOBS: dict[str, Callable[[Rank], Any]] = {
    "every_op": every_op,
    "out_of_order": out_of_order,
    "stalled": stalled,
    "shutdown_leaves_no_thread": shutdown_leaves_no_thread,
    "failing_rank": failing_rank,
}

# The stall job's policy: warn after 0.2 s, fail after 1 s (well before the timeout).
STALL_WARNING_S, STALL_SHUTDOWN_S = 0.2, 1.0


def config_for(job: str) -> EngineConfig:
    """The engine settings a job runs with."""
    if job == "stalled":
        return EngineConfig(timeout=20.0, stall_warning=STALL_WARNING_S,
                            stall_shutdown=STALL_SHUTDOWN_S)
    return EngineConfig(timeout=20.0)
