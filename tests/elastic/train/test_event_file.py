"""elastic.train.event_file writes what TensorBoard's own writer writes, byte for byte."""

from __future__ import annotations

import io
import os

import pytest

from elastic.train.event_file import event, record

pytest.importorskip("tensorboard", reason="the hf extra (tensorboard) is what these compare against")


def test_records_and_events_are_tensorboards_bytes():
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter

    for data in (b"", b"a", os.urandom(4096)):
        out = io.BytesIO()
        RecordWriter(out).write(data)
        assert out.getvalue() == record(data)
    assert event(1.5, file_version="brain.Event:2") == event_pb2.Event(
        wall_time=1.5, file_version="brain.Event:2").SerializeToString()
    for step, scalars in ((0, {"a": 1.0}), (7, {"train/loss": 2.5, "cost/usd": 1e-6}), (2**40, {"x": -3.25}),
                          (3, {"é/ünïcode": float("inf")})):
        values = [summary_pb2.Summary.Value(tag=t, simple_value=v) for t, v in scalars.items()]
        want = event_pb2.Event(wall_time=1764000000.25, step=step, summary=summary_pb2.Summary(value=values))
        assert event(1764000000.25, step, scalars=scalars) == want.SerializeToString(), (step, scalars)
