"""TensorBoard event files written on the driver, with no TensorFlow or tensorboard import.

An event file is a sequence of TFRecords (length, masked CRC-32C of the length, data,
masked CRC-32C of the data), each holding one serialized ``Event`` protobuf. Scalars
need four fields of it, encoded here by hand: ``wall_time`` (1, double), ``step``
(2, int64), ``file_version`` (3, string) and ``summary`` (5) with its values' ``tag``
(1, string) and ``simple_value`` (2, float). Both frameworks' metrics arrive on the
driver as progress events, so one writer serves TorchEstimator and KerasEstimator alike.
"""

from __future__ import annotations

import socket
import struct
import time
from typing import Any

_CRC_TABLE: list[int] = []


def _crc_table() -> list[int]:
    if not _CRC_TABLE:
        for byte in range(256):  # CRC-32C (Castagnoli), reflected polynomial
            crc = byte
            for _ in range(8):
                crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
            _CRC_TABLE.append(crc)
    return _CRC_TABLE


def crc32c(data: bytes) -> int:
    """CRC-32C of ``data`` (a table per byte: event records are small)."""
    table, crc = _crc_table(), 0xFFFFFFFF
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """The CRC as TFRecord stores it (rotated and offset, so CRCs of CRCs stay sound)."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(value: int) -> bytes:
    out = bytearray()
    value &= (1 << 64) - 1  # negative int64 as protobuf encodes it
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, wire_type: int) -> bytes:
    return _varint((number << 3) | wire_type)


def _bytes_field(number: int, data: bytes) -> bytes:
    return _field(number, 2) + _varint(len(data)) + data


def encode_event(wall_time: float, step: int, *, file_version: str | None = None,
                 scalars: dict[str, float] | None = None) -> bytes:
    """One serialized ``Event``: a file-version header or a summary of scalars."""
    out = _field(1, 1) + struct.pack("<d", wall_time) + _field(2, 0) + _varint(step)
    if file_version is not None:
        out += _bytes_field(3, file_version.encode())
    if scalars:
        summary = b"".join(
            _bytes_field(1, _bytes_field(1, tag.encode()) + _field(2, 5)
                         + struct.pack("<f", float(value)))
            for tag, value in scalars.items())
        out += _bytes_field(5, summary)
    return out


def record(data: bytes) -> bytes:
    """``data`` framed as one TFRecord."""
    length = struct.pack("<Q", len(data))
    return (length + struct.pack("<I", masked_crc32c(length)) + data
            + struct.pack("<I", masked_crc32c(data)))


class EventFileWriter:
    """Appends scalar events to one event file in a Store directory.

    Args:
        store: The run's Store (its filesystem is written through pyarrow).
        directory: Store-relative directory, e.g. ``store.logs_path(run_id)``.
    """

    def __init__(self, store: Any, directory: str) -> None:
        now = time.time()
        name = f"events.out.tfevents.{int(now)}.{socket.gethostname()}.hvd_spark"
        self.path = store.path(f"{directory}/{name}")
        store.filesystem.create_dir(store.path(directory), recursive=True)
        self._out = store.filesystem.open_output_stream(self.path)
        self._out.write(record(encode_event(now, 0, file_version="brain.Event:2")))
        self._out.flush()

    def add_scalars(self, step: int, scalars: dict[str, float]) -> None:
        """Write ``scalars`` (tag -> number) at ``step``, and flush them to the store."""
        numbers = {k: float(v) for k, v in scalars.items() if isinstance(v, (int, float))}
        if numbers:
            self._out.write(record(encode_event(time.time(), step, scalars=numbers)))
            self._out.flush()

    def close(self) -> None:
        """Close the file (an object store uploads it now)."""
        self._out.close()
