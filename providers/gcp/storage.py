"""The `gcp` provider's object store: `gs://bucket/prefix` through google-cloud-storage with
application-default credentials; `STORAGE_EMULATOR_HOST` points it at an emulator. Large files go
up as resumable uploads."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

from elastic.errors import UserError
from elastic.storage import CHUNK_BYTES, Storage


class GCSStorage(Storage):
    """A Google Cloud Storage bucket (or an emulator through STORAGE_EMULATOR_HOST)."""

    def __init__(self, uri: str, bucket: str, prefix: str, create: bool):
        from google.api_core import exceptions as gexc
        from google.auth.exceptions import DefaultCredentialsError
        from google.cloud import storage

        self.uri, self.prefix = uri, prefix
        self._gexc = gexc
        self.errors = (gexc.GoogleAPIError,)
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
