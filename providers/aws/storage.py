"""The `aws` provider's object store: `s3://bucket/prefix` through boto3, with its usual
configuration (profile, region, credentials chain) and `AWS_ENDPOINT_URL` /
`AWS_ENDPOINT_URL_S3` for S3-compatible servers. Large files go up as multipart uploads with
parallel parts."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from elastic.errors import UserError
from elastic.storage.stores import CHUNK_BYTES, KeyStore, Storage, key_slug

KEY_PARAMETER_PREFIX = "/elastic-checkpoint-keys/"   # outside /elastic/<run>/*, which a run's nodes may read


class S3Storage(Storage):
    """An S3 bucket (or any S3-compatible server through AWS_ENDPOINT_URL)."""

    def __init__(self, uri: str, bucket: str, prefix: str, create: bool, threads: int = 8):
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        from providers.aws.sdk import session

        self.uri, self.bucket, self.prefix = uri, bucket, prefix
        self._client = session().client("s3", config=Config(retries={"mode": "adaptive", "max_attempts": 8},
                                                             max_pool_connections=max(10, threads * 2)))
        self._transfer = TransferConfig(multipart_threshold=CHUNK_BYTES, multipart_chunksize=CHUNK_BYTES,
                                        max_concurrency=threads)
        self.errors = _s3_errors()
        try:
            self._client.head_bucket(Bucket=bucket)
        except self.errors as exc:
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
        except self.errors as exc:
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
        except self.errors as exc:
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
        """Raises OSError naming the first key S3 did not delete: DeleteObjects answers 200 and lists
        the keys it refused (AccessDenied, say) in the body."""
        for i in range(0, len(names), 1000):
            batch = [{"Key": self._key(n)} for n in names[i:i + 1000]]
            resp = self._client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
            errors = resp.get("Errors") or []
            if errors:
                e = errors[0]
                more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
                raise OSError(f"s3://{self.bucket}/{e.get('Key', '')}: not deleted: {e.get('Code', '?')}: "
                              f"{e.get('Message', '')}{more}")


class SSMKeys(KeyStore):
    """Checkpoint keys as SecureString parameters `/elastic-checkpoint-keys/<run slug>` of SSM
    Parameter Store in the bucket's region. The driver's policy reaches them; a run's node role
    reads only `/elastic/<run>/*`."""

    def __init__(self, uri: str, bucket: str):
        super().__init__()
        from providers.aws.sdk import session as new_session

        session = new_session()
        s3 = session.client("s3")
        try:   # the bucket's own region: the same parameters wherever the driver runs
            head = s3.head_bucket(Bucket=bucket)
            region = head["ResponseMetadata"]["HTTPHeaders"].get("x-amz-bucket-region")
        except _s3_errors() as exc:
            raise UserError(_s3_message(uri, exc)) from None
        self.region = region or s3.meta.region_name or "us-east-1"
        self._ssm = session.client("ssm", region_name=self.region)
        self.where = f"SSM Parameter Store ({self.region}) under {KEY_PARAMETER_PREFIX}"

    def _call(self, action: str, **kwargs):
        try:
            return getattr(self._ssm, action)(**kwargs)
        except _s3_errors() as exc:
            if _s3_code(exc) in ("ParameterNotFound", "ParameterAlreadyExists"):
                raise
            raise UserError(f"checkpoint key: ssm {action} {kwargs.get('Name')}: {_s3_code(exc) or exc}") from None

    def _read(self, run: str) -> bytes | None:
        import base64

        try:
            value = self._call("get_parameter", Name=KEY_PARAMETER_PREFIX + key_slug(run),
                               WithDecryption=True)["Parameter"]["Value"]
        except _s3_errors():   # ParameterNotFound
            return None
        return base64.b64decode(value)

    def _create(self, run: str, key: bytes) -> bytes:
        import base64

        try:
            self._call("put_parameter", Name=KEY_PARAMETER_PREFIX + key_slug(run), Type="SecureString",
                       Value=base64.b64encode(key).decode(), Overwrite=False,
                       Description=f"elastic: authenticates the checkpoint manifests of run {run}"[:1024])
        except _s3_errors():   # ParameterAlreadyExists: another process of this run stored it first
            return self._read(run)
        return key


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
