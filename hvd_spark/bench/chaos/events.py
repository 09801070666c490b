"""The soak's clock of what happened: training steps, detected failures, ends of jobs.

Sources: the ranks' progress file (``ProgressTail``), hvd_spark's driver-side log
(``LogTap``: a cancelled job, a fit's retry, an elastic rank lost) and the elastic
driver's own lines (``LineTap``). Times are ``time.time()``: the ranks run on the same
machine, in other namespaces, on the same clock.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time

#: Driver-side messages that mean "a failure was noticed".
DETECTED = re.compile(r"cancelling Spark job group|lost: .*resuming from|\) lost: |"
                      r"rank \d+ .*lost|aborting the collectives|generation \d+: .* after: ")


@dataclasses.dataclass(frozen=True)
class Event:
    """``kind`` is ``step`` (``n`` the step), ``reset``, ``detected`` or ``ended``."""

    at: float
    kind: str
    n: int = 0
    text: str = ""


class Events:
    """A thread-safe, time-ordered record of events."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[Event] = []
        self.changed = threading.Condition(self._lock)

    def add(self, event: Event) -> None:
        with self._lock:
            self._items.append(event)
            self._items.sort(key=lambda e: e.at)
            self.changed.notify_all()

    def since(self, at: float, kind: str | None = None) -> list[Event]:
        """Events at or after ``at`` (of ``kind`` when given), oldest first."""
        with self._lock:
            return [e for e in self._items if e.at >= at and (kind is None or e.kind == kind)]

    def before(self, at: float, kind: str) -> list[Event]:
        """Events of ``kind`` before ``at``, oldest first."""
        with self._lock:
            return [e for e in self._items if e.at < at and e.kind == kind]

    def wait(self, timeout: float) -> None:
        """Until the next event, or ``timeout`` seconds."""
        with self._lock:
            self.changed.wait(timeout)


class ProgressTail(threading.Thread):
    """Reads the ranks' progress file as it grows, into ``events``."""

    def __init__(self, path: str, events: Events, poll_s: float = 0.05) -> None:
        super().__init__(daemon=True, name="chaos-progress")
        self.path, self.events, self.poll_s = path, events, poll_s
        self._halt = threading.Event()

    def run(self) -> None:
        offset, rest = 0, b""
        while not self._halt.is_set():
            try:
                with open(self.path, "rb") as f:
                    f.seek(offset)
                    data = f.read()
            except FileNotFoundError:
                data = b""
            offset += len(data)
            lines = (rest + data).split(b"\n")
            rest = lines.pop()
            for line in lines:
                self._parse(line.decode(errors="replace"))
            self._halt.wait(self.poll_s)

    def _parse(self, line: str) -> None:
        parts = line.split()
        if len(parts) >= 2:
            n = int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else 0
            self.events.add(Event(float(parts[0]), parts[1], n, line))

    def stop(self) -> None:
        """Stop reading (after one last read)."""
        time.sleep(2 * self.poll_s)
        self._halt.set()
        self.join(5)


class LogTap(logging.Handler):
    """Records hvd_spark's driver-side messages that mean a failure was noticed."""

    def __init__(self, events: Events, log_path: str | None = None) -> None:
        super().__init__(logging.INFO)
        self.events = events
        self.lines: list[str] = []
        self.log_path = log_path

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        self.lines.append(text)
        if self.log_path:
            with open(self.log_path, "a") as f:
                f.write(f"{record.created:.3f} {record.levelname} {text}\n")
        if DETECTED.search(text):
            self.events.add(Event(record.created, "detected", text=text[:200]))

    def __enter__(self) -> LogTap:
        self._logger = logging.getLogger("hvd_spark")
        self._level = self._logger.level
        self._logger.addHandler(self)
        self._logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc: object) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)


class LineTap:
    """A text stream (a run's ``stdout``/``stderr``) that records the lines saying a
    failure was noticed, and keeps the last lines for the report."""

    def __init__(self, events: Events, log_path: str | None = None) -> None:
        self.events = events
        self.lines: list[str] = []
        self.log_path = log_path
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        now = time.time()
        with self._lock:
            for line in text.splitlines():
                self.lines.append(line)
                if DETECTED.search(line):
                    self.events.add(Event(now, "detected", text=line[:200]))
            del self.lines[:-200]
            if self.log_path:
                with open(self.log_path, "a") as f:
                    f.write(text)
        return len(text)

    def flush(self) -> None:
        """Nothing is buffered."""
