"""``hvd_spark.TorchDistributor`` and ``hvd_spark.HorovodRunner``: pyspark's and sparkdl's
notebook cells, with only the import changed, on real local Spark and local processes."""

from __future__ import annotations

import textwrap

import numpy as np
import pyspark  # noqa: F401 - CI installs it: never a skip
import pytest
import torch  # noqa: F401 - CI installs it: never a skip

from hvd_spark import HorovodRunner, TorchDistributor
from hvd_spark.errors import ConfigError, WorkerFailedError
from tests.integration import torch_dist_jobs as jobs

_SCRIPT = textwrap.dedent("""
    import argparse, os, torch, torch.distributed as dist
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float)
    parser.add_argument("--tag")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    print(f"script rank={dist.get_rank()} name={__name__} lr={args.lr} tag={args.tag} "
          f"sum={t.item():g}", flush=True)
    dist.destroy_process_group()
""")


def _echo(a, b=0, *, c="-"):
    """Returns what the rank got and where it stands."""
    import os

    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        return {"args": (a, b, c), "rank": dist.get_rank(), "world": dist.get_world_size(),
                "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}
    finally:
        dist.destroy_process_group()


@pytest.mark.smoke
def test_function_on_barrier_tasks_returns_rank_zeros_value(spark, capsys) -> None:
    out = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(
        _echo, 1, 2, c="x")
    assert out == {"args": (1, 2, "x"), "rank": 0, "world": 2, "cuda": ""}


def test_ddp_through_the_distributor_equals_one_process(spark) -> None:
    want = jobs.reference()
    got = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(jobs.ddp)
    assert got["rank"] == 0
    for name, value in want.items():
        np.testing.assert_allclose(got["weights"][name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.smoke
@pytest.mark.parametrize("local_mode", [True, False], ids=["local", "tasks"])
def test_a_script_runs_as_main_with_its_arguments_and_logs_reach_the_driver(
        spark, tmp_path, capsys, local_mode) -> None:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    distributor = TorchDistributor(num_processes=2, local_mode=local_mode, use_gpu=False)
    assert distributor.run(str(script), "--lr", "0.5", "--tag", "t1") is None
    out = capsys.readouterr().out
    for rank in (0, 1):
        assert f"[{rank}] script rank={rank} name=__main__ lr=0.5 tag=t1 sum=3" in out, out


def test_local_mode_runs_functions_on_the_driver(spark) -> None:
    out = TorchDistributor(num_processes=3, local_mode=True, use_gpu=False).run(_echo, "a")
    assert out == {"args": ("a", 0, "-"), "rank": 0, "world": 3, "cuda": ""}


def test_bad_input_is_named_before_anything_starts(spark, tmp_path) -> None:
    for bad in (0, -1, "2", 1.5, True):
        with pytest.raises(ValueError, match="positive"):
            TorchDistributor(num_processes=bad)
    with pytest.raises(ValueError, match="spark.task.resource.gpu.amount"):
        TorchDistributor(num_processes=2, local_mode=False, use_gpu=True)
    with pytest.raises(ValueError, match="spark.driver.resource.gpu.amount"):
        TorchDistributor(num_processes=2, local_mode=True, use_gpu=True)
    distributor = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False)
    with pytest.raises(ValueError, match="no such Python file"):
        distributor.run(str(tmp_path / "missing.py"))
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    with pytest.raises(ValueError, match="not keyword arguments"):
        distributor.run(str(script), lr=1)
    with pytest.raises(ValueError, match="non-zero integer"):
        HorovodRunner(np=0)
    with pytest.raises(ValueError, match="driver_log_verbosity"):
        HorovodRunner(np=2, driver_log_verbosity="some")
    assert issubclass(ConfigError, ValueError)


def test_a_failing_script_names_its_rank(spark, tmp_path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nif os.environ['RANK'] == '1':\n"
                      "    raise SystemExit('bad data in shard 1')\n")
    with pytest.raises(WorkerFailedError, match="bad data in shard 1") as info:
        TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(str(script))
    assert info.value.root_cause.rank == 1


def _horovod_main(scale: float) -> float:

    import horovod.torch as hvd  # as sparkdl notebooks wrote it: served by the alias

    hvd.init()
    value = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
    print(f"hello from rank {hvd.rank()}", flush=True)
    return value * scale


@pytest.mark.smoke
def test_horovod_runner_on_tasks_with_the_horovod_import(spark, capsys) -> None:
    assert HorovodRunner(np=2).run(_horovod_main, scale=10.0) == 30.0
    out = capsys.readouterr().out
    assert "[0] hello from rank 0" in out and "[1] hello from rank 1" in out


def test_horovod_runner_on_the_driver_shows_only_the_first_rank_when_asked(capsys) -> None:
    runner = HorovodRunner(np=-2, driver_log_verbosity="log_callback_only")
    assert runner.run(_horovod_main, scale=1.0) == 3.0
    out = capsys.readouterr().out
    assert "[0] hello from rank 0" in out and "hello from rank 1" not in out


def test_a_rank_killed_in_a_ddp_step_on_barrier_tasks_ends_the_run(spark) -> None:
    distributor = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
    with pytest.raises(WorkerFailedError) as info:
        distributor.run(jobs.ddp_with_fault, 1, 2)
    assert info.value.root_cause.rank == 1, str(info.value)
    assert "signal 9" in info.value.root_cause.message, str(info.value)
    # The session is free at once: the barrier job was cancelled, no task holds a slot.
    assert spark.range(4).count() == 4
