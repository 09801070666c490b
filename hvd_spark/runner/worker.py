"""The process every launcher starts for a rank when running a Python function.

It fetches the pickled ``(fn, args, kwargs)`` from the launcher's authenticated
store, runs it, and reports the pickled result or the failure back.
"""

from __future__ import annotations

import functools
import json
import os
import select
import socket
import sys
from collections.abc import Callable, Sequence

import cloudpickle

from hvd_spark import _env
from hvd_spark.collectives.tcp import wire
from hvd_spark.collectives.tcp.store import StoreClient
from hvd_spark.config import DEFAULT_START_TIMEOUT_S
from hvd_spark.errors import ConfigError, DataError, RendezvousTimeoutError
from hvd_spark.runner import tied_child
from hvd_spark.runner.failures import WorkerFailure

FN_KEY = "fn"
REPORT = "report"


def pickle_job(fn: Callable, args: Sequence, kwargs: dict | None) -> bytes:
    """Pickle ``(fn, args, kwargs)`` or raise a ConfigError naming what is not picklable."""
    if not callable(fn):
        raise ConfigError(f"fn must be callable, got {type(fn).__name__}")
    for what, value in (("fn", fn), ("args", tuple(args)), ("kwargs", dict(kwargs or {}))):
        try:
            cloudpickle.dumps(value)
        except Exception as exc:  # noqa: BLE001 - re-raised with the culprit named
            raise ConfigError(
                f"{what} cannot be pickled to send to the workers: {exc}. Create such objects "
                "(sessions, locks, open files) inside fn instead of capturing them"
            ) from exc
    return cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))


def _hostname() -> str:
    return _env.get_str(_env.HOSTNAME) or socket.gethostname()


def _rank_for_report() -> int:
    """The rank this process reports as: fixed by the launcher, or under an elastic
    launcher the worker's rank in the last ring it belonged to (-1: it never joined)."""
    if not _env.get_bool(_env.ELASTIC):
        return _require_int(_env.RANK)
    if "hvd_spark.collectives.api" in sys.modules:
        from hvd_spark.collectives import api

        if api.is_initialized():
            return api.rank()
    return -1


def receive_rank_env(timeout: float) -> None:
    """Wait for this rank's variables on stdin and apply them to ``os.environ``.

    Only in a worker that a Spark task started before it registered
    (``task_process.start_worker(rank_env_later=True)``, which sets
    ``RANK_ENV_ON_STDIN``); otherwise nothing.

    Raises:
        RendezvousTimeoutError: Nothing arrived within ``timeout`` seconds, or the task
            closed stdin first (it failed to register and is ending).
    """
    if os.environ.pop(_env.RANK_ENV_ON_STDIN, None) is None:
        return
    ready, _, _ = select.select([sys.stdin.buffer], [], [], timeout)
    line = sys.stdin.buffer.readline() if ready else b""
    if not line:
        raise RendezvousTimeoutError(
            f"this rank's Spark task did not hand over the rank's place within {timeout:.0f} s "
            "(it could not register with the driver: see the task's error)")
    message = json.loads(line)
    os.environ.update(message["set"])
    for name in message["unset"]:
        os.environ.pop(name, None)


def main() -> int:
    """Run the job's function as this rank; return the process exit code."""
    tied_child.arm_from_env()
    if _env.get_bool(_env.HOROVOD_ALIAS):
        from hvd_spark.compat import enable_horovod_alias

        enable_horovod_alias()  # before fn is unpickled: it may refer to horovod modules
    receive_rank_env(_env.get_float(_env.START_TIMEOUT, DEFAULT_START_TIMEOUT_S) + 30.0)
    rank = _rank_for_report()
    secret = _require_hex(_env.SECRET)
    addr = wire.parse_addr(_env.require_str(_env.RENDEZVOUS_ADDR), _env.RENDEZVOUS_ADDR)
    timeout = _env.get_float(_env.START_TIMEOUT, DEFAULT_START_TIMEOUT_S)
    if _env.get_str(_env.SHARE_PATH) and not _env.get_str(_env.SHARE_MIN_ROWS):
        from hvd_spark.data import rank_share

        rank_share.set_min_rows_source(functools.cache(
            functools.partial(_launcher_min_rows, addr, secret, timeout)))
    store = StoreClient(addr, secret, timeout)
    try:
        try:
            # Inside the try: a function that cannot be unpickled here (a module missing
            # on this machine) is reported with its traceback like any failure of fn.
            fn, args, kwargs = cloudpickle.loads(store.get(FN_KEY, timeout))
            _beat_from_start(rank, addr, secret)
            result = fn(*args, **kwargs)
            rank = _rank_for_report()
        except BaseException as exc:  # noqa: BLE001 - every failure is reported to the driver
            rank = _rank_for_report()
            sys.stdout.flush()
            _report(store, rank, "error", WorkerFailure.from_exception(rank, _hostname(), exc))
            return 1
        try:
            payload = cloudpickle.dumps(result)
        except Exception as exc:  # noqa: BLE001 - reported with what to do
            failure = WorkerFailure(rank, _hostname(), (
                f"the return value of fn on rank {rank} ({type(result).__name__}) cannot be "
                f"pickled: {exc}; return plain data (numbers, lists, numpy arrays, state dicts)"))
            _report(store, rank, "error", failure)
            return 1
        _leave_collectives()
        sys.stdout.flush()
        _report(store, rank, "ok", payload)
        return 0
    finally:
        store.close()


def _beat_from_start(rank: int, addr: tuple[str, int], secret: bytes) -> None:
    """Beat to the launcher while ``fn`` runs, whether or not it calls ``init()``: code on
    torch.distributed alone waits in gloo or NCCL, where a frozen peer would hold it for
    torch's 30-minute timeout; the launcher finds the silent rank in seconds instead."""
    if _env.get_bool(_env.ELASTIC) or not _env.get_str(_env.HEARTBEAT):
        return  # elastic workers beat once they join (their rank is not theirs yet)
    from hvd_spark.collectives import bootstrap

    bootstrap.start_heartbeat(addr, secret, str(rank))


def _launcher_min_rows(addr: tuple[str, int], secret: bytes, timeout: float) -> int:
    """The smallest share of any rank: the driver publishes it once every Spark task has
    written its rank's share (they write while the ranks start).

    Raises:
        DataError: Some rank's share is empty (the message names it and what to do).
        RendezvousTimeoutError: The shares were not all written within ``timeout`` s.
    """
    store = StoreClient(addr, secret, timeout)
    try:
        status, value = store.get(_env.SHARE_MIN_ROWS_KEY, timeout)
    except RendezvousTimeoutError:
        raise RendezvousTimeoutError(
            f"the Spark tasks did not finish writing the ranks' shares of the DataFrame "
            f"within the start timeout of {timeout:g} s: raise start_timeout "
            f"({_env.START_TIMEOUT}) for a DataFrame this large, or see the tasks' errors"
        ) from None
    finally:
        store.close()
    if status != "ok":
        raise DataError(value)
    return int(value)


def _report(store: StoreClient, rank: int, status: str, payload: object) -> None:
    """Send the outcome; an elastic worker adds its id, since its rank may have changed."""
    if _env.get_bool(_env.ELASTIC):
        store.call(REPORT, rank, status, payload, _env.require_str(_env.WORKER_ID))
    else:
        store.call(REPORT, rank, status, payload)


def _require_int(name: str) -> int:
    value = _env.require_str(name)
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer; the launcher sets it") from None


def _require_hex(name: str) -> bytes:
    try:
        return bytes.fromhex(_env.require_str(name))
    except ValueError:
        raise ConfigError(f"{name} is not hex-encoded; the launcher sets it") from None


def _leave_collectives() -> None:
    """Shut the collectives down gracefully if fn left them running."""
    if "hvd_spark.collectives.api" in sys.modules:
        from hvd_spark.collectives import api

        api.shutdown()


def _close_timelines() -> None:
    """os._exit skips atexit: end the timeline files here, so they hold every event."""
    if "hvd_spark.collectives.timeline" in sys.modules:
        from hvd_spark.collectives import timeline

        timeline.close_all()


if __name__ == "__main__":
    try:
        code = main()
    finally:
        _close_timelines()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
