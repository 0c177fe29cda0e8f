"""Checkpoints: torch.distributed.checkpoint shards of the lead replica, plus a manifest written last.

Layout under the checkpoint directory: `step-00000010/` holds the DCP files (model, inner AdamW,
outer momentum — sharded per rank) and `elastic.json` (step, data cursor, recipe digest, world
layout). A checkpoint counts only once `elastic.json` exists; it is written atomically after every
shard, so an interrupted save is never taken for a whole one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from elastic.errors import UserError

MANIFEST = "elastic.json"


def checkpoint_dir(uri: str | None, run_dir: Path) -> Path:
    """The local directory a `checkpoint.uri` (file://, a path, or empty) names."""
    if not uri:
        return run_dir / "checkpoints"
    return Path(uri.removeprefix("file://")).expanduser()


def _step_of(path: Path) -> int | None:
    """The step a `step-NNNNNNNN` directory holds, or None for any other name."""
    try:
        return int(path.name.split("-")[1])
    except (IndexError, ValueError):
        return None


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def complete_steps(root: Path) -> list[int]:
    """Steps with a manifest, oldest first."""
    if not root.is_dir():
        return []
    return sorted(s for p in root.glob("step-*") if (s := _step_of(p)) is not None and (p / MANIFEST).is_file())


def save(world, root: Path, recipe_digest: str) -> dict:
    """Save the world's state at its current outer step; returns the ledger fields."""
    t0 = time.monotonic()
    path = step_dir(root, world.outer_step)
    if path.exists():
        shutil.rmtree(path)  # a leftover partial save of this step (no manifest): never loaded
    path.mkdir(parents=True)
    lead = world.lead_replica()
    world.call_replica(lead, "save_checkpoint", str(path))
    files = [{"name": p.name, "bytes": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(path.iterdir()) if p.is_file()]
    manifest = {"step": world.outer_step, "inner_step": world.inner_step, "data_cursor": world.cursor,
                "tokens": world.tokens, "recipe_digest": recipe_digest, "ranks": len(lead.actors),
                "replicas": len(world.replicas), "saved_at": time.time(), "files": files}
    tmp = path / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    os.replace(tmp, path / MANIFEST)
    size = sum(f["bytes"] for f in files)
    return {"step": world.outer_step, "path": str(path), "bytes": size, "stall_s": round(time.monotonic() - t0, 3)}


def prune(root: Path, keep_last: int) -> list[int]:
    """Delete all but the newest `keep_last` complete checkpoints, and partial ones older than the
    newest complete one. Never deletes the newest complete checkpoint. Returns deleted steps."""
    steps = complete_steps(root)
    deleted = []
    for s in steps[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(step_dir(root, s), ignore_errors=True)
        deleted.append(s)
    newest = steps[-1] if steps else None
    if newest is not None:
        for p in root.glob("step-*"):
            s = _step_of(p)
            if s is not None and s < newest and not (p / MANIFEST).exists():
                shutil.rmtree(p, ignore_errors=True)
    return deleted


def sha256_file(path: Path, chunk_bytes: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def local_root(uri: str) -> Path:
    """The directory a checkpoint URI names, for the destinations this version supports."""
    if "://" in uri and not uri.startswith("file://"):
        raise UserError(f"{uri}: only file:// and plain paths are supported for now")
    root = checkpoint_dir(uri, Path("."))
    if not root.is_dir():
        raise UserError(f"{uri}: no such checkpoint directory")
    return root


def listing(root: Path) -> list[dict]:
    """Every checkpoint under `root`, oldest first: step, saved_at, bytes, complete."""
    out = []
    for p in sorted(root.glob("step-*")):
        step = _step_of(p)
        if step is None:
            continue
        manifest = _read_manifest(p)
        if manifest is None:
            out.append({"step": step, "saved_at": None, "bytes": sum(f.stat().st_size for f in p.iterdir()
                                                                     if f.is_file()), "complete": False})
        else:
            out.append({"step": step, "saved_at": manifest["saved_at"],
                        "bytes": sum(f["bytes"] for f in manifest["files"]), "complete": True})
    return out


def _read_manifest(path: Path) -> dict | None:
    try:
        return json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def verify(root: Path, step: int | None = None) -> tuple[int, list[str]]:
    """Re-hash every file of a complete checkpoint (the newest, or `step`) against its manifest.
    Returns (step, problems); each problem names a file."""
    steps = complete_steps(root)
    if not steps:
        raise UserError(f"{root}: no complete checkpoint (none has a manifest)")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise UserError(f"{root}: no complete checkpoint at step {step} (complete: {steps})")
    path = step_dir(root, step)
    manifest = _read_manifest(path)
    problems = []
    for f in manifest["files"]:
        p = path / f["name"]
        if not p.is_file():
            problems.append(f"{p}: missing")
        elif p.stat().st_size != f["bytes"]:
            problems.append(f"{p}: {p.stat().st_size} bytes, manifest says {f['bytes']}")
        elif sha256_file(p) != f["sha256"]:
            problems.append(f"{p}: sha256 does not match the manifest")
    return step, problems
