"""Checkpoints: torch.distributed.checkpoint shards of the lead replica, plus a manifest written last.

Layout under the checkpoint directory: `step-00000010/` holds the DCP files (model, inner AdamW,
outer momentum — sharded per rank) and `elastic.json` (step, data cursor, recipe digest, world
layout). A checkpoint counts only once `elastic.json` exists; it is written atomically after every
shard, so an interrupted save is never taken for a whole one.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

MANIFEST = "elastic.json"


def checkpoint_dir(uri: str | None, run_dir: Path) -> Path:
    """The local directory a `checkpoint.uri` (file://, a path, or empty) names."""
    if not uri:
        return run_dir / "checkpoints"
    return Path(uri.removeprefix("file://")).expanduser()


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def complete_steps(root: Path) -> list[int]:
    """Steps with a manifest, oldest first."""
    if not root.is_dir():
        return []
    return sorted(int(p.name.split("-")[1]) for p in root.glob("step-*") if (p / MANIFEST).is_file())


def save(world, root: Path, recipe_digest: str) -> dict:
    """Save the world's state at its current outer step; returns the ledger fields."""
    t0 = time.monotonic()
    path = step_dir(root, world.outer_step)
    if path.exists():
        shutil.rmtree(path)  # a leftover partial save of this step (no manifest): never loaded
    path.mkdir(parents=True)
    lead = world.lead_replica()
    world.call_replica(lead, "save_checkpoint", str(path))
    manifest = {"step": world.outer_step, "inner_step": world.inner_step, "data_cursor": world.cursor,
                "tokens": world.tokens, "recipe_digest": recipe_digest, "ranks": len(lead.actors),
                "replicas": len(world.replicas), "saved_at": time.time(),
                "files": sorted(p.name for p in path.iterdir())}
    tmp = path / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    os.replace(tmp, path / MANIFEST)
    size = sum(p.stat().st_size for p in path.iterdir())
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
            s = int(p.name.split("-")[1])
            if s < newest and not (p / MANIFEST).exists():
                shutil.rmtree(p, ignore_errors=True)
    return deleted
