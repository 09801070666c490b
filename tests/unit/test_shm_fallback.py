"""/dev/shm that cannot be reserved: the pair falls back to TCP instead of dying of SIGBUS."""

from __future__ import annotations

import errno
import glob
import logging
import os
import socket

import numpy as np

from hvd_spark.collectives.tcp import shm
from tests.threads import run_on_threads


def _negotiate_pair(slot_bytes: int = 1 << 16) -> list:
    a, b = socket.socketpair()
    links = run_on_threads(
        [(a, 1), (b, 0)],
        lambda item: shm.negotiate_shm(item[0], item[1], slot_bytes, tag="falloctest"),
        timeout=30)
    if links == [None, None]:
        a.close()
        b.close()
    return links


def test_reserved_segments_give_working_links():
    links = _negotiate_pair()
    assert all(isinstance(link, shm.ShmLink) for link in links)
    data = np.arange(1000, dtype=np.float64)
    out = np.empty_like(data)
    links[0].send([data])
    links[1].recv_into([out])
    np.testing.assert_array_equal(out, data)
    for link in links:
        link.close()


def test_full_shm_falls_back_to_tcp_with_one_warning(monkeypatch, caplog):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    before = set(glob.glob(os.path.join(shm._shm_dir(), "hvd_spark_falloctest_*")))
    with caplog.at_level(logging.WARNING, logger=shm.__name__):
        links = _negotiate_pair()
    assert links == [None, None]  # both sides agree: no shared memory, use TCP
    warnings = [r.getMessage() for r in caplog.records if "shared memory" in r.getMessage()]
    assert len(warnings) == 2, warnings  # one line per side of the pair
    assert "using TCP" in warnings[0] and "No space left" in warnings[0]
    after = set(glob.glob(os.path.join(shm._shm_dir(), "hvd_spark_falloctest_*")))
    assert after == before  # the half-made segment file was removed
