"""The console's writer thread (`elastic.views.termout`) on a real pipe whose reader comes late."""

from __future__ import annotations

import fcntl
import os
import threading

from elastic.views.termout import _Pump


def test_text_past_the_limit_is_dropped_and_said_once_the_reader_catches_up():
    r, w = os.pipe()
    size = fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)
    os.write(w, b"x" * size)   # the pipe is full before the first line: nothing reads it yet
    pump = _Pump(limit_chars=10_000)
    lines = [f"line {i:05d}\n" for i in range(2000)]          # 22,000 characters
    for line in lines:
        pump.write(w, line)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.extend(iter(lambda: os.read(r, 65536), b"")))
    reader.start()
    try:
        assert pump.drain(30)
        pump.write(w, "last\n")                                # after the drop: the notice comes first
        assert pump.close(30)
    finally:
        os.close(w)
        reader.join(30)
        os.close(r)
    data = b"".join(got)
    assert data[:size] == b"x" * size
    out = data[size:].decode().splitlines(keepends=True)
    assert out[-1] == "last\n" and out[-2].startswith("[") and "of output dropped" in out[-2]
    kept = out[:-2]
    assert kept == lines[:10_000 // 11]                                 # in order, up to the limit, none cut
    dropped = int(out[-2][1:].split()[0].replace(",", ""))
    assert dropped == sum(map(len, lines[len(kept):]))                 # every character accounted for
