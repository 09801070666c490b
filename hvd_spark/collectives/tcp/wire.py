"""Authenticated sockets: mutual HMAC handshake, length-prefixed frames, deadlines.

Every connection proves it knows the job secret before a byte it sends is used.
After the handshake the connection is trusted, so control frames may carry pickles;
nothing is unpickled from a connection that has not passed ``authenticate_*``.
"""

from __future__ import annotations

import hashlib
import hmac
import operator
import os
import pickle
import socket
import struct
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from hvd_spark.collectives.buffers import OUTPUTS
from hvd_spark.collectives.messages import IN_BAND_MAX_BYTES
from hvd_spark.errors import (
    AuthenticationError,
    CollectiveTimeoutError,
    ConfigError,
    PeerDisconnectedError,
)

_MAGIC = b"HVDSPRK1"
_NONCE_BYTES = 16
_DIGEST = hashlib.sha256
_MAC_BYTES = _DIGEST().digest_size
_LEN = struct.Struct("<Q")
HANDSHAKE_TIMEOUT_S = 10.0
MAX_FRAME_BYTES = 1 << 34
# Frames up to this size are read with one plain recv first (control messages).
_ONE_RECV_BYTES = 64 * 1024
# A frame whose arrays travel behind the pickle starts with this byte (a plain pickle
# starts with the PROTO opcode, 0x80), then the count of buffers, the pickle's length and
# each buffer's; each buffer starts at a multiple of _BUFFER_ALIGN within the frame.
_BUFFERS = b"B"
_COUNT = struct.Struct("<I")
_BUFFER_ALIGN = 16


def _mac(secret: bytes, role: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, role + b"".join(parts), _DIGEST).digest()


def frame_buffer(nbytes: int) -> memoryview:
    """Writable memory for a large frame, from the output pool: in a busy process
    malloc gives each allocation of over 128 KB fresh pages from the kernel, whose first
    touch cost more than the copy into them (a 256 KB frame: about 150 us)."""
    return memoryview(OUTPUTS.empty((nbytes,), np.uint8))


def recv_exact(sock: socket.socket, nbytes: int, what: str = "peer",
               pooled: bool = False) -> bytes | bytearray | memoryview:
    """Read exactly ``nbytes`` or raise PeerDisconnectedError/CollectiveTimeoutError.

    Past ``_ONE_RECV_BYTES`` the data is returned in the buffer it was read into, not
    copied into bytes: a bytearray, or with ``pooled`` a ``frame_buffer`` (the engine's
    frames, which come again and again; elsewhere a pooled block would stay idle).
    """
    if nbytes > _ONE_RECV_BYTES:
        buf = frame_buffer(nbytes) if pooled else bytearray(nbytes)
        recv_into_exact(sock, memoryview(buf), what)
        return buf
    try:
        # A small message usually comes in one read: no buffer to fill and copy out.
        # A socket with a timeout polls before each recv (CPython's deadline), a system
        # call that costs 1-2 us on a VM where the data is usually there already. Python
        # documents that a socket in timeout mode has a non-blocking descriptor, so
        # reading the descriptor itself just looks (a blocking one would wait without a
        # deadline: recv waits then).
        first = None
        if sock.gettimeout() is not None:
            try:
                first = os.read(sock.fileno(), nbytes)
            except (BlockingIOError, InterruptedError):
                pass
        if first is None:
            first = sock.recv(nbytes)
    except TimeoutError:
        raise _recv_timeout(sock, what) from None
    except (ConnectionResetError, BrokenPipeError, ConnectionAbortedError) as exc:
        raise PeerDisconnectedError(f"{what} dropped the connection ({exc})") from None
    if len(first) == nbytes:
        return first
    if not first:
        raise PeerDisconnectedError(f"{what} closed the connection")
    buf = bytearray(nbytes)
    buf[: len(first)] = first
    recv_into_exact(sock, memoryview(buf)[len(first):], what)
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview, what: str = "peer") -> None:
    """Fill ``view`` from the socket; the socket's own timeout is the deadline."""
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    got, total = 0, len(view)
    try:
        while got < total:
            n = sock.recv_into(view[got:], total - got)
            if n == 0:
                raise PeerDisconnectedError(f"{what} closed the connection")
            got += n
    except TimeoutError:
        raise _recv_timeout(sock, what) from None
    except (ConnectionResetError, BrokenPipeError, ConnectionAbortedError) as exc:
        raise PeerDisconnectedError(f"{what} dropped the connection ({exc})") from None


def _recv_timeout(sock: socket.socket, what: str) -> CollectiveTimeoutError:
    return CollectiveTimeoutError(
        f"no data from {what} within {sock.gettimeout()} s; it may be stalled or dead "
        "(raise HVD_SPARK_TIMEOUT if it is just slow)")


def send_all(sock: socket.socket, data: bytes | memoryview, what: str = "peer") -> None:
    """Send everything or raise PeerDisconnectedError/CollectiveTimeoutError."""
    try:
        sock.sendall(data)
    except TimeoutError:
        raise _send_timeout(sock, what) from None
    except OSError as exc:
        raise PeerDisconnectedError(f"{what} dropped the connection ({exc})") from None


def _send_timeout(sock: socket.socket, what: str) -> CollectiveTimeoutError:
    return CollectiveTimeoutError(
        f"could not send to {what} within {sock.gettimeout()} s; it may be stalled")


def authenticate_client(sock: socket.socket, secret: bytes) -> None:
    """Run the dialer's side of the mutual HMAC handshake.

    Raises:
        AuthenticationError: The server did not prove it knows the secret.
    """
    previous = sock.gettimeout()
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    try:
        client_nonce = os.urandom(_NONCE_BYTES)
        send_all(sock, _MAGIC + client_nonce, "server")
        reply = recv_exact(sock, _NONCE_BYTES + _MAC_BYTES, "server")
        server_nonce, server_mac = reply[:_NONCE_BYTES], reply[_NONCE_BYTES:]
        if not hmac.compare_digest(server_mac, _mac(secret, b"S", client_nonce, server_nonce)):
            raise AuthenticationError(
                "the server did not prove it knows this job's secret; "
                "check that HVD_SPARK_SECRET matches the launcher's"
            )
        send_all(sock, _mac(secret, b"C", server_nonce, client_nonce), "server")
    finally:
        sock.settimeout(previous)


def authenticate_server(sock: socket.socket, secret: bytes) -> None:
    """Run the listener's side of the handshake; raise AuthenticationError on any doubt."""
    previous = sock.gettimeout()
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    try:
        hello = recv_exact(sock, len(_MAGIC) + _NONCE_BYTES, "client")
        if hello[: len(_MAGIC)] != _MAGIC:
            raise AuthenticationError("client did not speak the hvd_spark protocol")
        client_nonce = hello[len(_MAGIC) :]
        server_nonce = os.urandom(_NONCE_BYTES)
        send_all(sock, server_nonce + _mac(secret, b"S", client_nonce, server_nonce), "client")
        proof = recv_exact(sock, _MAC_BYTES, "client")
        if not hmac.compare_digest(proof, _mac(secret, b"C", server_nonce, client_nonce)):
            raise AuthenticationError("client did not prove it knows this job's secret")
    except (PeerDisconnectedError, CollectiveTimeoutError) as exc:
        raise AuthenticationError(f"handshake with client failed: {exc}") from None
    finally:
        sock.settimeout(previous)


def free_port(host: str = "") -> int:
    """A TCP port that is free on this machine's ``host`` interface now (the kernel's pick).

    Another process may take it before the caller binds it; whoever binds then fails at
    once naming the address in use (as with torchrun's own probe).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def tune(sock: socket.socket) -> None:
    """Low latency and large buffers for collective traffic."""
    if sock.family != getattr(socket, "AF_UNIX", None):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, 4 * 1024 * 1024)
        except OSError:
            pass


def connect(
    addr: tuple[str, int], secret: bytes, timeout: float, what: str = "server"
) -> socket.socket:
    """Dial ``addr`` (retrying until ``timeout``), authenticate, and return the socket."""
    deadline = time.monotonic() + timeout
    delay = 0.01
    while True:
        try:
            sock = socket.create_connection(addr, timeout=max(0.1, deadline - time.monotonic()))
            break
        except OSError as exc:
            if time.monotonic() + delay > deadline:
                raise PeerDisconnectedError(
                    f"could not connect to {what} at {addr[0]}:{addr[1]} within {timeout} s ({exc})"
                ) from None
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
    return _authenticated(sock, secret, timeout)


def connect_unix(name: str, secret: bytes, timeout: float) -> socket.socket:
    """Dial the Unix socket ``name`` (Linux abstract namespace) of a rank on this host,
    authenticate as over TCP, and return it; raises OSError when nobody listens there."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect("\0" + name)
    except BaseException:
        sock.close()
        raise
    return _authenticated(sock, secret, timeout)


def _authenticated(sock: socket.socket, secret: bytes, timeout: float) -> socket.socket:
    """Tune a freshly connected socket and run the client handshake (closing it on
    failure); it keeps ``timeout`` as every later wait's deadline."""
    tune(sock)
    try:
        authenticate_client(sock, secret)
    except BaseException:
        sock.close()
        raise
    sock.settimeout(timeout)
    return sock


def send_frame(sock: socket.socket, payload: bytes | bytearray | memoryview,
               what: str = "peer") -> None:
    """Send one length-prefixed frame."""
    send_frames(sock, [payload], what)


_NBYTES = operator.attrgetter("nbytes")  # (a C callable: no Python frame per piece)
# sendmsg takes at most IOV_MAX (1024 on Linux) pieces; two per frame.
_PIECES_PER_SENDMSG = 1000


def frame_pieces(payloads: Sequence[bytes | bytearray | memoryview]) -> list[memoryview]:
    """The bytes of length-prefixed frames, as pieces for one gathered send."""
    pieces = []
    for payload in payloads:
        pieces += (memoryview(_LEN.pack(len(payload))), memoryview(payload).cast("B"))
    return pieces


def send_frames(sock: socket.socket, payloads: Sequence[bytes | bytearray | memoryview],
                what: str = "peer") -> None:
    """Send several length-prefixed frames in one go (one system call when small): the
    receiver reads them as if sent one by one."""
    send_pieces(sock, frame_pieces(payloads), what)


def send_pieces(sock: socket.socket, pieces: list[memoryview], what: str = "peer") -> None:
    """Send ``pieces`` (see ``frame_pieces``) in order, waiting as the socket's timeout
    allows."""
    if sum(p.nbytes for p in pieces) <= _ONE_RECV_BYTES:
        send_all(sock, b"".join(pieces), what)
        return
    # Gathered by the kernel: joining would copy the frames into fresh pages first.
    while pieces:
        pieces = _sendmsg(sock, pieces, what)


def send_pieces_now(sock: socket.socket, pieces: list[memoryview],
                    what: str = "peer") -> list[memoryview]:
    """Send what of ``pieces`` the socket takes without waiting; returns the rest (empty
    when all went), to be sent later in order."""
    previous = sock.gettimeout()
    if previous is not None:
        # Its descriptor is non-blocking (CPython's deadline) and writev just returns
        # what fit: no switching the timeout off and on (1-2 us a small frame).
        fd = sock.fileno()
        try:
            while pieces:
                sent = os.writev(fd, pieces[:_PIECES_PER_SENDMSG])
                if sent == sum(map(_NBYTES, pieces)):
                    return []  # the usual case: all went at once
                pieces = _unsent(pieces, sent)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            raise PeerDisconnectedError(f"{what} dropped the connection ({exc})") from None
        return pieces
    sock.settimeout(0.0)  # else CPython waits for room up to the timeout
    try:
        while pieces:
            try:
                pieces = _sendmsg(sock, pieces, what)
            except BlockingIOError:
                break
    finally:
        sock.settimeout(previous)
    return pieces


def _sendmsg(sock: socket.socket, pieces: list[memoryview], what: str) -> list[memoryview]:
    """One sendmsg of the first pieces; returns what is left to send."""
    try:
        sent = sock.sendmsg(pieces[:_PIECES_PER_SENDMSG])
    except (BlockingIOError, InterruptedError):
        raise
    except TimeoutError:
        raise _send_timeout(sock, what) from None
    except OSError as exc:
        raise PeerDisconnectedError(f"{what} dropped the connection ({exc})") from None
    return _unsent(pieces, sent)


def _unsent(pieces: list[memoryview], sent: int) -> list[memoryview]:
    """What of ``pieces`` is left after ``sent`` bytes of them went."""
    done = 0
    while done < len(pieces) and sent >= pieces[done].nbytes:  # what went in full
        sent -= pieces[done].nbytes
        done += 1
    rest = pieces[done:]
    if rest and sent:
        rest[0] = rest[0][sent:]
    return rest


def recv_frame(sock: socket.socket, what: str = "peer",
               pooled: bool = False) -> bytes | bytearray | memoryview:
    """Receive one length-prefixed frame (``pooled``: see ``recv_exact``)."""
    (length,) = _LEN.unpack(recv_exact(sock, _LEN.size, what))
    if length > MAX_FRAME_BYTES:
        raise PeerDisconnectedError(f"{what} sent a frame of {length} bytes; protocol error")
    return recv_exact(sock, length, what, pooled)


def encode_obj(obj: Any, pooled: bool = False) -> bytes | bytearray | memoryview:
    """``obj`` as ``send_obj`` frames it: a snapshot, so a caller may send it later while
    another thread changes the arrays it holds.

    Tensors stay in the pickle up to ``IN_BAND_MAX_BYTES`` in all; the others (a big
    eager allreduce's tensor, a batch of many mid-size ones) leave it as raw buffers,
    copied once into the frame behind it (``_BUFFERS``), and the receiver's arrays are
    views of the frame it read. In the pickle they would be copied three times more on
    each side, into fresh pages once it grows large. With ``pooled`` such a frame is a
    ``frame_buffer`` (the engine's, sent again and again), else a bytearray.
    """
    buffers: list[pickle.PickleBuffer] = []
    in_band = 0

    def out_of_band(buffer: pickle.PickleBuffer) -> bool:
        nonlocal in_band
        size = buffer.raw().nbytes
        if in_band + size <= IN_BAND_MAX_BYTES:
            in_band += size
            return True  # in the pickle: cheaper for small ones
        buffers.append(buffer)
        return False

    body = pickle.dumps(obj, protocol=5, buffer_callback=out_of_band)
    if not buffers:
        return body  # starts with pickle's PROTO opcode, never with _BUFFERS
    raws = [b.raw() for b in buffers]
    head = _BUFFERS + _COUNT.pack(len(raws)) + struct.pack(f"<{len(raws) + 1}Q", len(body),
                                                          *(r.nbytes for r in raws))
    placed = [(0, head), (len(head), body)]
    offset = len(head) + len(body)
    for raw in raws:
        offset += -offset % _BUFFER_ALIGN  # numpy wants its items aligned
        placed.append((offset, raw))
        offset += raw.nbytes
    frame = frame_buffer(offset) if pooled else memoryview(bytearray(offset))
    for start, part in placed:
        frame[start:start + len(part)] = part
    return frame


def decode_obj(frame: bytes | bytearray | memoryview, what: str = "peer") -> Any:
    """The object ``encode_obj`` framed (one received frame).

    Raises:
        PeerDisconnectedError: The frame is not a whole pickle (a peer from another
            version of hvd_spark, or a broken stream), naming ``what``.
    """
    try:
        if not frame or frame[0] != _BUFFERS[0]:
            return pickle.loads(frame)
        view = memoryview(frame)
        (count,) = _COUNT.unpack_from(view, 1)
        sizes = struct.unpack_from(f"<{count + 1}Q", view, 1 + _COUNT.size)
        offset = 1 + _COUNT.size + 8 * (count + 1)
        body = view[offset:offset + sizes[0]]
        offset += sizes[0]
        buffers = []
        for size in sizes[1:]:
            offset += -offset % _BUFFER_ALIGN
            buffers.append(view[offset:offset + size])
            offset += size
        if offset != len(view):
            raise ValueError(f"its buffers end at byte {offset}")
        return pickle.loads(body, buffers=buffers)
    except (pickle.UnpicklingError, EOFError, ValueError, struct.error) as exc:
        raise PeerDisconnectedError(
            f"{what} sent a frame of {len(frame)} bytes that does not unpickle ({exc}); "
            "check that every rank runs the same hvd_spark version"
        ) from None


def send_obj(sock: socket.socket, obj: Any, what: str = "peer") -> None:
    """Pickle ``obj`` into one frame (only ever sent over authenticated sockets)."""
    send_frame(sock, encode_obj(obj), what)


def recv_obj(sock: socket.socket, what: str = "peer", pooled: bool = False) -> Any:
    """Receive one frame that ``send_obj`` sent over an authenticated socket (``pooled``:
    see ``recv_exact``).

    Raises:
        PeerDisconnectedError: The frame is not a whole pickle (see ``decode_obj``).
    """
    # (recv_frame's lines: a small synchronous call runs them every time)
    (length,) = _LEN.unpack(recv_exact(sock, _LEN.size, what))
    if length > MAX_FRAME_BYTES:
        raise PeerDisconnectedError(f"{what} sent a frame of {length} bytes; protocol error")
    return decode_obj(recv_exact(sock, length, what, pooled), what)


def parse_addr(addr: str, what: str = "address") -> tuple[str, int]:
    """Split ``host:port`` (IPv6 hosts in brackets) into a tuple.

    Args:
        addr: The address text.
        what: Where it came from (a variable's name, a peer), named in the error.

    Raises:
        ConfigError: ``addr`` is not ``host:port`` with a port in 1..65535.
    """
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"{what}={addr!r} is not of the form host:port (with a port in 1..65535)"
        )
    return host.strip("[]"), int(port)
