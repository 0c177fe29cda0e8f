"""Models elastic trains: our GPT-style decoder, a Hugging Face causal LM via `model.hf`, or a
user's own module via `model.factory`."""

from __future__ import annotations

import importlib

from torch import nn

from elastic.models.gpt import GPT, GPTConfig


def build_model(section) -> nn.Module:
    """Build the model a recipe's `model` section describes (on the current default device)."""
    if section.hf:
        from elastic.models.hf import build_hf
        return build_hf(section)
    if section.factory:
        mod, _, fn = section.factory.partition(":")
        model = getattr(importlib.import_module(mod), fn)(section.model_dump())
        if not isinstance(model, nn.Module):
            raise TypeError(f"model.factory {section.factory} returned {type(model).__name__}, not an nn.Module")
        return model
    return GPT(GPTConfig(layers=section.layers, width=section.width, heads=section.heads,
                         context=section.context, vocab_size=section.vocab_size, mlp_ratio=section.mlp_ratio))


def shard_units(model: nn.Module) -> list[nn.Module]:
    """Submodules FSDP2 wraps one by one (then the root): the model's repeated blocks, found
    generically as the `nn.ModuleList` of same-class modules holding the most parameters (our
    GPT's `blocks`, a Llama's or Qwen's `model.layers`), else none (the root alone is sharded)."""
    best, best_numel = [], 0
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) and len({type(b) for b in m}) == 1:
            numel = sum(p.numel() for p in m.parameters())
            if numel > best_numel:
                best, best_numel = list(m), numel
    return best


def wrap_blocks(model: nn.Module, compile: bool, checkpoint: bool) -> int:
    """Per repeated block (`shard_units`), in place: with `checkpoint`, recompute its activations
    in the backward pass (torch.utils.checkpoint, non-reentrant); with `compile`, compile its
    `forward` (`torch.compile`). Only `forward` is replaced: the parameter names stay (state dicts
    and checkpoints are the eager model's), and FSDP2's per-block hooks run outside the compiled
    graph. Compiling block by block, not the whole model, keeps graphs small (one per block
    shape). Returns the blocks wrapped."""
    import torch

    blocks = shard_units(model) if compile or checkpoint else []
    for block in blocks:
        if checkpoint:
            block.forward = _checkpointed(block.forward)
        if compile:
            block.forward = torch.compile(block.forward)
    return len(blocks)


def _checkpointed(forward):
    """`forward` whose activations are recomputed in the backward pass instead of kept."""
    from torch.utils.checkpoint import checkpoint

    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return run


__all__ = ["GPT", "GPTConfig", "build_model", "shard_units", "wrap_blocks"]
