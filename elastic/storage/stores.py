"""Where checkpoints live: one small interface over `file://` (or a plain path) and each
provider's object store (`s3://` in providers/aws/storage.py, `gs://` in providers/gcp/storage.py),
chosen by the URI's scheme through the provider registry.

Names are `/`-separated paths relative to the URI's root. `write_bytes` is atomic (a reader sees the
whole object or none), which is what makes a manifest written last mark a checkpoint complete. A
cloud SDK is imported only when a URI of its cloud is opened.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Iterator

from elastic.errors import UserError

CHUNK_BYTES = 8 * 1024 * 1024
KEY_BYTES = 32          # an HMAC-SHA256 key
KEY_FILE = "checkpoint.key"


def open_storage(uri: str, create: bool = False) -> "Storage":
    """The storage a URI names. `create`: make the bucket or directory if it does not exist (the
    destination of a new run); otherwise a missing one is a UserError."""
    scheme, sep, rest = uri.partition("://")
    if not sep:
        return FileStorage(Path(uri).expanduser(), create)
    if scheme == "file":
        return FileStorage(Path(rest).expanduser(), create)
    from providers import provider_class, storage_schemes

    schemes = storage_schemes()
    if scheme not in schemes:
        raise UserError(f"{uri}: unsupported scheme {scheme}:// "
                        f"(use {', '.join(f'{s}://' for s in ['file', *schemes])})")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise UserError(f"{uri}: no bucket name")
    return provider_class(schemes[scheme]).open_storage(uri, bucket, prefix.strip("/"), create)


class Storage:
    """A checkpoint destination. Subclasses implement the primitives; names are relative."""

    uri: str
    errors: tuple[type[BaseException], ...] = ()
    """What its SDK raises on a failed transfer besides OSError (a vanished object, a refused call)."""

    def write_file(self, src: Path, name: str) -> None:
        raise NotImplementedError

    def write_bytes(self, name: str, data: bytes) -> None:
        raise NotImplementedError

    def read_bytes(self, name: str) -> bytes | None:
        """The object's bytes, or None when it does not exist."""
        raise NotImplementedError

    def read_chunks(self, name: str) -> Iterator[bytes]:
        raise NotImplementedError

    def list(self, prefix: str = "") -> dict[str, int]:
        """Every object under `prefix`: name → size in bytes."""
        raise NotImplementedError

    def delete(self, names: list[str]) -> None:
        raise NotImplementedError

    def read_file(self, name: str, dest: Path) -> str:
        """Download `name` to `dest` (atomically); returns its sha256."""
        h = hashlib.sha256()
        tmp = dest.with_name(dest.name + ".part")
        with open(tmp, "wb") as f:
            for block in self.read_chunks(name):
                h.update(block)
                f.write(block)
        os.replace(tmp, dest)
        return h.hexdigest()

    def sha256(self, name: str) -> str:
        h = hashlib.sha256()
        for block in self.read_chunks(name):
            h.update(block)
        return h.hexdigest()

    def close(self) -> None:
        pass


class FileStorage(Storage):
    """A directory on a filesystem every node sees (local disk for a one-machine run, or NFS)."""

    def __init__(self, root: Path, create: bool):
        self.root = root
        self.uri = str(root)
        if create:
            try:
                root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:   # e.g. a file in the way (/dev/null/ckpt), a read-only disk
                raise UserError(f"{root}: cannot make the checkpoint directory: {exc.strerror or exc}") from None
        elif not root.is_dir():
            raise UserError(f"{root}: no such checkpoint directory")

    def _path(self, name: str) -> Path:
        """`name` under the root; ValueError for a name that would leave it (absolute, or `..`)."""
        parts = name.split("/")
        if name.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"{name[:80]!r}: not a relative name under {self.root}")
        return self.root / name

    def write_file(self, src: Path, name: str) -> None:
        dest = self._path(name)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".part")
        shutil.copyfile(src, tmp)
        os.replace(tmp, dest)

    def write_bytes(self, name: str, data: bytes) -> None:
        dest = self._path(name)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".part")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)

    def read_bytes(self, name: str) -> bytes | None:
        try:
            return self._path(name).read_bytes()
        except FileNotFoundError:
            return None

    def read_chunks(self, name: str) -> Iterator[bytes]:
        with open(self._path(name), "rb") as f:
            while block := f.read(CHUNK_BYTES):
                yield block

    def list(self, prefix: str = "") -> dict[str, int]:
        base = self._path(prefix) if prefix else self.root
        if not base.exists():
            return {}
        return {p.relative_to(self.root).as_posix(): p.stat().st_size
                for p in base.rglob("*") if p.is_file() and not p.name.endswith(".part")}

    def delete(self, names: list[str]) -> None:
        dirs = set()
        for name in names:
            p = self._path(name)
            p.unlink(missing_ok=True)
            dirs.add(p.parent)
        for d in sorted(dirs, key=lambda d: len(d.parts), reverse=True):
            if d != self.root:
                try:
                    d.rmdir()  # only once empty
                except OSError:
                    pass


# -- the keys that authenticate checkpoint manifests -------------------------------------------------

def open_keys(uri: str, run_dir: Path) -> "KeyStore":
    """Where the per-run keys authenticating the manifests at checkpoint `uri` are kept: the secret
    store of the cloud holding the checkpoints (its provider's `open_keys`: SSM Parameter Store,
    Secret Manager), or, for `file://` and paths, each run's `<run dir>/checkpoint.key` in the
    directory holding `run_dir` (run names are run directory names), and `run_dir`'s own key (a
    run directory renamed or copied keeps its key, not its name)."""
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme == "file":
        return LocalKeys([Path(run_dir).parent], home=Path(run_dir))
    from providers import provider_class, storage_schemes

    schemes = storage_schemes()
    if scheme not in schemes:
        raise UserError(f"{uri}: unsupported scheme {scheme}://")
    return provider_class(schemes[scheme]).open_keys(uri, rest.partition("/")[0])


def key_slug(run: str) -> str:
    """A secret-store name part for run `run`: its name in `[A-Za-z0-9_-]`, cut short, and a digest
    of the exact name so two runs never share a key."""
    return f"{re.sub(r'[^A-Za-z0-9_-]', '-', run)[:40]}-{hashlib.sha256(run.encode()).hexdigest()[:12]}"


class KeyStore:
    """The runs' checkpoint keys (random, KEY_BYTES each), kept where the run's driver may read and
    write them and its nodes may not. A key outlives its run: its checkpoints do."""

    where: str
    """Where the keys are, for messages."""

    def __init__(self):
        self._known: dict[str, bytes] = {}

    def where_for(self, run: str) -> str:
        """Where run `run`'s key would be, for messages."""
        return self.where

    def read(self, run: str) -> bytes | None:
        """Run `run`'s key, or None when it has none here."""
        if run not in self._known:
            key = self._read(run)
            if key is None:
                return None
            self._known[run] = key
        return self._known[run]

    def create(self, run: str) -> bytes:
        """Run `run`'s key: the stored one (a resumed or restarted run of that name), else a new
        random one, stored now."""
        key = self.read(run)
        if key is None:
            key = self._known[run] = self._create(run, secrets.token_bytes(KEY_BYTES))
        return key

    def _read(self, run: str) -> bytes | None:
        raise NotImplementedError

    def _create(self, run: str, key: bytes) -> bytes:
        """Store `key` unless one exists already; return the stored one."""
        raise NotImplementedError


class LocalKeys(KeyStore):
    """Keys in files readable by their owner only: `<root>/<run>/checkpoint.key`, in the first of
    `roots` that holds one, else `<home>/checkpoint.key` (the run directory at hand, whatever its
    name now: the manifest's HMAC decides whether that key is the right one). New keys go to the
    first root.

    Args:
        roots: directories holding run directories.
        home: a run directory whose key is tried for a run found in none of `roots`.
    """

    def __init__(self, roots: list[Path], home: Path | None = None):
        super().__init__()
        self.roots = roots
        self.home = home
        self.where = " or ".join([f"{r}/RUN/{KEY_FILE}" for r in roots] + ([str(home / KEY_FILE)] if home else []))

    def where_for(self, run: str) -> str:
        return ", ".join(str(p) for p in self._tried(run)) or self.where

    def _paths(self, run: str) -> list[Path]:
        """Where run `run`'s own key may be (none for a name that is not a run directory's)."""
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,200}", run) or run in (".", ".."):
            return []
        return [root / run / KEY_FILE for root in self.roots]

    def _tried(self, run: str) -> list[Path]:
        """Where `_read` looks for run `run`'s key, in order (nowhere for a name that is not a run
        directory's: no manifest of a real run names one)."""
        own = self._paths(run)
        home = [self.home / KEY_FILE] if self.home is not None and own else []
        return list(dict.fromkeys(own + home))

    def _read(self, run: str) -> bytes | None:
        for path in self._tried(run):
            try:
                key = path.read_bytes()
            except (FileNotFoundError, NotADirectoryError):
                continue
            if len(key) == KEY_BYTES:
                return key
        return None

    def _create(self, run: str, key: bytes) -> bytes:
        paths = self._paths(run)
        if not paths:
            raise UserError(f"checkpoint key: run name {run!r} is not a plain directory name")
        path = paths[0]
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return path.read_bytes()
        with os.fdopen(fd, "wb") as f:
            f.write(key)
        return key
