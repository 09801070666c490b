"""Every survivor names the root cause (issue 47): in a 3-rank job where rank 2 is frozen
(SIGSTOP) or killed (SIGKILL), ranks 0 and 1 fail with rank 2 and its fault, not with
"rank 0 disconnected" (or "rank 1 disconnected") because a peer stopped on the news first.

A rank that aborts tells its control peers why before it closes its links (rank 0 passes
it on), and the launcher lets the survivors hear and report it before stopping them.
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest

from hvd_spark.errors import WorkerFailedError
from hvd_spark.runner.local.local_launcher import run_local

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # tests/ is not on the ranks' path


def fault_on_rank_two(signal_name: str) -> None:
    """One allreduce, then rank 2 sends itself ``signal_name`` and the others start a
    second allreduce, which cannot complete."""
    import os
    import signal

    import numpy as np

    import hvd_spark.collectives as hvd

    hvd.init()
    hvd.allreduce(np.ones(4), name="first")
    if hvd.rank() == 2:
        os.kill(os.getpid(), getattr(signal, signal_name))
    hvd.allreduce(np.ones(4), name="second")


@pytest.mark.parametrize("signal_name,fault", [
    ("SIGSTOP", "rank 2 sent no heartbeat"),
    ("SIGKILL", "rank 2 disconnected (it exited or was killed)"),
])
def test_every_survivor_names_rank_two_and_its_fault(monkeypatch, signal_name, fault) -> None:
    monkeypatch.setenv("HVD_SPARK_HEARTBEAT_S", "2")
    with pytest.raises(WorkerFailedError) as info:
        run_local(fault_on_rank_two, args=(signal_name,), num_proc=3,
                  env={"HVD_SPARK_TIMEOUT": "120"})
    error = info.value
    root = error.root_cause
    assert root.rank == 2 and not root.secondary, str(error)
    if signal_name == "SIGKILL":
        assert "killed by signal 9" in root.message and "stopped by the launcher" not in (
            root.message)
    else:
        assert "sent no heartbeat" in root.message
    by_rank = {f.rank: f for f in error.failures}
    for survivor in (0, 1):
        message = by_rank[survivor].message
        assert by_rank[survivor].secondary, message
        assert "PeerDisconnectedError" in message and fault in message, (
            f"rank {survivor}: {message}")
        assert "rank 0 disconnected" not in message and "rank 1 disconnected" not in message
