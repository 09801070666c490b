"""The collective stream of each device, ordered after the framework's stream by events.

Device collectives run on a stream of their own. A tensor submitted from a framework
is ordered after the kernels that produced it by an event recorded on the producer's
stream and waited for by the collective stream (on the GPU: the host does not wait);
its consumer waits, the same way, for an event recorded after the collective.
"""

from __future__ import annotations

import threading
from typing import Any

from hvd_spark.collectives.nccl import library

_lock = threading.Lock()
_streams: dict[int, Any] = {}


def collective_stream(device_id: int) -> Any:
    """The (non-blocking) stream device collectives run on, one per device."""
    with _lock:
        stream = _streams.get(device_id)
        if stream is None:
            cp = library.cupy()
            with cp.cuda.Device(device_id):
                stream = _streams[device_id] = cp.cuda.Stream(non_blocking=True)
        return stream


def _stream_of(ptr: int | None) -> Any:
    cp = library.cupy()
    return cp.cuda.get_current_stream() if ptr is None else cp.cuda.ExternalStream(ptr)


def order_after(device_id: int, producer_stream: int | None) -> None:
    """Make later collectives on ``device_id`` wait for the producer stream's work so far.

    Args:
        device_id: The CUDA device of the tensors.
        producer_stream: Raw ``cudaStream_t`` of the stream that wrote them (torch's
            current stream); None for cupy's current stream.
    """
    cp = library.cupy()
    with cp.cuda.Device(device_id):
        event = cp.cuda.Event(block=False, disable_timing=True, interprocess=False)
        event.record(_stream_of(producer_stream))
        collective_stream(device_id).wait_event(event)


def done_event(device_id: int) -> Any:
    """An event marking the end of everything queued on the collective stream so far."""
    cp = library.cupy()
    with cp.cuda.Device(device_id):
        event = cp.cuda.Event(block=False, disable_timing=True, interprocess=False)
        event.record(collective_stream(device_id))
        return event


def consumer_waits(event: Any, consumer_stream: int | None) -> None:
    """Order the consumer stream (torch's current one) after ``event``, on the GPU."""
    _stream_of(consumer_stream).wait_event(event)
