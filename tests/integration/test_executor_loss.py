"""An executor JVM killed under hvd_spark.run on local-cluster[2,1,1024]: the error names it.

Each rank finds the executor JVM that hosts it (walking up its parent processes) and
prints its pid; the driver-side stream kills rank 1's executor with SIGKILL while the
ranks run allreduces, as a preempted node would die.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time

import cloudpickle
import pyspark  # noqa: F401 - CI installs it: never a skip
import pytest

import hvd_spark
from hvd_spark.errors import WorkerFailedError

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # tests/ is not on the workers' path


class KillOnLine:
    """A text stream for a run's output that kills the process a line names.

    Args:
        pattern: A regex whose groups are (rank, pid); the first match with ``rank`` kills ``pid``.
        rank: Whose executor to kill.
    """

    def __init__(self, pattern: str, rank: int) -> None:
        self.pattern = re.compile(pattern)
        self.rank = rank
        self.killed: int | None = None
        self.killed_at: float | None = None
        self.lines: list[str] = []
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self.lines.extend(text.splitlines())
            match = self.pattern.search(text)
            if match and int(match.group(1)) == self.rank and self.killed is None:
                self.killed = int(match.group(2))
                self.killed_at = time.monotonic()
                os.kill(self.killed, signal.SIGKILL)
        return len(text)

    def flush(self) -> None:
        pass


def _allreduce_until_killed() -> int:
    """Rank body: report the executor JVM above this process, then allreduce for a while."""
    import os
    import time

    import numpy as np

    import hvd_spark.collectives as hvd

    def executor_pid() -> int:
        pid = os.getpid()
        while pid > 1:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"CoarseGrainedExecutorBackend" in f.read():
                    return pid
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        raise RuntimeError("no executor JVM above this rank")

    hvd.init()
    hvd.allreduce(np.ones(4), name="warmup")
    print(f"rank {hvd.rank()} runs in executor JVM {executor_pid()}", flush=True)
    deadline = time.monotonic() + 90  # bounded: the test fails rather than hangs
    step = 0
    while time.monotonic() < deadline:
        hvd.allreduce(np.ones(1000), name=f"step.{step}")
        step += 1
        time.sleep(0.01)
    return step


def test_killed_executor_is_the_root_cause(spark_cluster):
    out = KillOnLine(r"\[\d+\] rank (\d+) runs in executor JVM (\d+)", rank=1)
    started = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        hvd_spark.run(_allreduce_until_killed, num_proc=2, stdout=out, start_timeout=120)
    assert out.killed is not None, f"no executor was killed; output: {out.lines}"
    ended = time.monotonic()
    err = info.value
    print(f"started->killed {out.killed_at - started:.1f} s, killed->raised "
          f"{ended - out.killed_at:.1f} s\n{err}")
    root = err.root_cause
    # The rank whose executor was killed is the root cause, not the survivor's disconnect.
    assert root.rank == 1, str(err)
    assert not root.secondary and root.lost, str(err)
    assert re.search(r"executor \S+ lost", root.message), root.message
    assert "partition" in root.message, root.message
    assert root.host != "?", root.message
    assert all(f.secondary for f in err.failures[1:]), str(err)
    assert str(err).startswith("2 rank(s) failed") or str(err).startswith("1 rank(s) failed")
    assert "root cause: rank 1 on host" in str(err)
    # Recognized within seconds of the kill, not after a collective timeout.
    assert ended - out.killed_at < 30, f"{ended - out.killed_at:.1f} s after the kill"
    assert ended - started < 120
