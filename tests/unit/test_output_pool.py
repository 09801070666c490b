"""OutputPool: large outputs reuse dropped blocks, never one still referenced."""

import gc
import threading

import numpy as np
import torch

from hvd_spark.collectives.buffers import ALIGN_BYTES, OutputPool

MB = 1 << 20


def _address(arr: np.ndarray) -> int:
    return arr.ctypes.data


def test_a_dropped_output_gives_its_block_to_the_next_one():
    pool = OutputPool(min_bytes=MB)
    first = pool.empty((MB // 4,), np.float32)
    where = _address(first)
    del first
    second = pool.empty((512, 512), np.float32)  # same bytes, another shape
    assert _address(second) == where
    assert second.shape == (512, 512) and second.dtype == np.float32
    assert second.flags.c_contiguous and second.flags.writeable
    assert where % ALIGN_BYTES == 0


def test_a_block_stays_taken_while_any_view_of_it_lives():
    pool = OutputPool(min_bytes=MB)
    out = pool.empty((MB,), np.uint8)
    out[:] = 7
    tail = out[MB // 2 :].reshape(2, -1)  # a view that outlives the array
    where = _address(out)
    del out
    other = pool.empty((MB,), np.uint8)
    assert _address(other) != where
    other[:] = 1
    assert (tail == 7).all()  # nobody wrote over the view's memory
    del tail
    assert _address(pool.empty((MB,), np.uint8)) == where


def test_a_torch_tensor_made_from_an_output_keeps_its_block():
    pool = OutputPool(min_bytes=MB)
    out = pool.empty((MB // 4,), np.float32)
    out[:] = 3.0
    tensor = torch.from_numpy(out)
    where = _address(out)
    del out
    again = pool.empty((MB // 4,), np.float32)
    again[:] = 0.0
    assert _address(again) != where and float(tensor.sum()) == 3.0 * (MB // 4)


def test_small_outputs_bypass_the_pool_and_sizes_round_to_pages():
    pool = OutputPool(min_bytes=MB)
    small = pool.empty((10,), np.float64)
    assert small.ctypes.data % ALIGN_BYTES == 0
    del small
    assert pool.idle_bytes == 0
    out = pool.empty((MB + 1,), np.uint8)
    del out
    assert pool.idle_bytes == MB + 4096


def test_idle_blocks_beyond_the_limit_are_let_go_oldest_first():
    pool = OutputPool(min_bytes=MB, max_idle_bytes=3 * MB)
    older, newer = pool.empty((MB,), np.uint8), pool.empty((MB,), np.uint8)
    big = pool.empty((2 * MB,), np.uint8)
    dropped_first = _address(older)
    del older
    del newer  # 2 MB idle
    del big  # 4 MB idle: the block dropped first goes
    assert pool.idle_bytes == 3 * MB
    kept = pool.empty((MB,), np.uint8)
    assert _address(kept) != dropped_first


def test_zero_limit_turns_the_pool_off():
    pool = OutputPool(min_bytes=MB, max_idle_bytes=0)
    out = pool.empty((MB,), np.uint8)
    del out
    assert pool.idle_bytes == 0


def test_blocks_freed_on_other_threads_and_by_the_collector_come_back():
    pool = OutputPool(min_bytes=MB)
    out = pool.empty((MB,), np.uint8)
    cycle: list = [out]
    cycle.append(cycle)  # only the cyclic collector frees this one
    where = _address(out)
    del out
    holder = {"cycle": cycle}
    del cycle

    def drop() -> None:
        holder.clear()
        gc.collect()

    worker = threading.Thread(target=drop)
    worker.start()
    worker.join(10)
    assert _address(pool.empty((MB,), np.uint8)) == where
