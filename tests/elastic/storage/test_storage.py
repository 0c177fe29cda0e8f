"""Checkpoint storage against real servers on 127.0.0.1: file://, S3 (moto server), GCS (emulator)."""

from __future__ import annotations

import json
import os
import uuid

import pytest

from elastic.errors import UserError
from elastic.storage import checkpoint as ckpt
from elastic.storage.stores import CHUNK_BYTES, KeyStore, open_keys, open_storage
from tests.conftest import run_cli


@pytest.fixture(params=["file", "s3", "gs"])
def uri(request, tmp_path):
    """A fresh, empty checkpoint destination of each kind."""
    if request.param == "file":
        return f"file://{tmp_path / 'ckpt'}"
    # S3 keeps checkpoint keys in SSM (moto), GCS in Secret Manager (the GCP fake)
    for server in ("s3_server",) if request.param == "s3" else ("gcs_server", "gcp_fake"):
        request.getfixturevalue(server)
    return f"{request.param}://ckpt-{uuid.uuid4().hex[:8]}/runs/one"


def test_objects_round_trip(uri, tmp_path):
    store = open_storage(uri, create=True)
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(2 * CHUNK_BYTES + 12345))     # multipart / resumable sized
    store.write_file(big, "step-00000001/big.bin")
    store.write_bytes("step-00000001/elastic.json", b'{"step": 1}')
    assert store.list() == {"step-00000001/big.bin": big.stat().st_size, "step-00000001/elastic.json": 11}
    assert store.read_bytes("step-00000001/elastic.json") == b'{"step": 1}'
    assert store.read_bytes("step-00000001/absent") is None
    assert store.sha256("step-00000001/big.bin") == ckpt.sha256_file(big)
    back = tmp_path / "back.bin"
    assert store.read_file("step-00000001/big.bin", back) == ckpt.sha256_file(big)
    assert back.read_bytes() == big.read_bytes()
    store.delete(["step-00000001/big.bin", "step-00000001/elastic.json"])
    assert store.list() == {}


def reader_keys(uri: str, tmp_path) -> KeyStore:
    """The checkpoint keys at `uri` as a run in a directory under `tmp_path` finds them."""
    return open_keys(uri, tmp_path / "reader")


def fake_checkpoint(uri: str, tmp_path, step: int, complete: bool = True, **fields) -> dict:
    """A checkpoint made the way ranks and driver make one: phase-2 upload, then the manifest
    (`fields` override its entries) authenticated with its run's key (`tmp_path/<run>` the run's
    directory). Returns the manifest."""
    local = tmp_path / f"local-{step}"
    local.mkdir()
    for name in ("__0_0.distcp", "__1_0.distcp", ".metadata", "rng-0.json"):
        (local / name).write_bytes(os.urandom(1000 + step))
    files = []
    for rank in (0, 1):
        files += ckpt.upload(uri, local, step, ckpt.rank_files(local, rank), threads=2)
    manifest = {"step": step, "inner_step": step * 4, "data_cursor": step * 8, "tokens": step * 1024, "ranks": 2,
                "replicas": 1, "run": "run-a", "model_digest": "m", "saved_at": 1.0, "files": files, **fields}
    manifest["hmac"] = ckpt.manifest_mac(manifest, open_keys(uri, tmp_path / manifest["run"]).create(manifest["run"]))
    if complete:
        open_storage(uri).write_bytes(f"{ckpt.step_name(step)}/{ckpt.MANIFEST}", json.dumps(manifest).encode())
    return manifest


def tamper_manifest(uri: str, at_step: int, **fields) -> dict:
    """Rewrite checkpoint `at_step`'s manifest with `fields` (its HMAC left as it was)."""
    store = open_storage(uri)
    name = f"{ckpt.step_name(at_step)}/{ckpt.MANIFEST}"
    manifest = {**json.loads(store.read_bytes(name)), **fields}
    store.write_bytes(name, json.dumps(manifest).encode())
    return manifest


def test_listing_retention_and_verify(uri, tmp_path):
    store = open_storage(uri, create=True)
    for step in (2, 4, 6):
        fake_checkpoint(uri, tmp_path, step)
    fake_checkpoint(uri, tmp_path, 5, complete=False)      # an upload cut short
    fake_checkpoint(uri, tmp_path, 8, complete=False)      # one still under way
    listed = {c["step"]: c["complete"] for c in ckpt.listing(store)}
    assert listed == {2: True, 4: True, 5: False, 6: True, 8: False}
    assert ckpt.latest(store, reader_keys(uri, tmp_path))["step"] == 6
    # every rank's file is there exactly once, shared ones from rank 0
    assert sorted(f["name"] for f in ckpt.read_manifest(store, 6)["files"]) == \
        [".metadata", "__0_0.distcp", "__1_0.distcp", "rng-0.json"]

    assert ckpt.prune(store, keep_last=2) == [2]
    assert {c["step"] for c in ckpt.listing(store)} == {4, 6, 8}   # partial 5 gone, 8 may still finish
    assert ckpt.verify(store) == (6, [])

    # one flipped byte in one shard: verify names that file
    name = "step-00000006/__1_0.distcp"
    data = bytearray(store.read_bytes(name))
    data[10] ^= 0xFF
    store.write_bytes(name, bytes(data))
    step, problems = ckpt.verify(store, 6)
    assert step == 6 and len(problems) == 1 and "__1_0.distcp" in problems[0] and "sha256" in problems[0]
    assert ckpt.verify(store, 4) == (4, [])


def test_retention_never_deletes_the_newest_complete_checkpoint(uri, tmp_path):
    store = open_storage(uri, create=True)
    fake_checkpoint(uri, tmp_path, 3)
    fake_checkpoint(uri, tmp_path, 7, complete=False)
    assert ckpt.prune(store, keep_last=1) == []
    assert {c["step"]: c["complete"] for c in ckpt.listing(store)} == {3: True, 7: False}


def test_checkpoints_cli_on_object_storage(uri, tmp_path):
    open_storage(uri, create=True)
    for step in (1, 2):
        fake_checkpoint(uri, tmp_path, step)
    listed = run_cli("checkpoints", "list", uri)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.count("yes") == 2
    # The fake run's key is in tmp_path/run-a (file://) or the cloud's secret store.
    ok = run_cli("checkpoints", "verify", uri, "--runs-dir", str(tmp_path))
    assert ok.returncode == 0 and "step 2" in ok.stdout and "authenticated" in ok.stdout, ok.stderr
    # Step 2's manifest rewritten by a writer of the bucket without the key: its files still match
    # the sha256s it lists, but the HMAC does not.
    tamper_manifest(uri, 2, tokens=1)
    bad = run_cli("checkpoints", "verify", uri, "--runs-dir", str(tmp_path))
    assert bad.returncode == 1 and "HMAC does not match run 'run-a'" in bad.stderr, (bad.stdout, bad.stderr)
    assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr
    elsewhere = run_cli("checkpoints", "verify", uri, "--step", "1", "--runs-dir", str(tmp_path / "none"))
    expect = ("no checkpoint key" if uri.startswith("file") else "step 1")
    assert expect in elsewhere.stdout + elsewhere.stderr, (elsewhere.stdout, elsewhere.stderr)


def test_missing_bucket_and_credentials_are_one_line_errors(s3_server, gcs_server, monkeypatch):
    with pytest.raises(UserError, match="bucket does not exist"):
        open_storage("s3://no-such-bucket/x")
    with pytest.raises(UserError, match="bucket does not exist"):
        open_storage("gs://no-such-bucket/x")
    with pytest.raises(UserError, match="unsupported scheme"):
        open_storage("ftp://host/x")
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(UserError, match="no AWS credentials found"):
        open_storage("s3://any-bucket/x")


def test_cli_reports_a_missing_bucket_in_one_line(s3_server):
    proc = run_cli("checkpoints", "list", "s3://nothing-here/run")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "bucket does not exist" in proc.stderr
