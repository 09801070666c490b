"""The process's session in the job: its state and the accessors that read it.

One :class:`Session` per process (:data:`STATE`) holds what ``init()`` set up: the world
(rank, size, hosts), the engine, the ring generation, the automatic-name counters and the
process sets added on this rank. ``bootstrap`` fills it in and empties it; the rest of the
collectives read it through :func:`require` and the accessors here.
"""

from __future__ import annotations

import itertools
import threading
from typing import TYPE_CHECKING

from hvd_spark.collectives.process_sets import ProcessSet
from hvd_spark.config import WorldInfo
from hvd_spark.errors import CollectiveError

if TYPE_CHECKING:
    from hvd_spark.collectives.engine_core import EngineCore
    from hvd_spark.collectives.heartbeat import Heartbeat
    from hvd_spark.collectives.tcp.store import StoreClient


class Session:
    """This process's membership in the job, between ``init()`` and ``shutdown()``.

    Attributes:
        lock: Held while ``init()``/``shutdown()`` change the session.
        world: This rank's world, or None while not initialized.
        engine: The engine running the collectives, or None while not initialized.
        epochs: Ring numbers of fixed-size jobs (one per ``init()``).
        names: Automatic-name counters per ``(process set id, kind)``, so that they agree
            among each set's members.
        process_sets: Process sets added on this rank, by id (the global set is 0).
        homogeneous: True when every host runs the same number of ranks.
        heartbeat: The heartbeat thread (one per process, kept across re-formed rings), or
            None when the launcher asked for none.
        generation: The ring generation the heartbeat beats for (elastic jobs count
            generations; fixed jobs stay at 0).
        abort_lock: Orders the heartbeat's abort against ``init()`` setting the engine (not
            ``lock``: ``init()`` holds that while the ring forms, and the heartbeat must
            not wait on it).
        broken: ``(generation, reason)`` of the last ring the launcher said was broken,
            kept for an engine that did not exist yet when the word came.
        forming: The rendezvous client of a ring being formed, or None.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.world: WorldInfo | None = None
        self.engine: EngineCore | None = None
        self.epochs = itertools.count()
        self.names: dict[tuple[int, str], itertools.count] = {}
        self.process_sets: dict[int, ProcessSet] = {}
        self.homogeneous = True
        self.heartbeat: Heartbeat | None = None
        self.generation = 0
        self.abort_lock = threading.Lock()
        self.broken: tuple[int, str] | None = None
        self.forming: StoreClient | None = None


#: The process's one session.
STATE = Session()


def require() -> tuple[WorldInfo, EngineCore]:
    """This rank's world and engine.

    Raises:
        CollectiveError: ``init()`` was not called (or ``shutdown()`` was).
    """
    world, engine = STATE.world, STATE.engine
    if world is None or engine is None:
        raise CollectiveError("hvd_spark is not initialized: call init() first")
    return world, engine


def current_engine() -> EngineCore | None:
    """The engine running this process's collectives, or None while not initialized."""
    return STATE.engine


def is_initialized() -> bool:
    """True between ``init()`` and ``shutdown()``."""
    return STATE.engine is not None


def rank() -> int:
    """This process's rank."""
    return require()[0].rank


def size() -> int:
    """Number of ranks."""
    return require()[0].size


def local_rank() -> int:
    """Rank among the processes on this host."""
    return require()[0].local_rank


def local_size() -> int:
    """Number of ranks on this host."""
    return require()[0].local_size


def cross_rank() -> int:
    """Index of this host."""
    return require()[0].cross_rank


def cross_size() -> int:
    """Number of hosts."""
    return require()[0].cross_size


def is_homogeneous() -> bool:
    """True when every host runs the same number of ranks."""
    require()
    return STATE.homogeneous


def backend_name() -> str:
    """Name of the backend moving the bytes (e.g. "tcp")."""
    return require()[1].comm.name
