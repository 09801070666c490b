"""The TCP engine's express path for the moving collectives: a synchronous broadcast or
allgather of two ranks on the caller's thread, with no entry, handle or cycle.

As for allreduce (``tcp.express``): with two ranks each sends the other its small
broadcast and allgather requests with their tensors along (a broadcast's receiver sends
an empty one, ``pairing.pair_payload``), and each rank builds its result as soon as it
holds both. A synchronous call made while nothing else is in flight sends its request,
reads the other rank's and copies out the result here; whenever something else turns
up, it hands over to the usual path (``ExpressMixin._express_handover``), whose pairing
decides the same request the same way. Tensors ride inline (no lane): these calls are
small, and usually a model's state at start or a metric.

The request's fields around its shape are worked out once per (kind, dtype, root), as
the allreduce's plan is, so a call builds one tuple and pickles it.
"""

from __future__ import annotations

import numpy as np

from hvd_spark.collectives import messages as m
from hvd_spark.collectives.coordinator import request_problem
from hvd_spark.collectives.operations import Entry, Handle
from hvd_spark.collectives.pairing import (
    disagreement,
    moved_output,
    pair_output,
    pair_payload,
)
from hvd_spark.collectives.tcp import wire
from hvd_spark.errors import HvdSparkError

# Where a request's fields sit in ``Request.fields()`` (see ``tcp.express``).
_SHAPE, _AGREED = 3, -2
# Plans kept, one per (kind, dtype, root) a job moves (a job uses a handful).
_PLANS_KEPT = 64


class ExpressMovesMixin:
    """The broadcast and allgather half of the TCP engine's express path: caller-side
    code of the engine itself, on top of ``ExpressMixin`` (its claim, read, handover
    and counters), kept in a module of its own for size."""

    def _init_express_moves(self) -> None:
        # (kind, dtype, root) -> the request's fields around its shape.
        self._move_plans: dict[tuple, tuple] = {}

    def express_broadcast(self, name: str, array: np.ndarray, root: int,
                          inplace: bool) -> np.ndarray | None:
        """A synchronous broadcast the two ranks decide alone (see ``pairing``).

        Returns:
            The result (``array`` itself when ``inplace``, else a new array), or None
            when this call does not qualify (the caller submits it as usual).
        """
        if (self.pairing is None or not array.flags.c_contiguous
                or (inplace and not array.flags.writeable)
                or array.nbytes > self.lone_eager_bytes or root not in (0, 1)):
            return None
        fields = (self._move_plans.get((m.BROADCAST, array.dtype, root))
                  or self._move_fields(m.BROADCAST, array.dtype, root))
        if fields is None:
            return None
        return self._express_call(name, self._express_move, fields, array, root, inplace)

    def express_allgather(self, name: str, array: np.ndarray) -> np.ndarray | None:
        """A synchronous allgather the two ranks decide alone (see ``pairing``).

        Returns:
            The concatenation in rank order (a new array), or None when this call does
            not qualify (the caller submits it as usual).
        """
        if (self.pairing is None or not array.flags.c_contiguous
                or array.nbytes > self.lone_eager_bytes):
            return None
        fields = (self._move_plans.get((m.ALLGATHER, array.dtype, -1))
                  or self._move_fields(m.ALLGATHER, array.dtype, -1))
        if fields is None:
            return None
        if array.ndim == 0:
            array = array.reshape(1)
        return self._express_call(name, self._express_move, fields, array, -1, False)

    def _move_fields(self, kind: str, dtype: np.dtype, root: int) -> tuple | None:
        """A request's fields for ``kind``, ``dtype`` and ``root``, split around the
        shape: (before, after), kept for the next call; None when the usual path must
        decide (a dtype it refuses, which it then reports in its own words). Callers
        look in ``_move_plans`` first (one Python call less a call)."""
        plans = self._move_plans
        try:
            dtype_name = m.dtype_name(dtype)
            if request_problem(kind, dtype_name, 1, 1.0, 1.0, root, 2) is not None:
                return None
        except (TypeError, ValueError, HvdSparkError):
            return None
        every = m.Request("", kind, dtype_name, (), root=root).fields()
        fields = (every[1:_SHAPE], every[_SHAPE + 1:_AGREED])
        if len(plans) < _PLANS_KEPT:
            plans[(kind, dtype, root)] = fields
        return fields

    def _express_move(self, name: str, held: m.Request | None, fields: tuple,
                      array: np.ndarray, root: int,
                      inplace: bool) -> tuple[np.ndarray | None, Entry | None]:
        """Send this rank's request, take the other rank's and build the result:
        (result, None); or, when the usual path must go on, (None, its entry).

        The two requests are compared as the tuples the wire carries, as
        ``pairing.disagreement`` would (a broadcast's in full; an allgather's but for
        its first dim), and a ``Request`` is built only when the call hands over.
        """
        try:
            kind = fields[0][0]
            mine = pair_payload(kind, array, root, self.rank)
            shape = array.shape
            own = (name, *fields[0], shape, *fields[1],
                   mine.tobytes() if mine.nbytes < m.OUT_OF_BAND_MIN_BYTES
                   else m.wire_bytes(mine), None)
            frame = wire.encode_obj((self._express_kind, [own]), pooled=True)
            control = self.control
            with control.send_lock:
                control.send(1 - self.rank, [frame])
            if inplace or kind == m.ALLGATHER:
                target = array
            else:  # a new array: the root's tensor, or one the root's fills
                target = array.copy() if root == self.rank else np.empty_like(array)
            message = None
            if held is None:
                theirs, message = self._express_read(name)
                if (theirs is not None and theirs[-2] is not None
                        and theirs[:_SHAPE] == own[:_SHAPE]
                        and theirs[_SHAPE + 1:_AGREED] == own[_SHAPE + 1:_AGREED]
                        and (theirs[_SHAPE] == shape if kind == m.BROADCAST else
                             len(theirs[_SHAPE]) == len(shape)
                             and theirs[_SHAPE][1:] == shape[1:])):
                    peer = np.frombuffer(theirs[-2], array.dtype)
                    first, second = (mine, peer) if self.rank == 0 else (peer, mine)
                    shapes = (shape, theirs[_SHAPE]) if self.rank == 0 else (theirs[_SHAPE],
                                                                             shape)
                    out = moved_output(kind, root, first, second, *shapes, target)
                    self._express_done(name)
                    return out, None
            request = m.Request(*own[:_AGREED], mine)
            if held is not None:  # a cycle read the other rank's request already
                first, second = (request, held) if self.rank == 0 else (held, request)
                if disagreement(name, first, second) is None:
                    out = pair_output(first, second, target)
                    self._express_done(name)
                    return out, None
            # The usual path decides (another message, a late or different request):
            # the other rank's request, or the message read, handled as a cycle would.
            entry = Entry(request, Handle(name), target)
            return None, self._express_handover(entry, held, message)
        except BaseException as exc:  # noqa: BLE001 - as in ExpressMixin._express_run
            raise self._express_failed(name, exc) from exc
