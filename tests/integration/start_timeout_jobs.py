"""Rank functions of the start-timeout tests (issue 47): slow to arrive, quick to run.

``SlowToUnpickle(fn, seconds)`` pickles to a call that sleeps before returning ``fn``:
the rank process pays ``seconds`` while it loads the function, after its task started,
as it pays for ``import torch`` or TensorFlow in a slow environment. Pickled by value
(tests/ is not on the ranks' path).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

import cloudpickle

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _arrive_late(fn: Callable, seconds: float, only_rank: int | None) -> Callable:
    if only_rank is None or os.environ.get("HVD_SPARK_RANK") == str(only_rank):
        time.sleep(seconds)
    return fn


class SlowToUnpickle:
    """``fn``, whose unpickling takes ``seconds`` on rank ``only_rank`` (None: every rank)."""

    def __init__(self, fn: Callable, seconds: float, only_rank: int | None = None) -> None:
        self.fn, self.seconds, self.only_rank = fn, seconds, only_rank

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __reduce__(self) -> tuple:
        return (_arrive_late, (self.fn, self.seconds, self.only_rank))


def sum_of_ranks() -> dict:
    """init(), one allreduce and the time since the process started, per rank."""
    import numpy as np

    import hvd_spark.collectives as C

    C.init()
    total = C.allreduce(np.array([C.rank() + 1.0]), name="sum_of_ranks", op=C.Sum)
    return {"rank": C.rank(), "size": C.size(), "sum": float(total[0])}
