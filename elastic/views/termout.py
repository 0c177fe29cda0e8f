"""What a run prints never holds its training: the console's lines (stdout and stderr) are written
by a thread of their own, in the order they were printed.

A terminal that stops reading (a paused pager, Ctrl-S, a full pipe: 64 KB, about 500 outer steps
of progress lines) would otherwise block the driver's next print, and with it every step while the
VMs bill. Here the driver only queues the text. While more than `LIMIT_CHARS` wait unwritten, new
text is dropped, and once the reader catches up one line says how much was lost; the ledger,
driver.log and the report are files and lose nothing. The thread writes with `os.write` on the
streams' descriptors, so no Python buffer is left half-written at exit. When the run ends the
driver waits at most `DRAIN_S` for the reader, then exits anyway.

`plain_console` is the other rule of what elastic prints: piped output keeps whole table rows."""

from __future__ import annotations

import io
import os
import sys
import threading
from collections import deque
from contextlib import contextmanager

LIMIT_CHARS = 1 << 20   # text waiting to be written beyond which new text is dropped
DRAIN_S = 10.0          # at the end, how long the driver waits for the reader


class _Pump:
    """One writer thread for every stream of the console, in print order."""

    def __init__(self, limit_chars: int = LIMIT_CHARS):
        self._limit = limit_chars
        self._queue: deque[tuple[int, str]] = deque()
        self._waiting = 0      # characters queued, not yet written
        self._dropped = 0      # characters dropped since the last notice
        self._closed = False
        self._cond = threading.Condition()
        threading.Thread(target=self._run, name="console", daemon=True).start()

    def write(self, fd: int, text: str) -> None:
        if not text:
            return
        with self._cond:
            if self._waiting + len(text) > self._limit:
                self._dropped += len(text)
                return
            if self._dropped:
                notice = f"[{self._dropped:,} characters of output dropped: nothing was reading them]\n"
                self._queue.append((fd, notice))
                self._waiting += len(notice)
                self._dropped = 0
            self._queue.append((fd, text))
            self._waiting += len(text)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                fd, text = self._queue.popleft()
            data = text.encode("utf-8", "replace")
            try:
                while data:
                    data = data[os.write(fd, data):]
            except OSError:   # the reader went away (EPIPE): nothing more can be shown
                pass
            with self._cond:
                self._waiting -= len(text)
                self._cond.notify_all()

    def drain(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for what is queued to be written; True when everything was."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and self._waiting == 0, timeout=timeout_s)

    def close(self, timeout_s: float) -> bool:
        """Stop the thread once what is queued is written; wait up to `timeout_s` for that."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        return self.drain(timeout_s)


class _PumpedFile(io.TextIOBase):
    """A text stream whose writes go to the pump (for `sys.stdout`, `sys.stderr`, a rich Console)."""

    def __init__(self, pump: _Pump, stream):
        self._pump, self._stream = pump, stream
        self._fd = stream.fileno()

    def write(self, s: str) -> int:
        self._pump.write(self._fd, s)
        return len(s)

    def flush(self) -> None:
        """Nothing to flush here: the pump writes each piece as soon as the reader takes it."""

    def isatty(self) -> bool:
        return self._stream.isatty()

    def fileno(self) -> int:
        return self._fd

    @property
    def encoding(self) -> str:
        return "utf-8"


def _has_fd(stream) -> bool:
    """Whether `stream` writes to a descriptor (flushed first, so nothing it holds comes late)."""
    try:
        stream.flush()
        stream.fileno()
        return True
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return False


@contextmanager
def detached(console):
    """While the block runs, `sys.stdout`, `sys.stderr` and `console` print through one writer
    thread (see the module's docstring); afterwards they are restored, and the driver waits at
    most `DRAIN_S` for the reader to take what is left. Streams without a descriptor (a test's
    capture) are left as they are."""
    if not all(_has_fd(s) for s in (sys.stdout, sys.stderr, console.file)):
        yield
        return
    pump = _Pump()
    saved = sys.stdout, sys.stderr, console.file
    sys.stdout, sys.stderr = _PumpedFile(pump, saved[0]), _PumpedFile(pump, saved[1])
    console.file = _PumpedFile(pump, saved[2])
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved[0], saved[1]
        console.file = saved[2]
        pump.close(DRAIN_S)


def plain_console(console):
    """`console` on a terminal; piped, a wide console, so tables keep whole rows and words (a
    table squeezed into 80 columns wraps `cloud:zone` cells letter by letter)."""
    if console.is_terminal:
        return console
    from rich.console import Console
    return Console(width=200, file=console.file, soft_wrap=True)
