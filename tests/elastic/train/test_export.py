"""`elastic export` of the built-in GPT: θ_outer of the newest complete checkpoint as safetensors."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import yaml

from elastic.models import build_model
from elastic.recipe.model import dump_recipe
from elastic.storage.checkpoint import manifest_mac, sha256_file
from elastic.storage.stores import LocalKeys
from tests.conftest import run_cli, tiny_recipe

safetensors = pytest.importorskip("safetensors.torch", reason="the hf extra is not installed")


def save_checkpoint(run_dir, recipe, step: int, seed: int) -> dict:
    """A checkpoint as the lead replica writes one (DCP shards of the model's state, and more),
    with its manifest, signed with the run's key; returns the model state saved."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(seed)
    model = build_model(recipe.model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    d = run_dir / "checkpoints" / f"step-{step:08d}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict(), "inner_step": torch.tensor(4 * step)},
                 storage_writer=dcp.FileSystemWriter(str(d)))
    files = [{"name": p.name, "bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in d.iterdir()]
    manifest = {"step": step, "inner_step": 4 * step, "data_cursor": 0, "tokens": 0, "ranks": 1, "replicas": 1,
                "saved_at": 0, "files": files, "run": run_dir.name}
    # Signed with the run's key, as the run's driver signs it (the key in the run directory).
    manifest["hmac"] = manifest_mac(manifest, LocalKeys([run_dir.parent]).create(run_dir.name))
    (d / "elastic.json").write_text(json.dumps(manifest))
    return state


def test_export_gpt_writes_the_newest_theta_as_safetensors(tmp_path):
    recipe = tiny_recipe()
    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text(dump_recipe(recipe))
    save_checkpoint(run, recipe, 1, seed=1)
    newest = save_checkpoint(run, recipe, 2, seed=2)
    out = run_cli("export", str(run), "--to", str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr
    assert "exported step 2" in out.stdout
    exported = safetensors.load_file(tmp_path / "out" / "model.safetensors")
    assert exported.keys() == newest.keys()
    assert all(torch.equal(exported[k], newest[k]) for k in newest)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["elastic_model"] == "gpt" and config["width"] == recipe.model.width


def test_export_without_a_checkpoint_is_one_line(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "recipe.yaml").write_text(yaml.safe_dump({"name": "x"}))
    out = run_cli("export", str(run), "--to", str(tmp_path / "out"))
    assert out.returncode == 2 and "no complete checkpoint" in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def _run_with_two_checkpoints(tmp_path):
    recipe = tiny_recipe()
    run = tmp_path / "run"
    run.mkdir(parents=True)
    (run / "recipe.yaml").write_text(dump_recipe(recipe))
    older = save_checkpoint(run, recipe, 1, seed=1)
    save_checkpoint(run, recipe, 2, seed=2)
    return run, older


def test_export_falls_back_from_a_corrupt_newest_checkpoint_as_resume_does(tmp_path):
    run, older = _run_with_two_checkpoints(tmp_path)
    shard = next((run / "checkpoints" / "step-00000002").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF   # same size, another sha256: found only when the file is hashed
    shard.write_bytes(bytes(data))
    out = run_cli("export", str(run), "--to", str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr
    assert "exported step 1" in out.stdout and "passed over: step-00000002" in out.stdout, out.stdout
    exported = safetensors.load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(exported[k], older[k]) for k in older)
    # asked for by number, it is not replaced by another: one line, exit 2, no --to left behind
    out = run_cli("export", str(run), "--step", "2", "--to", str(tmp_path / "out2"))
    assert out.returncode == 2 and "does not match its manifest" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and not (tmp_path / "out2").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run"]   # no partial directory either


def test_a_failed_export_leaves_no_to_directory_and_a_used_one_is_refused(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "recipe.yaml").write_text(yaml.safe_dump({"name": "x"}))
    out = run_cli("export", str(run), "--to", str(tmp_path / "new" / "out"))
    assert out.returncode == 2 and not (tmp_path / "new").exists(), out.stderr
    run, _ = _run_with_two_checkpoints(tmp_path / "b")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "mine.txt").write_text("the user's own file")
    out = run_cli("export", str(run), "--to", str(tmp_path / "used"))
    assert out.returncode == 2 and "not an empty directory" in out.stderr, out.stderr
    assert [p.name for p in (tmp_path / "used").iterdir()] == ["mine.txt"]
    (tmp_path / "empty").mkdir()
    out = run_cli("export", str(run), "--to", str(tmp_path / "empty"))
    assert out.returncode == 0 and (tmp_path / "empty" / "model.safetensors").is_file(), out.stderr


def test_export_says_it_needs_the_hf_extra_before_reading_anything(tmp_path):
    """Without safetensors (the hf extra): one line naming the extra, before any checkpoint is read
    (this run has none) or any directory made; a `safetensors` that cannot be imported stands in
    for a base install."""
    import os

    from tests.conftest import cli_env

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "recipe.yaml").write_text(yaml.safe_dump({"name": "x"}))
    shadow = tmp_path / "shadow"
    (shadow / "safetensors").mkdir(parents=True)
    (shadow / "safetensors" / "__init__.py").write_text("raise ImportError('not installed')\n")
    env = cli_env()
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(shadow)])
    out = run_cli("export", str(run), "--to", str(tmp_path / "out"), env=env)
    assert out.returncode == 2 and "elastic[hf]" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
