"""Functions the integration tests run on real ranks (importable by the workers)."""

from __future__ import annotations

import os
import time

import ml_dtypes
import numpy as np

import hvd_spark.collectives as hvd
from tests.waiting import wait_until


def all_ops() -> dict:
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out: dict = {"rank": r, "size": n, "local": (hvd.local_rank(), hvd.local_size())}
    x = np.arange(6, dtype=np.float32).reshape(2, 3) + r
    out["sum"] = hvd.allreduce(x, op=hvd.Sum)
    out["avg"] = hvd.allreduce(x)
    out["min"] = hvd.allreduce(x, op=hvd.Min)
    out["max"] = hvd.allreduce(x, op=hvd.Max)
    out["prod"] = hvd.allreduce(np.array([r + 2], np.int64), op=hvd.Product)
    out["scaled"] = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
    out["int_avg"] = hvd.allreduce(np.array([r * 3 + 1], np.int32))
    out["bf16"] = hvd.allreduce(np.full(4, 0.5, ml_dtypes.bfloat16), op=hvd.Sum)
    out["f16"] = hvd.allreduce(np.full(4, 0.25, np.float16))
    noncontig = np.arange(20, dtype=np.float64).reshape(4, 5)[:, ::2] * (r + 1)
    out["noncontig"] = hvd.allreduce(noncontig, op=hvd.Sum)
    inplace = np.arange(20, dtype=np.float64).reshape(4, 5)
    view = inplace[:, 1:3]
    hvd.allreduce_(view, op=hvd.Sum)
    out["inplace"] = inplace
    out["gather"] = hvd.allgather(np.full((r + 1, 2), r, np.int16))
    out["bcast"] = hvd.broadcast(np.array([r, r + 1]), root_rank=n - 1)
    b = np.array([float(r)] * 3)
    hvd.broadcast_(b, 0)
    out["bcast_"] = b
    splits = [1 + (r + d) % 2 for d in range(n)]
    send = np.concatenate([np.full(s, 10 * r + d) for d, s in enumerate(splits)])
    out["a2a"] = hvd.alltoall(send, splits=splits)
    out["rs"] = hvd.reducescatter(np.ones((2 * n + 1, 2)) * (r + 1), op=hvd.Sum)
    out["grouped"] = hvd.grouped_allreduce([np.ones(3) * r, np.ones((2, 2)) * r], op=hvd.Sum)
    out["obj"] = hvd.broadcast_object({"from": r, "list": [1, 2]}, root_rank=1 % n)
    out["objs"] = hvd.allgather_object(("rank", r))
    h = hvd.allreduce_async(np.ones(1000) * r, name="async.1", op=hvd.Sum)
    wait_until(lambda: hvd.poll(h), timeout=60, what="poll() of async.1")
    out["async"] = hvd.synchronize(h)
    hvd.barrier()
    from hvd_spark.collectives import _plumbing

    out["arena"] = getattr(_plumbing.current_engine().comm, "arena", None) is not None
    return out


def out_of_order_and_fusion() -> dict:
    hvd.init()
    r = hvd.rank()
    names = ["a", "b", "c"] if r % 2 == 0 else ["c", "b", "a"]
    handles = {nm: hvd.allreduce_async(np.ones(4) * (r + 1), name=nm, op=hvd.Sum) for nm in names}
    ooo = {nm: hvd.synchronize(h).tolist() for nm, h in handles.items()}
    from hvd_spark.collectives import _plumbing

    engine = _plumbing.current_engine()
    before = (engine.executed_responses, engine.executed_tensors)
    # Above the eager size, so they take the ring (fused); eager ones have nothing to fuse.
    rows = engine.eager_bytes // 4 + 1
    handles = [hvd.allreduce_async(np.full(rows, i, np.float32), name=f"g{i}") for i in range(64)]
    fused_ok = all(np.allclose(hvd.synchronize(h), i) for i, h in enumerate(handles))
    after = (engine.executed_responses, engine.executed_tensors)
    return {"ooo": ooo, "fused_ok": fused_ok, "responses": after[0] - before[0],
            "tensors": after[1] - before[1]}


def eager_paths() -> dict:
    """Small allreduces reduced during negotiation: every op, dtype and scaling, in place
    and out of place, any submission order, sizes either side of the eager limit."""
    import threading

    from hvd_spark.collectives import _plumbing

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    engine = _plumbing.current_engine()
    out: dict = {"limit": engine.eager_bytes}
    eager_before = engine.executed_eager
    x = np.arange(12, dtype=np.float64).reshape(3, 4) * (r + 1) - 5
    for op in ("Sum", "Average", "Min", "Max", "Product"):
        out[op] = hvd.allreduce(x, op=getattr(hvd, op), name=f"e.{op}")
    out["scaled"] = hvd.allreduce(x.astype(np.float32), op=hvd.Sum, prescale_factor=0.5,
                                  postscale_factor=3.0)
    out["int_avg"] = hvd.allreduce(np.array([7 * r + 1, -3], np.int32))
    out["bool_or"] = hvd.allreduce(np.array([r == 0, False]), op=hvd.Sum)
    out["f16"] = hvd.allreduce(np.full(5, 0.125 * (r + 1), np.float16), op=hvd.Sum)
    out["zero_d"] = hvd.allreduce(np.float32(r + 1), op=hvd.Sum)
    out["empty"] = hvd.allreduce(np.zeros((0, 3), np.float32), op=hvd.Sum)
    inplace = np.arange(8, dtype=np.float32) + r
    hvd.allreduce_(inplace, op=hvd.Sum)
    out["inplace"] = inplace
    strided = (np.arange(20, dtype=np.float64) * (r + 1))[::3]
    out["strided_input_kept"] = bool((strided == (np.arange(20) * (r + 1))[::3]).all())
    out["strided"] = hvd.allreduce(strided, op=hvd.Sum)
    # Submitted in opposite orders on even and odd ranks, completed in yet another order.
    names = [f"o{i}" for i in range(6)]
    order = names if r % 2 == 0 else names[::-1]
    handles = {nm: hvd.allreduce_async(np.full(3, float(names.index(nm) + r)), name=nm,
                                       op=hvd.Sum) for nm in order}
    out["orders"] = [hvd.synchronize(handles[nm]).tolist() for nm in sorted(names)[::-1]]
    # The same name with a new shape each step (as a model whose batch changes).
    out["reshaped"] = [hvd.allreduce(np.ones(k) * (r + 1), name="same", op=hvd.Sum).tolist()
                       for k in (1, 5, 2)]
    # Either side of the limit: the same values, one eager and one through the ring (a
    # synchronous call's limit: ``lone_eager_bytes``, past 64 KB out of the pickle); with
    # two ranks on one host the one above crosses the express lane instead of the ring.
    limit_rows = engine.lone_eager_bytes // 8
    lane = engine.comm.express_lane
    before = engine.executed_eager
    at = hvd.allreduce(np.arange(limit_rows, dtype=np.float64) + r, op=hvd.Sum)
    out["at_limit_eager"] = engine.executed_eager - before == 1
    before, posts = engine.executed_eager, (lane.posted if lane is not None else 0)
    above = hvd.allreduce(np.arange(limit_rows + 1, dtype=np.float64) + r, op=hvd.Sum)
    out["above_path_ok"] = (engine.executed_eager - before == 0 if lane is None
                            else lane.posted - posts == 1)
    out["above_lane"] = lane is not None
    out["at_ok"] = bool((at == n * np.arange(limit_rows) + sum(range(n))).all())
    out["above_ok"] = bool((above == n * np.arange(limit_rows + 1) + sum(range(n))).all())
    # Several threads waiting at once: whoever drives completes the others' operations.
    results: dict = {}

    def worker(t: int) -> None:
        results[t] = [float(hvd.allreduce(np.array([t + r], np.float32), name=f"t{t}.{i}",
                                          op=hvd.Sum)[0]) for i in range(20)]

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    out["threads"] = {t: results.get(t) for t in range(4)}
    # An async operation nobody waits for still completes (the background thread runs it).
    handle = hvd.allreduce_async(np.ones(2) * (r + 1), name="unwaited", op=hvd.Sum)
    out["unwaited_done"] = wait_until(lambda: hvd.poll(handle), timeout=10,
                                      what="the unwaited allreduce")
    out["unwaited"] = hvd.synchronize(handle).tolist()
    out["eager_count"] = engine.executed_eager - eager_before
    hvd.shutdown()
    return out


def freeze_rank_one() -> None:
    """Rank 1 stops itself (SIGSTOP) between two allreduces: only a heartbeat notices."""
    import os
    import signal

    hvd.init()
    hvd.allreduce(np.ones(4))
    if hvd.rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    hvd.allreduce(np.ones(4))


def out_of_place_mixes() -> dict:
    """Out-of-place allreduces fused with in-place ones, big and small, (non-)contiguous."""
    hvd.init()
    r = hvd.rank()
    big = np.arange(300_000, dtype=np.float32) * (r + 1)     # 1.2 MB: its own piece
    small = [np.full(10, r + i, np.float64) for i in range(5)]  # packed together
    strided = np.arange(40, dtype=np.float64).reshape(8, 5)[:, ::2] * (r + 1)
    inplace = np.full(7, float(r + 1))
    keep = [big.copy(), *[s.copy() for s in small], strided.copy()]
    handles = [hvd.allreduce_async(big, name="big", op=hvd.Sum),
               *[hvd.allreduce_async(s, name=f"s{i}", op=hvd.Sum) for i, s in enumerate(small)],
               hvd.allreduce_async(strided, name="strided", op=hvd.Sum),
               hvd.allreduce_async_(inplace, name="inplace", op=hvd.Sum)]
    results = [hvd.synchronize(h) for h in handles]
    unchanged = all(np.array_equal(a, b) for a, b in
                    zip(keep, [big, *small, strided]))
    one = hvd.allreduce(np.float32(2.5), name="scalar")
    return {"results": results, "unchanged": unchanged, "inplace": inplace, "scalar": one}


def pooled_outputs_across_steps() -> dict:
    """Large outputs over several steps: some kept (a view, an allgather), some dropped so
    the next step reuses their pages; every kept result must stay as it was computed."""
    from hvd_spark.collectives.buffers import OUTPUTS

    hvd.init()
    r = hvd.rank()
    kept, views, gathers, reused = [], [], [], 0
    for step in range(6):
        x = np.full(1 << 19, float(step + r), np.float32)  # 2 MB: pooled
        out = hvd.allreduce(x, op=hvd.Sum, name="pooled")
        where = out.ctypes.data
        if step % 2 == 0:
            kept.append(out)
        elif step == 3:
            views.append(out[::1000])  # only a view survives
        gathers.append(hvd.allgather(np.full((1 << 18, 2), step + r, np.float32), name="g"))
        del out
        after = hvd.allreduce(x, op=hvd.Sum, name="pooled.again")
        reused += after.ctypes.data == where
    return {"kept": [k[[0, -1]].tolist() for k in kept], "kept_whole": kept,
            "views": [v[[0, -1]].tolist() for v in views], "reused": reused,
            "gathers": [(g[0, 0], g[-1, 0]) for g in gathers],
            "idle": OUTPUTS.idle_bytes, "limit": OUTPUTS.max_idle_bytes}


def batches_that_differ_by_rank() -> dict:
    """allreduce_many_async_: ranks batch different sets of names; every name still matches."""
    hvd.init()
    r = hvd.rank()
    arrays = {nm: np.full(3, float(i + r), np.float32) for i, nm in enumerate("abcd")}
    batches = [["a", "b"], ["c", "d"]] if r == 0 else [["d"], ["b", "c", "a"]]
    handles = []
    for names in batches:
        handles += hvd.allreduce_many_async_([arrays[n] for n in names], names, op=hvd.Sum)
    for h in handles:
        hvd.synchronize(h)
    try:
        hvd.allreduce_many_async_([np.ones(2)], ["x", "y"])
        mismatch = "accepted"
    except Exception as exc:
        mismatch = f"{type(exc).__name__}: {exc}"
    hvd.shutdown()
    return {"values": {n: a.tolist() for n, a in arrays.items()}, "mismatch": mismatch}


def mismatches() -> list[str]:
    hvd.init()
    r = hvd.rank()
    errors = []
    for call in (
        lambda: hvd.allreduce(np.ones(3 + r), name="shape.w"),
        lambda: hvd.allreduce(np.ones(3, np.float32 if r else np.float64), name="dtype.w"),
        lambda: hvd.allreduce(np.ones(3), name="op.w", op=hvd.Sum if r else hvd.Max),
        lambda: hvd.broadcast(np.ones(2), root_rank=r, name="root.w"),
        lambda: hvd.allreduce([1, 2, 3]),
    ):
        try:
            call()
            errors.append("no error")
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    # The engine still works after disagreements.
    errors.append(str(hvd.allreduce(np.ones(2), op=hvd.Sum).tolist()))
    return errors


def raise_on_rank_one() -> int:
    hvd.init()
    if hvd.rank() == 1:
        raise RuntimeError("boom from rank one")
    hvd.allreduce(np.ones(3), name="never")
    return 0


def wrong_secret_probe() -> str:
    """Rank 0 dials the launcher's store with a bad secret mid-job; the job must go on."""
    from hvd_spark.collectives.tcp import wire
    from hvd_spark.collectives.tcp.store import StoreClient
    from hvd_spark.errors import AuthenticationError

    hvd.init()
    verdict = "n/a"
    if hvd.rank() == 0:
        addr = wire.parse_addr(os.environ["HVD_SPARK_RENDEZVOUS_ADDR"])
        try:
            StoreClient(addr, b"not-the-secret-not-the-secret!!!", timeout=5)
            verdict = "accepted"
        except AuthenticationError:
            verdict = "rejected"
    total = hvd.allreduce(np.ones(5), op=hvd.Sum)
    return f"{verdict} {total.tolist()}"


def half_input(dtype, rank: int) -> np.ndarray:
    """A rank's float16/bfloat16 tensor: 1.5 shm slots and an odd tail, with NaN, inf and
    subnormals at fixed places (the tests rebuild it for their reference)."""
    rng = np.random.default_rng(100 + rank)
    x = (rng.standard_normal((1 << 19) * 3 + 17) * 4).astype(np.float32)
    x[3 + rank] = np.nan
    x[11] = np.inf if rank == 1 else 2.0
    x[20:30] = float(ml_dtypes.finfo(dtype).smallest_subnormal) * (rank + 1)
    return x.astype(dtype)


def count_tensorflow_half_kernels(taken: list[bool]) -> None:
    """Register TensorFlow's float16 kernels so that each reduction offered to them appends
    whether they took it to ``taken`` (a bitwise check passes whoever reduced)."""
    from hvd_spark.collectives import ops
    from hvd_spark.tensorflow import half_kernels

    def counted(dst, src, op, base):
        taken.append(half_kernels.reduce(dst, src, op, base))
        return taken[-1]

    ops.register_half_kernels(ops.HalfKernels("tensorflow", counted, half_kernels.scale))


def half_allreduces(kernels: str) -> dict:
    """float16/bfloat16 allreduces of every op, out of place and in place, through the ring
    and the eager path, with numpy's half kernels or ("torch", "tensorflow") a binding's."""
    from hvd_spark.collectives import ops

    taken: list[bool] = []
    if kernels == "torch":
        import hvd_spark.torch

        hvd_spark.torch.init()  # the binding's init lends torch's half kernels
    elif kernels == "tensorflow":
        import tensorflow as tf

        tf.constant(0.0).numpy()  # they wait for TensorFlow's runtime to start
        count_tensorflow_half_kernels(taken)
    else:
        ops.register_half_kernels(None)
    hvd.init()
    r = hvd.rank()
    out: dict = {"kernels": ops.half_kernels_name()}
    for name, dtype in (("f16", np.dtype(np.float16)), ("bf16", ops.BFLOAT16)):
        x = half_input(dtype, r)
        for op in ("Sum", "Average", "Min", "Max", "Product"):
            out[name, op] = hvd.allreduce(x, op=getattr(hvd, op), name=f"h.{name}.{op}")
        inplace = x.copy()
        hvd.allreduce_(inplace, op=hvd.Sum, name=f"h.{name}.in_place")
        out[name, "in_place"] = inplace
        out[name, "small"] = hvd.allreduce(x[:40], op=hvd.Average, name=f"h.{name}.small")
        # Past 64 KB a riding tensor travels beside its message's pickle, as bytes (numpy
        # exports no buffer of bfloat16): one synchronous call rides (120 KB), four
        # asynchronous ones of 60 KB ride alone but not fused (through the ring).
        out[name, "mid"] = hvd.allreduce(x[:60000], op=hvd.Average, name=f"h.{name}.mid")
        handles = [hvd.allreduce_async(x[i * 30000:(i + 1) * 30000], op=hvd.Sum,
                                       name=f"h.{name}.fused{i}") for i in range(4)]
        out[name, "fused"] = np.concatenate([hvd.synchronize(h) for h in handles])
    out["taken"] = sum(taken)
    return out


def autotune_mid_run(max_steps: int = 400) -> dict:
    """Train-like steps under HVD_SPARK_AUTOTUNE until rank 0's tuner froze its choice.

    Each step: a fused set of random float32 tensors (one spans several chunks), a
    broadcast and an allgather; with 3+ ranks also an allreduce in a process set of
    ranks 0 and 1 (a chunk change riding on it must reach rank 2 too). Returns per step
    the results' digests and this rank's ring chunk size, and what the tuner logged.
    """
    import hashlib
    import logging

    from hvd_spark.collectives import _plumbing

    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    tune_log = logging.getLogger("hvd_spark.collectives.autotune")
    tune_log.addHandler(Keep())
    tune_log.setLevel(logging.INFO)
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    pair = hvd.add_process_set([0, 1]) if n >= 3 else None
    engine = _plumbing.current_engine()
    shapes = [(700_000,), (3, 1000), (17,), (120_000,), (5,)]  # 2.8 MB down to 20 B
    digests, pair_digests, chunks, worst = [], [], [], 0.0
    done, step = False, 0
    while not done and step < max_steps:
        rngs = [np.random.default_rng(1000 * step + q) for q in range(n)]
        inputs = [[g.standard_normal(s, np.float32) for s in shapes] for g in rngs]
        handles = [hvd.allreduce_async(x, name=f"t{i}", op=hvd.Sum)
                   for i, x in enumerate(inputs[r])]
        sums = [hvd.synchronize(h) for h in handles]
        for i, got in enumerate(sums):
            want = np.sum([inputs[q][i] for q in range(n)], axis=0, dtype=np.float64)
            worst = max(worst, float(np.max(np.abs(got - want))))
        sums.append(hvd.broadcast(inputs[r][0], root_rank=step % n, name="bc"))
        sums.append(hvd.allgather(inputs[r][3], name="ag"))
        digests.append(hashlib.sha256(b"".join(s.tobytes() for s in sums)).hexdigest())
        if pair is not None and r in (0, 1):
            got = hvd.allreduce(inputs[r][0], op=hvd.Sum, name="pair", process_set=pair)
            pair_digests.append(hashlib.sha256(got.tobytes()).hexdigest())
        chunks.append(getattr(engine.comm, "chunk_bytes", None))
        done = hvd.broadcast_object(not engine.autotuning, 0, name="tuned")
        step += 1
    choice = engine.autotune_choice
    return {"digests": digests, "pair_digests": pair_digests, "chunks": chunks,
            "worst_error": worst, "steps": step, "done": done, "messages": messages,
            "engine": type(engine).__name__,
            "choice": None if choice is None else choice.describe()}


def spy_on_copies(engine, names: set[str]):
    """Rank 1: an event set once rank 0's paired copies of all ``names`` are recorded
    here (those recorded already count)."""
    import threading

    pairing, arrived = engine.pairing, threading.Event()
    hold_peer, missing = pairing.hold_peer, set(names)

    def noted(request, now):
        hold_peer(request, now)
        missing.discard(request.name)
        if not missing:
            arrived.set()

    pairing.hold_peer = noted  # the engine looks it up at each message
    with engine._lock:  # (the table is used under the engine's lock)
        missing.difference_update(pairing.table.peer)
    if not missing:
        arrived.set()
    return arrived


def held_requests() -> dict:
    """Submissions wait to be sent until the next cycle (``TcpEngine._submitted``): a burst
    leaves in a frame or two, and a pair decided before its half left still sends that
    half's input, not the result written into it."""
    from hvd_spark.collectives import _plumbing

    hvd.init()
    r = hvd.rank()
    engine = _plumbing.current_engine()
    out: dict = {}
    # Rank 0's copies reach rank 1 before rank 1 submits: rank 1 could decide each pair
    # the moment it records its own half, while that half is still held.
    if r == 1:
        copies = spy_on_copies(engine, {f"held.{i}" for i in range(20)})
        assert copies.wait(30), "rank 0's copies never came"
    arrays = [np.arange(4.0) + 10 * i + 100 * r for i in range(20)]
    handles = [hvd.allreduce_async_(a, name=f"held.{i}", op=hvd.Sum)
               for i, a in enumerate(arrays)]
    for h in handles:
        hvd.synchronize(h)
    out["in_place"] = [a.tolist() for a in arrays]
    hvd.barrier()
    # A burst of 100, half small (paired) and half too large to ride along (rank 0's
    # coordinator): one request frame per submission before, a few now.
    sent = engine.frames_sent
    burst = [np.full(16 if i % 2 else 30_000, float(i + r)) for i in range(100)]
    handles = [hvd.allreduce_async_(a, name=f"burst.{i}", op=hvd.Sum)
               for i, a in enumerate(burst)]
    for h in handles:
        hvd.synchronize(h)
    out["burst_frames"] = engine.frames_sent - sent
    out["burst"] = [float(a[0]) for a in burst] == [2.0 * i + 1 for i in range(100)]
    out["burst_same"] = all((a == a[0]).all() for a in burst)
    hvd.shutdown()
    return out


def many_open_files() -> dict:
    """Every socket of the job gets a descriptor past select()'s limit (1024): the rank
    holds 1100 files before ``init()``, as a data loader or a Spark executor may."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4096:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    hvd.init()
    r = hvd.rank()
    out = {"lowest_free_fd": os.dup(0)}
    os.close(out["lowest_free_fd"])
    out["small"] = hvd.allreduce(np.ones(3) * (r + 1), op=hvd.Sum).tolist()
    out["large"] = float(hvd.allreduce(np.ones(1 << 20) * (r + 1), op=hvd.Sum)[-1])
    handles = [hvd.allreduce_async(np.full(8, float(i + r)), name=f"fd.{i}", op=hvd.Sum)
               for i in range(30)]
    out["burst"] = [float(hvd.synchronize(h)[0]) for h in handles]
    out["gathered"] = hvd.allgather(np.array([r])).tolist()
    hvd.barrier()
    hvd.shutdown()
    for fd in held:
        os.close(fd)
    return out


def burst_through_small_socket_buffers(count: int = 160) -> dict:
    """Both ranks' cycles send at once (rank 0 its pair copies, rank 1 its requests): a
    burst bigger than the control sockets' buffers must not leave each waiting for the
    other to read (Linux's default buffer limits are about 200 KB; these are 64 KB)."""
    import socket

    from hvd_spark.collectives import _plumbing

    hvd.init()
    r = hvd.rank()
    for sock in _plumbing.current_engine().control.socks.values():
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, opt, 64 * 1024)
    hvd.barrier()
    started = time.monotonic()
    arrays = [np.full(8 * 1024, float(i + r)) for i in range(count)]  # 64 KB: paired
    handles = [hvd.allreduce_async_(a, name=f"small.{i}", op=hvd.Sum)
               for i, a in enumerate(arrays)]
    for h in handles:
        hvd.synchronize(h)
    out = {"seconds": time.monotonic() - started,
           "exact": all((a == 2 * i + 1).all() for i, a in enumerate(arrays))}
    hvd.barrier()
    hvd.shutdown()
    return out


def hold_after_a_thread_switch() -> dict:
    """Rank 1's thread is switched out between recording a paired request and holding
    it (a delay injected there), while rank 0's copy is already in: the pair must still
    send rank 1's input, not the result written into its array."""
    from hvd_spark.collectives import _plumbing

    hvd.init()
    r = hvd.rank()
    engine = _plumbing.current_engine()
    if r == 1:
        control = engine.control
        hold = control.hold

        def slow_hold(peer, kind, requests):
            control.wake()  # the engine thread runs meanwhile
            time.sleep(0.05)  # a window for it (a race made likely, not an order)
            hold(peer, kind, requests)

        control.hold = slow_hold
        copy_in = spy_on_copies(engine, {"switch.0"})
        assert copy_in.wait(30), "rank 0's copy of switch.0 never came"  # it comes first
    arrays = [np.arange(4.0) + 10 * (r + 1) + i for i in range(5)]
    for i, a in enumerate(arrays):
        hvd.synchronize(hvd.allreduce_async_(a, name=f"switch.{i}", op=hvd.Sum))
    hvd.barrier()
    hvd.shutdown()
    return {"results": [a.tolist() for a in arrays]}


def submissions_while_another_thread_drives(count: int = 40) -> dict:
    """Thread A on rank 1 waits in an allreduce rank 0 joins only later (A's thread runs
    the cycles meanwhile); thread B's asynchronous allgathers, which rank 0 submitted
    long ago, must still leave at once, not at A's next slice of its cycle."""
    import threading

    hvd.init()
    r = hvd.rank()
    hvd.barrier()
    if r == 0:
        handles = [hvd.allgather_async(np.ones(2), name=f"b.{i}") for i in range(count)]
        # Each completes when rank 1 submits its half: all done, rank 1's loop is over, and
        # only then does rank 0 join "slow" (rank 1's thread A waited in it all along).
        for h in handles:
            hvd.synchronize(h)
        hvd.allreduce(np.ones(2), name="slow")
        hvd.barrier()
        hvd.shutdown()
        return {}
    from hvd_spark.collectives import _plumbing

    engine = _plumbing.current_engine()
    waiter = threading.Thread(target=hvd.allreduce, args=(np.ones(2),), kwargs={"name": "slow"})
    waiter.start()
    deadline = time.monotonic() + 30
    while not engine._drivers and time.monotonic() < deadline:
        time.sleep(1e-3)  # until thread A waits in "slow", running the cycles
    assert engine._drivers, "thread A never waited in its allreduce"
    latencies = []
    for i in range(count):
        time.sleep(0.005 + 0.01 * (i % 2))  # pacing: submissions fall at various points
        started = time.monotonic()
        h = hvd.allgather_async(np.ones(2), name=f"b.{i}")
        while not hvd.poll(h) and time.monotonic() - started < 30:
            time.sleep(1e-4)
        latencies.append(time.monotonic() - started)
    waiter.join(30)
    hvd.barrier()
    hvd.shutdown()
    return {"latencies": latencies}
