"""A two-rank job counting the Python functions a small synchronous collective runs.

Each rank times nothing: it counts the ``'call'`` events ``sys.setprofile`` reports
while one collective runs (Python functions and generators entered; built-ins are
``'c_call'`` events and not counted), for many calls, and returns the median per kind.
A small call's cost is that Python work, so the count is a measure that does not move
with the machine's speed or load.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable

import numpy as np

#: Calls counted per kind (the median is kept), after as many to warm up.
CALLS = 60


def _count(call: Callable[[], object]) -> int:
    """Python-level calls while ``call`` runs, ``call`` itself included."""
    events = [0]

    def profile(frame, event, arg) -> None:
        if event == "call":
            events[0] += 1

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return events[0] - 1  # less the lambda that wraps the collective


def _median_count(call: Callable[[], object]) -> int:
    for _ in range(CALLS):
        call()
    return int(statistics.median(_count(call) for _ in range(CALLS)))


def small_call_counts(nbytes: int = 1024) -> dict:
    """The median number of Python-level calls of each kind of small synchronous call
    (1 KB of float32), and how many of the allreduces took the express path."""
    import torch

    import hvd_spark.collectives as hvd
    import hvd_spark.torch as hvd_torch
    from hvd_spark.collectives import _plumbing

    hvd.init()
    try:
        engine = _plumbing.current_engine()
        x = np.ones(nbytes // 4, np.float32)
        t = torch.ones(nbytes // 4)
        before = engine.express_rounds
        counts = {
            "allreduce": _median_count(lambda: hvd.allreduce(x, name="a", op=hvd.Sum)),
            "allreduce_": _median_count(lambda: hvd.allreduce_(x, name="b", op=hvd.Sum)),
            "allreduce unnamed": _median_count(lambda: hvd.allreduce(x, op=hvd.Average)),
        }
        express = engine.express_rounds - before
        counts.update({
            "broadcast": _median_count(lambda: hvd.broadcast(x, 0, name="c")),
            "allgather": _median_count(lambda: hvd.allgather(x, name="d")),
            "torch allreduce": _median_count(
                lambda: hvd_torch.allreduce(t, name="e", op=hvd_torch.Sum)),
            "torch allreduce_": _median_count(
                lambda: hvd_torch.allreduce_(t, name="f", op=hvd_torch.Sum)),
            "torch broadcast": _median_count(lambda: hvd_torch.broadcast(t, 0, name="g")),
            "torch allgather": _median_count(lambda: hvd_torch.allgather(t, name="h")),
        })
        return {"counts": counts, "express": express, "allreduces": 3 * 2 * CALLS}
    finally:
        hvd.shutdown()
