"""The one place elastic keeps things between runs: `$ELASTIC_CACHE`, else `~/.cache/elastic`
(the default corpus, cloud price lists, the preemption history)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """Where elastic caches things: `$ELASTIC_CACHE`, else `~/.cache/elastic`."""
    return Path(os.environ.get("ELASTIC_CACHE") or Path.home() / ".cache" / "elastic")


def write_json_atomic(path: Path, doc, **dump_kw) -> None:
    """Write `doc` as JSON to a temp file beside `path`, then rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(doc, f, **dump_kw)
    os.replace(tmp, path)
