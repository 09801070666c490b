"""A Spark task starts its rank's process before it registers and hands over the rank's
variables on stdin afterwards (``task_process.start_worker(rank_env_later=True)``,
``send_rank_env``, ``worker.receive_rank_env``). Real processes and a real store."""

from __future__ import annotations

import os
import secrets

import cloudpickle

from hvd_spark import _env
from hvd_spark.collectives.tcp.store import StoreServer
from hvd_spark.runner import worker
from hvd_spark.runner.rendezvous import RankInfo
from hvd_spark.runner.spark.spark_task import TaskSpec, child_env, early_env
from hvd_spark.runner.spark.task_process import reap_worker, send_rank_env, start_worker


def _what_the_rank_sees() -> dict:
    names = (_env.RANK, _env.SIZE, _env.HOSTNAME, "RANK", "CUDA_VISIBLE_DEVICES",
             _env.GPU_INDEX, _env.RANK_ENV_ON_STDIN, "DROPPED", "USER_VAR")
    return {name: os.environ.get(name) for name in names}


def _job(secret: bytes):
    reports = []
    server = StoreServer(secret, handlers={worker.REPORT: lambda *a: reports.append(a)})
    server.set(worker.FN_KEY, cloudpickle.dumps((_what_the_rank_sees, (), {})))
    spec = TaskSpec(driver_addr=f"127.0.0.1:{server.port}", secret=secret, start_timeout_s=20.0,
                    heartbeat_s=10.0, env={"USER_VAR": "u"}, use_gpu=True, run_id="t1")
    return server, spec, reports


def test_a_worker_started_early_runs_with_its_rank_variables():
    secret = secrets.token_bytes(16)
    server, spec, reports = _job(secret)
    base = {**os.environ, "DROPPED": "x", _env.GPU_INDEX: "7"}
    started_with = early_env(base, spec)
    proc = start_worker(started_with, rank_env_later=True)
    try:
        info = RankInfo(partition=0, host="host-a", rank=1, size=2, local_rank=1,
                        local_size=2, cross_rank=0, cross_size=1, host_gpus=("3", "5"),
                        gpu_index=1)
        env = child_env(base, spec, info, ["3", "5"], ["5"])
        del env["DROPPED"]  # what the task's environment lacks is removed from the rank's
        send_rank_env(proc, started_with, env)
        assert proc.wait(60) == 0, proc.stderr.read().decode()
    finally:
        reap_worker(proc, secret)
        proc.stdout.close()
        proc.stderr.close()
        server.close()
    assert [(rank, status) for rank, status, _ in reports] == [(1, "ok")]
    assert cloudpickle.loads(reports[0][2]) == {
        _env.RANK: "1", _env.SIZE: "2", _env.HOSTNAME: "host-a", "RANK": "1",
        "CUDA_VISIBLE_DEVICES": "3,5", _env.GPU_INDEX: "1", _env.RANK_ENV_ON_STDIN: None,
        "DROPPED": None, "USER_VAR": "u"}


def test_a_worker_whose_task_ends_before_registering_exits_saying_so():
    secret = secrets.token_bytes(16)
    server, spec, reports = _job(secret)
    proc = start_worker(early_env(dict(os.environ), spec), rank_env_later=True)
    try:
        proc.stdin.close()  # the task failed to register and is going away
        assert proc.wait(60) != 0
        err = proc.stderr.read().decode()
    finally:
        reap_worker(proc, secret)
        proc.stdout.close()
        proc.stderr.close()
        server.close()
    assert "did not hand over the rank's place" in err, err
    assert reports == []  # it never ran fn, so it reports nothing
