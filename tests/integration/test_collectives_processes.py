"""The collectives across real processes, launched by run_local / hvdrun."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from hvd_spark.collectives.tcp.express_lane import lane_supported
from hvd_spark.collectives.tcp.store import StoreServer
from hvd_spark.errors import ConfigError, WorkerFailedError
from hvd_spark.runner import run_local
from hvd_spark.runner.local.local_launcher import rank_env
from tests.integration import collective_jobs as jobs


@pytest.mark.parametrize("num_proc", [2, 3])
def test_eager_small_allreduces_match_numpy_and_agree_bitwise(num_proc):
    results = run_local(jobs.eager_paths, num_proc=num_proc)
    n = num_proc
    xs = [np.arange(12, dtype=np.float64).reshape(3, 4) * (r + 1) - 5 for r in range(n)]
    expect = {"Sum": sum(xs), "Average": sum(xs) / n, "Min": np.minimum.reduce(xs),
              "Max": np.maximum.reduce(xs), "Product": np.multiply.reduce(xs)}
    first = results[0]
    for r, out in enumerate(results):
        for op, want in expect.items():
            np.testing.assert_allclose(out[op], want, err_msg=op)
            assert out[op].tobytes() == first[op].tobytes(), f"{op} differs on rank {r}"
        np.testing.assert_allclose(
            out["scaled"], 3.0 * sum(0.5 * x.astype(np.float32) for x in xs), rtol=1e-6)
        assert out["int_avg"].tolist() == [int(sum(7 * k + 1 for k in range(n)) / n), -3]
        assert out["bool_or"].tolist() == [True, False] and out["bool_or"].dtype == np.bool_
        assert out["f16"].dtype == np.float16
        assert out["f16"].tolist() == [0.125 * sum(range(1, n + 1))] * 5
        assert out["zero_d"].shape == () and float(out["zero_d"]) == sum(range(1, n + 1))
        assert out["empty"].shape == (0, 3)
        assert out["inplace"].tolist() == [n * i + sum(range(n)) for i in range(8)]
        assert out["strided_input_kept"]
        np.testing.assert_allclose(out["strided"],
                                   (np.arange(20) * sum(range(1, n + 1)))[::3])
        assert out["orders"] == [[float(n * i + sum(range(n)))] * 3 for i in range(5, -1, -1)]
        s = sum(range(1, n + 1))
        assert out["reshaped"] == [[s] * 1, [s] * 5, [s] * 2]
        assert out["at_limit_eager"] and out["at_ok"] and out["above_ok"]
        assert out["above_path_ok"], out["above_lane"]
        assert out["above_lane"] == (n == 2)  # two ranks on this host: the lane
        assert out["threads"] == {t: [float(n * t + sum(range(n)))] * 20 for t in range(4)}
        assert out["unwaited_done"] and out["unwaited"] == [float(s)] * 2
        # Everything small above went eager (tensors submitted together fuse into one
        # eager response): 5 ops + 8 + at least 1 for the orders + 3 + 1 + at least 4.
        assert out["eager_count"] >= 22


def test_held_requests_leave_together_and_carry_their_inputs():
    results = run_local(jobs.held_requests, num_proc=2)
    want = [(2 * (np.arange(4.0) + 10 * i) + 100).tolist() for i in range(20)]
    for r, out in enumerate(results):
        assert out["in_place"] == want, f"rank {r}"
        assert out["burst"] and out["burst_same"], f"rank {r}"
        # 100 submissions (and, on rank 0, the responses): a frame each before.
        assert out["burst_frames"] < 25, f"rank {r} sent {out['burst_frames']} frames"


@pytest.mark.parametrize("shm", ["0", "1"])
def test_a_burst_larger_than_the_socket_buffers_does_not_block_both_ranks(shm):
    results = run_local(jobs.burst_through_small_socket_buffers, num_proc=2,
                        env={"HVD_SPARK_TIMEOUT": "20", "HVD_SPARK_DISABLE_SHM": shm})
    for r, out in enumerate(results):
        assert out["exact"], f"rank {r}"
        assert out["seconds"] < 10, f"rank {r} took {out['seconds']:.1f} s"


def test_submissions_leave_promptly_while_another_thread_drives():
    latencies = sorted(run_local(jobs.submissions_while_another_thread_drives,
                                 num_proc=2)[1]["latencies"])
    # Held for the waiting thread's cycle, they used to wait for its 50 ms slice to end
    # (a third of them over 10 ms); each needs a few ms at most.
    slow = [round(t * 1e3) for t in latencies if t > 0.025]
    assert len(slow) <= 3, f"ms: {slow}"


def test_a_pair_decided_before_its_half_is_held_sends_the_input():
    results = run_local(jobs.hold_after_a_thread_switch, num_proc=2)
    want = [(np.arange(4.0) * 2 + 30 + 2 * i).tolist() for i in range(5)]
    assert results[0]["results"] == want
    assert results[1]["results"] == want


@pytest.mark.parametrize("num_proc,env", [(2, {}), (3, {"HVD_SPARK_DISABLE_SHM": "1"})])
def test_ranks_holding_over_1024_files_still_connect_and_reduce(num_proc, env):
    """select() took no descriptor from 1024 on: such a rank failed at init (its peers
    saw a timeout from a rank that looked alive)."""
    results = run_local(jobs.many_open_files, num_proc=num_proc, env=env)
    total = num_proc * (num_proc + 1) / 2
    for out in results:
        assert out["lowest_free_fd"] > 1024  # the job's sockets came after the files
        assert out["small"] == [total] * 3 and out["large"] == total
        assert out["burst"] == [num_proc * i + total - num_proc for i in range(30)]
        assert out["gathered"] == list(range(num_proc))


@pytest.mark.parametrize("num_proc,env", [
    (2, {}),
    (3, {"HVD_SPARK_DISABLE_SHM": "1"}),
    (4, {"HVD_SPARK_CHUNK_BYTES": "4096"}),
    (2, {"HVD_SPARK_EAGER_BYTES": "0"}),  # small tensors through the ring too
    # Every allreduce through the host arena, in 4 KB pieces (the async one takes two).
    (3, {"HVD_SPARK_EAGER_BYTES": "0", "HVD_SPARK_ARENA_BYTES": "4096"}),
])
def test_every_operation(num_proc, env):
    results = run_local(jobs.all_ops, num_proc=num_proc, env=env)
    n = num_proc
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    ranks = range(n)
    arena = n > 2 and "HVD_SPARK_DISABLE_SHM" not in env and lane_supported()
    for r, out in enumerate(results):
        assert out["rank"] == r and out["size"] == n and out["local"] == (r, n)
        assert out["arena"] == arena
        np.testing.assert_allclose(out["sum"], sum(x + k for k in ranks))
        np.testing.assert_allclose(out["avg"], sum(x + k for k in ranks) / n, rtol=1e-6)
        np.testing.assert_allclose(out["min"], x)
        np.testing.assert_allclose(out["max"], x + n - 1)
        assert out["prod"].tolist() == [int(np.prod([k + 2 for k in ranks]))]
        np.testing.assert_allclose(out["scaled"], out["sum"], rtol=1e-6)
        assert out["int_avg"].tolist() == [sum(k * 3 + 1 for k in ranks) // n]
        assert out["bf16"].astype(float).tolist() == [0.5 * n] * 4
        assert out["f16"].dtype == np.float16 and float(out["f16"][0]) == 0.25
        base = np.arange(20, dtype=np.float64).reshape(4, 5)
        np.testing.assert_allclose(out["noncontig"], base[:, ::2] * sum(k + 1 for k in ranks))
        want_inplace = base.copy()
        want_inplace[:, 1:3] *= n
        np.testing.assert_allclose(out["inplace"], want_inplace)
        assert out["gather"].tolist() == [[k, k] for k in ranks for _ in range(k + 1)]
        assert out["bcast"].tolist() == [n - 1, n]
        assert out["bcast_"].tolist() == [0.0] * 3
        received, received_splits = out["a2a"]
        want_splits = [1 + (s + r) % 2 for s in ranks]
        assert received_splits.tolist() == want_splits
        assert received.tolist() == [10 * s + r for s in ranks for _ in range(want_splits[s])]
        rows = (2 * n + 1) // n + (1 if r < (2 * n + 1) % n else 0)
        assert out["rs"].shape == (rows, 2) and (out["rs"] == sum(k + 1 for k in ranks)).all()
        total = sum(ranks)
        assert [g.tolist() for g in out["grouped"]] == [[total] * 3, [[total] * 2] * 2]
        assert out["obj"] == {"from": 1 % n, "list": [1, 2]}
        assert out["objs"] == [("rank", k) for k in ranks]
        assert (out["async"] == total).all()


def _same_values(got: np.ndarray, want: np.ndarray, bits: bool) -> None:
    """NaN at the same places; elsewhere the same bits (``bits``) or values (+0 == -0)."""
    g, w = got.astype(np.float32), want.astype(np.float32)
    nan = np.isnan(w)
    np.testing.assert_array_equal(np.isnan(g), nan)
    if bits:
        np.testing.assert_array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan])
    else:
        np.testing.assert_array_equal(g[~nan], w[~nan])


def _one_ring_order(got: np.ndarray, xs: list[np.ndarray]) -> None:
    """Each element is a float32 sum rounded once per step, the ranks' values taken in
    one cyclic order (which one depends on where the element's segment starts)."""
    n = len(xs)
    candidates = []
    for start in range(n):
        for step in (1, -1):
            acc = xs[start]
            for k in range(1, n):
                nxt = xs[(start + step * k) % n]
                acc = (acc.astype(np.float32) + nxt.astype(np.float32)).astype(got.dtype)
            candidates.append(acc)
    g = got.view(np.uint16)
    nan = np.isnan(got.astype(np.float32))
    match = nan.copy()
    for c in candidates:
        match |= g == c.view(np.uint16)
        assert (np.isnan(c.astype(np.float32)) == nan).all()
    assert match.all(), f"{(~match).sum()} elements match no ring order"


@pytest.mark.parametrize("num_proc,env", [(2, {}), (3, {"HVD_SPARK_DISABLE_SHM": "1"})])
def test_half_precision_allreduce_rounds_once_and_ranks_agree_bitwise(num_proc, env):
    import ml_dtypes

    n = num_proc
    runs = {k: run_local(jobs.half_allreduces, args=(k,), num_proc=n, env=env)
            for k in ("numpy", "torch", "tensorflow")}
    dtypes = {"f16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16)}
    with np.errstate(all="ignore"):
        for kernels, results in runs.items():
            assert [out["kernels"] for out in results] == [kernels] * n
            if kernels == "tensorflow":
                assert sum(out["taken"] for out in results) > 0
            for key, first in results[0].items():
                if key in ("kernels", "taken"):
                    continue
                for r, out in enumerate(results):
                    assert out[key].tobytes() == first.tobytes(), (kernels, key, r)
            for name, dtype in dtypes.items():
                xs = [jobs.half_input(dtype, r).astype(np.float32) for r in range(n)]
                got = results[0]
                for key in ("Sum", "in_place"):
                    _one_ring_order(got[name, key], [x.astype(dtype) for x in xs])
                avg = (got[name, "Sum"].astype(np.float32) * np.float32(1 / n)).astype(dtype)
                _same_values(got[name, "Average"], avg, bits=True)
                # Eager: the coordinator sums the rows in rank order, rounding each step.
                for key, rows in (("small", 40), ("mid", 60000)):
                    want = xs[0][:rows].astype(dtype)
                    for x in xs[1:]:
                        want = (want.astype(np.float32) + x[:rows]).astype(dtype)
                    want = (want.astype(np.float32) * np.float32(1 / n)).astype(dtype)
                    _same_values(got[name, key], want, bits=True)
                np.testing.assert_allclose(got[name, "fused"].astype(np.float32),
                                           np.sum([x[:120000] for x in xs], axis=0),
                                           rtol=2e-2, atol=0.25, equal_nan=True)
                _same_values(got[name, "Min"], np.minimum.reduce(xs).astype(dtype), bits=False)
                _same_values(got[name, "Max"], np.maximum.reduce(xs).astype(dtype), bits=False)
                if n == 2:
                    _same_values(got[name, "Product"], (xs[0] * xs[1]).astype(dtype), bits=True)
        # torch's kernels and numpy's: the same bits (Min/Max: +0 and -0 may swap). Not
        # "fused": whether the four calls fuse (ring order) or each rides alone (rank
        # order) depends on timing, which may differ between the two jobs.
        for key, want in runs["numpy"][0].items():
            if key not in ("kernels", "taken") and key[1] != "fused":
                for other in ("torch", "tensorflow"):
                    _same_values(runs[other][0][key], want, bits=key[1] not in ("Min", "Max"))


def test_out_of_order_names_and_fusion():
    a, b = run_local(jobs.out_of_order_and_fusion, num_proc=2)
    for out in (a, b):
        assert out["ooo"] == {"a": [3.0] * 4, "b": [3.0] * 4, "c": [3.0] * 4}
        assert out["fused_ok"] and out["tensors"] == 64
        # 64 tensors submitted together must not need 64 ring passes.
        assert out["responses"] < 64
    assert a["responses"] == b["responses"]


@pytest.mark.parametrize("num_proc,env", [(2, {}), (3, {"HVD_SPARK_DISABLE_SHM": "1"})])
def test_out_of_place_allreduce_fused_with_in_place_ones(num_proc, env):
    """Out of place, the ring reads the caller's input: results right, inputs untouched."""
    n = num_proc
    total = sum(k + 1 for k in range(n))
    for out in run_local(jobs.out_of_place_mixes, num_proc=n, env=env):
        big, *small, strided, inplace_result = out["results"]
        np.testing.assert_array_equal(big, np.arange(300_000, dtype=np.float32) * total)
        for i, s in enumerate(small):
            np.testing.assert_array_equal(s, np.full(10, sum(k + i for k in range(n)), float))
        base = np.arange(40, dtype=np.float64).reshape(8, 5)[:, ::2]
        np.testing.assert_array_equal(strided, base * total)
        assert out["unchanged"]
        np.testing.assert_array_equal(out["inplace"], np.full(7, float(total)))
        assert inplace_result is out["inplace"] or np.array_equal(inplace_result, out["inplace"])
        assert float(out["scalar"]) == 2.5


def test_pooled_outputs_are_reused_only_once_dropped():
    """Out-of-place outputs come from the output pool: a dropped one's pages serve the
    next call, and one still held (whole, or only through a view) is never written."""
    n = 2
    for out in run_local(jobs.pooled_outputs_across_steps, num_proc=n):
        sums = [float(sum(step + k for k in range(n))) for step in range(6)]
        assert out["kept"] == [[sums[s]] * 2 for s in (0, 2, 4)]
        for whole, step in zip(out["kept_whole"], (0, 2, 4)):
            assert (whole == sums[step]).all()
        assert out["views"] == [[sums[3]] * 2]
        assert out["gathers"] == [(float(step), float(step + 1)) for step in range(6)]
        # Odd steps drop their output at once (except step 3's view): its pages come back.
        assert out["reused"] >= 2, out["reused"]
        assert out["limit"] == 512 << 20


def test_output_pool_off_reuses_nothing_and_results_stay_right():
    n = 2
    outs = run_local(jobs.pooled_outputs_across_steps, num_proc=n,
                     env={"HVD_SPARK_OUTPUT_POOL_BYTES": "0"})
    for out in outs:
        assert out["limit"] == 0 and out["idle"] == 0
        sums = [float(sum(step + k for k in range(n))) for step in range(6)]
        assert out["kept"] == [[sums[s]] * 2 for s in (0, 2, 4)]


def test_batched_in_place_allreduce_matches_by_name_across_different_batches():
    for out in run_local(jobs.batches_that_differ_by_rank, num_proc=2):
        # In place: a = 0+1, b = 1+2, c = 2+3, d = 3+4 on both ranks.
        assert out["values"] == {"a": [1.0] * 3, "b": [3.0] * 3, "c": [5.0] * 3,
                                 "d": [7.0] * 3}
        assert out["mismatch"].startswith("ConfigError") and "1 arrays but 2 names" in (
            out["mismatch"])


def test_mismatches_raise_on_every_rank_and_engine_survives():
    for errors in run_local(jobs.mismatches, num_proc=2):
        assert "CollectiveArgumentError" in errors[0] and "'shape.w'" in errors[0]
        assert "rank 0: (3,)" in errors[0] and "rank 1: (4,)" in errors[0]
        assert "dtype" in errors[1] and "float64" in errors[1]
        assert "reduce op" in errors[2]
        assert "root_rank" in errors[3]
        assert "expects a numpy array, got list" in errors[4]
        assert errors[5] == "[2.0, 2.0]"


def _shm_files() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("hvd_spark_")}


def test_failure_names_rank_with_remote_traceback():
    before = _shm_files()
    start = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        run_local(jobs.raise_on_rank_one, num_proc=3)
    assert _shm_files() <= before, "a failed job must not leave shared-memory files behind"
    err = info.value
    assert err.root_cause.rank == 1
    assert "boom from rank one" in str(err) and "raise_on_rank_one" in str(err)
    assert time.monotonic() - start < 60


def test_wrong_secret_rejected_job_unharmed():
    assert run_local(jobs.wrong_secret_probe, num_proc=2) == [
        "rejected [2.0, 2.0, 2.0, 2.0, 2.0]", "n/a [2.0, 2.0, 2.0, 2.0, 2.0]"]


def test_unpicklable_fn_is_named():
    import threading

    lock = threading.Lock()
    with pytest.raises(ConfigError, match="fn cannot be pickled"):
        run_local(lambda: lock, num_proc=1)


KILL_SCRIPT = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import hvd_spark.collectives as hvd
    hvd.init()
    x = np.ones(4 << 20, np.float32)
    for i in range(3):
        hvd.allreduce_(x)
    if hvd.rank() == int(sys.argv[1]):
        os.kill(os.getpid(), 9)
    start = time.monotonic()
    try:
        for i in range(1000):
            hvd.allreduce_(x)
        print("NOERROR")
    except Exception as exc:
        print(f"RAISED {time.monotonic() - start:.2f} {type(exc).__name__}: {exc}")
""")


@pytest.mark.parametrize("shm", [True, False])
def test_killed_rank_makes_others_raise_quickly(tmp_path, shm):
    """Ranks started by hand (no launcher teardown): survivors must raise on their own."""
    script = tmp_path / "kill.py"
    script.write_text(KILL_SCRIPT)
    secret = os.urandom(32)
    server = StoreServer(secret)
    procs = []
    try:
        for rank in range(3):
            env = {**os.environ, **rank_env(rank, 3, server.port, secret)}
            env["HVD_SPARK_DISABLE_SHM"] = "" if shm else "1"
            procs.append(subprocess.Popen(
                [sys.executable, str(script), "1"], env=env, stdout=subprocess.PIPE, text=True))
        outputs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
        server.close()
    assert procs[1].returncode == -9
    for rank in (0, 2):
        line = [ln for ln in outputs[rank].splitlines() if ln.startswith("RAISED")]
        assert line, f"rank {rank} did not raise: {outputs[rank]!r}"
        seconds = float(line[0].split()[1])
        assert seconds < 10, line[0]
        assert "Disconnected" in line[0] or "CollectiveError" in line[0]


def _hvdrun(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "hvd_spark.runner", *args], capture_output=True, text=True,
        timeout=timeout,
    )


def test_hvdrun_prefixes_output_and_reports_success(tmp_path):
    script = tmp_path / "ok.py"
    script.write_text(
        "import numpy as np, hvd_spark.collectives as hvd\n"
        "hvd.init()\n"
        "print('total', hvd.allreduce(np.ones(2), op=hvd.Sum).tolist())\n"
    )
    proc = _hvdrun("-np", "2", sys.executable, str(script))
    assert proc.returncode == 0, proc.stderr
    lines = sorted(proc.stdout.splitlines())
    assert lines == ["[0] total [2.0, 2.0]", "[1] total [2.0, 2.0]"]


def test_hvdrun_failure_exit_code_and_traceback(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text(
        "import hvd_spark.collectives as hvd, time\n"
        "hvd.init()\n"
        "if hvd.rank() == 1:\n"
        "    raise ValueError('rank one is unhappy')\n"
        "time.sleep(60)\n"
    )
    start = time.monotonic()
    proc = _hvdrun("-np", "2", "--timeout", "30", sys.executable, str(script))
    assert proc.returncode == 1
    assert "root cause: rank 1" in proc.stderr
    assert "[1] ValueError: rank one is unhappy" in proc.stderr
    assert time.monotonic() - start < 30, "the sleeping rank must be torn down"


def test_hvdrun_usage_errors():
    proc = _hvdrun("-np", "0", "python")
    assert proc.returncode == 2 and "-np must be at least 1" in proc.stderr


def test_init_outside_launcher_is_a_one_rank_job():
    # Horovod users debug with a plain `python train.py`: a one-rank job where everything works.
    code = (
        "import numpy as np, hvd_spark.collectives as hvd\n"
        "hvd.init()\n"
        "print(hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.is_homogeneous())\n"
        "print(hvd.allreduce(np.array([1.0, 3.0])).tolist(), hvd.allgather(np.ones(2)).tolist())\n"
        "print(hvd.broadcast(np.array([7]), 0).tolist(), hvd.alltoall(np.arange(2))[0].tolist())\n"
        "print(hvd.reducescatter(np.arange(4.0), op=hvd.Sum).tolist(), hvd.join())\n"
        "hvd.barrier(); hvd.shutdown(); print('done')\n"
    )
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HVD_SPARK_", "HOROVOD_", "OMPI_", "PMI_"))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:5] == [
        "0 1 0 1 True", "[1.0, 3.0] [1.0, 1.0]", "[7] [0, 1]", "[0.0, 1.0, 2.0, 3.0] 0", "done"]


@pytest.mark.parametrize("late,warn_s", [(1, 1), (0, 1), (1, 60), (0, 60)])
def test_missing_rank_warns_then_times_out(tmp_path, late, warn_s):
    script = tmp_path / "late.py"
    script.write_text(
        "import time, numpy as np, hvd_spark.collectives as hvd\n"
        "hvd.init()\n"
        f"if hvd.rank() == {late}:\n"
        "    time.sleep(8)\n"
        "    try:\n"  # too late: it fails too, and does not pair with a stale request
        "        hvd.allreduce(np.ones(2), name='lonely')\n"
        "        print('LATE OK')\n"
        "    except Exception as exc:\n"
        "        print(f'LATE RAISED {exc}')\n"
        "else:\n"
        "    start = time.monotonic()\n"
        "    try:\n"
        "        hvd.allreduce(np.ones(2), name='lonely')\n"
        "    except Exception as exc:\n"
        "        print(f'RAISED {time.monotonic() - start:.1f} {exc}')\n"
        "    time.sleep(9)\n"  # alive while the late rank's call times out
    )
    # The timeout holds whether the stall warning comes before it or (the default) after.
    env = {**os.environ, "HVD_SPARK_TIMEOUT": "3", "HVD_SPARK_STALL_WARNING_TIME": str(warn_s)}
    proc = subprocess.run([sys.executable, "-m", "hvd_spark.runner", "-np", "2", sys.executable,
                           str(script)], capture_output=True, text=True, timeout=60, env=env)
    warned = f"'lonely' has waited over {warn_s} s for ranks [{late}]" in proc.stderr
    assert warned == (warn_s < 3), proc.stderr
    raised = [ln for ln in proc.stdout.splitlines() if "RAISED" in ln]
    assert raised and f"ranks [{late}] did not submit it within 3.0 s" in raised[0]
    assert float(raised[0].split()[2]) < 6
    assert "LATE RAISED" in proc.stdout and "LATE OK" not in proc.stdout


_FAST_AUTOTUNE = {"HVD_SPARK_AUTOTUNE": "1", "HVD_SPARK_AUTOTUNE_WARMUP_SAMPLES": "1",
                  "HVD_SPARK_AUTOTUNE_STEPS_PER_SAMPLE": "1", "HVD_SPARK_AUTOTUNE_SAMPLES": "1"}


@pytest.mark.parametrize("num_proc,shm", [(2, True), (3, True), (3, False)])
def test_autotune_switches_chunk_mid_run_results_stay_exact(tmp_path, num_proc, shm):
    log_path = tmp_path / "autotune.csv"
    env = {**_FAST_AUTOTUNE, "HOROVOD_AUTOTUNE_LOG": str(log_path),
           "HVD_SPARK_DISABLE_SHM": "" if shm else "1"}
    results = run_local(jobs.autotune_mid_run, num_proc=num_proc, env=env)
    first = results[0]
    assert first["done"], "the tuner never froze its choice"
    for out in results:
        assert out["worst_error"] < 1e-3
        assert out["digests"] == first["digests"]  # bitwise equal on every rank
        assert out["chunks"] == first["chunks"]  # every rank switched at the same step
    if num_proc >= 3:  # ranks 0 and 1 also ran a process set's allreduce every step
        assert results[1]["pair_digests"] == first["pair_digests"] != []
    # The climb always tries a larger chunk first: the ring chunk did change mid-run.
    assert len(set(first["chunks"])) >= 2, first["chunks"]
    assert any(m.startswith("autotune chose") or m.startswith("autotune kept")
               for m in first["messages"]), first["messages"]
    assert first["choice"] is not None and first["choice"] in first["messages"][-1]
    assert not any(out["messages"] for out in results[1:])  # rank 0 alone tunes
    rows = log_path.read_text().splitlines()
    assert rows[0].startswith("fusion_threshold_bytes,") and rows[-1].endswith(",chosen")
    assert len(rows) >= 4


def test_autotune_leaves_user_set_values_alone():
    env = {**_FAST_AUTOTUNE, "HVD_SPARK_CHUNK_BYTES": str(1 << 20),
           "HOROVOD_FUSION_THRESHOLD": str(32 << 20)}
    results = run_local(jobs.autotune_mid_run, num_proc=2, env=env)
    assert all(set(out["chunks"]) == {1 << 20} for out in results)
    assert "tuning cycle_time_ms from" in results[0]["messages"][0]
    assert "fusion_threshold=32 MiB" in results[0]["choice"]
