"""The TCP and MPI engines (and the NCCL device path, where a GPU is) against the
engine contract, on real ranks: TCP ranks on threads over real sockets, MPI ranks as
processes under mpirun."""

from __future__ import annotations

import gc
import os
import pickle
import subprocess
import sys
import threading

import pytest

from hvd_spark.collectives.communicator import Communicator
from hvd_spark.collectives.tcp.communicator import TcpCommunicator
from hvd_spark.collectives.tcp.engine import TcpEngine
from hvd_spark.collectives.tcp.mesh import build_mesh
from hvd_spark.collectives.tcp.store import StoreClient, StoreServer
from hvd_spark.runner.local.mpi_launcher import mpirun_command
from tests.contract import engine_jobs, mpi_engine_ranks
from tests.contract.engine_contract import SIZE, EngineContract

SECRET = b"engine-contract-0123456789abcdef"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _on_threads(fn, count: int, timeout: float = 60.0) -> None:
    threads = [threading.Thread(target=fn, args=(r,)) for r in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)


def run_tcp_job(name: str, kit: type = engine_jobs.HostKit, wrap=None) -> list[tuple]:
    """Form ``SIZE`` TCP ranks over loopback (threads of this process), run job ``name``
    on their engines, shut them down; each rank's outcome."""
    config = engine_jobs.config_for(name)
    before = frozenset(threading.enumerate())
    server = StoreServer(SECRET)
    engines: list[TcpEngine | None] = [None] * SIZE

    def form(rank: int) -> None:
        store = StoreClient(("127.0.0.1", server.port), SECRET)
        mesh = build_mesh(rank, SIZE, store, SECRET, "host", "", timeout=30,
                          local_sockets=config.use_shm)
        store.close()
        comm: Communicator = TcpCommunicator(rank, SIZE, mesh.data, config.chunk_bytes,
                                             config.use_shm)
        if wrap is not None:
            comm = wrap(comm)
        engines[rank] = TcpEngine(rank, SIZE, comm, mesh.control, config)

    _on_threads(form, SIZE)
    server.close()
    assert all(e is not None for e in engines), "mesh formation failed"
    outcomes: list[tuple] = [("err", "Timeout", "the job did not end")] * SIZE

    def job(rank: int) -> None:
        try:
            ctx = engine_jobs.Rank(engines[rank], rank, SIZE, kit(), before)
            outcomes[rank] = ("ok", engine_jobs.JOBS[name](ctx))
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            outcomes[rank] = ("err", type(exc).__name__, str(exc))

    try:
        _on_threads(job, SIZE)
    finally:
        # Together: rank 0 leaves once every rank said goodbye.
        _on_threads(lambda rank: engines[rank].shutdown(), SIZE)
        # A failure's traceback may hold views of shared memory: unmap them now.
        engines.clear()
        gc.collect()
    return outcomes


class TestTcpEngine(EngineContract):
    def run_job(self, name):
        return run_tcp_job(name)


def _gpu_problem() -> str | None:
    """Why CUDA tensors cannot run here; None when a GPU and cupy are there."""
    from hvd_spark.collectives.nccl import library

    problem = library.cupy_problem()
    if problem is not None:
        return problem
    try:
        count = library.cupy().cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - no driver, no device alike
        return f"{type(exc).__name__}: {exc}"
    return None if count else "no CUDA device"


class TestNcclEngine(EngineContract):
    """The TCP engine with the device path (NCCL, or what it selects), on cupy tensors."""

    @pytest.fixture(autouse=True)
    def _needs_a_gpu(self):
        problem = _gpu_problem()
        if problem is not None:
            pytest.skip(f"no GPU here ({problem})")

    def run_job(self, name):
        from hvd_spark.collectives.nccl import device

        return run_tcp_job(name, engine_jobs.CupyKit, wrap=lambda comm: device.wrap(comm, "host"))


@pytest.fixture(scope="module")
def mpi_outcomes(tmp_path_factory) -> dict[str, list[tuple]]:
    """Every job in one mpirun session: each rank runs them in turn on fresh engines."""
    out = tmp_path_factory.mktemp("mpi-engine")
    env = {mpi_engine_ranks.JOBS_VAR: ",".join(engine_jobs.JOBS),
           mpi_engine_ranks.OUT_VAR: str(out),
           "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    args, full_env = mpirun_command(
        SIZE, [sys.executable, "-m", "tests.contract.mpi_engine_ranks"], env)
    proc = subprocess.run(args, env=full_env, cwd=ROOT, capture_output=True, text=True,
                          timeout=180)
    found: dict[str, list[tuple]] = {}
    for name in engine_jobs.JOBS:
        found[name] = []
        for rank in range(SIZE):
            path = out / f"{name}.{rank}.pkl"
            if not path.exists():
                found[name].append(("err", "Missing", proc.stdout + proc.stderr))
                continue
            with open(path, "rb") as f:
                found[name].append(pickle.load(f))
    return found


class TestMpiEngine(EngineContract):
    """MPI ranks as processes under mpirun (one session runs every job)."""

    @pytest.fixture(autouse=True)
    def _outcomes(self, mpi_outcomes):
        self.outcomes = mpi_outcomes

    def run_job(self, name):
        return self.outcomes[name]
