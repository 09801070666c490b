"""A small authenticated key-value store that ranks use to find each other.

The launcher runs a ``StoreServer``; every rank publishes its listening address
under its rank and waits for everyone else's. Launchers may add their own request
kinds (``handlers``) to the same server, e.g. to collect results and logs.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from hvd_spark.collectives.tcp import wire
from hvd_spark.errors import AuthenticationError, HvdSparkError, RendezvousTimeoutError

log = logging.getLogger(__name__)

Handler = Callable[..., Any]

#: Seconds close() waits for the serving threads before it closes their connections.
_CLOSE_GRACE_S = 1.0


class UnknownRequestError(HvdSparkError):
    """The store's launcher does not serve this request kind (an older or simpler launcher)."""


class StoreServer:
    """Threaded KV server: one thread per authenticated connection.

    Args:
        secret: The job secret every client must prove.
        host: Interface to listen on.
        handlers: Extra request kinds: ``name -> fn(*args) -> reply``.
    """

    def __init__(
        self, secret: bytes, host: str = "127.0.0.1", handlers: dict[str, Handler] | None = None
    ) -> None:
        self._secret = secret
        self._data: dict[str, Any] = {}
        self._cond = threading.Condition()
        self._handlers = dict(handlers or {})
        self._listener = socket.create_server((host, 0), backlog=128)
        self._closed = False
        # Connections being served: close() ends them, so no serving thread (and no
        # socket) outlives the server waiting on a client that will never speak again.
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._conns_lock = threading.Lock()
        self.rejected_connections = 0
        self._thread = threading.Thread(target=self._accept_loop, name="hvd-store", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        """The port the server listens on."""
        return self._listener.getsockname()[1]

    def set(self, key: str, value: Any) -> None:
        """Set a key from the server's own process."""
        with self._cond:
            self._data[key] = value
            self._cond.notify_all()

    def get(self, key: str, timeout: float) -> Any:
        """Wait up to ``timeout`` s for ``key`` to be set, from the server's own process."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while key not in self._data:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    raise RendezvousTimeoutError(f"key {key!r} was not set within {timeout} s")
                self._cond.wait(left)
            return self._data[key]

    def close(self) -> None:
        """Stop accepting; wakes any waiting getters."""
        self._closed = True
        with self._cond:
            self._cond.notify_all()
        try:
            # Closing alone does not wake a thread blocked in accept() on Linux; shutdown does.
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._listener.close()
        except OSError:
            pass
        with self._conns_lock:
            conns = dict(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # its serving thread sees EOF and closes it
            except OSError:
                pass
        # A thread still inside a handler (a join waiting on its driver) is not reading:
        # give the threads a moment, then close what they still hold, so no connection
        # outlives the server. The thread's late reply then fails on the closed socket.
        deadline = time.monotonic() + _CLOSE_GRACE_S
        for conn, thread in conns.items():
            if thread is threading.current_thread():
                continue  # close() called by a handler: its own connection ends with it
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                conn.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return
            threading.Thread(
                target=self._serve, args=(conn, peer), name="hvd-store-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket, peer: tuple) -> None:
        with self._conns_lock:
            if self._closed:
                conn.close()
                return
            self._conns[conn] = threading.current_thread()
        try:
            self._serve_conn(conn, peer)
        finally:
            with self._conns_lock:
                self._conns.pop(conn, None)

    def _serve_conn(self, conn: socket.socket, peer: tuple) -> None:
        with conn:
            try:
                wire.authenticate_server(conn, self._secret)
            except AuthenticationError as exc:
                self.rejected_connections += 1
                log.warning("rejected connection from %s: %s", peer[0], exc)
                return
            conn.settimeout(None)
            while not self._closed:
                try:
                    request = wire.recv_obj(conn, "store client")
                except (HvdSparkError, OSError):
                    return
                try:
                    reply = ("ok", self._dispatch(request))
                except Exception as exc:  # noqa: BLE001 - the error travels to the client
                    reply = ("error", exc)
                try:
                    wire.send_obj(conn, reply, "store client")
                except (HvdSparkError, OSError):  # OSError: closed by close() meanwhile
                    return

    def _dispatch(self, request: tuple) -> Any:
        kind, *args = request
        if kind == "set":
            self.set(*args)
            return None
        if kind == "get":
            return self.get(*args)
        handler = self._handlers.get(kind)
        if handler is None:
            raise UnknownRequestError(f"store has no request kind {kind!r}")
        return handler(*args)


class StoreClient:
    """Client of a StoreServer; one authenticated connection, calls serialized by a lock.

    Args:
        addr: ``(host, port)`` of the server.
        secret: The job secret.
        timeout: Seconds to wait for the connection.
    """

    def __init__(self, addr: tuple[str, int], secret: bytes, timeout: float = 60.0) -> None:
        self._sock = wire.connect(addr, secret, timeout, "rendezvous store")
        self._sock.settimeout(None)
        self._lock = threading.Lock()

    @property
    def local_address(self) -> str:
        """This side's IP address as the server sees it: reachable by the other ranks."""
        return self._sock.getsockname()[0]

    def call(self, kind: str, *args: Any, timeout: float | None = None) -> Any:
        """Send one request and return its reply; errors raised by the server re-raise here."""
        with self._lock:
            self._sock.settimeout(None if timeout is None else timeout + 5.0)
            wire.send_obj(self._sock, (kind, *args), "rendezvous store")
            status, value = wire.recv_obj(self._sock, "rendezvous store")
        if status == "error":
            raise value
        return value

    def set(self, key: str, value: Any) -> None:
        """Publish ``value`` under ``key``."""
        self.call("set", key, value)

    def get(self, key: str, timeout: float) -> Any:
        """Wait up to ``timeout`` s for ``key``."""
        return self.call("get", key, timeout, timeout=timeout)

    def interrupt(self) -> None:
        """Fail the call in flight (from another thread) and every later one."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Close the connection."""
        try:
            self._sock.close()
        except OSError:
            pass
