"""The communicator the engine sees: host buffers to the host backend, device buffers to
the device path chosen for this job (NCCL, CUDA IPC, both, or host staging).

The device path forms at the first collective on device buffers, on every rank at the
same point (the engine runs operations in one order everywhere, and the coordinator
made the ranks agree that this one is on the GPU): the ranks exchange their (host, GPU)
over the host communicator, decide with ``selection.plan``, and form NCCL/IPC groups.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from hvd_spark.collectives import ops
from hvd_spark.collectives.buffers import SegmentedBuffer
from hvd_spark.collectives.communicator import Communicator
from hvd_spark.collectives.nccl import library, selection, streams
from hvd_spark.collectives.nccl.arrays import is_device
from hvd_spark.collectives.nccl.exchange import allgather_bytes
from hvd_spark.collectives.nccl.staging import HostStagingCommunicator

log = logging.getLogger(__name__)


def wanted(setting: str | None = None) -> bool:
    """True when device tensors may take a device path here (cupy is installed and the
    GPU backend is not ``host``); cheap, imports nothing."""
    setting = setting or selection.gpu_backend_setting()
    return setting != selection.HOST and library.cupy_installed()


def bus_id(device_id: int) -> str:
    """The PCI bus id of CUDA device ``device_id`` (names one GPU on a host)."""
    return library.cupy().cuda.runtime.deviceGetPCIBusId(device_id)


class DeviceAwareCommunicator(Communicator):
    """Routes each collective by where its buffer lives.

    Args:
        host: The host backend's communicator (TCP or MPI).
        hostname: This rank's host name (ranks on one host may share a GPU).
        setting: ``selection.gpu_backend_setting()``.
    """

    def __init__(self, host: Communicator, hostname: str, setting: str) -> None:
        self.host = host
        self.name = host.name
        self.rank, self.size = host.rank, host.size
        self.hostname = hostname
        self.setting = setting
        self.plan: selection.DevicePlan | None = None
        self._device: Communicator | None = None
        self._staging = HostStagingCommunicator(host)
        # The host backend's chunk size and express lane serve host buffers, which go to
        # it; its allreduce options (source=, finish=) are not passed through.
        self.tunes_chunks = host.tunes_chunks
        self.express_lane = host.express_lane

    def __getattr__(self, name: str) -> Any:
        # The host backend's own attributes (a TCP ring's links, ...) stay visible.
        if name == "host":
            raise AttributeError(name)
        return getattr(self.host, name)

    # ------------------------------------------------------------------ forming the path

    def device_path(self, device_id: int) -> Communicator:
        """The device communicator, formed at the first device collective (on the device
        of its tensors: one device per rank)."""
        if self._device is None:
            self._device = self._form(device_id)
        return self._device

    def _form(self, device_id: int) -> Communicator:
        nccl_here = int(library.nccl_version() > 0)
        mine = f"{self.hostname}\n{bus_id(device_id)}\n{nccl_here}"
        facts = [b.decode().split("\n") for b in allgather_bytes(self.host, mine.encode())]
        devices = {r: (host, bus) for r, (host, bus, _) in enumerate(facts)}
        # NCCL only if every rank can load it: the ranks must all choose the same path.
        nccl_ok = all(flag == "1" for _, _, flag in facts)
        self.plan = plan = selection.plan(self.rank, devices, self.setting, nccl_ok=nccl_ok)
        log.info("rank %d: CUDA tensors go by %s (%s)", self.rank, plan.mode, plan.reason)
        if plan.mode == selection.HOST and self.setting != selection.HOST and self.rank == 0:
            library.warn_host_staging(_staging_problem(plan, facts))
        # The engine thread's cupy work (packing, scaling, outputs, staging copies) goes to
        # the tensors' device, on the collective stream: after the producers' events, before
        # the consumers'. (cupy's current device is per thread; torch's set_device is not it.)
        library.cupy().cuda.Device(device_id).use()
        streams.collective_stream(device_id).use()
        if plan.mode == selection.HOST:
            return self._staging
        from hvd_spark.collectives.nccl.communicator import NcclCommunicator
        from hvd_spark.collectives.nccl.ipc import IpcCommunicator

        if plan.mode == selection.NCCL:
            return NcclCommunicator.form(self.host, device_id)
        ipc = IpcCommunicator(self.host.subset(plan.ipc_group), device_id)
        if plan.mode == "ipc":
            return ipc
        from hvd_spark.collectives.nccl.hierarchical import HierarchicalDeviceCommunicator

        leaders_nccl = None
        if self.rank == plan.leader:
            leaders_nccl = NcclCommunicator.form(self.host.subset(plan.leaders), device_id)
        groups = sorted((tuple(r for r in sorted(devices) if devices[r] == devices[lead])
                         for lead in plan.leaders), key=lambda g: g[0])
        return HierarchicalDeviceCommunicator(self.host, ipc, leaders_nccl, groups)

    def _route(self, sample: Any) -> Communicator:
        if not is_device(sample):
            return self.host
        from hvd_spark.collectives.nccl.communicator import supports

        path = self.device_path(int(sample.device.id))  # formed at the first one, any dtype
        if not supports(sample.dtype):
            return self._staging  # int16/uint16: NCCL has no such type
        return path

    # ------------------------------------------------------------------ the contract

    def allreduce(self, buf: SegmentedBuffer, op: ops.ReduceOp) -> None:
        self._route(buf.pieces[0] if buf.pieces else None).allreduce(buf, op)

    def reducescatter(self, buf: SegmentedBuffer, op: ops.ReduceOp, counts: Sequence[int]) -> None:
        self._route(buf.pieces[0] if buf.pieces else None).reducescatter(buf, op, counts)

    def allgather(self, buf: SegmentedBuffer, counts: Sequence[int]) -> None:
        self._route(buf.pieces[0] if buf.pieces else None).allgather(buf, counts)

    def broadcast(self, buf: SegmentedBuffer, root: int) -> None:
        self._route(buf.pieces[0] if buf.pieces else None).broadcast(buf, root)

    def alltoall(self, send: Any, send_counts: Sequence[int], recv: Any,
                 recv_counts: Sequence[int]) -> None:
        self._route(send).alltoall(send, send_counts, recv, recv_counts)

    def subset(self, members: Sequence[int]) -> DeviceAwareCommunicator:
        """A process set's view: its own device path, formed at its first device collective."""
        return DeviceAwareCommunicator(self.host.subset(members), self.hostname, self.setting)

    def set_chunk_bytes(self, chunk_bytes: int) -> None:
        """The host backend's (see ``Communicator.set_chunk_bytes``)."""
        self.host.set_chunk_bytes(chunk_bytes)

    def abort(self) -> None:
        if self._device is not None and self._device is not self._staging:
            self._device.abort()
        self.host.abort()

    def close(self) -> None:
        try:
            if self._device is not None and self._device is not self._staging:
                self._device.close()
        finally:
            self.host.close()


def _staging_problem(plan: selection.DevicePlan, facts: list[list[str]]) -> str:
    """Why the plan stages through the host, naming the ranks that lack NCCL and, where
    this rank is one of them, its own import error."""
    missing = [r for r, (_, _, flag) in enumerate(facts) if flag != "1"]
    if not missing:
        return plan.reason
    mine = library.nccl_problem() if 0 in missing else None
    return f"NCCL cannot be loaded on rank(s) {missing}" + (f" (rank 0: {mine})" if mine else "")


def wrap(host: Communicator, hostname: str) -> Communicator:
    """``host`` itself where no device path is wanted, else a DeviceAwareCommunicator."""
    setting = selection.gpu_backend_setting()
    if not wanted(setting):
        return host
    return DeviceAwareCommunicator(host, hostname, setting)
