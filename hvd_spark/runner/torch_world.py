"""Where torch.distributed's master is: a port found free on rank 0's host, for every launcher.

``torch.distributed.init_process_group()`` with no arguments reads ``MASTER_ADDR``,
``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE`` (its ``env://`` rendezvous); Lightning
recognises a torchrun job by ``RANK``, ``GROUP_RANK``, ``LOCAL_RANK`` and
``LOCAL_WORLD_SIZE``; ``accelerate`` and the Hugging Face ``Trainer`` read ``LOCAL_RANK`` and
``WORLD_SIZE``. Every launcher puts these variables (``_env.torchrun_variables``) in its
ranks' environment, so a script written for ``torchrun --nproc-per-node N`` runs unchanged
under ``hvdrun -np N`` or ``hvd_spark.run``, next to our own ring.

``MASTER_PORT`` is a port found free on rank 0's host while the job forms (never a fixed
number, so two jobs on one host do not collide); rank 0's ``init_process_group`` then
listens on it. Between the probe and torch's bind another process could take the port, as
with torchrun's own probe; the job then fails at once naming the address in use. This
module probes the port and, where the launcher cannot reach rank 0's host, has rank 0
publish it through the launcher's store.
"""

from __future__ import annotations

from typing import Any

from hvd_spark import _env

# The one port probe, shared with the elastic membership (the collectives cannot import
# the runner); the launchers call it as ``torch_world.free_port``.
from hvd_spark.collectives.tcp.wire import free_port
from hvd_spark.runner.rendezvous import RankInfo

#: Where rank 0 publishes ``(address, port)`` in the launcher's store, for launchers that
#: cannot know rank 0's host before the ranks start (ssh hosts).
STORE_KEY = "torch_master"


def rank_world(info: RankInfo, run_id: str) -> dict[str, str]:
    """A placed rank's variables, the one builder every fixed-size launcher uses: its place
    under our, Horovod's and torch's names, and torchrun's world (with rank 0's endpoint
    when ``info`` has it; else the rank learns it as it starts, ``fill_master``)."""
    master = (info.master_addr, info.master_port) if info.master_port else (None, None)
    return {
        **info.variables(info.host),
        **_env.torchrun_variables(rank=info.rank, size=info.size, node_rank=info.node_rank,
                                  num_nodes=info.num_nodes, run_id=run_id,
                                  master_addr=master[0], master_port=master[1]),
    }


def exchange_master(store: Any, rank: int, address: str, timeout: float) -> tuple[str, int]:
    """Rank 0 probes a free port and publishes ``(address, port)``; every rank returns it.

    For launchers whose rank 0 runs where the launcher cannot probe (another host).

    Args:
        store: A ``StoreClient`` of the launcher's store.
        rank: This rank.
        address: This host's address as the other ranks reach it (used by rank 0).
        timeout: Seconds the other ranks wait for rank 0's answer.

    Raises:
        RendezvousTimeoutError: Rank 0 did not publish within ``timeout``.
    """
    if rank == 0:
        endpoint = (address, free_port())
        store.set(STORE_KEY, endpoint)
        return endpoint
    address, port = store.get(STORE_KEY, timeout)
    return str(address), int(port)


def fill_master(env: dict[str, str], timeout: float) -> None:
    """Add ``MASTER_ADDR``/``MASTER_PORT`` to a rank's ``env`` through its launcher's store,
    where the launcher could not (rank 0 on another host); nothing where they are set.

    Args:
        env: The rank's environment: ``HVD_SPARK_RANK``, the store's address and the secret.
        timeout: Seconds to wait for rank 0's answer.
    """
    if _env.MASTER_PORT in env or "GROUP_RANK" not in env:
        return
    from hvd_spark.collectives.tcp.store import StoreClient
    from hvd_spark.collectives.tcp.wire import parse_addr

    addr = parse_addr(env[_env.RENDEZVOUS_ADDR], _env.RENDEZVOUS_ADDR)
    store = StoreClient(addr, bytes.fromhex(env[_env.SECRET]), timeout)
    try:
        address = env.get(_env.ADVERTISE_ADDR) or store.local_address
        master = exchange_master(store, int(env[_env.RANK]), address, timeout)
    finally:
        store.close()
    env[_env.MASTER_ADDR], env[_env.MASTER_PORT] = master[0], str(master[1])
