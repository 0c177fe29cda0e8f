"""Where checkpoints live: one small interface over `file://` (or a plain path), `s3://` and `gs://`.

Names are `/`-separated paths relative to the URI's root. `write_bytes` is atomic (a reader sees the
whole object or none), which is what makes a manifest written last mark a checkpoint complete. The
cloud SDKs are imported only when a URI of theirs is opened:

- `s3://bucket/prefix`: boto3, with its usual configuration (profile, region, credentials chain) and
  `AWS_ENDPOINT_URL` / `AWS_ENDPOINT_URL_S3` for S3-compatible servers. Large files go up as
  multipart uploads with parallel parts.
- `gs://bucket/prefix`: google-cloud-storage with application-default credentials;
  `STORAGE_EMULATOR_HOST` points it at an emulator. Large files go up as resumable uploads.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Iterator

from elastic.errors import UserError

CHUNK_BYTES = 8 * 1024 * 1024


def open_storage(uri: str, create: bool = False) -> "Storage":
    """The storage a URI names. `create`: make the bucket or directory if it does not exist (the
    destination of a new run); otherwise a missing one is a UserError."""
    scheme, sep, rest = uri.partition("://")
    if not sep:
        return FileStorage(Path(uri).expanduser(), create)
    if scheme == "file":
        return FileStorage(Path(rest).expanduser(), create)
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise UserError(f"{uri}: no bucket name")
    if scheme == "s3":
        return S3Storage(uri, bucket, prefix.strip("/"), create)
    if scheme == "gs":
        return GCSStorage(uri, bucket, prefix.strip("/"), create)
    raise UserError(f"{uri}: unsupported scheme {scheme}:// (use file://, s3:// or gs://)")


class Storage:
    """A checkpoint destination. Subclasses implement the primitives; names are relative."""

    uri: str

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
            root.mkdir(parents=True, exist_ok=True)
        elif not root.is_dir():
            raise UserError(f"{root}: no such checkpoint directory")

    def _path(self, name: str) -> Path:
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


class S3Storage(Storage):
    """An S3 bucket (or any S3-compatible server through AWS_ENDPOINT_URL)."""

    def __init__(self, uri: str, bucket: str, prefix: str, create: bool, threads: int = 8):
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.uri, self.bucket, self.prefix = uri, bucket, prefix
        self._client = boto3.session.Session().client("s3", config=Config(retries={"mode": "adaptive", "max_attempts": 8},
                                                        max_pool_connections=max(10, threads * 2)))
        self._transfer = TransferConfig(multipart_threshold=CHUNK_BYTES, multipart_chunksize=CHUNK_BYTES,
                                        max_concurrency=threads)
        self._errors = _s3_errors()
        try:
            self._client.head_bucket(Bucket=bucket)
        except self._errors as exc:
            code = _s3_code(exc)
            if code in ("404", "NoSuchBucket") and create:
                self._create_bucket()
            else:
                raise UserError(_s3_message(uri, exc)) from None

    def _create_bucket(self) -> None:
        region = self._client.meta.region_name
        kwargs = {} if region in (None, "us-east-1") else {
            "CreateBucketConfiguration": {"LocationConstraint": region}}
        try:
            self._client.create_bucket(Bucket=self.bucket, **kwargs)
        except self._errors as exc:
            raise UserError(_s3_message(self.uri, exc)) from None

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def write_file(self, src: Path, name: str) -> None:
        self._client.upload_file(str(src), self.bucket, self._key(name), Config=self._transfer)

    def write_bytes(self, name: str, data: bytes) -> None:
        self._client.put_object(Bucket=self.bucket, Key=self._key(name), Body=data)

    def read_bytes(self, name: str) -> bytes | None:
        try:
            return self._client.get_object(Bucket=self.bucket, Key=self._key(name))["Body"].read()
        except self._errors as exc:
            if _s3_code(exc) in ("404", "NoSuchKey"):
                return None
            raise

    def read_chunks(self, name: str) -> Iterator[bytes]:
        body = self._client.get_object(Bucket=self.bucket, Key=self._key(name))["Body"]
        yield from body.iter_chunks(CHUNK_BYTES)

    def list(self, prefix: str = "") -> dict[str, int]:
        out = {}
        strip = len(self.prefix) + 1 if self.prefix else 0
        pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._key(prefix))
        for page in pages:
            for obj in page.get("Contents", []):
                out[obj["Key"][strip:]] = obj["Size"]
        return out

    def delete(self, names: list[str]) -> None:
        for i in range(0, len(names), 1000):
            batch = [{"Key": self._key(n)} for n in names[i:i + 1000]]
            self._client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})


def _s3_errors():
    from botocore.exceptions import BotoCoreError, ClientError
    return (ClientError, BotoCoreError)


def _s3_code(exc) -> str:
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))


def _s3_message(uri: str, exc) -> str:
    from botocore.exceptions import EndpointConnectionError, NoCredentialsError

    if isinstance(exc, NoCredentialsError):
        return (f"{uri}: no AWS credentials found (set AWS_PROFILE, or AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or run on a VM with an instance profile)")
    if isinstance(exc, EndpointConnectionError):
        return f"{uri}: cannot reach S3 at {exc.kwargs.get('endpoint_url', '?')}"
    code = _s3_code(exc)
    if code in ("404", "NoSuchBucket"):
        return f"{uri}: bucket does not exist"
    if code in ("403", "AccessDenied"):
        return f"{uri}: access denied (the credentials in use may not read and write this bucket)"
    return f"{uri}: {exc}"


class GCSStorage(Storage):
    """A Google Cloud Storage bucket (or an emulator through STORAGE_EMULATOR_HOST)."""

    def __init__(self, uri: str, bucket: str, prefix: str, create: bool):
        from google.api_core import exceptions as gexc
        from google.auth.exceptions import DefaultCredentialsError
        from google.cloud import storage

        self.uri, self.prefix = uri, prefix
        self._gexc = gexc
        try:
            if os.environ.get("STORAGE_EMULATOR_HOST"):
                from google.auth.credentials import AnonymousCredentials
                self._client = storage.Client(project=os.environ.get("GOOGLE_CLOUD_PROJECT", "emulator"),
                                              credentials=AnonymousCredentials())
            else:
                self._client = storage.Client()
        except DefaultCredentialsError:
            raise UserError(f"{uri}: no Google Cloud credentials found (run `gcloud auth application-default "
                            "login`, or set GOOGLE_APPLICATION_CREDENTIALS)") from None
        self._bucket = self._client.bucket(bucket)
        try:
            exists = self._bucket.exists()
            if not exists and create:
                self._bucket = self._client.create_bucket(bucket)
            elif not exists:
                raise UserError(f"{uri}: bucket does not exist")
        except gexc.Forbidden:
            raise UserError(f"{uri}: access denied (the credentials in use may not read and write this bucket)") from None

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def write_file(self, src: Path, name: str) -> None:
        blob = self._bucket.blob(self._key(name), chunk_size=4 * CHUNK_BYTES)
        blob.upload_from_filename(str(src))

    def write_bytes(self, name: str, data: bytes) -> None:
        self._bucket.blob(self._key(name)).upload_from_string(data)

    def read_bytes(self, name: str) -> bytes | None:
        try:
            return self._bucket.blob(self._key(name)).download_as_bytes()
        except self._gexc.NotFound:
            return None

    def read_chunks(self, name: str) -> Iterator[bytes]:
        with self._bucket.blob(self._key(name)).open("rb", chunk_size=CHUNK_BYTES) as f:
            while block := f.read(CHUNK_BYTES):
                yield block

    def list(self, prefix: str = "") -> dict[str, int]:
        strip = len(self.prefix) + 1 if self.prefix else 0
        return {b.name[strip:]: b.size for b in self._client.list_blobs(self._bucket, prefix=self._key(prefix))}

    def delete(self, names: list[str]) -> None:
        for name in names:
            try:
                self._bucket.blob(self._key(name)).delete()
            except self._gexc.NotFound:
                pass
