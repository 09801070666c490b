"""Rank assignment: which Spark task becomes which rank, grouped host by host.

A pure function over what the tasks registered (partition id and host), so the
driver can assign every rank at once and the rule is unit-tested on its own.

Ranks on one host are consecutive, hosts are ordered by their lowest partition id,
and within a host tasks are ordered by partition id. As in Horovod, ``local_rank``
counts ranks on the same host and ``cross_rank``/``cross_size`` index the hosts
that have a rank with the same ``local_rank``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from hvd_spark.config import RankPlace
from hvd_spark.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class TaskSlot:
    """What one barrier task told the driver about itself.

    Attributes:
        partition: The task's partition id (0..num_proc-1).
        host: Name of the machine it runs on; equal names mean shared memory works.
    """

    partition: int
    host: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankInfo(RankPlace):
    """Where one task's rank sits in the job: its ``RankPlace`` (rank, size, local and
    cross rank and size), and what the launcher knows besides.

    Attributes:
        partition: The Spark partition the rank runs in.
        host: The host it runs on.
        host_gpus: The GPU addresses of the job's tasks on this host, in CUDA device order
            (``gpu_mapping.host_gpu_order``); empty without GPU scheduling.
        gpu_index: Index in ``host_gpus`` of the rank's own (first) GPU; None without one.
        node_rank, num_nodes: Index of the rank's host among the job's hosts (in rank
            order), and their number: torchrun's ``GROUP_RANK`` and ``GROUP_WORLD_SIZE``.
        master_addr, master_port: Rank 0's address as the others reach it and a port found
            free on its host (``torch_world``); empty and 0 until every task registered.
    """

    partition: int
    host: str
    host_gpus: tuple[str, ...] = ()
    gpu_index: int | None = None
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str = ""
    master_port: int = 0


def assign_ranks(slots: Sequence[TaskSlot]) -> dict[int, RankInfo]:
    """Assign a rank to every task.

    Args:
        slots: One entry per task, any order; partition ids must be distinct.

    Returns:
        Partition id -> its RankInfo.

    Raises:
        ConfigError: No tasks, or a partition id registered twice.
    """
    if not slots:
        raise ConfigError("cannot assign ranks: no task registered")
    partitions = [s.partition for s in slots]
    if len(set(partitions)) != len(partitions):
        raise ConfigError(f"a partition registered twice: {sorted(partitions)}")
    by_host: dict[str, list[int]] = {}
    for slot in sorted(slots, key=lambda s: s.partition):
        by_host.setdefault(slot.host, []).append(slot.partition)
    # dict order = order of each host's lowest partition, since slots were sorted.
    hosts = list(by_host)
    size = len(slots)
    result: dict[int, RankInfo] = {}
    rank = 0
    for host in hosts:
        local = by_host[host]
        for local_rank, partition in enumerate(local):
            peers = [h for h in hosts if len(by_host[h]) > local_rank]
            result[partition] = RankInfo(
                partition=partition,
                host=host,
                rank=rank,
                size=size,
                local_rank=local_rank,
                local_size=len(local),
                cross_rank=peers.index(host),
                cross_size=len(peers),
                node_rank=hosts.index(host),
                num_nodes=len(hosts),
            )
            rank += 1
    return result


def with_master(assignment: Mapping[int, RankInfo],
                endpoints: Mapping[int, tuple[str, int] | None]) -> dict[int, RankInfo]:
    """Give every rank rank 0's endpoint as its torch.distributed master.

    Args:
        assignment: Partition -> RankInfo, as ``assign_ranks`` returns it.
        endpoints: Partition -> the ``(address, free port)`` its task found on its host, or
            None from a task that sent none (then no rank gets a master).

    Returns:
        The same assignment with ``master_addr`` and ``master_port`` set.
    """
    first = next(p for p, info in assignment.items() if info.rank == 0)
    endpoint = endpoints.get(first)
    if endpoint is None:
        return dict(assignment)
    addr, port = endpoint
    return {p: dataclasses.replace(info, master_addr=addr, master_port=int(port))
            for p, info in assignment.items()}
