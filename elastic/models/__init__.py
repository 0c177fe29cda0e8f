"""Models elastic trains: our GPT-style decoder, or a user's own module via `model.factory`."""

from __future__ import annotations

import importlib

from torch import nn

from elastic.models.gpt import GPT, GPTConfig


def build_model(section) -> nn.Module:
    """Build the model a recipe's `model` section describes (on the current default device)."""
    if section.factory:
        mod, _, fn = section.factory.partition(":")
        model = getattr(importlib.import_module(mod), fn)(section.model_dump())
        if not isinstance(model, nn.Module):
            raise TypeError(f"model.factory {section.factory} returned {type(model).__name__}, not an nn.Module")
        return model
    return GPT(GPTConfig(layers=section.layers, width=section.width, heads=section.heads,
                         context=section.context, vocab_size=section.vocab_size, mlp_ratio=section.mlp_ratio))


def shard_units(model: nn.Module) -> list[nn.Module]:
    """Submodules FSDP2 wraps one by one (then the root): the transformer blocks when the model has
    them (`model.blocks`), else none (the root alone is sharded)."""
    blocks = getattr(model, "blocks", None)
    return list(blocks) if isinstance(blocks, nn.ModuleList) else []


__all__ = ["GPT", "GPTConfig", "build_model", "shard_units"]
