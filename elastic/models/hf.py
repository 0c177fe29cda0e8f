"""Hugging Face causal LMs (`model.hf`): built from their config (scratch) or their safetensors
weights (pretrained), from a hub name, a local directory, or a directory in object storage.

Needs the `hf` extra; nothing here is imported unless a recipe names `model.hf`.
"""

from __future__ import annotations

import functools
import hashlib
import re
from pathlib import Path

from torch import nn

from elastic.errors import UserError, first_line

EXTRA = "model.hf needs the hf extra: pip install 'elastic[hf]'"


def _transformers():
    try:
        import transformers
    except ImportError:
        raise UserError(EXTRA) from None
    return transformers


def local_dir(name: str, weights: bool) -> str:
    """A hub name or local directory as it is; an `s3://`/`gs://`/`file://` directory downloaded
    (once per node) into the cache: `config.json` and, with `weights`, everything else."""
    if "://" not in name:
        return str(Path(name).expanduser()) if Path(name).expanduser().exists() else name
    from elastic.cache import cache_dir
    from elastic.storage.stores import FileStorage, open_storage

    storage = open_storage(name)
    if isinstance(storage, FileStorage):
        return str(storage.root)
    dest = cache_dir() / "models" / hashlib.sha256(name.rstrip("/").encode()).hexdigest()[:16]
    dest.mkdir(parents=True, exist_ok=True)
    files = storage.list()
    if "config.json" not in files:
        raise UserError(f"{name}: no config.json (not a Hugging Face model directory)")
    for rel, size in files.items():
        if "/" in rel or (not weights and rel != "config.json"):
            continue
        target = dest / rel
        if not (target.exists() and target.stat().st_size == size):
            storage.read_file(rel, target)
    return str(dest)


HUB_PROBE_TIMEOUT_S = 3.0


@functools.lru_cache(maxsize=None)
def hub_offline() -> str | None:
    """Why the Hugging Face hub cannot be reached from here (`HF_HUB_OFFLINE` set, or no TCP
    connection to `HF_ENDPOINT`, default huggingface.co, within HUB_PROBE_TIMEOUT_S), or None.
    Asked once per process: transformers would otherwise retry each file for half a minute."""
    import os
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=HUB_PROBE_TIMEOUT_S).close()
    except OSError as exc:
        return f"{host}:{port} is unreachable ({exc.strerror or type(exc).__name__})"
    return None


def _hub_kwargs(name: str, path: str) -> dict:
    """`from_pretrained` arguments for `path` (what `local_dir` made of `name`): a hub name while
    the hub is unreachable is read from the local cache only (UserError, one line, when it is not
    there), at once rather than after transformers' retries."""
    hub_name = re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_.-]+)?", name) is not None
    if path != name or not hub_name or Path(path).exists() or (why := hub_offline()) is None:
        return {}
    from huggingface_hub import try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(name, "config.json"), str):
        raise UserError(f"model.hf: {name}: offline ({why}) and not in the local Hugging Face cache "
                        "(download it once online, or name a local directory)")
    return {"local_files_only": True}


def hf_config(name: str):
    """The model's config (UserError, one line, when it does not resolve)."""
    transformers = _transformers()
    path = local_dir(name, weights=False)
    kwargs = _hub_kwargs(name, path)
    try:
        return transformers.AutoConfig.from_pretrained(path, **kwargs)
    except UserError:
        raise
    except Exception as exc:   # hub errors, bad JSON, unknown model type: the user's to fix
        raise UserError(f"model.hf: {name} does not resolve to a causal LM config: {first_line(exc)}") from None


class HFCausalLM(nn.Module):
    """A transformers causal LM whose `forward(tokens)` gives bare logits, as elastic's loop wants.

    Args:
        hf: the `PreTrainedModel` (its tied weights stay tied: they are one parameter).
    """

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf

    def forward(self, tokens):
        return self.hf(input_ids=tokens, use_cache=False).logits


def build_hf(section) -> HFCausalLM:
    """The recipe's HF model, in float32 on the current default device: `init: scratch` from the
    config with the current (seeded) RNG, `pretrained` from the safetensors weights."""
    transformers = _transformers()
    path = local_dir(section.hf, weights=section.init == "pretrained")
    if section.init == "pretrained":
        import torch
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                  **_hub_kwargs(section.hf, path))
    else:
        model = transformers.AutoModelForCausalLM.from_config(hf_config(section.hf))
    return HFCausalLM(model)
