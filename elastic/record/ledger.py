"""The run's ledger: every event (typed: elastic/record/events.py), appended as one JSON line to `events.jsonl`.

`Ledger.events` and `read_events` hold the JSON records; views read them back typed with
`elastic.record.events.read`.

Status views, reports and the live terminal are views of these events; nothing keeps a second
tally. Each line is written whole and flushed, so a crash leaves at most one torn last line, which
`read_events` skips.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

from elastic.errors import UserError
from elastic.record.events import Event, declared

log = logging.getLogger("elastic.record.events")   # every event at INFO: driver.log's record of the run


class Ledger:
    """Append-only JSONL event log.

    Args:
        path: the `events.jsonl` file (created, or appended to).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # Called with each event after it is written, typed and stamped with its `t` (the live
        # terminal view, elastic.train.metrics); a listener that fails is logged, never the run's problem.
        self.listeners: list[Callable[[Event], None]] = []
        self._f = open(self.path, "a", encoding="utf-8")
        self.events: list[dict] = read_events(self.path)
        # A crash can leave a torn last line with no newline; end it, or the next event would be glued
        # onto it and lost to read_events.
        if self.path.stat().st_size and not self.path.read_bytes().endswith(b"\n"):
            self._f.write("\n")
            self._f.flush()

    def append(self, typed: Event) -> dict:
        """Record `typed` (an event elastic/record/events.py declares) at the wall time `t` (unix seconds);
        returns its JSON record. Anything else is a programming error: TypeError."""
        if not declared(typed):
            raise TypeError(f"not an event declared in elastic/record/events.py: {typed!r}")
        event = typed.record(round(time.time(), 6))
        line = json.dumps(event, separators=(",", ":"), default=str)
        with self._lock:
            self._f.write(line + "\n")
            self._f.flush()
            self.events.append(event)
        log.info("%s", typed.TYPE, extra={"event": event})
        stamped = dataclasses.replace(typed, t=event["t"])
        for listener in list(self.listeners):
            try:
                listener(stamped)
            except Exception:
                log.exception("ledger listener")
        return event

    def sync(self) -> None:
        """Force the ledger to disk (at run end and before reports)."""
        with self._lock:
            self._f.flush()
            os.fsync(self._f.fileno())

    def close(self) -> None:
        with self._lock:
            if not self._f.closed:
                self._f.flush()
                os.fsync(self._f.fileno())
                self._f.close()


def read_events(path: str | Path) -> list[dict]:
    """All whole events of a ledger file (a torn last line is skipped). A line that is JSON but
    not an event (an object with a string `type` and a numeric time `t`) is a LedgerError."""
    p = Path(path)
    if not p.exists():
        return []
    events = []
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise LedgerError(f"{p}: cannot read: {exc}") from None
    for n, line in enumerate(text.splitlines(), 1):
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not (isinstance(event, dict) and isinstance(event.get("type"), str)
                and type(event.get("t")) in (int, float)):
            raise LedgerError(f"{p}: line {n} is not an event elastic writes")
        events.append(event)
    return events


# What reading an event of an unexpected shape raises in a view (report, status).
SHAPE_ERRORS = (KeyError, TypeError, ValueError, AttributeError, IndexError)


class LedgerError(UserError):
    """A ledger that is not one elastic wrote (one line for the user)."""
