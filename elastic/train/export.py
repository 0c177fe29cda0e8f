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
import shutil
import tempfile
import warnings
from pathlib import Path

import yaml

from elastic.errors import UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "generation_config.json")


def load_theta(recipe, uri: str, run_dir: Path, step: int | None = None):
    """The model of `recipe` on the CPU holding θ_outer of checkpoint `step` (default: the newest
    complete one) at `uri`, its manifest authenticated by the key of the run that wrote it (see
    `elastic.storage.stores.open_keys`; `run_dir` the run's directory). Returns (model, step)."""
    import torch

    from elastic.storage import checkpoint as ckpt
    from elastic.models import build_model
    from elastic.storage.stores import open_keys, open_storage

    storage = open_storage(uri)
    step = ckpt.complete_step(storage, step)
    # The weights come from the checkpoint: build the architecture only, never download weights.
    section = recipe.model.model_copy(update={"init": "scratch"})
    with torch.device("cpu"):
        model = build_model(section)
    with tempfile.TemporaryDirectory(prefix="elastic-export-") as staging, warnings.catch_warnings():
        # No process group on purpose: DCP reads every shard here (and warns that it assumes so).
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            manifest = ckpt.read_manifest(storage, step, open_keys(uri, run_dir))
        except ckpt.CheckpointError as exc:
            raise UserError(f"{uri}: {exc}") from None
        local = ckpt.fetch(uri, manifest, staging)
        state = {"model": model.state_dict()}
        ckpt.dcp_load(state, local)   # no pickle from storage beyond DCP's own record types
    model.load_state_dict(state["model"])
    return model.eval(), step


def export(run_dir: Path, to: Path, step: int | None = None) -> dict:
    """Write θ_outer of the run at `run_dir` to the directory `to`. Returns what was written."""
    from elastic.storage import checkpoint as ckpt
    from elastic.recipe.model import Recipe

    recipe_file = run_dir / "recipe.yaml"
    if not recipe_file.is_file():
        raise UserError(f"{run_dir}: no recipe.yaml (not a run directory)")
    recipe = Recipe.model_validate(yaml.safe_load(recipe_file.read_text(encoding="utf-8")))
    uri = ckpt.destination(recipe.checkpoint.uri, run_dir)
    model, step = load_theta(recipe, uri, run_dir, step)
    to.mkdir(parents=True, exist_ok=True)
    if recipe.model.hf is not None:
        from elastic.models.hf import local_dir

        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        model.hf.save_pretrained(str(to))
        src = Path(local_dir(recipe.model.hf, weights=False))
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, to / name)
        kind = "hf"
    else:
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise UserError("export needs safetensors: pip install 'elastic[hf]'") from None

        if recipe.model.factory is None:
            m = recipe.model
            config = {"elastic_model": "gpt", "layers": m.layers, "width": m.width, "heads": m.heads,
                      "context": m.context, "vocab_size": m.vocab_size, "mlp_ratio": m.mlp_ratio}
        else:
            config = {"elastic_model": recipe.model.factory, **recipe.model.model_dump(mode="json")}
        (to / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(to / "model.safetensors"))
        kind = "safetensors"
    return {"step": step, "uri": uri, "to": str(to), "format": kind,
            "params": sum(p.numel() for p in model.parameters())}
