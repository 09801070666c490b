"""Which CUDA devices a rank sees, so that Horovod's ``set_device(local_rank)`` lands right.

Spark gives each task its GPU addresses (the machine's numbering, as the discovery
script reports them). ``hvd_spark.run(use_gpu=True)`` shows every rank of a host the same
``CUDA_VISIBLE_DEVICES``: the addresses of all the job's tasks on that host, ordered so
that device ``local_rank`` is the rank's own GPU. The order, host by host, ranks in
local-rank order:

1. each rank's first address (Spark's order within a task), unless already listed;
2. then each rank's other addresses, unless already listed.

So with one GPU per task, device ``i`` is local rank ``i``'s GPU; with several per task,
device ``local_rank`` is the rank's first GPU and its others follow all the first ones.
Ranks sharing a GPU (``spark.task.resource.gpu.amount`` < 1) get one entry for it: CUDA
refuses a list that names a device twice, so ``set_device(local_rank)`` cannot work for
them and ``gpu_index`` (``HVD_SPARK_GPU_INDEX``) says each rank's device instead.

Pure functions over what the tasks registered, unit-tested on their own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from hvd_spark.runner.rendezvous import RankInfo


def host_gpu_order(tasks: Sequence[Sequence[str]]) -> list[str]:
    """The devices of one host, in CUDA order, from its tasks' addresses.

    Args:
        tasks: Each rank's GPU addresses on this host, in local-rank order.

    Returns:
        Every address once: the ranks' first addresses, then their others (module doc).
    """
    order: list[str] = []
    for addresses in tasks:
        if addresses and addresses[0] not in order:
            order.append(addresses[0])
    for addresses in tasks:
        order.extend(a for a in addresses[1:] if a not in order)
    return order


def place_gpus(assignment: Mapping[int, RankInfo],
               gpus: Mapping[int, Sequence[str]]) -> dict[int, RankInfo]:
    """Add each host's GPU order and each rank's own device to the rank assignment.

    Args:
        assignment: Partition -> its rank (``rendezvous.assign_ranks``).
        gpus: Partition -> the GPU addresses Spark gave its task (missing: none).

    Returns:
        Partition -> the same RankInfo with ``host_gpus`` and ``gpu_index`` set.
    """
    by_host: dict[str, list[RankInfo]] = {}
    for info in sorted(assignment.values(), key=lambda i: i.local_rank):
        by_host.setdefault(info.host, []).append(info)
    placed: dict[int, RankInfo] = {}
    for infos in by_host.values():
        order = host_gpu_order([list(gpus.get(i.partition, ())) for i in infos])
        for info in infos:
            own = list(gpus.get(info.partition, ()))
            placed[info.partition] = dataclasses.replace(
                info, host_gpus=tuple(order), gpu_index=order.index(own[0]) if own else None)
    return placed


def index_in_visible(address: str, cuda_visible: str | None) -> int | None:
    """The CUDA device index of GPU ``address`` in a process that keeps its environment.

    Used where the rank's ``CUDA_VISIBLE_DEVICES`` stays the executor's (``run_elastic``):
    the address's position when the executor lists its devices, the address itself when
    it does not (CUDA then numbers every GPU of the machine, as Horovod assumes).

    Args:
        address: A Spark GPU address.
        cuda_visible: The process's ``CUDA_VISIBLE_DEVICES`` (None: unset).

    Returns:
        The device index, or None when the address is not a device of the process.
    """
    if cuda_visible is None:
        return int(address) if address.isdigit() else None
    visible = [entry.strip() for entry in cuda_visible.split(",")]
    return visible.index(address) if address in visible else None
