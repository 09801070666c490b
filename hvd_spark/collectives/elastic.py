"""Elastic training, worker side: Horovod's ``hvd.elastic`` on the numpy collectives.

Under an elastic launcher (``hvdrun --min-np``, ``hvd_spark.run_elastic``) a worker has no
fixed rank: each ``init()`` joins the launcher's next *generation* of the ring and gets
its rank there. The :func:`run` decorator turns failures into recovery: when a peer is
lost, the collectives raise :class:`HorovodInternalError`; the decorator restores the last
``commit()``, re-forms the ring among the survivors (``shutdown()`` + ``init()``), syncs the
state from the new rank 0 and calls the training function again. When workers wait to
join, ``commit()``/``check_host_updates()`` raise :class:`HostsUpdatedInterrupt` on every
rank at the same step, and the ring re-forms with them.

The framework bindings add ``TorchState``, ``TensorFlowKerasState`` and friends on top
of :class:`State` and :class:`ObjectState`. The worker's link to the launcher, which
``init()`` uses, is in ``membership`` (re-exported here), so ``init()`` does not import
this module, which sits above it.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from hvd_spark.collectives import bootstrap, session
from hvd_spark.collectives.gather_ops import broadcast_object
from hvd_spark.collectives.membership import (  # re-exported: elastic's public names
    DEFAULT_ELASTIC_TIMEOUT_S,
    JOIN,
    MESH_TIMEOUT_S,
    VERSION,
    Membership,
    is_elastic,
    membership,
)
from hvd_spark.errors import (
    HorovodInternalError,
    HostsUpdatedInterrupt,
)

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

__all__ = [
    "DEFAULT_ELASTIC_TIMEOUT_S", "JOIN", "MESH_TIMEOUT_S", "VERSION", "Membership", "ObjectState",
    "State", "is_elastic", "membership", "reset", "run",
]


class State:
    """Training state that survives a re-formed ring: saved by ``commit()``, restored on
    failure, synced from rank 0 after every reset (Horovod's ``hvd.elastic.State``).

    Subclasses implement ``save``, ``restore`` and ``sync``.
    """

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: Sequence[Callable[[], None]]) -> None:
        """Functions called after every reset, e.g. to rescale the learning rate by size."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run the reset callbacks (the ring has just re-formed)."""
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Keep the current state as the one ``restore()`` returns to, then check whether
        workers wait to join (raising :class:`HostsUpdatedInterrupt` on every rank)."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank when workers wait to join.

        Rank 0 asks the launcher and broadcasts the answer, so all ranks decide alike.
        Outside an elastic job this does nothing.
        """
        if not is_elastic() or not session.is_initialized() or session.size() < 1:
            return
        updated = membership().hosts_updated() if session.rank() == 0 else False
        if session.size() > 1:
            updated = broadcast_object(updated, 0, name="elastic.check_host_updates")
        if updated:
            raise HostsUpdatedInterrupt(skip_sync=False)

    def save(self) -> None:
        """Copy the current state (called by ``commit``)."""
        raise NotImplementedError

    def restore(self) -> None:
        """Go back to the last saved state."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make every rank take rank 0's state."""
        raise NotImplementedError


class ObjectState(State):
    """Plain attributes (keyword arguments, e.g. ``epoch=0, batch=0``) that survive resets.

    Args:
        bcast_object: Function broadcasting a picklable object from rank 0 (default: the
            numpy collectives' ``broadcast_object``).
        get_rank: Function returning this rank (default: the collectives' ``rank``).
        **kwargs: The attributes and their initial values.
    """

    def __init__(self, bcast_object: Callable | None = None, get_rank: Callable | None = None,
                 **kwargs: Any) -> None:
        super().__init__()
        self._bcast_object = bcast_object
        self._get_rank = get_rank
        self._saved_attrs = copy.deepcopy(kwargs)
        self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_attrs.items():
            setattr(self, name, copy.deepcopy(value))

    def save(self) -> None:
        self._saved_attrs = {k: copy.deepcopy(getattr(self, k)) for k in self._saved_attrs}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if not self._saved_attrs:
            return
        bcast = self._bcast_object or (lambda obj, root: broadcast_object(
            obj, root, name="elastic.object_state"))
        current = {k: getattr(self, k) for k in self._saved_attrs}
        self._saved_attrs = bcast(current, 0)
        self._set_attrs()


def reset() -> None:
    """Leave the current ring and join the next generation (shutdown, then init).

    ``init()`` of an elastic worker leaves a generation whose ring cannot connect (a
    member died or froze while it formed) for the next one; the launcher's deadlines end
    the job when none can form.
    """
    bootstrap.shutdown()
    bootstrap.init()


def run(func: F) -> F:
    """Decorate a training function ``func(state, *args, **kwargs)`` to survive lost ranks.

    The wrapper syncs ``state`` from rank 0, runs ``func``, and on
    :class:`HorovodInternalError` restores the last commit, re-forms the ring among the
    survivors and runs ``func`` again; on :class:`HostsUpdatedInterrupt` it re-forms the
    ring with the new workers. Outside an elastic job the errors propagate unchanged,
    since a fixed-size job cannot replace a lost rank.
    """
    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HorovodInternalError as exc:
                if not is_elastic():
                    raise
                log.warning("a rank was lost (%s); restoring the last commit and re-forming "
                            "the ring", exc)
                state.restore()
                skip_sync = False
            except HostsUpdatedInterrupt as exc:
                if not is_elastic():
                    raise
                log.info("workers are joining; re-forming the ring")
                skip_sync = exc.skip_sync
            reset()
            state.on_reset()

    return wrapper  # type: ignore[return-value]
