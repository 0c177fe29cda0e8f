"""elastic's own log: the standard `logging` module, JSON lines in the run's `driver.log`, rich's
handler (warnings and errors) on a terminal.

Every ledger event is logged at INFO by `elastic.record.events` (the ledger is the record; the log puts it
beside the decisions and warnings of the `elastic.*` and `providers.*` loggers), and a run that
fails logs its full traceback. Ray's own messages go to Ray's log directory (see
`elastic.run.cluster`), not here."""

from __future__ import annotations

import json
import logging
import sys
from contextlib import contextmanager
from pathlib import Path

LOGGERS = ("elastic", "providers")


class JsonLines(logging.Formatter):
    """One JSON object per record: `t` (unix s), `level`, `logger`, `msg`, the ledger `event` when
    the record carries one, and `traceback` when it has exception info."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {"t": round(record.created, 6), "level": record.levelname, "logger": record.name,
               "msg": record.getMessage()}
        event = getattr(record, "event", None)
        if event is not None:
            doc["event"] = event
        if record.exc_info:
            doc["traceback"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


class OneLine(logging.Formatter):
    """The terminal's form of a record: one line, never a traceback (that goes to driver.log)."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None,
                                                     "stack_info": None}))
        first = text.splitlines()[0] if text else ""
        return first + (" (traceback in driver.log)" if record.exc_info else "")


@contextmanager
def run_logging(log_path: Path, console):
    """While the block runs: `elastic.*` and `providers.*` at INFO to `log_path` as JSON lines, and
    their warnings and errors to `console` as one line each (rich's handler on a terminal, plain
    lines otherwise), tracebacks to the file only."""
    file_handler = logging.FileHandler(log_path, encoding="utf-8")
    file_handler.setFormatter(JsonLines())
    if console.is_terminal:
        from rich.logging import RichHandler
        term: logging.Handler = RichHandler(console=console, show_path=False, markup=False, rich_tracebacks=False)
        term.setFormatter(OneLine("%(message)s"))
    else:
        term = logging.StreamHandler(sys.stderr)
        term.setFormatter(OneLine("%(levelname)s %(name)s: %(message)s"))
    term.setLevel(logging.WARNING)
    loggers = [logging.getLogger(n) for n in LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.INFO)
        lg.addHandler(file_handler)
        lg.addHandler(term)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(file_handler)
            lg.removeHandler(term)
            lg.setLevel(level)
        file_handler.close()


def read_log(path: Path) -> list[dict]:
    """The records of a driver.log (lines that are not JSON are skipped)."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def format_record(rec: dict) -> str:
    """One driver.log record for people: `HH:MM:SS LEVEL logger: message` (UTC), and its
    traceback's last line when it has one."""
    from datetime import datetime, timezone

    t = rec.get("t")
    stamp = datetime.fromtimestamp(t, timezone.utc).strftime("%H:%M:%S") if isinstance(t, (int, float)) else "--:--:--"
    text = f"{stamp} {rec.get('level', '?'):<7} {rec.get('logger', '?')}: {rec.get('msg', '')}"
    tb = rec.get("traceback")
    if isinstance(tb, str) and tb.strip():
        text += f"  [{tb.strip().splitlines()[-1]}]"
    return text
