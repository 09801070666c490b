"""Malformed addresses and frames are the project's errors, naming where they came from."""

from __future__ import annotations

import socket

import pytest

from hvd_spark.collectives.tcp import wire
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
