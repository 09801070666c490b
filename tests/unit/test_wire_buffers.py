"""Large tensors travel beside a control message's pickle (``wire.encode_obj``)."""

from __future__ import annotations

import pickle
import socket
import threading

import numpy as np
import pytest

from hvd_spark.collectives import messages as m
from hvd_spark.collectives.tcp import wire
from hvd_spark.errors import PeerDisconnectedError

BIG = m.IN_BAND_MAX_BYTES // 8 + 1  # float64 elements just past the in-band limit


def _request(payload: np.ndarray, name: str = "t") -> m.Request:
    return m.Request(name, m.ALLREDUCE, str(payload.dtype), payload.shape, payload=payload)


def test_small_tensors_stay_in_the_pickle_and_large_ones_leave_it():
    small = wire.encode_obj(("req", [_request(np.arange(8.0))]))
    big = wire.encode_obj(("req", [_request(np.arange(float(BIG)))]))
    assert bytes(small[:1]) == b"\x80"  # a plain pickle
    assert bytes(big[:1]) == b"B"
    # The big tensor is in the frame once, not also inside the pickle.
    assert BIG * 8 < len(big) < BIG * 8 + 1024


def test_a_frame_is_a_snapshot_of_the_arrays_it_carries():
    payload = np.arange(float(BIG))
    data = np.full(BIG, 7, np.int32)
    frame = wire.encode_obj(("x", [_request(payload)], m.Response(m.ALLREDUCE, ("t",),
                                                                  data=data)))
    payload[:] = -1  # another thread reduces into the tensor after it was framed
    data[:] = -1
    kind, (request,), response = wire.decode_obj(frame)
    assert kind == "x"
    np.testing.assert_array_equal(request.payload, np.arange(float(BIG)))
    assert request.payload.dtype == np.float64
    assert request == _request(payload)  # the fields ranks agree on survive too
    np.testing.assert_array_equal(np.frombuffer(response.data, np.int32), 7)


def test_a_batch_of_mid_size_tensors_keeps_its_pickle_small():
    """53 requests carrying 64 KB tensors each (a grouped allreduce of a ResNet's
    gradients): at most ``IN_BAND_MAX_BYTES`` of tensors stay in the pickle, the rest
    travel beside it, and every tensor (float32 and bfloat16 alike) comes back exact,
    in order; a lone 1 KB tensor stays a plain pickle."""
    import ml_dtypes

    rng = np.random.default_rng(0)
    tensors = [rng.random(16384).astype(np.float32) for _ in range(50)]
    tensors += [rng.random(32768).astype(ml_dtypes.bfloat16) for _ in range(3)]
    frame = wire.encode_obj(("req", [_request(t, f"t{i}") for i, t in enumerate(tensors)]))
    assert bytes(frame[:1]) == b"B"
    (count,) = wire._COUNT.unpack_from(frame, 1)
    body = int.from_bytes(bytes(frame[1 + wire._COUNT.size:9 + wire._COUNT.size]), "little")
    assert body <= m.IN_BAND_MAX_BYTES + 16 * 1024  # the pickle holds one tensor at most
    assert count == len(tensors) - 1
    kind, requests = wire.decode_obj(frame)
    assert [q.name for q in requests] == [f"t{i}" for i in range(len(tensors))]
    for q, t in zip(requests, tensors):
        assert q.payload.dtype == t.dtype and q.payload.tobytes() == t.tobytes()
    lone = wire.encode_obj(("req", [_request(np.arange(256, dtype=np.float32))]))
    assert bytes(lone[:1]) == b"\x80"


@pytest.mark.parametrize("count", [1, 3])
def test_large_frames_cross_a_socket_whole_and_aligned(count):
    """Frames larger than the socket's buffer (partial sends), several tensors in one
    message, each received array aligned for its items."""
    a, b = socket.socketpair()
    a.settimeout(10.0)
    b.settimeout(10.0)
    tensors = [np.random.default_rng(i).random(BIG * 8 + i) for i in range(count)]
    sent = ("req", [_request(t, f"t{i}") for i, t in enumerate(tensors)])
    got: list = []
    reader = threading.Thread(target=lambda: got.append(wire.recv_obj(b, "rank 1")))
    reader.start()
    try:
        wire.send_obj(a, sent, "rank 1")
        reader.join(10.0)
        assert not reader.is_alive()
        kind, requests = got[0]
        assert kind == "req" and [q.name for q in requests] == [f"t{i}" for i in range(count)]
        for q, t in zip(requests, tensors):
            assert q.payload.tobytes() == t.tobytes()
            assert q.payload.ctypes.data % 8 == 0
    finally:
        a.close()
        b.close()


def test_requests_still_pickle_without_out_of_band_buffers():
    """Other pickles of a request (protocol 4, or 5 with no buffer callback) keep its
    tensor in band."""
    request = _request(np.arange(float(BIG)))
    for protocol in (4, 5):
        back = pickle.loads(pickle.dumps(request, protocol=protocol))
        np.testing.assert_array_equal(back.payload, request.payload)


def test_a_broken_buffer_frame_names_the_peer():
    frame = bytes(wire.encode_obj(("req", [_request(np.arange(float(BIG)))])))
    for broken in (frame[:-1], frame + b"\0", frame[:9]):
        with pytest.raises(PeerDisconnectedError, match="rank 2 sent a frame of"):
            wire.decode_obj(broken, "rank 2")


def test_any_array_in_a_message_arrives_writable():
    """Plain numpy arrays (not a request's tensor) take the same rule, and the receiver
    may write into what it got, small or large (test harnesses and callers do)."""
    a, b = socket.socketpair()
    a.settimeout(10.0)
    b.settimeout(10.0)
    try:
        for n in (3, BIG):
            sent = {"x": np.arange(n, dtype=np.int64)}
            frame = wire.encode_obj(sent)
            assert bytes(frame[:1]) == (b"B" if n == BIG else b"\x80")
            got: list = []
            reader = threading.Thread(
                target=lambda out=got: out.append(wire.recv_obj(b, "rank 1")))
            reader.start()
            wire.send_obj(a, sent, "rank 1")
            reader.join(10.0)
            x = got[0]["x"]
            np.testing.assert_array_equal(x, sent["x"])
            x += 1  # writable
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("count,big", [(3, False), (1200, False), (40, True)])
def test_frames_sent_together_arrive_one_by_one(count, big):
    """``send_frames`` joins small frames into one send and gathers large ones (more
    pieces than one sendmsg takes, more bytes than the socket buffer holds: partial
    sends); the receiver reads each frame as if it had been sent alone."""
    a, b = socket.socketpair()
    a.settimeout(10.0)
    b.settimeout(10.0)
    payloads = [np.full(BIG * 2 if big else 3, i, np.float64) for i in range(count)]
    frames = [wire.encode_obj(("req", [_request(p, f"t{i}")])) for i, p in enumerate(payloads)]
    got: list = []
    reader = threading.Thread(
        target=lambda: got.extend(wire.recv_obj(b, "rank 1") for _ in range(count)))
    reader.start()
    try:
        wire.send_frames(a, frames, "rank 1")
        reader.join(20.0)
        assert not reader.is_alive() and len(got) == count
        for i, (kind, requests) in enumerate(got):
            assert kind == "req" and requests[0].name == f"t{i}"
            assert requests[0].payload.tobytes() == payloads[i].tobytes()
    finally:
        a.close()
        b.close()


def test_frames_to_a_closed_peer_name_it():
    a, b = socket.socketpair()
    b.close()
    with pytest.raises(PeerDisconnectedError, match="rank 3"):
        wire.send_frames(a, [b"x" * (1 << 20)] * 3, "rank 3")
    a.close()


def test_requests_and_responses_cross_the_control_socket_as_their_fields():
    """The engine sends requests and responses as plain tuples (``fields``) and rebuilds
    them on arrival; tensors still leave the pickle past the in-band limit."""
    big = np.arange(float(BIG))
    requests = [_request(big, "big"), _request(np.arange(3.0), "small"),
                m.Request("lane", m.ALLREDUCE, "float32", (1024,), lane=7)]
    response = m.Response(m.ALLREDUCE, ("big",), data=big, chunk_bytes=8192)
    frames = [wire.encode_obj(("req", [r.fields() for r in requests])),
              wire.encode_obj(("resp", [response.fields()]))]
    assert bytes(frames[0][:1]) == b"B" and BIG * 8 < len(frames[0]) < BIG * 8 + 1024
    _, got = wire.decode_obj(frames[0])
    got = [m.Request.from_fields(f) for f in got]
    assert got == requests  # the fields ranks agree on
    assert got[0].payload.tobytes() == big.tobytes() and got[1].payload.tolist() == [0, 1, 2]
    assert got[2].payload is None and got[2].lane == 7
    _, (fields,) = wire.decode_obj(frames[1])
    back = m.Response.from_fields(fields)
    assert back == response and back.chunk_bytes == 8192
    assert np.frombuffer(back.data, np.float64).tobytes() == big.tobytes()


def test_a_request_with_another_payload_is_a_new_request_of_the_same_fields():
    original = m.Request("t", m.ALLREDUCE, "float64", (3,), op=2, prescale=0.5,
                         postscale=2.0, members=(0, 1), payload=np.arange(3.0))
    moved = original.with_payload(None, 4)
    assert moved == original and moved is not original
    assert moved.fields()[:13] == original.fields()[:13]
    assert (moved.payload, moved.lane) == (None, 4)
    assert original.payload.tolist() == [0.0, 1.0, 2.0] and original.lane is None
