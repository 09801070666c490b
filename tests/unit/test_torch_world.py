"""The torchrun environment every launcher gives its ranks (runner.torch_world)."""

from __future__ import annotations

import socket
import threading

import pytest

from hvd_spark import _env
from hvd_spark.collectives.tcp.store import StoreClient, StoreServer
from hvd_spark.runner import torch_world
from hvd_spark.runner.local.local_launcher import rank_env
from hvd_spark.runner.rendezvous import TaskSlot, assign_ranks, with_master


def test_variables_name_what_torchrun_lightning_and_accelerate_read() -> None:
    env = _env.torchrun_variables(rank=3, size=4, node_rank=1, num_nodes=2, run_id="job",
                                master_addr="10.0.0.1", master_port=29511)
    assert env["MASTER_ADDR"] == "10.0.0.1" and env["MASTER_PORT"] == "29511"
    assert env["GROUP_RANK"] == env["NODE_RANK"] == "1"
    assert env["GROUP_WORLD_SIZE"] == "2"
    assert env["ROLE_RANK"] == "3" and env["ROLE_WORLD_SIZE"] == "4"
    assert env["TORCHELASTIC_RUN_ID"] == "job"
    # rank 0 must start torch's store itself: no agent store exists
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    assert set(env) == set(_env.TORCHRUN_NAMES)


def test_variables_without_a_master_leave_it_to_the_rank() -> None:
    env = _env.torchrun_variables(rank=0, size=2, node_rank=0, num_nodes=1, run_id="j")
    assert "MASTER_ADDR" not in env and "MASTER_PORT" not in env
    assert env["GROUP_RANK"] == "0"


def test_free_port_is_bindable_and_differs_between_calls() -> None:
    ports = {torch_world.free_port("127.0.0.1") for _ in range(5)}
    assert len(ports) > 1  # the kernel's pick, never one fixed number
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports.pop()))


def test_local_ranks_get_a_complete_torch_world() -> None:
    env = rank_env(1, 2, 4567, b"s" * 32, master_port=31000, run_id="r1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", *_env.TORCHRUN_NAMES):
        assert name in env, name
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("1", "2", "1")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "31000")


def test_node_rank_counts_hosts_in_rank_order_and_rank_zeros_endpoint_is_everyones() -> None:
    slots = [TaskSlot(0, "b"), TaskSlot(1, "a"), TaskSlot(2, "b"), TaskSlot(3, "a")]
    ranks = assign_ranks(slots)
    assert {p: (i.rank, i.node_rank, i.num_nodes) for p, i in ranks.items()} == {
        0: (0, 0, 2), 2: (1, 0, 2), 1: (2, 1, 2), 3: (3, 1, 2)}
    endpoints = {p: (f"addr{p}", 40000 + p) for p in range(4)}
    placed = with_master(ranks, endpoints)
    assert {(i.master_addr, i.master_port) for i in placed.values()} == {("addr0", 40000)}


def test_with_master_without_rank_zeros_endpoint_sets_none() -> None:
    ranks = assign_ranks([TaskSlot(0, "h"), TaskSlot(1, "h")])
    placed = with_master(ranks, {0: None, 1: ("x", 1)})
    assert all(i.master_port == 0 for i in placed.values())


def test_exchange_master_hands_rank_zeros_endpoint_to_the_others() -> None:
    secret = b"k" * 32
    server = StoreServer(secret, "127.0.0.1", {})
    got: dict[int, tuple[str, int]] = {}
    try:
        def rank(r: int) -> None:
            client = StoreClient(("127.0.0.1", server.port), secret, 10)
            try:
                got[r] = torch_world.exchange_master(client, r, f"host{r}", 10)
            finally:
                client.close()

        threads = [threading.Thread(target=rank, args=(r,)) for r in (2, 1, 0)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        server.close()
    assert len(set(got.values())) == 1 and got[1][0] == "host0"


def test_fill_master_uses_the_store_only_where_the_launcher_could_not() -> None:
    env = {"MASTER_PORT": "1", "GROUP_RANK": "0"}
    torch_world.fill_master(env, 1.0)  # no store variables needed: nothing to do
    assert env == {"MASTER_PORT": "1", "GROUP_RANK": "0"}
    with pytest.raises(KeyError):
        torch_world.fill_master({"GROUP_RANK": "0"}, 1.0)  # a rank without its store


def test_torch_backends_peer_loss_errors_are_consequences_not_root_causes() -> None:
    from hvd_spark.runner.failures import WorkerFailure, is_peer_loss

    gloo = RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                        "[127.0.0.1]:59584: Connection reset by peer")
    assert is_peer_loss(gloo)
    assert WorkerFailure.from_exception(1, "h", gloo).secondary
    assert not is_peer_loss(ValueError("loss is nan"))


def test_a_sigkill_before_the_launcher_escalated_is_not_blamed_on_the_teardown() -> None:
    from hvd_spark.runner.failures import WorkerFailure

    own = WorkerFailure.from_exit(2, "h", -9, torn_down=True, escalated=False)
    assert not own.secondary and own.lost and "stopped by the launcher" not in own.message
    ours = WorkerFailure.from_exit(2, "h", -9, torn_down=True, escalated=True)
    assert ours.secondary and "stopped by the launcher" in ours.message
    term = WorkerFailure.from_exit(0, "h", -15, torn_down=True, escalated=False)
    assert term.secondary
