"""Structured training progress, sent by a rank to the driver that launched it.

A training loop calls ``send(event)`` with small dicts (``{"kind": "step", ...}``,
``{"kind": "epoch", ...}``); they travel over the run's authenticated service to the
driver, which draws them (``hvd_spark.estimator.progress``). Nothing here parses
printed lines. Step events are rate-limited so the loop never waits on the network
more than a few times a second. Without a launcher that listens (``hvdrun``, a launcher
of an older version), ``available()`` is False and callers print instead.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from hvd_spark import _env
from hvd_spark.collectives.tcp import wire
from hvd_spark.errors import HvdSparkError

PROGRESS = "progress"
# Step events closer together than this are dropped (the next one carries the totals).
MIN_STEP_INTERVAL_S = 0.2
_SEND_TIMEOUT_S = 5.0


class _Channel:
    """One connection to the driver service, opened (and tried) on first use."""

    def __init__(self) -> None:
        self._client: Any = None
        self._usable: bool | None = None  # None: not tried yet
        self._last_step = 0.0
        self._step_epoch: Any = None

    def usable(self) -> bool:
        if self._usable is None:
            self._usable = self._open()
        return self._usable

    def _open(self) -> bool:
        addr, secret = _env.get_str(_env.RENDEZVOUS_ADDR), _env.get_str(_env.SECRET)
        if not addr or not secret:
            return False
        from hvd_spark.collectives.tcp.store import StoreClient

        try:
            self._client = StoreClient(wire.parse_addr(addr, _env.RENDEZVOUS_ADDR),
                                       bytes.fromhex(secret), _SEND_TIMEOUT_S)
        except (HvdSparkError, OSError, ValueError):
            return False
        return self._call(-1, {"kind": "hello"})

    def _call(self, rank: int, event: dict[str, Any]) -> bool:
        try:
            self._client.call(PROGRESS, rank, event, timeout=_SEND_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - progress must never fail training
            # UnknownRequestError: this launcher takes no progress (hvdrun, run_local).
            self._usable = False
            with contextlib.suppress(OSError):
                self._client.close()
            return False
        return True

    def send(self, rank: int, event: dict[str, Any]) -> bool:
        if not self.usable():
            return False
        if event.get("kind") == "step":
            # The first step of an epoch always goes: it opens the epoch's bar. So does
            # the last: the epoch's rate is measured from the first to it.
            now, epoch = time.monotonic(), event.get("epoch")
            last = event.get("steps") is not None and event.get("step") == event["steps"]
            if now - self._last_step < MIN_STEP_INTERVAL_S and epoch == self._step_epoch \
                    and not last:
                return True  # dropped: the next step event carries the totals
            self._last_step, self._step_epoch = now, epoch
        return self._call(rank, event)


_CHANNEL: _Channel | None = None


def _channel() -> _Channel:
    global _CHANNEL
    if _CHANNEL is None:
        _CHANNEL = _Channel()
    return _CHANNEL


def available() -> bool:
    """True when this process was started by a launcher that takes progress events."""
    return _channel().usable()


def send(rank: int, event: dict[str, Any]) -> bool:
    """Send one event from ``rank``; False when no driver takes it (then print instead)."""
    return _channel().send(rank, event)
