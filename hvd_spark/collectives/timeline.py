"""Horovod-style timeline: what each tensor went through, as a Chrome trace.

The file is a JSON array of Trace Event Format events, loadable by Perfetto
(ui.perfetto.dev) and chrome://tracing. Each tensor name gets its own row (a
"process" named by ``M`` metadata events); on it, nested duration events show
its phases::

    NEGOTIATE_ALLREDUCE          submitted .. the coordinator's response
    ALLREDUCE                    response .. done, holding the activities:
      QUEUE                        response .. execution starts
      MEMCPY_IN_FUSION_BUFFER      ... (any activity names the engine uses)
      RING_ALLREDUCE
      MEMCPY_OUT_FUSION_BUFFER

Optional ``CYCLE_START`` instant events mark engine cycles. Calls are thread-safe
and cheap: each takes one timestamp and appends a tuple under a lock; a
background thread formats and writes the events every ``flush_interval_s``. After
every write the file ends with ``]`` so it is valid JSON while being written, and
after ``close()`` (also run at interpreter exit) it holds every event.

Phases are kept paired per tensor: starting a new phase where one is still open
closes it first, so begin/end events always nest, whatever order the engine's
threads report them in.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterable

from hvd_spark.errors import ConfigError

log = logging.getLogger(__name__)

NEGOTIATE_PREFIX = "NEGOTIATE_"
QUEUE = "QUEUE"
MEMCPY_IN_FUSION_BUFFER = "MEMCPY_IN_FUSION_BUFFER"
MEMCPY_OUT_FUSION_BUFFER = "MEMCPY_OUT_FUSION_BUFFER"
RING_ALLREDUCE = "RING_ALLREDUCE"
# A small allreduce rank 0 reduced during negotiation (no ring): copying the result out.
EAGER_ALLREDUCE = "EAGER_ALLREDUCE"
CYCLE_START = "CYCLE_START"

_FLUSH_INTERVAL_S = 0.05
_WAKE_AT_EVENTS = 20000  # wake the writer early when this many events wait
_CLOSE_TIMEOUT_S = 10.0

# Per-tensor states (Horovod's): between phases / negotiating / in an op / in an activity.
_IDLE, _NEGOTIATING, _TOP, _ACTIVITY = 0, 1, 2, 3

# Event tuples: (kind, perf_counter_ns, row_name, event_name, args). Kinds:
_BEGIN, _END, _INSTANT, _MARK = "B", "E", "X", "i"
_negotiate_names: dict[str, str] = {}


def _negotiate_name(kind: str) -> str:
    """``NEGOTIATE_<KIND>``, built once per kind."""
    name = _negotiate_names.get(kind)
    if name is None:
        name = _negotiate_names[kind] = NEGOTIATE_PREFIX + kind.upper()
    return name


class Timeline:
    """A Chrome-trace timeline file, written in the background.

    Args:
        path: File to write (truncated). Its directory must exist.
        mark_cycles: Record ``mark_cycle()`` calls as ``CYCLE_START`` instants.
        flush_interval_s: Most seconds between two writes of queued events.

    Raises:
        ConfigError: ``path`` is empty or the file cannot be created.
    """

    def __init__(self, path: str, mark_cycles: bool = False,
                 flush_interval_s: float = _FLUSH_INTERVAL_S) -> None:
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise ConfigError(f"timeline file_path must be a non-empty path, got {path!r}")
        self.path = os.fspath(path)
        self.mark_cycles = bool(mark_cycles)
        try:
            self._file = open(self.path, "wb")  # noqa: SIM115 - closed by close()
        except OSError as exc:
            raise ConfigError(f"cannot create the timeline file {self.path!r}: {exc}") from exc
        self._t0_ns = time.perf_counter_ns()
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._events: list[tuple] = []
        self._states: dict[str, int] = {}
        self._closed = False
        self._interval = flush_interval_s
        self._wake = threading.Event()
        self._rows: dict[str, str] = {}
        self._names: dict[str, str] = {}
        self._started_file = False
        self._write_error: OSError | None = None
        self._writer = threading.Thread(target=self._write_loop, name="hvd-timeline",
                                        daemon=True)
        self._writer.start()
        _open_timelines.add(self)

    # --- recording (any thread) ---------------------------------------------------

    @property
    def closed(self) -> bool:
        """True once ``close()`` ran: further calls record nothing."""
        return self._closed

    def _wake_if_full(self) -> None:
        # Caller holds the lock.
        if len(self._events) > _WAKE_AT_EVENTS:
            self._wake.set()

    def _close_open(self, name: str, ts: int, args: dict | None = None) -> None:
        # Caller holds the lock: end whatever ``name`` has open, innermost first.
        state = self._states.pop(name, _IDLE)
        if state == _ACTIVITY:
            self._events.append((_END, ts, name, None, None))
            state = _TOP
        if state != _IDLE:
            self._events.append((_END, ts, name, None, args))

    def negotiate_start(self, name: str, kind: str) -> None:
        """``name`` was submitted: begin ``NEGOTIATE_<KIND>`` (no-op if already negotiating).

        Args:
            name: The tensor (operation) name: one row per name.
            kind: The operation, e.g. "allreduce" (upper-cased in the event name).
        """
        self.negotiate_start_all((name,), kind)

    def negotiate_start_all(self, names: Iterable[str], kind: str) -> None:
        """``negotiate_start`` for several tensors of one kind, with one timestamp."""
        if self._closed:
            return
        event = _negotiate_name(kind)
        states = self._states
        with self._lock:
            ts = time.perf_counter_ns()  # under the lock: file order is time order
            for name in names:
                state = states.get(name)
                if state == _NEGOTIATING:
                    continue
                if state is not None:
                    self._close_open(name, ts)
                self._events.append((_BEGIN, ts, name, event, None))
                states[name] = _NEGOTIATING
            self._wake_if_full()

    def negotiate_rank_ready(self, name: str, rank: int) -> None:
        """While negotiating, mark that ``rank`` submitted ``name`` (an instant named by it)."""
        if self._closed:
            return
        with self._lock:
            if self._states.get(name) == _NEGOTIATING:
                self._events.append((_INSTANT, time.perf_counter_ns(), name, str(rank), None))

    def negotiate_end(self, name: str) -> None:
        """The coordinator answered for ``name``: end its negotiation."""
        self.negotiate_end_all((name,))

    def negotiate_end_all(self, names: Iterable[str]) -> None:
        """``negotiate_end`` for several tensors (one response), with one timestamp."""
        if self._closed:
            return
        states = self._states
        with self._lock:
            events = self._events  # read under the lock: a flush swaps the list
            ts = time.perf_counter_ns()
            for name in names:
                if states.get(name) == _NEGOTIATING:
                    events.append((_END, ts, name, None, None))
                    del states[name]

    def start(self, name: str, kind: str, args: dict | None = None) -> None:
        """Begin the operation itself (e.g. ``ALLREDUCE``) on ``name``'s row.

        Ends a negotiation still open. Activities (``activity_start``) nest inside.

        Args:
            name: The tensor name.
            kind: The operation, upper-cased in the event name.
            args: Optional JSON-able details shown with the event (e.g. bytes).
        """
        self.start_all((name,), kind, args)

    def start_all(self, names: Iterable[str], kind: str, args: dict | None = None) -> None:
        """``start`` for every tensor of one (fused) operation, with one timestamp."""
        if self._closed:
            return
        event = kind.upper()
        states = self._states
        with self._lock:
            ts = time.perf_counter_ns()
            events = self._events
            for name in names:
                if name in states:
                    self._close_open(name, ts)
                events.append((_BEGIN, ts, name, event, args))
                states[name] = _TOP
            self._wake_if_full()

    def activity_start(self, name: str, activity: str) -> None:
        """Begin sub-phase ``activity`` of ``name``'s operation, ending the previous one.

        Without an open operation (``start``) nothing is recorded.
        """
        self.activity_start_all((name,), activity)

    def activity_start_all(self, names: Iterable[str], activity: str) -> None:
        """``activity_start`` for every tensor of one (fused) operation."""
        if self._closed:
            return
        states = self._states
        with self._lock:
            ts = time.perf_counter_ns()
            events = self._events
            for name in names:
                state = states.get(name)
                if state == _ACTIVITY:
                    events.append((_END, ts, name, None, None))
                elif state != _TOP:
                    continue
                events.append((_BEGIN, ts, name, activity, None))
                states[name] = _ACTIVITY
            self._wake_if_full()

    def activity_end(self, name: str) -> None:
        """End ``name``'s current activity (no-op without one)."""
        self.activity_end_all((name,))

    def activity_end_all(self, names: Iterable[str]) -> None:
        """``activity_end`` for every tensor of one (fused) operation."""
        if self._closed:
            return
        states = self._states
        with self._lock:
            ts = time.perf_counter_ns()
            for name in names:
                if states.get(name) == _ACTIVITY:
                    self._events.append((_END, ts, name, None, None))
                    states[name] = _TOP

    def end(self, name: str, args: dict | None = None) -> None:
        """``name``'s operation finished: end its activity and the operation.

        Args:
            name: The tensor name.
            args: Optional JSON-able details of the result (e.g. dtype, shape, error).
        """
        self.end_all((name,), args)

    def end_all(self, names: Iterable[str], args: dict | None = None) -> None:
        """``end`` for every tensor of one (fused) operation, with one timestamp."""
        if self._closed:
            return
        with self._lock:
            ts = time.perf_counter_ns()
            for name in names:
                self._close_open(name, ts, args)
            self._wake_if_full()

    def mark_cycle(self) -> None:
        """Record a ``CYCLE_START`` instant (only when ``mark_cycles`` is on)."""
        if self._closed or not self.mark_cycles:
            return
        with self._lock:
            self._events.append((_MARK, time.perf_counter_ns(), None, CYCLE_START, None))

    # --- writing (the writer thread, and close) -----------------------------------

    def _write_loop(self) -> None:
        while not self._closed:
            self._wake.wait(self._interval)
            self._wake.clear()
            self._flush()

    def _flush(self) -> None:
        # One flush at a time (the writer thread's and close()'s), taking events and writing
        # them under the same lock: batches reach the file whole and in order.
        with self._flush_lock:
            with self._lock:
                events, self._events = self._events, []
            if not events or self._write_error is not None:
                return
            try:
                self._write(self._format(events))
            except OSError as exc:  # a full disk must not stop training: stop the timeline
                self._write_error = exc
                log.error("writing the timeline %s failed (%s); no more events are recorded",
                          self.path, exc)

    def _header(self) -> list[str]:
        # The wall-clock time of ts 0, so several ranks' files can be aligned.
        epoch_us = (time.time_ns() - (time.perf_counter_ns() - self._t0_ns)) // 1000
        meta = {"name": "hvd_spark timeline", "start_time_since_epoch_in_micros": epoch_us}
        return [
            f'{{"name":"process_name","ph":"M","pid":0,"args":{json.dumps(meta)}}}',
            '{"name":"process_sort_index","ph":"M","pid":0,"args":{"sort_index":0}}',
        ]

    def _row(self, name: str, lines: list[str]) -> str:
        """The ``"pid":N,"tid":0`` part of ``name``'s events; announces a new row."""
        tail = self._rows.get(name)
        if tail is None:
            row = len(self._rows) + 1
            tail = self._rows[name] = f'"pid":{row},"tid":0'
            lines.append(f'{{"name":"process_name","ph":"M","pid":{row},'
                         f'"args":{{"name":{json.dumps(name)}}}}}')
            lines.append(f'{{"name":"process_sort_index","ph":"M","pid":{row},'
                         f'"args":{{"sort_index":{row}}}}}')
        return tail

    def _head(self, kind: str, event_name: str) -> str:
        """The ``{"ph":..,"name":..,"ts":`` start of an event, built once per name."""
        key = kind + event_name
        head = self._names.get(key)
        if head is None:
            head = self._names[key] = f'{{"ph":"{kind}","name":{json.dumps(event_name)},"ts":'
        return head

    def _format(self, events: list[tuple]) -> list[str]:
        lines: list[str] = []
        append = lines.append
        t0 = self._t0_ns
        rows = self._rows
        for kind, raw_ts, row_name, event_name, args in events:
            ts = (raw_ts - t0) // 1000  # microseconds since the timeline started
            if kind == _MARK:
                append(f'{{"ph":"i","name":"{event_name}","ts":{ts},"pid":0,"s":"g"}}')
                continue
            tail = rows.get(row_name) or self._row(row_name, lines)
            if args:
                tail = f'{tail},"args":{json.dumps(args, default=str)}'
            if kind == _END:
                append(f'{{"ph":"E","ts":{ts},{tail}}}')
            elif kind == _BEGIN:
                append(f'{self._head(kind, event_name)}{ts},{tail}}}')
            else:
                append(f'{self._head(kind, event_name)}{ts},"dur":0,{tail}}}')
        return lines

    def _write(self, lines: list[str]) -> None:
        # The file always ends with "\n]": overwrite that with the next events.
        if self._started_file:
            self._file.seek(-2, os.SEEK_END)
            head = ",\n"
        else:
            lines = self._header() + lines
            self._started_file = True
            head = "[\n"
        self._file.write((head + ",\n".join(lines) + "\n]").encode())
        self._file.flush()

    def close(self) -> None:
        """Stop recording, write every queued event and close the file (idempotent).

        Phases still open end now, so every begin event has its end.
        """
        with self._lock:
            ts = time.perf_counter_ns()
            if self._closed:
                return
            self._closed = True
            for name in list(self._states):
                self._close_open(name, ts)
        self._wake.set()
        if self._writer is not threading.current_thread():
            self._writer.join(_CLOSE_TIMEOUT_S)
        self._flush()
        try:
            with self._flush_lock:
                if not self._started_file and self._write_error is None:
                    self._write([])  # the header alone
        except OSError as exc:
            log.error("writing the timeline %s failed: %s", self.path, exc)
        finally:
            self._file.close()
            _open_timelines.discard(self)

    def __enter__(self) -> Timeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Every open timeline is closed at interpreter exit, so its file holds every event.
_open_timelines: weakref.WeakSet[Timeline] = weakref.WeakSet()


def close_all() -> None:
    """Close every open timeline (run at exit; launchers call it before ``os._exit``)."""
    global _current
    _current = None
    for timeline in list(_open_timelines):
        timeline.close()


atexit.register(close_all)

# --- the process's current timeline (start_timeline / stop_timeline) --------------

_switch_lock = threading.Lock()
_current: Timeline | None = None


def current() -> Timeline | None:
    """The timeline being recorded, or None: the engine reads it once per cycle."""
    return _current


def start_timeline(file_path: str, mark_cycles: bool = False) -> Timeline:
    """Start recording to ``file_path``, closing the timeline recorded before.

    Asking again for the file being recorded only updates ``mark_cycles``.

    Args:
        file_path: The Chrome-trace JSON file to write.
        mark_cycles: Mark each engine cycle.

    Returns:
        The timeline now recording.

    Raises:
        ConfigError: The path is empty or the file cannot be created.
    """
    global _current
    with _switch_lock:
        old = _current
        if old is not None and not old.closed and old.path == os.fspath(file_path):
            old.mark_cycles = bool(mark_cycles)
            return old
        new = Timeline(file_path, mark_cycles)
        _current = new
    if old is not None:
        old.close()
    return new


def stop_timeline() -> None:
    """Stop recording and close the file (no-op when no timeline is recorded)."""
    global _current
    with _switch_lock:
        old, _current = _current, None
    if old is not None:
        old.close()
