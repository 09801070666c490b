"""The GPU path's decisions and plumbing that need no GPU: selection, settings, the
unique-id and device exchanges over a real host ring, the fusion buffer's packing."""

from __future__ import annotations

import numpy as np
import pytest

from hvd_spark.collectives import ops
from hvd_spark.collectives.nccl import exchange, library, selection
from hvd_spark.collectives.nccl.device import DeviceAwareCommunicator, wanted, wrap
from hvd_spark.collectives.nccl.fusion import FusionBuffer
from hvd_spark.collectives.nccl.ipc import combine_in_rank_order
from hvd_spark.collectives.nccl.staging import HostStagingCommunicator
from hvd_spark.errors import BackendUnavailableError, CollectiveError, ConfigError
from tests.contract.communicator_contract import CommunicatorContract, run_parallel
from tests.contract.test_tcp_contract import make_tcp

GPU_VARS = ("HVD_SPARK_GPU_BACKEND", "HOROVOD_GPU_OPERATIONS")


@pytest.fixture
def clean(monkeypatch):
    for var in GPU_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.parametrize("var, value, want", [
    ("HVD_SPARK_GPU_BACKEND", "nccl", "nccl"), ("HVD_SPARK_GPU_BACKEND", "HOST", "host"),
    ("HVD_SPARK_GPU_BACKEND", "auto", "auto"), ("HOROVOD_GPU_OPERATIONS", "NCCL", "nccl"),
    ("HOROVOD_GPU_OPERATIONS", "MPI", "host"), ("HOROVOD_GPU_OPERATIONS", "gloo", "host"),
])
def test_settings(clean, var, value, want):
    clean.setenv(var, value)
    assert selection.gpu_backend_setting() == want


def test_ours_wins_over_horovods(clean):
    clean.setenv("HOROVOD_GPU_OPERATIONS", "NCCL")
    clean.setenv("HVD_SPARK_GPU_BACKEND", "host")
    assert selection.gpu_backend_setting() == "host"


@pytest.mark.parametrize("var", GPU_VARS)
def test_a_bad_setting_names_its_variable(clean, var):
    clean.setenv(var, "rdma")
    with pytest.raises(ConfigError, match=var):
        selection.gpu_backend_setting()


def test_unset_is_auto(clean):
    assert selection.gpu_backend_setting() == "auto"


def _devices(*pairs):
    return dict(enumerate(pairs))


def test_every_rank_its_own_gpu_is_nccl():
    devices = _devices(("h1", "0"), ("h1", "1"), ("h2", "0"), ("h2", "1"))
    p = selection.plan(2, devices, "auto", nccl_ok=True)
    assert p.mode == "nccl" and p.ipc_group == (2,) and p.leaders == (0, 1, 2, 3)


def test_same_bus_id_on_two_hosts_is_two_gpus():
    p = selection.plan(0, _devices(("h1", "0"), ("h2", "0")), "auto", nccl_ok=True)
    assert p.mode == "nccl"


def test_two_ranks_on_one_gpu_use_ipc():
    p = selection.plan(1, _devices(("h", "0"), ("h", "0")), "auto", nccl_ok=False)
    assert p.mode == "ipc" and p.ipc_group == (0, 1) and p.leader == 0 and p.leaders == (0,)


def test_shared_gpus_and_several_gpus_are_hierarchical():
    devices = _devices(("h", "0"), ("h", "1"), ("h", "0"), ("h", "1"))
    p = selection.plan(3, devices, "nccl", nccl_ok=True)
    assert p.mode == "ipc+nccl" and p.ipc_group == (1, 3) and p.leaders == (0, 1)
    assert p.leader == 1


def test_host_setting_always_stages():
    p = selection.plan(0, _devices(("h", "0"), ("h", "1")), "host", nccl_ok=True)
    assert p.mode == "host"


def test_without_nccl_auto_falls_back_and_nccl_refuses():
    devices = _devices(("h", "0"), ("h", "1"))
    p = selection.plan(0, devices, "auto", nccl_ok=False)
    assert p.mode == "host" and "NCCL cannot be loaded" in p.reason
    with pytest.raises(BackendUnavailableError, match="HVD_SPARK_GPU_BACKEND=nccl"):
        selection.plan(0, devices, "nccl", nccl_ok=False)


def test_shared_gpu_without_ipc_cannot_be_nccl():
    devices = _devices(("h", "0"), ("h", "0"))
    assert selection.plan(0, devices, "auto", nccl_ok=True, ipc_ok=False).mode == "host"
    with pytest.raises(BackendUnavailableError, match="share one GPU"):
        selection.plan(0, devices, "nccl", nccl_ok=True, ipc_ok=False)


def test_without_cupy_nothing_is_wrapped_and_builds_say_so(clean):
    assert not library.cupy_installed()  # this CI machine has no GPU stack
    assert library.nccl_version() == 0 and library.device_count() == 0
    assert not wanted()
    comms = make_tcp(1, use_shm=False)
    try:
        assert wrap(comms[0], "h") is comms[0]
    finally:
        comms[0].close()


def test_unique_id_travels_the_host_ring_intact():
    comms = make_tcp(3, use_shm=True)
    uid = bytes(range(128))
    try:
        got = run_parallel(comms, lambda c: exchange.broadcast_unique_id(
            c, 1, uid if c.rank == 1 else None))
        assert got == [uid] * 3
        with pytest.raises(CollectiveError, match="128 bytes"):
            exchange.broadcast_unique_id(comms[0], 0, b"short")
    finally:
        for c in comms:
            c.close()


def test_unique_id_tuple_round_trip():
    uid = bytes(range(256))[::2]
    values = exchange.id_to_tuple(uid)
    assert min(values) >= -128 and max(values) <= 127
    assert exchange.id_from_tuple(values) == uid


def test_allgather_bytes_of_different_lengths():
    comms = make_tcp(3, use_shm=False)
    try:
        got = run_parallel(comms, lambda c: exchange.allgather_bytes(c, b"x" * c.rank))
        assert got == [[b"", b"x", b"xx"]] * 3
    finally:
        for c in comms:
            c.close()


def test_fusion_buffer_packs_and_unpacks_and_reuses_its_scratch():
    fusion = FusionBuffer(np)
    pieces = [np.arange(3.0), np.arange(5.0) + 10, np.arange(2.0) + 20]
    flat = fusion.pack(pieces)
    assert flat.tolist() == [0, 1, 2, 10, 11, 12, 13, 14, 20, 21]
    flat *= 2
    fusion.unpack(flat, pieces)
    assert pieces[1].tolist() == [20, 22, 24, 26, 28]
    capacity = fusion.capacity(np.float64)
    fusion.pack([np.ones(2), np.ones(2)])
    assert fusion.capacity(np.float64) == capacity  # no new allocation for a smaller set
    single = np.ones(4)
    assert fusion.pack([single]) is single


@pytest.mark.parametrize("op, want", [(ops.Sum, 6.0), (ops.Min, 1.0), (ops.Max, 3.0),
                                      (ops.Product, 6.0), (ops.Average, 6.0)])
def test_ipc_combination_in_rank_order(op, want):
    parts = [np.full(4, v, np.float32) for v in (1.0, 2.0, 3.0)]
    out = np.empty(4, np.float32)
    combine_in_rank_order(np, parts, op, out)
    assert (out == want).all()
    flags = [np.array([True, False, False]), np.array([False, False, True])]
    got = np.empty(3, bool)
    combine_in_rank_order(np, flags, ops.Sum, got)
    assert got.tolist() == [True, False, True]


class TestHostStagingContract(CommunicatorContract):
    """The staging fallback runs the host ring underneath (here on host buffers)."""

    def make(self, size):
        return [HostStagingCommunicator(c, owns_host=True) for c in make_tcp(size, use_shm=True)]


class TestDeviceAwareRoutesHostBuffersToTheHost(CommunicatorContract):
    def make(self, size):
        return [DeviceAwareCommunicator(c, "h", "auto") for c in make_tcp(size, use_shm=True)]


def test_the_routing_layer_shows_the_host_backends_attributes():
    comms = make_tcp(2, use_shm=False)
    try:
        routed = DeviceAwareCommunicator(comms[0], "h", "auto")
        assert routed.name == "tcp" and routed.links is comms[0].links
        assert routed.plan is None  # no device collective yet
        with pytest.raises(AttributeError):
            routed.no_such_attribute  # noqa: B018
    finally:
        for c in comms:
            c.close()


def test_importing_the_device_path_imports_no_cupy_torch_or_mpi():
    import subprocess
    import sys

    code = ("import sys\n"
            "import hvd_spark.collectives, hvd_spark.collectives.device_ops\n"
            "import hvd_spark.collectives.nccl.communicator, hvd_spark.collectives.nccl.ipc\n"
            "import hvd_spark.collectives.nccl.hierarchical, hvd_spark.collectives.nccl.device\n"
            "import hvd_spark.collectives.nccl.streams, hvd_spark.collectives.mpi\n"
            "print(sorted(m for m in ('cupy', 'torch', 'mpi4py', 'tensorflow') "
            "if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr
