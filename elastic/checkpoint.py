"""Phased, sharded checkpoints at a storage URI (`file://`, a path, `s3://`, `gs://`).

Phase 1 (blocking, fast): the lead replica's ranks write their torch.distributed.checkpoint shards
(model, inner AdamW, outer momentum, inner step) and their RNG state to fast node-local storage
(`checkpoint.local_dir`). Training goes on as soon as that is done.

Phase 2 (background): each rank uploads the files it wrote, in parallel (multipart for large ones),
hashing them as it goes; when every rank is done the driver writes the manifest `elastic.json` (step,
counters, data cursor, recipe digest, world layout, every file with size and sha256). A checkpoint
exists only once its manifest does, so a node lost mid-upload leaves a partial directory that
nothing loads and that retention deletes later.

Layout at the URI: `step-00000010/{__0_0.distcp, .metadata, rng-0.pt, ..., elastic.json}`.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from elastic.errors import UserError
from elastic.storage import FileStorage, Storage, open_storage

MANIFEST = "elastic.json"


def destination(uri: str | None, run_dir: Path) -> str:
    """The URI checkpoints go to: `checkpoint.uri`, or `<run dir>/checkpoints` when empty."""
    return uri or str(run_dir / "checkpoints")


def staging_root(local_dir: str | None, run: str) -> str:
    """Where phase 1 writes on each node: `shm` → /dev/shm, a path, or the temp directory."""
    if local_dir == "shm":
        base = "/dev/shm"
    elif local_dir:
        base = local_dir
    else:
        base = tempfile.gettempdir()
    return str(Path(base).expanduser() / "elastic-staging" / run)


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def _step_of(name: str) -> int | None:
    """The step a `step-NNNNNNNN` name holds, or None for any other name."""
    head, _, digits = name.partition("-")
    return int(digits) if head == "step" and digits.isdigit() else None


def _by_step(storage: Storage) -> dict[int, dict[str, int]]:
    """Every step directory at the storage: step → {file name: bytes}."""
    out: dict[int, dict[str, int]] = {}
    for name, size in storage.list().items():
        top, _, rest = name.partition("/")
        step = _step_of(top)
        if step is not None and rest:
            out.setdefault(step, {})[rest] = size
    return out


def complete_steps(storage: Storage) -> list[int]:
    """Steps with a manifest, oldest first."""
    return sorted(s for s, files in _by_step(storage).items() if MANIFEST in files)


def read_manifest(storage: Storage, step: int) -> dict | None:
    data = storage.read_bytes(f"{step_name(step)}/{MANIFEST}")
    try:
        return json.loads(data) if data is not None else None
    except ValueError:
        return None


def latest(storage: Storage) -> dict | None:
    """The manifest of the newest complete checkpoint, or None."""
    for step in reversed(complete_steps(storage)):
        manifest = read_manifest(storage, step)
        if manifest is not None:
            return manifest
    return None


def listing(storage: Storage) -> list[dict]:
    """Every checkpoint at the storage, oldest first: step, saved_at, bytes, complete."""
    out = []
    for step, files in sorted(_by_step(storage).items()):
        manifest = read_manifest(storage, step) if MANIFEST in files else None
        if manifest is None:
            out.append({"step": step, "saved_at": None, "bytes": sum(files.values()), "complete": False})
        else:
            out.append({"step": step, "saved_at": manifest["saved_at"],
                        "bytes": sum(f["bytes"] for f in manifest["files"]), "complete": True})
    return out


def prune(storage: Storage, keep_last: int) -> list[int]:
    """Delete all but the newest `keep_last` complete checkpoints, and partial ones older than the
    newest complete one. Never deletes the newest complete checkpoint. Returns deleted steps."""
    steps = _by_step(storage)
    complete = sorted(s for s, files in steps.items() if MANIFEST in files)
    if not complete:
        return []
    doomed = set(complete[:-max(1, keep_last)])
    doomed |= {s for s, files in steps.items() if MANIFEST not in files and s < complete[-1]}
    names = []
    for s in sorted(doomed):
        # the manifest goes first, so a prune cut short never leaves a "complete" half checkpoint
        names += [f"{step_name(s)}/{MANIFEST}"] * (MANIFEST in steps[s])
        names += [f"{step_name(s)}/{n}" for n in steps[s] if n != MANIFEST]
    storage.delete(names)
    return sorted(s for s in doomed if s in complete)


def sha256_file(path: Path, chunk_bytes: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def verify(storage: Storage, step: int | None = None) -> tuple[int, list[str]]:
    """Re-hash every file of a complete checkpoint (the newest, or `step`) against its manifest.
    Returns (step, problems); each problem names a file."""
    steps = complete_steps(storage)
    if not steps:
        raise UserError(f"{storage.uri}: no complete checkpoint (none has a manifest)")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise UserError(f"{storage.uri}: no complete checkpoint at step {step} (complete: {steps})")
    manifest = read_manifest(storage, step)
    if manifest is None:
        return step, [f"{step_name(step)}/{MANIFEST}: unreadable manifest"]
    present = _by_step(storage).get(step, {})
    problems = []
    for f in manifest["files"]:
        name = f"{step_name(step)}/{f['name']}"
        if f["name"] not in present:
            problems.append(f"{name}: missing")
        elif present[f["name"]] != f["bytes"]:
            problems.append(f"{name}: {present[f['name']]} bytes, manifest says {f['bytes']}")
        elif storage.sha256(name) != f["sha256"]:
            problems.append(f"{name}: sha256 does not match the manifest")
    return step, problems


# -- what the ranks run on their nodes -------------------------------------------------------------

def rank_files(local: Path, rank: int) -> list[str]:
    """The files of a phase-1 directory that `rank` uploads: its own shards and RNG state; rank 0
    also uploads the shared ones (DCP's .metadata)."""
    mine = []
    for p in sorted(local.iterdir()):
        if not p.is_file() or p.name.endswith(".part"):
            continue
        owner = _owner(p.name)
        if owner == rank or (owner is None and rank == 0):
            mine.append(p.name)
    return mine


def _owner(name: str) -> int | None:
    """The rank that wrote `name` (DCP's `__R_N.distcp`, our `rng-R.pt`), or None if shared."""
    if name.startswith("__"):
        digits = name[2:].split("_", 1)[0]
    elif name.startswith("rng-"):
        digits = name[4:].split(".", 1)[0]
    else:
        return None
    return int(digits) if digits.isdigit() else None


def upload(uri: str, local: Path, step: int, names: list[str], threads: int) -> list[dict]:
    """Phase 2 for one rank: upload `names` from `local` to the step's directory at `uri`, several
    files at a time. Returns each file's name, bytes and sha256 (of what was read for upload)."""
    storage = open_storage(uri)
    hasher = ThreadPoolExecutor(max_workers=max(1, min(threads, len(names))))

    def one(name: str) -> dict:
        path = local / name
        digest = hasher.submit(sha256_file, path)   # hashed while it uploads (phase 1 is done with it)
        storage.write_file(path, f"{step_name(step)}/{name}")
        return {"name": name, "bytes": path.stat().st_size, "sha256": digest.result()}

    try:
        with ThreadPoolExecutor(max_workers=max(1, min(threads, len(names)))) as pool:
            return list(pool.map(one, names))
    finally:
        hasher.shutdown()
        storage.close()


def fetch(uri: str, step: int, staging: str) -> str:
    """Make a complete checkpoint loadable by DCP on this node; returns the local directory. A
    file:// checkpoint is read where it is; others are downloaded (each file checked against the
    manifest's sha256) into the node's staging area."""
    storage = open_storage(uri)
    manifest = read_manifest(storage, step)
    if manifest is None:
        raise RuntimeError(f"{uri}: checkpoint {step} has no manifest")
    if isinstance(storage, FileStorage):
        return str(storage.root / step_name(step))
    dest = Path(staging) / f"restore-{step_name(step)}"
    dest.mkdir(parents=True, exist_ok=True)

    def one(f: dict) -> None:
        target = dest / f["name"]
        if target.exists() and target.stat().st_size == f["bytes"] and sha256_file(target) == f["sha256"]:
            return
        if storage.read_file(f"{step_name(step)}/{f['name']}", target) != f["sha256"]:
            raise RuntimeError(f"{uri}: {step_name(step)}/{f['name']} does not match its manifest")

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(one, manifest["files"]))
    return str(dest)


# -- what the driver runs --------------------------------------------------------------------------

class Checkpointer:
    """The driver's side of checkpoints: phase 1 on the lead replica, phase 2 tracked in the
    background, manifest and retention when every rank has uploaded.

    Args:
        uri: destination (created if it does not exist).
        staging: node-local phase-1 directory (see `staging_root`).
        keep_last: retention.
        threads: parallel uploads per rank.
        ledger: the run's ledger.
    """

    def __init__(self, uri: str, staging: str, keep_last: int, threads: int, ledger):
        self.uri = uri
        self.storage = open_storage(uri, create=True)
        self.staging = staging
        self.keep_last = keep_last
        self.threads = threads
        self.ledger = ledger
        self._pending: dict | None = None

    @property
    def uploading(self) -> int | None:
        """The step whose phase 2 is under way, or None."""
        return self._pending["step"] if self._pending else None

    def save(self, world, lead, recipe_digest: str) -> None:
        """Phase 1 on `lead` (blocking), then start phase 2. Waits first for an upload still under way."""
        t0 = time.monotonic()
        self.wait()
        step = world.outer_step
        local = f"{self.staging}/{step_name(step)}"
        write_s = max(r["seconds"] for r in world.call_replica(lead, "save_checkpoint", local))
        stall_s = time.monotonic() - t0
        refs = [a.upload_checkpoint.remote(local, self.uri, step, self.threads) for a in lead.actors]
        self._pending = {"step": step, "refs": refs, "lead": lead, "local": local, "t0": time.monotonic(),
                         "manifest": {"step": step, "inner_step": world.inner_step, "data_cursor": world.cursor,
                                      "tokens": world.tokens, "recipe_digest": recipe_digest,
                                      "ranks": len(lead.actors), "replicas": len(world.replicas)}}
        self.ledger.append("checkpoint_saved", step=step, stall_s=round(stall_s, 3), write_s=round(write_s, 3), local=local,
                           replica=lead.replica_id)

    def poll(self) -> None:
        """Finish phase 2 if every rank is done uploading (non-blocking)."""
        if self._pending is not None:
            import ray
            done, _ = ray.wait(self._pending["refs"], num_returns=len(self._pending["refs"]), timeout=0)
            if len(done) == len(self._pending["refs"]):
                self._finish()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until phase 2 of the pending checkpoint ends (or `timeout_s`); True when none is left."""
        if self._pending is not None:
            import ray
            ray.wait(self._pending["refs"], num_returns=len(self._pending["refs"]), timeout=timeout_s)
            self.poll()
        return self._pending is None

    def _finish(self) -> None:
        import ray

        p, self._pending = self._pending, None
        try:
            files = [f for per_rank in ray.get(p["refs"]) for f in per_rank]
        except Exception as exc:  # a rank (its node) was lost mid-upload: no manifest, never loaded
            self.ledger.append("checkpoint_upload_failed", step=p["step"], message=str(exc).splitlines()[0][:200])
            self._drop_staging(p)
            return
        manifest = {**p["manifest"], "saved_at": time.time(), "files": sorted(files, key=lambda f: f["name"])}
        self.storage.write_bytes(f"{step_name(p['step'])}/{MANIFEST}", json.dumps(manifest, indent=2).encode())
        seconds = time.monotonic() - p["t0"]
        size = sum(f["bytes"] for f in files)
        self.ledger.append("checkpoint_uploaded", step=p["step"], uri=self.uri, bytes=size, files=len(files),
                           seconds=round(seconds, 3), mb_per_s=round(size / 1e6 / max(seconds, 1e-6), 1))
        self._drop_staging(p)
        for step in prune(self.storage, self.keep_last):
            self.ledger.append("checkpoint_deleted", step=step)

    @staticmethod
    def _drop_staging(p: dict) -> None:
        try:
            p["lead"].actors[0].drop_staging.remote(p["local"])
        except Exception:
            pass  # the lead is gone; its node's staging went with it

    def latest(self) -> dict | None:
        return latest(self.storage)

    def close(self) -> None:
        self.storage.close()
