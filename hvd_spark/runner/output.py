"""Forwarding the ranks' output lines, prefixed with the rank, to the driver's streams."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import IO


class OutputForwarder:
    """Copies lines from the ranks' pipes to two text streams, each line ``[rank] ...``.

    Args:
        stdout, stderr: Destination streams (a notebook's cell output by default).
        timestamps: Start each line with the driver's local time of receipt.
        tee: Also receives every line as ``(rank, stream, line)`` (e.g. to keep per-rank
            log files); its errors are not the run's.
    """

    def __init__(self, stdout: IO[str], stderr: IO[str], timestamps: bool = False,
                 tee: Callable[[int, str, str], None] | None = None) -> None:
        self._streams = {"stdout": stdout, "stderr": stderr}
        self._timestamps = timestamps
        self._tee = tee
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def write(self, rank: int, stream: str, line: str) -> None:
        """Write one line of ``rank``'s ``stream`` ("stdout" or "stderr")."""
        target = self._streams[stream]
        stamp = time.strftime("%Y-%m-%d %H:%M:%S ") if self._timestamps else ""
        with self._lock:
            target.write(f"{stamp}[{rank}] {line.rstrip(chr(10))}\n")
            target.flush()
            if self._tee is not None:
                try:
                    self._tee(rank, stream, line.rstrip("\n"))
                except Exception:  # noqa: BLE001 - a log copy must not stop the output
                    self._tee = None

    def follow(self, rank: int, out_pipe: IO[bytes], err_pipe: IO[bytes]) -> None:
        """Start forwarding a rank's two pipes until they close."""
        for name, pipe in (("stdout", out_pipe), ("stderr", err_pipe)):
            thread = threading.Thread(
                target=self._pump, args=(rank, name, pipe), name=f"hvd-out-{rank}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def _pump(self, rank: int, name: str, pipe: IO[bytes]) -> None:
        with pipe:
            for raw in iter(pipe.readline, b""):
                self.write(rank, name, raw.decode("utf-8", errors="replace"))

    def close(self, timeout: float = 5.0) -> None:
        """Wait (bounded) for the pipes to drain."""
        for thread in self._threads:
            thread.join(timeout)
