"""Restoring trusts nothing read from storage: manifests that name paths, manifests not
authenticated by their run's key, pickles that run code, altered files and another run's
checkpoints are refused (file:// and S3 on moto, 127.0.0.1)."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import uuid
from pathlib import Path

import pytest
import torch

from elastic.errors import UserError
from elastic.recipe.model import load_recipe
from elastic.storage import checkpoint as ckpt
from elastic.storage.stores import open_storage
from tests.conftest import REPO, run_cli
from tests.elastic.storage.test_storage import fake_checkpoint, reader_keys, tamper_manifest


class _Payload:
    """Unpickling this creates `marker`: the proof that a pickle ran code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.fixture(params=["file", "s3"])
def uri(request, tmp_path):
    if request.param == "file":
        return f"file://{tmp_path / 'ckpt'}"
    request.getfixturevalue("s3_server")
    return f"s3://ckpt-{uuid.uuid4().hex[:8]}/run"


def test_a_manifest_naming_a_path_writes_nothing_outside_staging(uri, tmp_path):
    open_storage(uri, create=True)
    manifest = fake_checkpoint(uri, tmp_path, 2)
    outside = tmp_path / "outside"
    evil = [{**manifest["files"][0], "name": f"../../../{outside.name}"}]
    tamper_manifest(uri, 2, files=evil)
    store = open_storage(uri)
    with pytest.raises(ckpt.CheckpointError, match="not a plain, unique file name"):
        ckpt.read_manifest(store, 2)
    assert ckpt.latest(store, reader_keys(uri, tmp_path)) is None and ckpt.listing(store)[0]["complete"] is False
    # A manifest that got past the parser (say, handed over by a compromised driver) still cannot
    # place a file outside the node's staging directory.
    staging = tmp_path / "a" / "b" / "staging"
    with pytest.raises(ckpt.CheckpointError, match="leaves the staging directory"):
        ckpt.fetch(uri, {**manifest, "files": evil}, str(staging))
    assert not outside.exists() and not list(tmp_path.glob("a/**/outside*"))
    # the CLI: one line, exit 2, nothing created
    proc = run_cli("launch", str(REPO / "recipes/local-tiny.yaml"), "--run-dir", str(tmp_path / "run"),
                   "--set", f"checkpoint.uri={uri}", "--resume")
    assert proc.returncode == 2 and "not a plain, unique file name" in proc.stderr, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and not (tmp_path / "run").exists() and not outside.exists()


def test_a_manifest_not_authenticated_by_its_runs_key_is_refused_and_its_pickle_never_runs(uri, tmp_path):
    """A writer of the bucket without the run's key swaps `.metadata` for a pickle payload and
    recomputes its size and sha256 in the manifest: kept HMAC, none, or one of its own making under
    a run name it invents, each is refused before anything is fetched; the older checkpoint is what
    restores, and with none left `--resume` exits 2 in one line. The payload never runs."""
    open_storage(uri, create=True)
    fake_checkpoint(uri, tmp_path, 2)
    genuine = fake_checkpoint(uri, tmp_path, 4)
    marker = tmp_path / "ran"
    payload = pickle.dumps(_Payload(marker))
    store = open_storage(uri)
    store.write_bytes(f"{ckpt.step_name(4)}/.metadata", payload)
    files = [{**f, "bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()} if f["name"] == ".metadata"
             else f for f in genuine["files"]]
    mallory = {**genuine, "files": files, "run": "mallory"}
    forgeries = [({**genuine, "files": files}, "HMAC does not match run 'run-a'"),
                 ({k: v for k, v in genuine.items() if k != "hmac"} | {"files": files}, "not authenticated (no HMAC"),
                 ({**mallory, "hmac": ckpt.manifest_mac(mallory, os.urandom(32))}, "run 'mallory' has no checkpoint key")]
    for forged, why in forgeries:
        store.write_bytes(f"{ckpt.step_name(4)}/{ckpt.MANIFEST}", json.dumps(forged).encode())
        found, skipped = ckpt.candidates(store, reader_keys(uri, tmp_path))
        assert [m["step"] for m in found] == [2] and len(skipped) == 1 and why in skipped[0], skipped
    # The control: the hashes alone would have let the payload through to the node ...
    local = ckpt.fetch(uri, forgeries[0][0], str(tmp_path / "staging"))
    assert (Path(local) / ".metadata").read_bytes() == payload
    # ... where the restricted unpickler (defence in depth) still refuses it.
    with pytest.raises(ckpt.CheckpointError, match="refused"), pytest.warns(UserWarning):
        ckpt.dcp_load({"w": torch.zeros(4)}, local)
    assert not marker.exists()
    # With no authenticated checkpoint left: one line, exit 2, nothing created, nothing run (the
    # CLI's path is the same for every store: once is enough).
    store.delete([f"{ckpt.step_name(2)}/{ckpt.MANIFEST}"])
    if not uri.startswith("file://"):
        return
    proc = run_cli("launch", str(REPO / "recipes/local-tiny.yaml"), "--run-dir", str(tmp_path / "run"),
                   "--set", f"checkpoint.uri={uri}", "--resume")
    assert proc.returncode == 2 and "not authenticated" in proc.stderr, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and not (tmp_path / "run").exists() and not marker.exists()


def test_a_local_runs_key_is_its_owners_alone(tmp_path):
    """file:// checkpoints: the run's key is `<run dir>/checkpoint.key`, mode 0600, made once; a
    run resuming another finds that run's key beside its own directory, and nowhere else."""
    uri = f"file://{tmp_path / 'ckpt'}"
    keys = ckpt.open_keys(uri, tmp_path / "runs" / "run-a")
    key = keys.create("run-a")
    path = tmp_path / "runs" / "run-a" / "checkpoint.key"
    assert path.read_bytes() == key and path.stat().st_mode & 0o777 == 0o600
    assert ckpt.open_keys(uri, tmp_path / "runs" / "run-b").read("run-a") == key
    assert ckpt.open_keys(uri, tmp_path / "runs" / "run-b").create("run-a") == key   # never replaced
    assert ckpt.open_keys(uri, tmp_path / "elsewhere" / "run-b").read("run-a") is None
    assert keys.read("..") is None and keys.read("a/../../x") is None     # not a run directory's name


@pytest.mark.parametrize("bad, message", [
    ({"step": -1}, "step must be"), ({"step": 9}, "names step 9"), ({"files": []}, "non-empty list"),
    ({"files": "x"}, "non-empty list"), ({"saved_at": float("nan")}, "unix time"), ({"tokens": "many"}, "tokens"),
])
def test_manifests_of_the_wrong_shape_are_refused_in_one_line(tmp_path, bad, message):
    uri = f"file://{tmp_path / 'ckpt'}"
    open_storage(uri, create=True)
    fake_checkpoint(uri, tmp_path, 2)
    tamper_manifest(uri, 2, **bad)
    with pytest.raises(ckpt.CheckpointError, match=message):
        ckpt.read_manifest(open_storage(uri), 2)
    proc = run_cli("checkpoints", "verify", uri)
    assert proc.returncode != 0 and message.split()[0] in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def test_every_file_is_hashed_before_use_file_uri_included(uri, tmp_path):
    open_storage(uri, create=True)
    fake_checkpoint(uri, tmp_path, 2)
    store = open_storage(uri)
    manifest = ckpt.latest(store, reader_keys(uri, tmp_path))
    local = Path(ckpt.fetch(uri, manifest, str(tmp_path / "staging")))
    assert local.is_relative_to(tmp_path / "staging")    # a copy, never the stored files themselves
    assert {p.name for p in local.iterdir()} == {f["name"] for f in manifest["files"]}
    name = f"{ckpt.step_name(2)}/__0_0.distcp"
    data = bytearray(store.read_bytes(name))
    data[0] ^= 0xFF                                     # same size: only the hash tells
    store.write_bytes(name, bytes(data))
    with pytest.raises(ckpt.CheckpointError, match="__0_0.distcp does not match its manifest"):
        ckpt.fetch(uri, manifest, str(tmp_path / "staging2"))
    assert not (tmp_path / "staging2" / "restore-step-00000002" / "__0_0.distcp").exists()


def saved_dcp(tmp_path: Path, state: dict) -> Path:
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "dcp"
    with pytest.warns(UserWarning):   # no process group: DCP says it saves from one process
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def test_dcp_metadata_and_values_carrying_a_pickle_payload_do_not_run(tmp_path):
    """DCP itself unpickles `.metadata` and non-tensor values without restriction; `dcp_load` reads
    the first with an allowlist of DCP's record types and the second with weights_only."""
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "ran"
    path = saved_dcp(tmp_path, {"w": torch.arange(4.0), "extra": _Payload(marker)})
    assert not marker.exists()
    with pytest.warns(UserWarning):   # the control: DCP's own load runs the payload
        dcp.load({"w": torch.zeros(4), "extra": None}, checkpoint_id=str(path), no_dist=True)
    assert marker.exists()
    marker.unlink()
    with pytest.raises(ckpt.CheckpointError, match="needs code to unpickle: refused"), pytest.warns(UserWarning):
        ckpt.dcp_load({"w": torch.zeros(4), "extra": None}, str(path))
    assert not marker.exists()

    # a clean checkpoint loads through the same reader
    clean = saved_dcp(tmp_path / "clean", {"w": torch.arange(4.0), "lr": 0.5, "betas": (0.9, 0.95)})
    state = {"w": torch.zeros(4), "lr": 0.0, "betas": (0.0, 0.0)}
    with pytest.warns(UserWarning):
        ckpt.dcp_load(state, str(clean))
    assert torch.equal(state["w"], torch.arange(4.0)) and state["lr"] == 0.5 and tuple(state["betas"]) == (0.9, 0.95)

    # .metadata replaced by a pickle of the payload: refused before it runs
    (clean / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(ckpt.CheckpointError, match="names pathlib.Path.touch|refused"), pytest.warns(UserWarning):
        ckpt.dcp_load(state, str(clean))
    assert not marker.exists()


def test_rng_state_is_json_and_a_pickle_in_its_place_is_refused(tmp_path):
    import random

    from elastic.train.replica import _rng_state, _set_rng_state

    saved = json.loads(json.dumps(_rng_state()))
    expected = (torch.rand(3), random.random())
    _set_rng_state(saved)
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    with pytest.raises(ValueError):
        json.loads(pickle.dumps(_Payload(tmp_path / "ran")))   # a pickle is not JSON: never unpickled
    assert not (tmp_path / "ran").exists()


def test_a_new_run_refuses_another_runs_checkpoint_uri(tmp_path):
    uri = f"file://{tmp_path / 'ckpt'}"
    open_storage(uri, create=True)
    recipe = load_recipe(str(REPO / "recipes/local-tiny.yaml"), [f"checkpoint.uri={uri}"])
    fake_checkpoint(uri, tmp_path, 2, run="run-a", model_digest=ckpt.model_digest(recipe))
    base = ["launch", str(REPO / "recipes/local-tiny.yaml"), "--set", f"checkpoint.uri={uri}"]
    proc = run_cli(*base, "--run-dir", str(tmp_path / "b"))
    assert proc.returncode == 2 and "already holds checkpoints (run run-a)" in proc.stderr, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and not (tmp_path / "b").exists()
    # --resume with another model: refused too
    proc = run_cli(*base, "--set", "model.layers=3", "--run-dir", str(tmp_path / "c"), "--resume")
    assert proc.returncode == 2 and "different model" in proc.stderr, proc.stderr
    assert not (tmp_path / "c").exists()
    # the same model with --resume passes the check (the launch itself is tested in test_launch)
    ckpt.check_destination(uri, True, ckpt.model_digest(recipe), tmp_path / "d")
    # ... where run A's key can be read: from a run directory that does not see it, refused
    with pytest.raises(UserError, match="run 'run-a' has no checkpoint key"):
        ckpt.check_destination(uri, True, ckpt.model_digest(recipe), tmp_path / "elsewhere" / "d")


def test_a_corrupt_or_incomplete_newest_checkpoint_is_passed_over(tmp_path):
    uri = f"file://{tmp_path / 'ckpt'}"
    store = open_storage(uri, create=True)
    for step in (2, 4, 6):
        fake_checkpoint(uri, tmp_path, step)
    os.remove(tmp_path / "ckpt" / ckpt.step_name(6) / "__1_0.distcp")          # incomplete
    tamper_manifest(uri, 4, files=[{"name": "..", "bytes": 1, "sha256": "0" * 64}])   # malformed
    found, skipped = ckpt.candidates(store, reader_keys(uri, tmp_path))
    assert [m["step"] for m in found] == [2]
    assert len(skipped) == 2 and "step-00000006: __1_0.distcp missing" in skipped[0] and "step-00000004" in skipped[1]


@pytest.mark.parametrize("name", ["..", ".", "", "a/b", "elastic.json"])
def test_fetch_rechecks_every_name_where_it_writes(uri, tmp_path, name):
    """`fetch` refuses a name that is not a plain file name itself (`..` included), whatever the
    manifest parser let through, before anything is read or written."""
    open_storage(uri, create=True)
    manifest = fake_checkpoint(uri, tmp_path, 2)
    staging = tmp_path / "staging"
    with pytest.raises(ckpt.CheckpointError, match="leaves the staging directory"):
        ckpt.fetch(uri, {**manifest, "files": [{**manifest["files"][0], "name": name}]}, str(staging))
    assert sorted(p.name for p in staging.rglob("*")) == ["restore-step-00000002"]


def test_file_storage_refuses_names_that_leave_its_root(tmp_path):
    store = open_storage(str(tmp_path / "ckpt"), create=True)
    for name in ("../outside", "/etc/x", "step-1/../../outside", "step-1//x"):
        with pytest.raises(ValueError, match="not a relative name"):
            store.write_bytes(name, b"x")
        with pytest.raises(ValueError, match="not a relative name"):
            store.read_bytes(name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"] and not list((tmp_path / "ckpt").iterdir())


def test_a_checkpoint_directory_that_cannot_be_made_is_one_line(tmp_path):
    with pytest.raises(UserError, match="cannot make the checkpoint directory"):
        open_storage("file:///dev/null/ckpt", create=True)


def _run_layout(tmp_path, run: str) -> str:
    """A run directory `tmp_path/runs/<run>` as `elastic launch` lays it out, with one checkpoint
    of its own under `checkpoints/`; returns the checkpoints' URI."""
    uri = f"file://{tmp_path / 'runs' / run / 'checkpoints'}"
    open_storage(uri, create=True)
    fake_checkpoint(uri, tmp_path / "runs", 2, run=run)
    return uri


def test_verify_finds_the_key_of_a_renamed_or_copied_run_directory(tmp_path):
    """A run directory renamed (or copied elsewhere) keeps its key but not its name: `checkpoints
    verify` and `export`'s key lookup try the key of the run directory holding the checkpoints."""
    _run_layout(tmp_path, "run-a")
    (tmp_path / "runs" / "run-a").rename(tmp_path / "runs" / "renamed")
    moved = tmp_path / "runs" / "renamed" / "checkpoints"
    ok = run_cli("checkpoints", "verify", str(moved))
    assert ok.returncode == 0 and "authenticated" in ok.stdout, ok.stderr
    import shutil
    shutil.copytree(tmp_path / "runs" / "renamed", tmp_path / "copy" / "run-a")
    ok = run_cli("checkpoints", "verify", f"file://{tmp_path / 'copy' / 'run-a' / 'checkpoints'}")
    assert ok.returncode == 0 and "authenticated" in ok.stdout, ok.stderr
    # export's (and a restore's) lookup: by the run directory at hand
    store = open_storage(str(moved))
    assert ckpt.read_manifest(store, 2, ckpt.open_keys(str(moved), tmp_path / "runs" / "renamed"))["step"] == 2


def test_verify_finds_the_keys_of_a_resumed_run_and_names_real_paths(tmp_path):
    """Run B resumed run A at a shared checkpoint.uri: their keys are in ./runs (where `elastic
    launch` puts runs) and verify finds both; a key it cannot find is named by the paths it tried,
    never a placeholder."""
    shared = f"file://{tmp_path / 'shared'}"
    open_storage(shared, create=True)
    (tmp_path / "runs").mkdir()
    fake_checkpoint(shared, tmp_path / "runs", 2, run="run-a")
    fake_checkpoint(shared, tmp_path / "runs", 4, run="run-b")
    for step in ("2", "4"):
        ok = run_cli("checkpoints", "verify", shared, "--step", step, cwd=tmp_path)
        assert ok.returncode == 0 and f"step {step}" in ok.stdout, ok.stderr
    (tmp_path / "runs" / "run-b" / "checkpoint.key").unlink()
    bad = run_cli("checkpoints", "verify", shared, "--step", "4", cwd=tmp_path)
    assert bad.returncode == 1 and "run 'run-b' has no checkpoint key" in bad.stderr, bad.stderr
    assert "runs/run-b/checkpoint.key" in bad.stderr and "<run>" not in bad.stderr and "RUN" not in bad.stderr


def test_the_runs_staging_directory_is_gone_after_the_run(tmp_path):
    """Restores copy a checkpoint into the run's staging directory (and phase 1 writes there): the
    Checkpointer removes that directory, this run's only, when the run ends."""
    from elastic.record.ledger import Ledger

    dest = f"file://{tmp_path / 'ckpt'}"
    staging = ckpt.staging_root(str(tmp_path / "local"), "run-a", dest)
    other = Path(ckpt.staging_root(str(tmp_path / "local"), "run-b", dest))
    # A run of the same name writing elsewhere (another directory's runs/run-a) stages apart.
    namesake = Path(ckpt.staging_root(str(tmp_path / "local"), "run-a", f"file://{tmp_path / 'elsewhere'}"))
    assert namesake != Path(staging)
    for d in (Path(staging) / "restore-step-00000002", other, namesake):
        d.mkdir(parents=True)
        (d / "x").write_bytes(b"x")
    ledger = Ledger(tmp_path / "events.jsonl")
    c = ckpt.Checkpointer(dest, staging, 2, 2, ledger, run="run-a", run_dir=tmp_path / "run-a")
    c.close()
    ledger.close()
    assert not Path(staging).exists() and (other / "x").exists() and (namesake / "x").exists()
