"""A run, wherever its record is: a run directory on this machine, or the record its driver
streams beside its checkpoints (elastic/record/remote.py). `elastic runs`, `status`, `logs`,
`report` and `down` read runs through here, so they work the same for local and controller runs and
from any machine with the credentials.

A run is named by its name (RUN: looked up in ./runs/RUN, then in the records at the URIs
`elastic.record.remote.known_uris` lists), a run directory, or a URI (`<checkpoint.uri>` holding
one run's record, or `<checkpoint.uri>/record/RUN`). A run directory that only records a
controller (`elastic launch` with `resources.head: controller`) is read from its record.
"""

from __future__ import annotations

import time
from pathlib import Path

from elastic.errors import UserError
from elastic.record import remote
from elastic.record.events import RunEnded, RunStarted
from elastic.record.ledger import read_events
from elastic.views.status import REFRESH_S, REMOTE_REFRESH_S, latest_run_dir, snapshot, target_outer_steps

RUNS = Path("runs")
FINAL_WAIT_S = 30.0   # a follower waits this long after run_ended for the driver's last lines


class LocalRun:
    """A run directory on this machine."""

    refresh_s = REFRESH_S   # `elastic status`'s seconds between two reads

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.name = run_dir.name
        self.where = str(run_dir)
        self.ledger = str(run_dir / "events.jsonl")   # for messages

    def events(self) -> list[dict]:
        return read_events(self.run_dir / "events.jsonl")

    def recipe_text(self) -> str | None:
        try:
            return (self.run_dir / "recipe.yaml").read_text(encoding="utf-8")
        except OSError:
            return None

    def finished(self) -> bool:
        return (self.run_dir / "report.json").is_file()

    def log_bytes(self, offset: int) -> tuple[bytes, int]:
        """driver.log's whole lines from byte `offset`, and the offset after them."""
        try:
            with open(self.run_dir / "driver.log", "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return b"", offset
        data = data[:data.rfind(b"\n") + 1]
        return data, offset + len(data)


class RemoteRun:
    """A run's record in storage (`elastic.record.remote.Record`); reads new parts only."""

    refresh_s = REMOTE_REFRESH_S   # a listing and the new parts each time

    def __init__(self, record: remote.Record):
        self.record = record
        self.name = record.run
        self.where = record.where
        self.ledger = f"{record.where}/events"   # for messages
        self._events = b""
        self._last = 0

    def events(self) -> list[dict]:
        data, self._last = self.record.read("events", self._last)
        self._events += data
        return [e for e in remote.records_of(self._events)
                if isinstance(e.get("type"), str) and type(e.get("t")) in (int, float)]

    def recipe_text(self) -> str | None:
        data = self.record.whole("recipe.yaml")
        return None if data is None else data.decode("utf-8", errors="replace")

    def log_bytes(self, offset: int) -> tuple[bytes, int]:
        """driver.log's parts after part number `offset`, and the last part's number."""
        return self.record.read("driver", offset)

    def finished(self) -> bool:
        """The driver wrote its last parts (the report is written after them)."""
        return self.record.whole("report.json") is not None


def _controller_stub(run_dir: Path) -> RemoteRun | None:
    """The record of a run directory that only records a controller (its driver runs elsewhere)."""
    import yaml

    events = read_events(run_dir / "events.jsonl")
    start = next((e for e in events if e["type"] == RunStarted.TYPE), None)
    if start is None or start.get("head") != "controller":
        return None
    try:
        doc = yaml.safe_load((run_dir / "recipe.yaml").read_text(encoding="utf-8")) or {}
        uri = (doc.get("checkpoint") or {}).get("uri")
    except (OSError, yaml.YAMLError, AttributeError):
        uri = None
    if not uri:
        return None
    return RemoteRun(remote.open_record(uri, start["run"]))


def _local(run_dir: Path):
    return _controller_stub(run_dir) or LocalRun(run_dir)


def resolve(arg: str | None, uris: list[str] = ()):
    """The run `arg` names (None: the run under ./runs whose ledger changed last)."""
    if arg is None:
        return _local(latest_run_dir())
    if "://" in arg:
        return _by_uri(arg)
    p = Path(arg)
    if (p / "events.jsonl").is_file():
        return _local(p)
    if "/" not in arg and (RUNS / arg / "events.jsonl").is_file():
        return _local(RUNS / arg)
    if "/" in arg or not arg:
        raise UserError(f"{arg}: not a run directory (no events.jsonl)")
    found = []
    for uri in remote.known_uris(list(uris)):
        try:
            found += [r for r in remote.runs_at(uri) if r.run == arg]
        except UserError:
            continue
    if not found:
        where = ", ".join(remote.known_uris(list(uris))) or f"none: pass --uri or set {remote.URIS_ENV}"
        raise UserError(f"{arg}: no run of that name under {RUNS}/ nor in the records at the known URIs ({where})")
    if len(found) > 1:
        raise UserError(f"{arg}: a run of that name at {', '.join(r.where for r in found)}; name its URI")
    return RemoteRun(found[0])


def _by_uri(uri: str):
    head, sep, run = uri.rstrip("/").rpartition(f"/{remote.RECORD}/")
    if sep and run and "/" not in run:
        return RemoteRun(remote.open_record(head, run))
    records = remote.runs_at(uri)
    if not records:
        raise UserError(f"{uri}: no run's record there (expected {remote.RECORD}/RUN/events/ under it)")
    if len(records) > 1:
        raise UserError(f"{uri}: holds the records of {len(records)} runs; name one: "
                        + ", ".join(r.where for r in records))
    return RemoteRun(records[0])


def all_runs(uris: list[str] = ()) -> list:
    """Every run of this machine (./runs/*) and of the records at the known URIs, once each."""
    out, seen = [], set()
    for d in sorted(RUNS.glob("*/events.jsonl")) if RUNS.is_dir() else []:
        src = _local(d.parent)
        key = src.where
        if key not in seen:
            seen.add(key)
            out.append(src)
    for uri in remote.known_uris(list(uris)):
        try:
            records = remote.runs_at(uri)
        except UserError:
            continue
        for r in records:
            if r.where not in seen:
                seen.add(r.where)
                out.append(RemoteRun(r))
    return out


def runs_table(sources: list, now_s: float):
    """`elastic runs`: one row per run: name, status, world, tokens, USD so far, age, where."""
    from rich.table import Table

    from elastic.record.ledger import SHAPE_ERRORS

    t = Table(title="elastic runs", title_justify="left")
    for col in ("run", "status", "world", "outer step", "tokens", "USD so far", "age", "where"):
        t.add_column(col, justify="right" if col in ("world", "outer step", "tokens", "USD so far", "age") else "left")
    for src in sources:
        try:
            events = src.events()
            snap = snapshot(events, now_s, target_outer_steps(src.recipe_text()))
        except (UserError, OSError, *SHAPE_ERRORS) as exc:
            t.add_row(src.name, f"unreadable: {str(exc)[:60]}", "-", "-", "-", "-", "-", src.where)
            continue
        age_s = now_s - events[0]["t"] if events else 0.0
        target = f"/{snap['target_outer_steps']}" if snap["target_outer_steps"] else ""
        t.add_row(snap["run"] or src.name, str(snap["status"]), str(snap["world"]), f"{snap['outer_step']}{target}",
                  f"{snap['tokens']:,}", f"${snap['usd_so_far']:.4f}", _age(age_s), src.where)
    return t


def _age(s: float) -> str:
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    if s < 2 * 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


def ended(events: list[dict]) -> dict | None:
    """The run's `run_ended` record, or None while it goes."""
    return next((e for e in reversed(events) if e.get("type") == RunEnded.TYPE), None)


def follow_logs(src, out, follow: bool, poll_s: float | None = None) -> dict | None:
    """Print the driver's log lines (`elastic.run.logs.format_record`); with `follow`, keep
    printing new ones until the run ends. Returns the `run_ended` record, if the run ended."""
    from elastic.run.logs import format_record

    poll_s = poll_s if poll_s is not None else (remote.POLL_S if isinstance(src, RemoteRun) else 0.5)
    offset, last_look = 0, None
    while True:
        done = ended(src.events())
        if done is not None and last_look is None:
            # The driver's last lines come after its run_ended, with the report: wait for those.
            last_look = time.monotonic() + FINAL_WAIT_S
        finished = done is not None and (src.finished() or time.monotonic() >= last_look)
        data, offset = src.log_bytes(offset)
        for rec in remote.records_of(data):   # driver.log is JSON lines too
            out.print(format_record(rec), highlight=False, soft_wrap=True, markup=False)
        if hasattr(out, "file"):
            out.file.flush()
        if finished or not follow:
            return done
        time.sleep(poll_s)
