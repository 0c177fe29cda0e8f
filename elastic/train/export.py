"""`elastic export RUN --to DIR`: the run's final θ_outer as files other tools load.

θ_outer is the model state of the run's newest complete checkpoint (a checkpoint is taken after
an outer step, when every replica's model holds θ_outer, and always after the last one). A
Hugging Face model (`model.hf`) is written with `save_pretrained` (config.json +
model.safetensors, and the source's tokenizer files when it has them), loadable with
`AutoModelForCausalLM.from_pretrained(DIR)`; the built-in GPT as `model.safetensors` plus a
`config.json` of its shape.
"""

from __future__ import annotations

import json
import pickle
import shutil
import tempfile
import warnings
from pathlib import Path

import yaml

from elastic.errors import UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "generation_config.json")


def load_theta(recipe, uri: str, run_dir: Path, step: int | None = None, skipped: list[str] | None = None):
    """The model of `recipe` on the CPU holding θ_outer of checkpoint `step` at `uri`, its manifest
    authenticated by the key of the run that wrote it (see `elastic.storage.stores.open_keys`; `run_dir`
    the run's directory). Without `step`: the newest checkpoint that authenticates, is complete and
    loads, as `--resume` picks one; each one passed over is appended to `skipped` (one line).
    Returns (model, step)."""
    from elastic.storage import checkpoint as ckpt
    from elastic.storage.stores import open_keys, open_storage

    storage = open_storage(uri)
    try:
        keys = open_keys(uri, run_dir)
        if step is not None:
            step = ckpt.complete_step(storage, step)
            try:
                manifests = [ckpt.read_manifest(storage, step, keys)]
            except ckpt.CheckpointError as exc:
                raise UserError(f"{uri}: {exc}") from None
        else:
            ckpt.complete_step(storage)   # "no complete checkpoint" when there is none at all
            manifests, passed = ckpt.candidates(storage, keys)
            if skipped is not None:
                skipped += passed
            if not manifests:
                raise UserError(f"{uri}: no usable checkpoint ({passed[0] if passed else 'none complete'})")
    finally:
        storage.close()
    for i, manifest in enumerate(manifests):
        try:
            return _load(recipe, uri, manifest), manifest["step"]
        except ckpt.CheckpointError as exc:
            if step is not None or i == len(manifests) - 1:
                raise UserError(f"{uri}: {exc}") from None
            if skipped is not None:
                skipped.append(f"{ckpt.step_name(manifest['step'])}: {exc}")
    raise AssertionError("unreachable")


def _load(recipe, uri: str, manifest: dict):
    """The model of `recipe` holding the checkpoint `manifest` describes (CheckpointError, one line,
    when a file is missing, altered or unreadable)."""
    import torch

    from elastic.models import build_model
    from elastic.storage import checkpoint as ckpt

    # The weights come from the checkpoint: build the architecture only, never download weights.
    section = recipe.model.model_copy(update={"init": "scratch"})
    with torch.device("cpu"):
        model = build_model(section)
    with tempfile.TemporaryDirectory(prefix="elastic-export-") as staging, warnings.catch_warnings():
        # No process group on purpose: DCP reads every shard here (and warns that it assumes so).
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        local = ckpt.fetch(uri, manifest, staging)
        state = {"model": model.state_dict()}
        try:
            ckpt.dcp_load(state, local)   # no pickle from storage beyond DCP's own record types
        except (OSError, EOFError, pickle.UnpicklingError) as exc:
            raise ckpt.CheckpointError(f"{ckpt.step_name(manifest['step'])}: unreadable ({type(exc).__name__})") from None
    model.load_state_dict(state["model"])
    return model.eval()


def _needs(recipe) -> None:
    """UserError (one line) before anything is read or written when the writer the export needs is
    not installed: transformers for `model.hf`, safetensors otherwise (both in the `hf` extra)."""
    try:
        import safetensors.torch  # noqa: F401
        if recipe.model.hf is not None:
            import transformers  # noqa: F401
    except ImportError as exc:
        raise UserError(f"export needs the hf extra ({exc.name or 'safetensors'} is not installed): "
                        "pip install 'elastic[hf]'") from None


def export(run_dir: Path, to: Path, step: int | None = None) -> dict:
    """Write θ_outer of the run at `run_dir` to the directory `to` (new, or empty): written into a
    directory beside it and renamed into place at the end, so a failed export leaves no `to`
    behind. Returns what was written, and `skipped`: a line per newer checkpoint passed over."""
    from elastic.recipe.model import Recipe
    from elastic.storage import checkpoint as ckpt

    recipe_file = run_dir / "recipe.yaml"
    if not recipe_file.is_file():
        raise UserError(f"{run_dir}: no recipe.yaml (not a run directory)")
    recipe = Recipe.model_validate(yaml.safe_load(recipe_file.read_text(encoding="utf-8")))
    _needs(recipe)
    if to.exists() and (not to.is_dir() or any(to.iterdir())):
        raise UserError(f"--to {to}: exists and is not an empty directory; choose a new one")
    uri = ckpt.destination(recipe.checkpoint.uri, run_dir)
    skipped: list[str] = []
    model, step = load_theta(recipe, uri, run_dir, step, skipped)
    to.parent.mkdir(parents=True, exist_ok=True)
    part = Path(tempfile.mkdtemp(prefix=f".{to.name}.", suffix=".part", dir=to.parent))
    try:
        kind = _write(recipe, model, part)
        if to.exists():
            to.rmdir()   # empty (checked above)
        part.rename(to)
    except BaseException:
        shutil.rmtree(part, ignore_errors=True)
        raise
    return {"step": step, "uri": uri, "to": str(to), "format": kind, "skipped": skipped,
            "params": sum(p.numel() for p in model.parameters())}


def _write(recipe, model, to: Path) -> str:
    """Write `model` to the directory `to`; returns the format (`hf` or `safetensors`)."""
    if recipe.model.hf is not None:
        from elastic.models.hf import local_dir

        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        model.hf.save_pretrained(str(to))
        src = Path(local_dir(recipe.model.hf, weights=False))
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, to / name)
        return "hf"
    from safetensors.torch import save_file

    if recipe.model.factory is None:
        m = recipe.model
        config = {"elastic_model": "gpt", "layers": m.layers, "width": m.width, "heads": m.heads,
                  "context": m.context, "vocab_size": m.vocab_size, "mlp_ratio": m.mlp_ratio}
    else:
        config = {"elastic_model": recipe.model.factory, **recipe.model.model_dump(mode="json")}
    (to / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(to / "model.safetensors"))
    return "safetensors"
