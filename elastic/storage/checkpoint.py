"""Phased, sharded checkpoints at a storage URI (`file://`, a path, `s3://`, `gs://`).

Phase 1 (blocking, fast): the lead replica's ranks copy their state (model, inner AdamW, outer
momentum, inner step) into host memory and write their RNG state; training goes on as soon as that
is done. Beside training, each rank writes its torch.distributed.checkpoint shards of that copy to
fast node-local storage (`checkpoint.local_dir`); a rank's next save waits for that write.

Phase 2 (background): once its write is done, each rank uploads the files it wrote, in parallel (multipart for large ones),
hashing them as it goes; when every rank is done the driver writes the manifest `elastic.json` (step,
counters, data cursor, recipe digest, world layout, every file with size and sha256). A checkpoint
exists only once its manifest does, so a node lost mid-write or mid-upload leaves a partial directory that
nothing loads and that retention deletes later.

Layout at the URI: `step-00000010/{__0_0.distcp, .metadata, rng-0.json, ..., elastic.json}`.

Restoring trusts nothing it reads from storage: the manifest must carry an HMAC-SHA256 made with
the key of the run that wrote it (kept in the secret store of the cloud holding the checkpoints,
`elastic.storage.stores.open_keys`, which the driver may read and nodes may not), have the expected shape
and name only plain file names (no path can leave the staging directory); every file is hashed
against it before use (`file://` too), so nothing reaches a node that the key did not vouch for.
Even then nothing is unpickled freely: RNG state is JSON, DCP's metadata is read by an unpickler
that knows only DCP's own record types, and DCP's non-tensor values by
`torch.load(weights_only=True)`. A checkpoint that fails any check is skipped for the one before.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import logging
import math
import pickle
import re
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from elastic.errors import UserError, first_line
from elastic.record.events import CheckpointDeleted, CheckpointSaved, CheckpointUploadFailed, CheckpointUploaded
from elastic.storage.stores import KeyStore, Storage, open_keys, open_storage

log = logging.getLogger(__name__)

MANIFEST = "elastic.json"
_FILE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class CheckpointError(RuntimeError):
    """A stored checkpoint that cannot be used: a malformed manifest, a missing or altered file."""


def destination(uri: str | None, run_dir: Path) -> str:
    """The URI checkpoints go to: `checkpoint.uri`, or `<run dir>/checkpoints` when empty."""
    return uri or str(run_dir / "checkpoints")


def staging_root(local_dir: str | None, run: str, destination: str) -> str:
    """Where phase 1 writes on each node: `shm` → /dev/shm, a path, or the temp directory; one
    directory per run and checkpoint destination (`<run>-<8 hex digits of the destination>`), so
    two runs of the same name on one machine (local nodes share it) never write, clean or restore
    in each other's."""
    if local_dir == "shm":
        base = "/dev/shm"
    elif local_dir:
        base = local_dir
    else:
        base = tempfile.gettempdir()
    digest = hashlib.sha256(destination.encode()).hexdigest()[:8]
    return str(Path(base).expanduser() / "elastic-staging" / f"{run}-{digest}")


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def plain_name(name: str) -> bool:
    """Whether `name` is a plain file name that stays in the directory it is joined to (no `/`,
    no `.` or `..`, no empty name, not the manifest's)."""
    return bool(_FILE_NAME.fullmatch(name)) and name not in (".", "..", MANIFEST)


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


def parse_manifest(data: bytes, step: int) -> dict:
    """The manifest of checkpoint `step`, checked for shape; CheckpointError (one line) otherwise.
    File names must be plain names (a path, `..` or an empty name could write outside the node's
    staging directory on restore)."""
    where = f"{step_name(step)}/{MANIFEST}"
    try:
        m = json.loads(data)
    except ValueError:
        raise CheckpointError(f"{where}: not JSON") from None
    if not isinstance(m, dict):
        raise CheckpointError(f"{where}: not a JSON object")
    for key in ("step", "inner_step", "data_cursor", "tokens", "ranks", "replicas"):
        if type(m.get(key)) is not int or m[key] < 0:
            raise CheckpointError(f"{where}: {key} must be a whole number >= 0")
    if m["step"] != step:
        raise CheckpointError(f"{where}: names step {m['step']}, stored under step {step}")
    if not isinstance(m.get("saved_at"), (int, float)) or not math.isfinite(m["saved_at"]):
        raise CheckpointError(f"{where}: saved_at must be a unix time")
    files = m.get("files")
    if not isinstance(files, list) or not files:
        raise CheckpointError(f"{where}: files must be a non-empty list")
    seen = set()
    for f in files:
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise CheckpointError(f"{where}: every file needs a name")
        name = f["name"]
        if not plain_name(name) or name in seen:
            raise CheckpointError(f"{where}: file name {name[:80]!r} is not a plain, unique file name")
        seen.add(name)
        if type(f.get("bytes")) is not int or f["bytes"] < 0:
            raise CheckpointError(f"{where}: {name}: bytes must be a whole number >= 0")
        if not isinstance(f.get("sha256"), str) or not _SHA256.fullmatch(f["sha256"]):
            raise CheckpointError(f"{where}: {name}: sha256 must be 64 lowercase hex digits")
    return m


def manifest_mac(manifest: dict, key: bytes) -> str:
    """HMAC-SHA256 (hex) of the manifest's entries other than `hmac`, as canonical JSON."""
    body = json.dumps({k: v for k, v in manifest.items() if k != "hmac"}, sort_keys=True,
                      separators=(",", ":"), allow_nan=False)
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


def authenticate(manifest: dict, keys: KeyStore) -> None:
    """Check the manifest's HMAC against the key of the run it names (`run`); CheckpointError (one
    line) when it has none, that run has no key in `keys`, or it does not match. Only a manifest
    that passes may name anything a node loads."""
    where = f"{step_name(manifest['step'])}/{MANIFEST}"
    mac, run = manifest.get("hmac"), manifest.get("run")
    if not isinstance(mac, str) or not isinstance(run, str) or not run:
        raise CheckpointError(f"{where}: not authenticated (no HMAC or no run): refused")
    key = keys.read(run)
    if key is None:
        raise CheckpointError(f"{where}: not authenticated: run {run[:80]!r} has no checkpoint key at {keys.where_for(run)}")
    if not hmac.compare_digest(mac, manifest_mac(manifest, key)):
        raise CheckpointError(f"{where}: HMAC does not match run {run[:80]!r}'s key: refused "
                              "(altered, or not written by that run)")


def read_manifest(storage: Storage, step: int, keys: KeyStore | None = None) -> dict | None:
    """The checked manifest of checkpoint `step`, or None when it has none; CheckpointError when
    it is malformed, or, given `keys`, not authenticated (see `authenticate`: required before
    anything it names is loaded)."""
    data = storage.read_bytes(f"{step_name(step)}/{MANIFEST}")
    if data is None:
        return None
    manifest = parse_manifest(data, step)
    if keys is not None:
        authenticate(manifest, keys)
    return manifest


def candidates(storage: Storage, keys: KeyStore) -> tuple[list[dict], list[str]]:
    """The authenticated manifests of the complete checkpoints whose files are all present at their
    recorded sizes, newest first, and one line per checkpoint passed over (malformed, not
    authenticated or incomplete)."""
    found, skipped = [], []
    by_step = _by_step(storage)
    for step in sorted((s for s, files in by_step.items() if MANIFEST in files), reverse=True):
        try:
            manifest = read_manifest(storage, step, keys)
        except CheckpointError as exc:
            skipped.append(str(exc))
            continue
        if manifest is None:
            continue
        short = [f["name"] for f in manifest["files"] if by_step[step].get(f["name"]) != f["bytes"]]
        if short:
            skipped.append(f"{step_name(step)}: {short[0]} missing or not of its recorded size")
            continue
        found.append(manifest)
    return found, skipped


def latest(storage: Storage, keys: KeyStore) -> dict | None:
    """The authenticated manifest of the newest complete checkpoint, or None."""
    found, _ = candidates(storage, keys)
    return found[0] if found else None


def check_destination(uri: str | None, resume: bool, model_digest: str, run_dir: Path) -> None:
    """Before a run starts: a new run refuses a `checkpoint.uri` that already holds checkpoints (two
    runs would overwrite each other's shards, and a restore would load the other's); `--resume`
    needs a complete, authenticated checkpoint there (by the key of the run that wrote it, see
    `open_keys`; the run to be in `run_dir`) of the same model. UserError (one line) otherwise."""
    if not uri:
        if resume:
            raise UserError("--resume: set checkpoint.uri to where the checkpoints are "
                            "(a run's default <run dir>/checkpoints is not shared with a new run)")
        return
    try:
        storage = open_storage(uri)
    except UserError as exc:
        if resume:
            raise UserError(f"--resume: no complete checkpoint ({exc})") from None
        return   # a new destination: created when the run starts
    try:
        if not resume:
            if by_step := _by_step(storage):
                runs = sorted({str(m.get("run")) for step in by_step
                               if (m := _unchecked(storage, step)) is not None}) or ["an unknown run"]
                raise UserError(f"checkpoint.uri {uri} already holds checkpoints (run {', '.join(runs)}): pass "
                                "--resume to continue from them, or give this run a checkpoint.uri of its own")
            return
        found, skipped = candidates(storage, open_keys(uri, run_dir))
        if not found:
            why = f" ({skipped[0]})" if skipped else ""
            raise UserError(f"--resume: no complete checkpoint at {uri}{why}")
        if found[0].get("model_digest") != model_digest:
            raise UserError(f"--resume: the newest checkpoint at {uri} (step {found[0]['step']}, run "
                            f"{found[0].get('run')}) was saved from a different model section than this recipe's")
    finally:
        storage.close()


def _unchecked(storage: Storage, step: int) -> dict | None:
    """The manifest of `step` if it parses (not authenticated: for naming its run in a message)."""
    try:
        return read_manifest(storage, step)
    except CheckpointError:
        return None


def listing(storage: Storage) -> list[dict]:
    """Every checkpoint at the storage, oldest first: step, saved_at, bytes, complete."""
    out = []
    for step, files in sorted(_by_step(storage).items()):
        try:
            manifest = read_manifest(storage, step) if MANIFEST in files else None
        except CheckpointError:
            manifest = None
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


def model_digest(recipe) -> str:
    """Hash of the recipe's model section: a checkpoint loads only into the same model."""
    blob = json.dumps(recipe.model.model_dump(mode="json"), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def sha256_file(path: Path, chunk_bytes: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def complete_step(storage: Storage, step: int | None = None) -> int:
    """`step` if a complete checkpoint is there, or the newest complete one; UserError otherwise."""
    steps = complete_steps(storage)
    if not steps:
        raise UserError(f"{storage.uri}: no complete checkpoint (none has a manifest)")
    if step is None:
        return steps[-1]
    if step not in steps:
        raise UserError(f"{storage.uri}: no complete checkpoint at step {step} (complete: {steps})")
    return step


def verify(storage: Storage, step: int | None = None, keys: KeyStore | None = None) -> tuple[int, list[str]]:
    """Re-hash every file of a complete checkpoint (the newest, or `step`) against its manifest,
    and, given `keys`, check the manifest's HMAC first, as a restore would (a manifest whose hashes
    were rewritten to match altered files fails there).

    Returns:
        (step, problems); each problem is one line naming the file or the manifest."""
    step = complete_step(storage, step)
    try:
        manifest = read_manifest(storage, step, keys)
    except CheckpointError as exc:
        return step, [str(exc)]
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
    """The rank that wrote `name` (DCP's `__R_N.distcp`, our `rng-R.json`), or None if shared."""
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


def fetch(uri: str, manifest: dict, staging: str) -> str:
    """Make the checkpoint `manifest` describes loadable by DCP on this node; returns the local
    directory. Every file (from `file://` too) is copied into the node's staging area and checked
    against the manifest's sha256 before anything reads it; CheckpointError (one line) when a file
    is missing or altered."""
    step = manifest["step"]
    storage = open_storage(uri)
    dest = (Path(staging) / f"restore-{step_name(step)}").resolve()
    dest.mkdir(parents=True, exist_ok=True)

    def one(f: dict) -> None:
        # parse_manifest refuses such names; checked again here, where the file is written, so a
        # manifest that came by another way never writes outside `dest` (`..` included).
        if not isinstance(f.get("name"), str) or not plain_name(f["name"]):
            raise CheckpointError(f"{step_name(step)}: file name {str(f.get('name'))[:80]!r} leaves the staging directory")
        target = dest / f["name"]
        if target.exists() and target.stat().st_size == f["bytes"] and sha256_file(target) == f["sha256"]:
            return
        try:
            digest = storage.read_file(f"{step_name(step)}/{f['name']}", target)
        except (OSError, *storage.errors) as exc:
            raise CheckpointError(f"{uri}: {step_name(step)}/{f['name']}: {type(exc).__name__}") from None
        if digest != f["sha256"]:
            target.unlink(missing_ok=True)
            raise CheckpointError(f"{uri}: {step_name(step)}/{f['name']} does not match its manifest")

    try:
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(one, manifest["files"]))
    finally:
        storage.close()
    return str(dest)


# -- reading DCP without running code from storage ----------------------------------------------

# What DCP's .metadata pickle may name: its own record types, torch's dtype/layout/Size, a path.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.serialization", "_get_layout"),
     ("torch", "Size"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata, refusing every global outside `_METADATA_GLOBALS` and torch dtypes
    (a pickle that names anything else, e.g. os.system, is refused before it can run)."""

    def find_class(self, module: str, name: str):
        import torch

        if (module, name) in _METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                    torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointError(f"DCP metadata names {module}.{name}: refused (not a checkpoint record type)")


def stored_entries(path: str) -> set[str]:
    """The top-level entries (`model`, `outer_theta`, …) of the DCP checkpoint in `path`, from its
    metadata (read by `_MetadataUnpickler`)."""
    with open(Path(path) / ".metadata", "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    return {fqn.split(".", 1)[0] for fqn in metadata.state_dict_metadata}


def dcp_load(state: dict, path: str) -> None:
    """`torch.distributed.checkpoint.load(state, checkpoint_id=path)` (a collective over the
    replica's ranks), with the metadata read by `_MetadataUnpickler` and non-tensor values by
    `torch.load(weights_only=True)`, where DCP itself would unpickle both without restriction."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.planner import ReadItem

    class Reader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with open(Path(self.path) / ".metadata", "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    try:
        dcp.load(state, storage_reader=Reader(path), planner=Planner())
    except CheckpointException as exc:   # DCP gathers every rank's error into one
        cause = next((f[0] if isinstance(f, tuple) else f for f in exc.failures.values()), exc)
        if isinstance(cause, pickle.UnpicklingError):
            raise CheckpointError(f"{path}: a stored value needs code to unpickle: refused") from None
        raise CheckpointError(f"{path}: {first_line(cause)}") from None


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
        run: the run's name, recorded in every manifest (`check_destination` reads it).
        run_dir: the run's directory (for `file://` checkpoints its `checkpoint.key`; see `open_keys`).
    """

    def __init__(self, uri: str, staging: str, keep_last: int, threads: int, ledger, run: str, run_dir: Path):
        self.uri = uri
        self.run = run
        self.storage = open_storage(uri, create=True)
        self.keys = open_keys(uri, run_dir)
        # The run's own key, made (or, for a run of the same name, read back) before training, so a
        # secret store out of reach is found now rather than at the first checkpoint.
        self._key = self.keys.create(run)
        self.staging = staging
        self.keep_last = keep_last
        self.threads = threads
        self.ledger = ledger
        self._pending: dict | None = None
        self.failed: tuple[int, str] | None = None   # (step, why) when the newest phase 2 did not land

    @property
    def uploading(self) -> int | None:
        """The step whose phase 2 is under way, or None."""
        return self._pending["step"] if self._pending else None

    def save(self, world, lead, recipe) -> None:
        """Phase 1 on `lead` (blocking: the snapshot), then start phase 2 (each rank uploads once its
        write is done). Waits first for a write or upload still under way."""
        t0 = time.monotonic()
        self.wait()
        step = world.outer_step
        try:
            # A resumed run saves again at a step an older attempt completed: that manifest goes
            # first, so it never vouches for files being overwritten.
            try:
                self.storage.delete([f"{step_name(step)}/{MANIFEST}"])
            except Exception as exc:
                raise CheckpointError(f"{self.uri}: cannot clear {step_name(step)}/{MANIFEST} before saving: "
                                      f"{first_line(exc)}") from None
            local = f"{self.staging}/{step_name(step)}"
            write_s = max(r["seconds"] for r in world.call_replica(lead, "save_checkpoint", local))
        except Exception as exc:   # the caller records it; `failed` says the newest save did not land
            self.failed = (step, first_line(exc))
            raise
        stall_s = time.monotonic() - t0
        refs = [a.upload_checkpoint.remote(local, self.uri, step, self.threads) for a in lead.actors]
        self._pending = {"step": step, "refs": refs, "lead": lead, "local": local, "t0": time.monotonic(),
                         "manifest": {"step": step, "inner_step": world.inner_step, "data_cursor": world.cursor,
                                      "tokens": world.tokens, "run": self.run,
                                      "recipe_digest": recipe.digest(), "model_digest": model_digest(recipe),
                                      "ranks": len(lead.actors), "replicas": len(world.replicas)}}
        self.ledger.append(CheckpointSaved(step=step, stall_s=round(stall_s, 3), write_s=round(write_s, 3), local=local,
                                           replica=lead.replica_id))

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
            self._failed(p, first_line(exc))
            return
        manifest = {**p["manifest"], "saved_at": time.time(), "files": sorted(files, key=lambda f: f["name"])}
        manifest["hmac"] = manifest_mac(manifest, self._key)
        try:
            self.storage.write_bytes(f"{step_name(p['step'])}/{MANIFEST}", json.dumps(manifest, indent=2).encode())
        except Exception as exc:  # the store refused or failed it: the step stays partial, the run goes on
            self._failed(p, f"manifest not written: {first_line(exc)}")
            return
        seconds = time.monotonic() - p["t0"]
        size = sum(f["bytes"] for f in files)
        self.ledger.append(CheckpointUploaded(step=p["step"], uri=self.uri, bytes=size, files=len(files),
                                              seconds=round(seconds, 3),
                                              mb_per_s=round(size / 1e6 / max(seconds, 1e-6), 1)))
        self.failed = None
        self._drop_staging(p)
        try:
            deleted = prune(self.storage, self.keep_last)
        except Exception as exc:  # old checkpoints stay a while longer; the next save prunes again
            log.warning("could not delete old checkpoints in %s: %s", self.uri, first_line(exc))
            return
        for step in deleted:
            self.ledger.append(CheckpointDeleted(step=step))

    def _failed(self, p: dict, why: str) -> None:
        self.failed = (p["step"], why)
        self.ledger.append(CheckpointUploadFailed(step=p["step"], message=why))
        self._drop_staging(p)

    @staticmethod
    def _drop_staging(p: dict) -> None:
        try:
            p["lead"].actors[0].drop_staging.remote(p["local"])
        except Exception:
            pass  # the lead is gone; its node's staging went with it

    def candidates(self) -> tuple[list[dict], list[str]]:
        """See `candidates`: usable (authenticated) manifests newest first, and the checkpoints
        passed over."""
        return candidates(self.storage, self.keys)

    def close(self) -> None:
        """At the end of the run: close the storage and remove this run's staging directory on this
        machine (phase-1 snapshots not yet dropped, restores' copies); a cloud node's goes with its
        disk."""
        self.storage.close()
        shutil.rmtree(self.staging, ignore_errors=True)
