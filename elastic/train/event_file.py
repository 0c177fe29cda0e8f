"""TensorBoard event files, written without TensorBoard or torch: the driver writes a few scalars
per outer step, and `torch.utils.tensorboard` would load torch (and TensorBoard's protobufs) into
it, about 2 CPU-seconds beside the ranks' start. TensorBoard reads these files as its own.

The format is TensorFlow's: a file of records, each `length (u64) | masked CRC-32C of length (u32)
| data | masked CRC-32C of data (u32)`, little-endian, whose data is one serialized `Event` proto;
the first event carries the file version `brain.Event:2`, each later one a `Summary` of scalars
(`Summary.Value.simple_value`, as `SummaryWriter.add_scalar` writes them).
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path

import google_crc32c


def _masked(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """One TFRecord holding `data`."""
    length = struct.pack("<Q", len(data))
    return (length + struct.pack("<I", _masked(google_crc32c.value(length))) + data
            + struct.pack("<I", _masked(google_crc32c.value(data))))


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1   # int64 fields: negative numbers as their two's complement
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _bytes_field(number: int, value: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def event(wall_time: float, step: int = 0, file_version: str | None = None,
          scalars: dict[str, float] | None = None) -> bytes:
    """A serialized `tensorflow.Event`: wall_time = 1 (double), step = 2 (int64), file_version = 3,
    summary = 5, whose `value`s (1) are each tag = 1 and simple_value = 2 (float)."""
    out = _varint(1 << 3 | 1) + struct.pack("<d", wall_time)
    if step:
        out += _varint(2 << 3 | 0) + _varint(step)
    if file_version is not None:
        out += _bytes_field(3, file_version.encode())
    if scalars:
        values = b"".join(_bytes_field(1, _bytes_field(1, tag.encode()) + _varint(2 << 3 | 5)
                                          + struct.pack("<f", float(value)))
                          for tag, value in scalars.items())
        out += _bytes_field(5, values)
    return out


class EventFile:
    """One event file in `logdir`, named as TensorBoard's writers name theirs
    (`events.out.tfevents.<time>.<host>.<pid>`); each `scalars` call is one event, flushed."""

    def __init__(self, logdir: Path):
        logdir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        self.path = logdir / f"events.out.tfevents.{int(now):010d}.{socket.gethostname()}.{os.getpid()}"
        self._f = open(self.path, "ab")
        self._f.write(record(event(now, file_version="brain.Event:2")))
        self._f.flush()

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self._f.write(record(event(time.time(), step, scalars=values)))
        self._f.flush()

    def close(self) -> None:
        self._f.close()
