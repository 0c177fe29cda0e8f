"""The `gcp` provider's object store: `gs://bucket/prefix` through google-cloud-storage with
application-default credentials; `STORAGE_EMULATOR_HOST` points it at an emulator. Large files go
up as resumable uploads."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

from elastic.errors import UserError
from elastic.storage.stores import CHUNK_BYTES, KeyStore, Storage, key_slug
from providers.gcp.api import SECRETS_ENDPOINT_ENV, credentials_or_line, endpoint_override, is_local, label_value

KEY_SECRET_PREFIX = "elastic-ckpt-key-"   # a run's node service account reads only its token secret


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


class SecretKeys(KeyStore):
    """Checkpoint keys as Secret Manager secrets `elastic-ckpt-key-<run slug>` of the project
    (`GOOGLE_CLOUD_PROJECT`, else the credentials' own); ELASTIC_GCP_SECRETS_ENDPOINT points it
    elsewhere, as it does the provider. A run's node service account may access only its token
    secret, not these."""

    def __init__(self, uri: str):
        super().__init__()
        from google.cloud import secretmanager_v1

        endpoint = endpoint_override(None, SECRETS_ENDPOINT_ENV)
        kwargs: dict = {"transport": "rest"}
        project = os.environ.get("GOOGLE_CLOUD_PROJECT") or os.environ.get("CLOUDSDK_CORE_PROJECT")
        if endpoint:
            kwargs["client_options"] = {"api_endpoint": endpoint}
        if is_local(endpoint):
            from google.auth.credentials import AnonymousCredentials
            kwargs["credentials"] = AnonymousCredentials()
        else:
            creds, found = credentials_or_line()
            if creds is None:
                raise UserError(f"{uri}: checkpoint keys: {found}")
            kwargs["credentials"], project = creds, project or found
        if not project:
            raise UserError(f"{uri}: checkpoint keys: no project (set GOOGLE_CLOUD_PROJECT)")
        self._project = project
        self._client = secretmanager_v1.SecretManagerServiceClient(**kwargs)
        self.where = f"Secret Manager (project {project}) under {KEY_SECRET_PREFIX}*"

    def _name(self, run: str) -> str:
        return f"projects/{self._project}/secrets/{KEY_SECRET_PREFIX}{key_slug(run)}"

    def _read(self, run: str) -> bytes | None:
        import base64

        from google.api_core import exceptions
        try:
            data = self._client.access_secret_version(name=self._name(run) + "/versions/latest").payload.data
        except exceptions.NotFound:
            return None
        except exceptions.GoogleAPICallError as exc:
            raise UserError(f"checkpoint key: read {self._name(run)}: {exc.message}") from None
        return base64.b64decode(data)

    def _create(self, run: str, key: bytes) -> bytes:
        from google.api_core import exceptions

        try:
            self._client.create_secret(request={
                "parent": f"projects/{self._project}", "secret_id": self._name(run).rsplit("/", 1)[-1],
                "secret": {"replication": {"automatic": {}},
                           "labels": {"elastic-run": label_value(run), "elastic-managed": "true"}}})
        except exceptions.AlreadyExists:
            return self._read(run) or self._add(run, key)   # created by another process of this run
        except exceptions.GoogleAPICallError as exc:
            raise UserError(f"checkpoint key: create {self._name(run)}: {exc.message}") from None
        return self._add(run, key)

    def _add(self, run: str, key: bytes) -> bytes:
        import base64

        self._client.add_secret_version(request={"parent": self._name(run),
                                                 "payload": {"data": base64.b64encode(key)}})
        return key
