"""TensorFlow collectives never deadlock: TF1-style graphs, Python threads, failed calls.

A v1 ``session.run`` of many independent collectives runs them in any order per rank,
on a pool of as little as one inter-op thread; threads issue collectives at the same
time in different orders per rank; unnamed calls that fail on some rank keep the
automatic names aligned. Real processes, real sockets (2 local ranks).
"""

from __future__ import annotations

import os

import numpy as np
import tensorflow  # noqa: F401 - CI installs it: never a skip

from hvd_spark.runner.local.local_launcher import run_local

ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "HVD_SPARK_TIMEOUT": "40"}
N_OPS = 24


def _graph_ops(tf, hvd, r: int, names: bool) -> dict:
    """Many independent collectives of every kind, with an expected value each."""
    ops, expect = {}, {}
    for i in range(N_OPS):
        name = f"op{i}" if names else None
        kind = i % 4
        if kind == 0:
            ops[i] = hvd.allreduce(tf.fill([5], float(i + r)), op=hvd.Sum, name=name)
            expect[i] = np.full(5, 2.0 * i + 1)
        elif kind == 1:
            ops[i] = hvd.allgather(tf.fill([r + 1, 2], i), name=name)
            expect[i] = np.array([[i, i]] * 3)
        elif kind == 2:
            ops[i] = hvd.broadcast(tf.fill([3], float(i + 10 * r)), root_rank=1, name=name)
            expect[i] = np.full(3, i + 10.0)
        else:
            ops[i] = hvd.reducescatter(tf.fill([4, 1], float(i)), op=hvd.Sum, name=name)
            expect[i] = np.full((2, 1), 2.0 * i)
    return {"ops": ops, "expect": expect}


def _check(got: dict, expect: dict) -> list:
    return [i for i in expect if not np.array_equal(np.asarray(got[i]), expect[i])]


def _graph_worker() -> dict:
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import random
    import threading
    import time

    import tensorflow as tf

    import hvd_spark.tensorflow as hvd
    from hvd_spark.errors import HvdSparkError

    hvd.init()
    r = hvd.rank()
    out: dict = {}
    one_thread = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1,
                                          intra_op_parallelism_threads=1)

    # 1. Unnamed ops in one v1 graph, fetched together, on a single inter-op thread.
    with tf.Graph().as_default():
        built = _graph_ops(tf, hvd, r, names=False)
        with tf.compat.v1.Session(config=one_thread) as sess:
            start = time.monotonic()
            for attempt in range(2):  # the same names again on a second run
                got = sess.run(built["ops"])
                out[f"unnamed_bad{attempt}"] = _check(got, built["expect"])
            out["unnamed_s"] = time.monotonic() - start

    # 2. Named ops built in opposite orders on the two ranks: matched by name only.
    with tf.Graph().as_default():
        built = _graph_ops(tf, hvd, r, names=True)
        fetch = list(built["ops"].items())
        if r == 1:
            fetch.reverse()
        with tf.compat.v1.Session(config=one_thread) as sess:
            values = sess.run([op for _, op in fetch])
        out["reversed_bad"] = _check({i: v for (i, _), v in zip(fetch, values)},
                                     built["expect"])

    # 3. Several Python threads at once, started in opposite orders on the two ranks:
    # eager calls, session runs of ops of one shared graph, and tf.functions.
    results: dict = {}
    errors: list = []
    graph = tf.Graph()
    with graph.as_default():
        shared = {t: hvd.allreduce(tf.fill([2], float(t + r)), op=hvd.Sum, name=f"shared{t}")
                  for t in range(4)}
    sess = tf.compat.v1.Session(graph=graph, config=one_thread)
    fns = {t: tf.function(lambda x, t=t: hvd.allreduce(x, op=hvd.Sum, name=f"fn{t}"))
           for t in range(4)}

    def work(t: int) -> None:
        try:
            for j in range(5):
                time.sleep(random.random() * 0.01)
                value = hvd.allreduce(tf.constant([t * 10.0 + j + r]), op=hvd.Sum,
                                      name=f"thread{t}.{j}")
                results[("eager", t, j)] = float(value.numpy()[0])
            results[("session", t)] = sess.run(shared[t]).tolist()
            results[("function", t)] = fns[t](tf.constant([float(t + r)])).numpy().tolist()
        except Exception as exc:  # noqa: BLE001 - reported to the test
            errors.append(repr(exc))

    order = list(range(4)) if r == 0 else [3, 2, 1, 0]
    threads = [threading.Thread(target=work, args=(t,)) for t in order]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    sess.close()
    out["thread_errors"] = errors
    out["thread_alive"] = any(th.is_alive() for th in threads)
    out["thread_results"] = results

    # 4. Unnamed eager calls, some failing on every rank (rank 1 disagrees on the shape):
    # the calls after a failure still pair up with the right partner.
    # Calls 5 and 9 fail rank 1's own checks before anything is sent (a scalar
    # reducescatter, an alltoall whose rows do not split evenly): rank 0 hears of it.
    seq = []
    for i in range(12):
        bad = i in (3, 7)
        x = tf.fill([3 if (bad and r == 1) else 2], float(i))
        try:
            if i == 5:
                y = hvd.reducescatter(tf.constant(1.0) if r == 1 else tf.ones([2]), op=hvd.Sum)
            elif i == 9:
                y = hvd.alltoall(tf.ones([3 if r == 1 else 2]))
            else:
                y = hvd.allreduce(x, op=hvd.Sum)
            seq.append(y.numpy().tolist())
        except (HvdSparkError, tf.errors.OpError) as exc:
            seq.append(f"error: {type(exc).__name__}: {exc}")
    out["sequence"] = seq

    # 5. The same inside a v1 graph: a failing op, then more unnamed ops.
    with tf.Graph().as_default():
        bad_op = hvd.allreduce(tf.ones([2 + r]), op=hvd.Sum)
        good_op = hvd.allreduce(tf.ones([2]), op=hvd.Sum)
        with tf.compat.v1.Session() as sess2:
            try:
                sess2.run(bad_op)
                out["graph_bad"] = "no error"
            except tf.errors.OpError as exc:
                out["graph_bad"] = f"{type(exc).__name__}: {exc.message}"
            out["graph_after"] = sess2.run(good_op).tolist()
    return out


def test_v1_graphs_threads_and_failures_never_deadlock():
    r0, r1 = run_local(_graph_worker, num_proc=2, env=ENV)
    for res in (r0, r1):
        assert res["unnamed_bad0"] == [] and res["unnamed_bad1"] == []
        assert res["unnamed_s"] < 30  # two runs of 24 collectives, no waiting on timeouts
        assert res["reversed_bad"] == []
        assert res["thread_errors"] == [] and not res["thread_alive"]
        got = res["thread_results"]
        for t in range(4):
            for j in range(5):
                assert got[("eager", t, j)] == 2 * (t * 10.0 + j) + 1
            assert got[("session", t)] == [2.0 * t + 1] * 2
            assert got[("function", t)] == [2.0 * t + 1]
        for i, value in enumerate(res["sequence"]):
            if i in (3, 7):
                assert value.startswith("error:") and "shape" in value, value
            elif i == 5:
                assert value.startswith("error:") and "scalar" in value, value
            elif i == 9:
                assert value.startswith("error:") and "split" in value, value
            else:
                assert value == [2.0 * i, 2.0 * i], (i, value)
        assert "shape" in res["graph_bad"], res["graph_bad"]
        assert res["graph_after"] == [2.0, 2.0]


def _functions_at_once_worker() -> dict:
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import threading
    import time

    import tensorflow as tf

    import hvd_spark.tensorflow as hvd

    hvd.init()
    r = hvd.rank()
    # More functions at once than this host's inter-op pool has threads (one per core).
    n = 3 * max(2, len(os.sched_getaffinity(0)))
    fns = {t: tf.function(lambda x, t=t: hvd.allreduce(x, op=hvd.Sum, name=f"at_once{t}"))
           for t in range(n)}
    together = threading.Barrier(n)
    results: dict = {}
    errors: list = []

    def work(t: int) -> None:
        try:
            fns[t].get_concrete_function(tf.TensorSpec([1], tf.float32))  # traced here
            x = tf.constant([float(t + r)])
            together.wait(30)  # then every thread calls its function at once
            results[t] = fns[t](x).numpy().tolist()
        except Exception as exc:  # noqa: BLE001 - reported to the test
            errors.append(f"{t}: {type(exc).__name__}: {exc}"[:500])

    order = list(range(n)) if r == 0 else list(reversed(range(n)))
    start = time.monotonic()
    threads = [threading.Thread(target=work, args=(t,)) for t in order]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    return {"n": n, "results": results, "errors": errors, "seconds": time.monotonic() - start,
            "alive": any(th.is_alive() for th in threads)}


def test_tf_functions_called_from_threads_at_once_in_opposite_orders():
    # Each rank's threads start in the other order, all released at once: blocking kernels
    # would fill each rank's pool with different collectives and wait for the timeout.
    r0, r1 = run_local(_functions_at_once_worker, num_proc=2,
                       env={**ENV, "HVD_SPARK_TIMEOUT": "20"})
    for res in (r0, r1):
        assert res["errors"] == [] and not res["alive"]
        assert res["results"] == {t: [2.0 * t + 1] for t in range(res["n"])}
        assert res["seconds"] < 15  # nothing waited for the timeout

