"""The environment ``torchrun`` gives its workers, built once for every rank we start.

``torch.distributed.init_process_group()`` with no arguments reads ``MASTER_ADDR``,
``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE`` (its ``env://`` rendezvous); Lightning
recognises a torchrun job by ``RANK``, ``GROUP_RANK``, ``LOCAL_RANK`` and
``LOCAL_WORLD_SIZE``; ``accelerate`` and the Hugging Face ``Trainer`` read ``LOCAL_RANK`` and
``WORLD_SIZE``. Every launcher puts these variables in its ranks' environment through
:func:`variables`, so a script written for ``torchrun --nproc-per-node N`` runs unchanged
under ``hvdrun -np N`` or ``hvd_spark.run``, next to our own ring.

``MASTER_PORT`` is a port found free on rank 0's host while the job forms (never a fixed
number, so two jobs on one host do not collide); rank 0's ``init_process_group`` then
listens on it. Between the probe and torch's bind another process could take the port, as
with torchrun's own probe; the job then fails at once naming the address in use.
"""

from __future__ import annotations

import socket
from typing import Any

MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
#: Where rank 0 publishes ``(address, port)`` in the launcher's store, for launchers that
#: cannot know rank 0's host before the ranks start (ssh hosts).
STORE_KEY = "torch_master"
#: Every name this module sets (the rank's own RANK/WORLD_SIZE/LOCAL_* come from
#: ``_env.rank_variables``).
NAMES = (MASTER_ADDR, MASTER_PORT, "GROUP_RANK", "NODE_RANK", "GROUP_WORLD_SIZE",
         "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_RUN_ID",
         "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
         "TORCHELASTIC_USE_AGENT_STORE")


def free_port(host: str = "") -> int:
    """A TCP port that is free on this machine's ``host`` interface now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def variables(*, rank: int, size: int, node_rank: int, num_nodes: int, run_id: str,
              master_addr: str | None = None, master_port: int | None = None
              ) -> dict[str, str]:
    """The torchrun variables of one rank besides ``RANK``/``WORLD_SIZE``/``LOCAL_*``.

    Args:
        rank: The rank's global rank (torchrun's ``ROLE_RANK`` equals it: one role).
        size: The number of ranks.
        node_rank: Index of the rank's host among the job's hosts (``GROUP_RANK``, and
            Lightning's ``NODE_RANK``).
        num_nodes: Number of hosts (``GROUP_WORLD_SIZE``).
        run_id: The job's id (``TORCHELASTIC_RUN_ID``).
        master_addr: Rank 0's address as the other ranks reach it; None where the rank
            learns it as it starts (:func:`exchange_master`).
        master_port: The port found free on rank 0's host; None likewise.
    """
    values: dict[str, Any] = {
        MASTER_ADDR: master_addr,
        MASTER_PORT: master_port,
        "GROUP_RANK": node_rank,
        "NODE_RANK": node_rank,
        "GROUP_WORLD_SIZE": num_nodes,
        "ROLE_RANK": rank,
        "ROLE_WORLD_SIZE": size,
        "ROLE_NAME": "default",
        "TORCHELASTIC_RUN_ID": run_id,
        # A fixed job: torch.distributed's restarts are ours (the Estimators' recovery).
        "TORCHELASTIC_RESTART_COUNT": 0,
        "TORCHELASTIC_MAX_RESTARTS": 0,
        # No agent hosts a store here: rank 0's init_process_group starts it on MASTER_PORT.
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }
    if master_addr is None or master_port is None:
        del values[MASTER_ADDR], values[MASTER_PORT]
    return {name: str(value) for name, value in values.items()}


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
    if MASTER_PORT in env or "GROUP_RANK" not in env:
        return
    from hvd_spark import _env
    from hvd_spark.collectives.tcp import wire
    from hvd_spark.collectives.tcp.store import StoreClient

    addr = wire.parse_addr(env[_env.RENDEZVOUS_ADDR], _env.RENDEZVOUS_ADDR)
    store = StoreClient(addr, bytes.fromhex(env[_env.SECRET]), timeout)
    try:
        address = env.get(_env.ADVERTISE_ADDR) or store.local_address
        master = exchange_master(store, int(env[_env.RANK]), address, timeout)
    finally:
        store.close()
    env[MASTER_ADDR], env[MASTER_PORT] = master[0], str(master[1])
