"""The handle of an asynchronous tensor collective, and waiting for it.

Its own module so that both the host path (``tensor_ops``) and the device path
(``device_path``) build handles without importing each other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hvd_spark import collectives as C
from hvd_spark.errors import ConfigError


class TorchHandle:
    """The pending result of an asynchronous tensor collective.

    Pass it to ``synchronize`` (or ``poll``). Wraps one or more engine handles and
    the step that turns their numpy results into tensors, run in the caller's thread.
    """

    def __init__(self, inner: Sequence[C.Handle], finish: Callable[[list], Any]) -> None:
        self.inner = list(inner)
        self._finish = finish
        self._done = False
        self._result: Any = None

    def done(self) -> bool:
        """True when every underlying operation finished."""
        return all(h.done() for h in self.inner)

    def __call__(self) -> Any:
        """``wait()``: Horovod's sparse handles are called to get their result."""
        return self.wait()

    def wait(self) -> Any:
        """Block until finished; return the tensor result (or raise the operation's error)."""
        if not self._done:
            results = [C.synchronize(h) for h in self.inner]
            self._result = self._finish(results)
            self._done = True
        return self._result


def synchronize(handle: TorchHandle) -> Any:
    """Wait for an async operation and return its output tensor."""
    if not isinstance(handle, TorchHandle):
        raise ConfigError(
            f"synchronize expects a handle returned by an *_async call, got {type(handle).__name__}"
        )
    return handle.wait()


def poll(handle: TorchHandle) -> bool:
    """True when the async operation finished (``synchronize`` then returns at once)."""
    return all(C.poll(h) for h in handle.inner)  # C.poll yields the GIL while not done
