"""The run's record in object storage, beside its checkpoints: what `elastic runs`, `status`,
`logs`, `report` and `down` read from any machine, and what outlives a controller VM.

Layout, under `<checkpoint.uri>/record/<RUN>/` (RUN: the run's name):

- `events/000001.jsonl`, `events/000002.jsonl`, …: the ledger (`events.jsonl`) in parts;
- `metrics/NNNNNN.jsonl`: `metrics.jsonl` in parts;
- `driver/NNNNNN.log`: `driver.log` (JSON lines) in parts;
- `recipe.yaml`: the resolved recipe, written once at the start;
- `report.json`, `report.html`: written whole at the end of the run.

Object stores have no append, so a file is appended in parts and never rewritten: each part
holds the whole lines added to the local file since the part before (six-digit numbers, from 1,
in order); a reader concatenates a stream's parts in number order and gets the local file's bytes.
The driver writes a part every `FLUSH_S` seconds a file grew, and the last ones when the run ends
(before a controller VM is let go). A driver that continues a run (a controller restarted, or
`elastic launch --resume RUN`) numbers its parts after the ones already there. A follower polls for
new parts.

The record is written by the driver's identity (the controller's, or the user's on a laptop); the
run's nodes may write its checkpoints but not its record (providers/aws/scope.py, gcp/scope.py).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from elastic.record.events import ControllerStarted, NodeLaunched, RunStarted

log = logging.getLogger(__name__)

RECORD = "record"          # the folder under checkpoint.uri
FLUSH_S = 3.0              # seconds between two parts of a growing file
POLL_S = 2.0               # a follower's seconds between two looks for new parts
STREAMS = {"events": ("events.jsonl", "jsonl"), "metrics": ("metrics.jsonl", "jsonl"), "driver": ("driver.log", "log")}
WHOLE = ("recipe.yaml", "report.json", "report.html")
_PART = re.compile(r"(\d{6})\.(jsonl|log)")
URIS_FILE = "run-uris.json"   # under the cache dir: the checkpoint URIs `elastic launch` used
URIS_ENV = "ELASTIC_RUNS_URIS"


def record_prefix(checkpoint_uri: str) -> str:
    """The URI under which every run's record at `checkpoint_uri` lives."""
    return checkpoint_uri.rstrip("/") + "/" + RECORD


def streams_record(recipe) -> bool:
    """Whether a run of `recipe` streams its record: its checkpoint.uri is set (object storage,
    file:// or a path); a run checkpointing into its own run directory keeps it there only."""
    return bool(recipe.checkpoint.uri)


@dataclass
class Record:
    """One run's record in storage.

    Args:
        store: the storage of the checkpoint URI (elastic.storage.stores).
        run: the run's name.
        uri: the checkpoint URI, for messages and `elastic runs`.
    """

    store: object
    run: str
    uri: str

    @property
    def where(self) -> str:
        return f"{record_prefix(self.uri)}/{self.run}"

    def _name(self, rest: str) -> str:
        return f"{RECORD}/{self.run}/{rest}"

    def parts(self, stream: str) -> list[tuple[int, str]]:
        """(number, object name) of the stream's parts, in order."""
        base = self._name(stream)
        out = []
        for name in self.store.list(base):
            if not name.startswith(base + "/"):
                continue
            m = _PART.fullmatch(name[len(base) + 1:])
            if m:
                out.append((int(m.group(1)), name))
        return sorted(out)

    def read(self, stream: str, after: int = 0) -> tuple[bytes, int]:
        """The stream's bytes in parts numbered above `after`, and the last part's number."""
        chunks, last = [], after
        for n, name in self.parts(stream):
            if n > after:
                data = self.store.read_bytes(name)
                if data is None:   # listed, then gone: only a deleted record does that
                    break
                chunks.append(data)
                last = n
        return b"".join(chunks), last

    def events(self) -> list[dict]:
        """The ledger's records (a torn line, never written by a driver, skipped)."""
        return records_of(self.read("events")[0])

    def whole(self, name: str) -> bytes | None:
        """One of the files written whole (`WHOLE`), or None."""
        return self.store.read_bytes(self._name(name))

    def write_whole(self, name: str, data: bytes) -> None:
        self.store.write_bytes(self._name(name), data)

    def write_part(self, stream: str, number: int, data: bytes) -> None:
        ext = STREAMS[stream][1]
        self.store.write_bytes(self._name(f"{stream}/{number:06d}.{ext}"), data)


def records_of(data: bytes) -> list[dict]:
    """The JSON objects of JSON-lines bytes (a line that is not one is skipped)."""
    out = []
    for line in data.decode("utf-8", errors="replace").splitlines():
        try:
            doc = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(doc, dict):
            out.append(doc)
    return out


def open_record(checkpoint_uri: str, run: str, create: bool = False) -> Record:
    """Run `run`'s record at `checkpoint_uri` (the storage opened; UserError when it is not there
    and not `create`)."""
    from elastic.storage.stores import open_storage

    return Record(open_storage(checkpoint_uri, create=create), run, checkpoint_uri)


def runs_at(checkpoint_uri: str) -> list[Record]:
    """Every run with a record at `checkpoint_uri` (or at a prefix above one: the listing finds
    `.../record/RUN/events/` wherever it is under the URI)."""
    from elastic.storage.stores import open_storage

    store = open_storage(checkpoint_uri)
    found: dict[tuple[str, str], None] = {}
    for name in store.list(""):
        parts = name.split("/")
        # ... record / RUN / events / NNNNNN.jsonl
        if len(parts) >= 4 and parts[-4] == RECORD and parts[-2] == "events" and _PART.fullmatch(parts[-1]):
            found[("/".join(parts[:-4]), parts[-3])] = None
    out = []
    for above, run in found:
        uri = checkpoint_uri.rstrip("/") + (f"/{above}" if above else "")
        out.append(Record(store if not above else open_storage(uri), run, uri))
    return out


class RecordStream:
    """Copies a run directory's growing files into its record, in parts, from a thread of its
    own: a slow or refusing store never holds the training (a failed part is tried again at the
    next flush, and logged).

    Args:
        record: where to write.
        run_dir: the run directory whose `events.jsonl`, `metrics.jsonl` and `driver.log` it copies.
        skip: bytes of each local file already in the record (a continued run's earlier ledger).
    """

    def __init__(self, record: Record, run_dir: Path, skip: dict[str, int] | None = None):
        self.record = record
        self._dir = run_dir
        self._sent = {s: (skip or {}).get(s, 0) for s in STREAMS}
        self._next = {s: (record.parts(s)[-1][0] if record.parts(s) else 0) + 1 for s in STREAMS}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="record-stream", daemon=True)

    def start(self) -> "RecordStream":
        recipe = self._dir / "recipe.yaml"
        if recipe.is_file():
            self._try(lambda: self.record.write_whole("recipe.yaml", recipe.read_bytes()), "recipe.yaml")
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(FLUSH_S):
            self.flush()

    def flush(self) -> None:
        """Write a part of each file that grew by whole lines since the last part."""
        with self._lock:
            for stream, (local, _) in STREAMS.items():
                path = self._dir / local
                try:
                    with open(path, "rb") as f:
                        f.seek(self._sent[stream])
                        data = f.read()
                except FileNotFoundError:
                    continue
                data = data[:data.rfind(b"\n") + 1]   # whole lines only: a reader never sees half a one
                if not data:
                    continue
                if self._try(lambda: self.record.write_part(stream, self._next[stream], data), f"{stream} part"):
                    self._sent[stream] += len(data)
                    self._next[stream] += 1

    def _try(self, write, what: str) -> bool:
        try:
            write()
            return True
        except Exception as exc:   # the record waits for the next flush; the run goes on
            log.warning("record: writing %s to %s failed (tried again): %s", what, self.record.where, exc)
            return False

    def close(self) -> None:
        """Stop the thread, write the last parts and the report files (the end of the run)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        for attempt in range(3):
            self.flush()
            if all(self._sent[s] >= _size(self._dir / STREAMS[s][0]) for s in STREAMS):
                break
            time.sleep(1.0 + attempt)
        for name in ("report.json", "report.html"):
            path = self._dir / name
            if path.is_file():
                self._try(lambda: self.record.write_whole(name, path.read_bytes()), name)


def _size(path: Path) -> int:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return 0
    return data.rfind(b"\n") + 1


# -- a run that continues its record (a controller restarted, `--resume RUN`) -----------------------

def earlier_part(events: list[dict]) -> bool:
    """Whether a driver already wrote this ledger (the run is continued, not started)."""
    return any(e.get("type") == RunStarted.TYPE and e.get("head", "local") == "local" for e in events)


def _by_launcher(e: dict) -> bool:
    """Whether `elastic launch` wrote record `e` starting a controller VM (not a driver)."""
    kind = e.get("type")
    return (kind == ControllerStarted.TYPE or (kind == RunStarted.TYPE and e.get("head") == "controller")
            or (kind == NodeLaunched.TYPE and e.get("role") == "controller"))


def last_seen(events: list[dict]) -> float | None:
    """Unix seconds of the last event the run's latest driver wrote (None: no driver wrote one);
    what a controller started for `--resume RUN` recorded since is not the driver's."""
    last_driver = max((i for i, e in enumerate(events) if e.get("type") == RunStarted.TYPE
                       and e.get("head", "local") == "local"), default=-1)
    if last_driver < 0:
        return None
    return max(e["t"] for e in events[last_driver:] if not _by_launcher(e))


def lost_vms(events: list[dict], now_s: float, autodown_after_s: float,
             this_vm: str | None = None) -> list[tuple[str, float]]:
    """(instance id, estimated release time) of each VM the ledger leaves held by a driver that
    is gone: its nodes' watchers end them `autodown_after_s` after the driver's last heartbeat,
    taken as its last event (`last_seen`). The VM this driver runs on (`this_vm`: a controller
    that booted again and continues its own run) and the newest controller, started after the last
    driver, are the ones continuing the run and are left out."""
    from elastic.record import billing
    from elastic.record.events import read

    seen = last_seen(events)
    if seen is None:
        return []
    last_driver = max(i for i, e in enumerate(events) if e.get("type") == RunStarted.TYPE
                      and e.get("head", "local") == "local")
    ours = None
    for e in events[last_driver + 1:]:
        if e.get("type") == ControllerStarted.TYPE:
            ours = e.get("instance_id")
    end = min(now_s, seen + autodown_after_s)
    return [(vm_id, end) for vm_id, h in billing.holds(read(events), now_s).items()
            if h.end_s is None and vm_id not in (ours, this_vm)]


# -- which runs this machine knows --------------------------------------------------------------------

def remember_uri(checkpoint_uri: str) -> None:
    """Add a checkpoint URI a run used to the list `elastic runs` reads."""
    from elastic.cache import cache_dir, write_json_atomic

    path = cache_dir() / URIS_FILE
    if checkpoint_uri not in _stored_uris():
        try:
            write_json_atomic(path, [*_stored_uris(), checkpoint_uri], indent=1)
        except OSError as exc:
            log.warning("could not remember %s in %s: %s", checkpoint_uri, path, exc)


def _stored_uris() -> list[str]:
    from elastic.cache import cache_dir

    try:
        doc = json.loads((cache_dir() / URIS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return [u for u in doc if isinstance(u, str)] if isinstance(doc, list) else []


def known_uris(extra: list[str] = ()) -> list[str]:
    """Where to look for runs: `extra` (--uri), `$ELASTIC_RUNS_URIS` (separated by commas or
    spaces), then the URIs `elastic launch` remembered in the cache dir."""
    env = [u for u in re.split(r"[,\s]+", os.environ.get(URIS_ENV, "")) if u]
    return list(dict.fromkeys([*extra, *env, *_stored_uris()]))
