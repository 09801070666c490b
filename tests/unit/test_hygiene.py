"""The hygiene check itself (tests/hygiene.py): what it calls a leaked socket."""

from __future__ import annotations

import os
import socket

from tests.hygiene import State


def test_a_python_socket_left_open_is_named_with_its_ports_and_other_end():
    before = State.now()
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    try:
        (problem,) = State.now().leaked_since(before)
    finally:
        for sock in (server, client, accepted):
            sock.close()
    assert problem.startswith("file descriptors still open")
    assert "LISTEN" in problem and "ESTABLISHED" in problem
    assert f"other end held by ['{os.getpid()} " in problem
    assert problem.count("<socket.socket fd=") == 3
    assert State.now().leaked_since(before) == []


def test_a_socket_no_python_object_holds_is_a_c_librarys():
    before = State.now()
    fd = socket.socket().detach()  # as gRPC's or ZMQ's own threads hold theirs
    try:
        assert State.now().leaked_since(before) == []
    finally:
        os.close(fd)
