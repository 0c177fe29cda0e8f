"""Stop signals that cannot be lost: Ctrl-C (SIGINT), SIGTERM and SIGHUP (a closed terminal or SSH
session) end a run cleanly (every node released, the report written).

Inside `raise_interrupt` each of them raises KeyboardInterrupt in the main thread, as Python's own
SIGINT handler does, and is also remembered. Python runs a signal's handler at whatever bytecode
the main thread is at; when that is a finalizer (an object's `__del__`, a weakref callback: Ray's
object and actor handles run many), the KeyboardInterrupt it raises is printed as "Exception
ignored" and lost, and the run went on as if no signal had come (seen: a Ctrl-C while nodes
joined, the run training on until it ran out of capacity minutes later). The driver calls `check`
on every tick: it raises the remembered stop again, and puts the handler back where something
replaced it (Ray installs its own around node starts)."""

from __future__ import annotations

import logging
import signal
import threading
from contextlib import contextmanager

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_armed = False
_requested: str | None = None
_warned: set[int] = set()   # signals whose replaced handler was logged (once per run)


def _handler(signum, frame):
    global _requested
    _requested = signal.Signals(signum).name
    raise KeyboardInterrupt(_requested)


@contextmanager
def raise_interrupt():
    """Inside the block, `SIGNALS` raise KeyboardInterrupt in the main thread, and `check` raises it
    again should a finalizer have swallowed it. The handlers before the block come back after it."""
    global _armed, _requested
    old = {s: signal.signal(s, _handler) for s in SIGNALS}
    _armed, _requested = True, None
    _warned.clear()
    try:
        yield
    finally:
        _armed = False
        for s, h in old.items():
            signal.signal(s, h)


def check() -> None:
    """Inside `raise_interrupt`, in the main thread: raise KeyboardInterrupt when a stop signal came
    (its first KeyboardInterrupt lost, or this is where it lands), and put back a handler that
    something replaced. Elsewhere (cleanup runs with the signals ignored): nothing."""
    if not _armed or threading.current_thread() is not threading.main_thread():
        return
    for s in SIGNALS:
        if signal.getsignal(s) is not _handler:
            if s not in _warned:
                _warned.add(s)
                log.warning("the %s handler was replaced (by %r): put back", signal.Signals(s).name,
                            signal.getsignal(s))
            signal.signal(s, _handler)
    if _requested is not None:
        raise KeyboardInterrupt(_requested)
