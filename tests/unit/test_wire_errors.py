"""Malformed addresses and frames are the project's errors, naming where they came from;
waits for data work on any descriptor."""

from __future__ import annotations

import os
import socket
import time

import pytest

from hvd_spark.collectives.tcp import readiness, wire
from hvd_spark.errors import ConfigError, PeerDisconnectedError


@pytest.mark.parametrize("addr", ["nohost", "host:", ":80", "host:port", "host:0", "host:70000"])
def test_bad_address_is_a_config_error_naming_its_source(addr):
    with pytest.raises(ConfigError, match=f"HVD_SPARK_RENDEZVOUS_ADDR={addr!r}"):
        wire.parse_addr(addr, "HVD_SPARK_RENDEZVOUS_ADDR")


def test_good_addresses_still_parse():
    assert wire.parse_addr("10.0.0.1:99", "x") == ("10.0.0.1", 99)
    assert wire.parse_addr("[::1]:65535") == ("::1", 65535)


def test_a_frame_that_does_not_unpickle_names_the_peer():
    a, b = socket.socketpair()
    try:
        wire.send_frame(a, b"\x80\x05this is not a pickle")
        with pytest.raises(PeerDisconnectedError, match="rank 3 sent a frame of 22 bytes"):
            wire.recv_obj(b, "rank 3")
        # A truncated pickle is the same kind of error, not a bare EOFError.
        wire.send_frame(a, b"\x80\x05")
        with pytest.raises(PeerDisconnectedError, match="same hvd_spark version"):
            wire.recv_obj(b, "rank 3")
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("high", [False, True])
def test_waiting_for_data_works_past_select_s_descriptor_limit(high):
    """select(2) refuses descriptors from 1024 on; a process holding many files gets
    such numbers, so waits use poll(2) there (with the same answers)."""
    import resource

    a, b = socket.socketpair()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if high and soft <= 1500:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    try:
        if high:
            fd = os.dup2(b.fileno(), 1500)  # a descriptor select() cannot take
            b.close()
            b = socket.socket(fileno=fd)
        assert readiness.wait_readable([b], 0.0) == []
        started = time.monotonic()
        assert readiness.wait_readable([b], 0.05) == []
        assert time.monotonic() - started >= 0.04
        a.sendall(b"x")
        assert readiness.wait_readable([a, b], 1.0) == [b]
        assert readiness.poll_readable([b], 0.01) == [b]
        a.close()  # the peer's close is readable too (recv then says so)
        assert readiness.wait_readable([b], 1.0) == [b]
    finally:
        a.close()
        b.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
