"""torch.distributed code (DDP, FSDP2, torch.distributed.checkpoint) on our ranks, unchanged.

Every rank function (``torch_dist_jobs``) calls ``init_process_group("gloo")`` with no
other arguments: the launchers' torchrun environment is what makes that work. Training
must equal one process at the same global batch; a rank killed or frozen inside a DDP
step must end the job in seconds, naming the rank.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from hvd_spark.errors import WorkerFailedError
from hvd_spark.runner.local.local_launcher import run_local
from tests.integration import torch_dist_jobs as jobs

REPO = Path(__file__).resolve().parents[2]


def _assert_equal_weights(got: dict, want: dict, initial: dict) -> None:
    """Within the equivalence bound of the Estimators' tests (``equivalence_jobs``): rel 1e-6
    of the weights' movement plus abs 1e-7; and training must have moved them."""
    for name, ref in want.items():
        moved = float(np.abs(ref - initial[name]).max())
        assert moved > 1e-3, f"{name} did not train"
        diff = float(np.abs(got[name] - ref).max())
        assert diff <= 1e-7 + 1e-6 * moved, f"{name}: {diff:.3g} from one process"


@pytest.fixture(scope="module")
def reference() -> tuple[dict, dict]:
    net = jobs.model()
    initial = {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}
    return jobs.reference(), initial


@pytest.mark.smoke
def test_ddp_under_run_local_equals_one_process(reference) -> None:
    want, initial = reference
    results = run_local(jobs.ddp, num_proc=2)
    assert [r["rank"] for r in results] == [0, 1]
    assert results[0]["master"] == results[1]["master"]
    assert results[0]["master"][0] == "127.0.0.1"
    for r in results:
        _assert_equal_weights(r["weights"], want, initial)


def test_fsdp2_equals_one_process_and_its_checkpoint_resumes_on_1_and_2_ranks(
        reference, tmp_path) -> None:
    want, initial = reference
    checkpoint = str(tmp_path / "store" / "checkpoints" / "step4")
    trained = run_local(jobs.fsdp2, args=(checkpoint,), num_proc=2)
    for weights in trained:
        _assert_equal_weights(weights, want, initial)
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(os.listdir(checkpoint))
    for ranks in (1, 2):
        for weights in run_local(jobs.dcp_resume, args=(checkpoint,), num_proc=ranks):
            for name, value in trained[0].items():
                np.testing.assert_array_equal(weights[name], value, err_msg=name)


def test_two_jobs_at_once_on_one_host_get_different_master_ports() -> None:
    out: dict[int, list] = {}

    def job(i: int) -> None:
        out[i] = run_local(jobs.ddp, num_proc=2)

    threads = [threading.Thread(target=job, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert sorted(out) == [0, 1], "a job did not finish"
    assert out[0][0]["master"][1] != out[1][0]["master"][1]


@pytest.mark.parametrize("num_proc", [2, 3])
def test_a_rank_killed_in_a_ddp_step_ends_the_job_in_seconds(num_proc: int) -> None:
    victim = num_proc - 1
    started = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        run_local(jobs.ddp_with_fault, args=(victim, 2), num_proc=num_proc)
    elapsed = time.monotonic() - started
    root = info.value.root_cause
    assert root.rank == victim, str(info.value)
    assert "signal 9" in str(info.value) or "SIGKILL" in str(info.value), str(info.value)
    # torch's own gloo timeout is 30 minutes: the supervision, not torch, ended it.
    assert elapsed < 120, f"took {elapsed:.0f} s"
    print(f"{num_proc} ranks: rank {victim} SIGKILLed mid-step, job ended in {elapsed:.1f} s")


def test_a_rank_frozen_in_a_ddp_step_is_named_within_the_heartbeat_limit(monkeypatch) -> None:
    monkeypatch.setenv("HVD_SPARK_HEARTBEAT_S", "3")
    started = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        run_local(jobs.ddp_with_fault, args=(1, 2, signal.SIGSTOP), num_proc=2)
    elapsed = time.monotonic() - started
    assert info.value.root_cause.rank == 1, str(info.value)
    assert "no heartbeat" in str(info.value), str(info.value)
    print(f"rank 1 SIGSTOPped mid-step: named after {elapsed:.1f} s")


@pytest.mark.smoke
def test_a_torchrun_script_runs_unchanged_under_hvdrun(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import os, sys, torch, torch.distributed as dist
        dist.init_process_group("gloo")   # torchrun's env:// rendezvous, no arguments
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        print(f"rank={dist.get_rank()} world={dist.get_world_size()} "
              f"local={os.environ['LOCAL_RANK']} group={os.environ['GROUP_RANK']} "
              f"sum={t.item():g} args={sys.argv[1:]}")
        dist.destroy_process_group()
    """))
    proc = subprocess.run(
        [sys.executable, "-m", "hvd_spark.runner", "-np", "2", sys.executable, str(script),
         "--epochs", "1"], capture_output=True, text=True, timeout=180, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for rank in (0, 1):
        assert (f"rank={rank} world=2 local={rank} group=0 sum=3 args=['--epochs', '1']"
                in proc.stdout), proc.stdout


def _elastic_torch() -> dict:
    """An elastic worker: after init() (each generation) torchrun's variables describe the
    generation, so init_process_group() joins it."""
    import os

    import torch
    import torch.distributed as dist

    import hvd_spark.torch as hvd

    hvd.init()
    dist.init_process_group("gloo")
    try:
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        return {"rank": dist.get_rank(), "hvd_rank": hvd.rank(), "sum": t.item(),
                "master": (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]),
                "group": os.environ["GROUP_RANK"]}
    finally:
        dist.destroy_process_group()
        hvd.shutdown()


def test_elastic_workers_get_each_generations_torch_world() -> None:
    from hvd_spark.runner.elastic.elastic_local import run_elastic_local

    results = run_elastic_local(_elastic_torch, num_proc=2, min_np=2, max_np=2)
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert all(r["rank"] == r["hvd_rank"] and r["sum"] == 3.0 for r in results)
    assert results[0]["master"] == results[1]["master"] and results[0]["group"] == "0"
