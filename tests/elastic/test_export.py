"""`elastic export` of the built-in GPT: θ_outer of the newest complete checkpoint as safetensors."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import yaml

from elastic.checkpoint import manifest_mac, sha256_file
from elastic.models import build_model
from elastic.recipe import dump_recipe
from elastic.storage import LocalKeys
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
