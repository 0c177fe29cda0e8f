"""One rank of one replica: a Ray actor that owns a shard of the model.

The ranks of a replica form an FSDP2 group (gloo on CPU; NCCL with bf16 mixed precision on
CUDA). The driver calls, per outer step: `inner_phase` (H AdamW steps on leased samples, then Δ is
formed), then `outer_sync` (average Δ over the live replicas, outer Nesterov step). The train loop
reads top to bottom in `inner_phase`.

This module is imported inside Ray worker processes; the driver only names `RankWorker`.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass
class RankSpec:
    """What a rank needs to start.

    Args:
        recipe: the resolved recipe, as a JSON-able dict.
        replica_id: the replica this rank belongs to (unique for the run, never reused).
        rank: this rank's index inside its replica.
        ranks: ranks per replica.
        store_host: host of the driver's TCPStore.
        store_port: port of the driver's TCPStore.
        total_inner_steps: inner steps the LR schedule spans.
    """

    recipe: dict
    replica_id: int
    rank: int
    ranks: int
    store_host: str
    store_port: int
    total_inner_steps: int


def lr_at(step: int, peak: float, warmup: int, total: int) -> float:
    """Inner LR at inner step `step` (0-based): linear warmup, then cosine decay to 10% of peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    span = max(1, total - warmup)
    frac = min(1.0, (step - warmup) / span)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


class RankWorker:
    """Ray actor body for one rank (wrapped with `ray.remote` by the world)."""

    def __init__(self, spec: RankSpec):
        self._spec = spec
        self._ready = False

    # -- lifecycle -------------------------------------------------------------------------------

    def setup(self) -> dict:
        """Join the replica's process group, build and shard the model, build both optimizers."""
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from elastic.data import SampleStream, load_tokens
        from elastic.diloco import OuterState
        from elastic.models import build_model, shard_units
        from elastic.recipe import Recipe

        t0 = time.monotonic()
        spec = self._spec
        recipe = Recipe.model_validate(spec.recipe)
        self._recipe = recipe
        cuda = torch.cuda.is_available()
        self._device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        if not cuda:
            torch.set_num_threads(recipe.world.cpu_threads_per_rank)

        timeout = datetime.timedelta(seconds=recipe.world.step_timeout_s)
        self._store = dist.TCPStore(spec.store_host, spec.store_port, is_master=False, timeout=timeout)
        replica_store = dist.PrefixStore(f"replica/{spec.replica_id}", self._store)
        backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
        dist.init_process_group(backend, store=replica_store, rank=spec.rank, world_size=spec.ranks,
                                timeout=timeout)
        mesh = init_device_mesh(self._device.type, (spec.ranks,))

        # Same seed on every replica: every replica starts from the same θ.
        torch.manual_seed(recipe.train.seed)
        with torch.device(self._device):
            model = build_model(recipe.model)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else MixedPrecisionPolicy()
        if spec.ranks > 1 or cuda:
            for unit in shard_units(model):
                fully_shard(unit, mesh=mesh, mp_policy=mp)
            fully_shard(model, mesh=mesh, mp_policy=mp)
        # else: one CPU rank has nothing to shard, and FSDP2's per-module hooks and DTensor
        # bookkeeping cost ~10% of a small model's step (bench/overhead.py). Plain parameters
        # save and load through DCP the same way (as full tensors, resharded on load).
        self._model = model
        self._params = list(model.parameters())
        t = recipe.train
        decay = [p for p in self._params if p.dim() >= 2]
        no_decay = [p for p in self._params if p.dim() < 2]
        self._opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": t.inner_weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=t.inner_lr, betas=t.inner_betas, foreach=True)
        sync_dtype = torch.bfloat16 if recipe.world.sync_dtype == "bfloat16" else torch.float32
        self._outer = OuterState(self._params, t.outer_lr, t.outer_momentum, t.outer_nesterov, sync_dtype)

        self._data = SampleStream(load_tokens(recipe.data.path, recipe.data.corpus_bytes), t.seq_len, t.seed)
        self._per_rank = t.batch_size // spec.ranks
        self._batch = torch.empty(self._per_rank, t.seq_len + 1, dtype=torch.int64)
        self._losses = torch.zeros(t.inner_steps, dtype=torch.float32, device=self._device)
        self._inner_step = 0
        self._ready = True
        return {"replica": spec.replica_id, "rank": spec.rank, "pid": os.getpid(), "device": str(self._device),
                "params": sum(p.numel() for p in self._params), "local_numel": self._outer.numel,
                "setup_s": time.monotonic() - t0}

    # -- training --------------------------------------------------------------------------------

    def inner_phase(self, lease_start: int, inner_step: int) -> dict:
        """H inner AdamW steps on samples `lease_start ..` (this rank takes its slice of each batch).

        `inner_step` is the global inner step count at the start (drives the LR schedule). Ends by
        forming the pseudo-gradient. Returns per-step losses of this rank, tokens and seconds.
        """
        import torch
        import torch.nn.functional as F

        t0 = time.monotonic()
        spec, t = self._spec, self._recipe.train
        model, opt, batch, losses = self._model, self._opt, self._batch, self._losses
        vocab = self._recipe.model.vocab_size
        for h in range(t.inner_steps):
            lr = lr_at(inner_step + h, t.inner_lr, t.warmup_steps, spec.total_inner_steps)
            for group in opt.param_groups:
                group["lr"] = lr
            first = lease_start + h * t.batch_size + spec.rank * self._per_rank
            self._data.batch(first, self._per_rank, out=batch)
            tokens = batch.to(self._device, non_blocking=True)
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, vocab).float(), tokens[:, 1:].reshape(-1))
            loss.backward()
            if t.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(self._params, t.grad_clip, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[h] = loss.detach()
        self._outer.form_pseudo_gradient()
        self._inner_step = inner_step + t.inner_steps
        return {"losses": losses.tolist(), "tokens": t.inner_steps * self._per_rank * t.seq_len,
                "seconds": time.monotonic() - t0}

    def outer_sync(self, epoch: int, index: int, size: int) -> dict:
        """Average Δ over the `size` replicas of membership `epoch` (this replica is `index`) and
        take the outer step."""
        t0 = time.monotonic()
        if size > 1:
            self._outer.join_group(self._store, epoch, index, size, self._recipe.world.step_timeout_s,
                                   shard=self._spec.rank)
        self._outer.sync_and_step(size)
        return {"seconds": time.monotonic() - t0, "bytes": self._outer.bytes_per_sync if size > 1 else 0}

    # -- inspection and state -------------------------------------------------------------------

    def full_state(self) -> dict | None:
        """Full (unsharded) parameters, on rank 0 only (a collective: call on every rank)."""
        out = {}
        for name, p in self._model.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name] = full.detach().cpu().clone()
        return out if self._spec.rank == 0 else None

    def param_placements(self) -> dict:
        """Per parameter: its type, global shape and this rank's local shape (proves sharding)."""
        return {name: {"type": type(p).__name__, "shape": tuple(p.shape),
                       "local_shape": tuple(p.to_local().shape) if hasattr(p, "to_local") else tuple(p.shape)}
                for name, p in self._model.named_parameters()}

    def save_checkpoint(self, path: str) -> dict:
        """Write this replica's model, inner optimizer and outer momentum with torch.distributed.checkpoint
        (a collective over the replica's ranks). Call after an outer sync, when θ_local = θ_outer."""
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.tensor import DTensor

        t0 = time.monotonic()
        model_sd, optim_sd = get_state_dict(self._model, self._opt)
        momentum = self._outer.momentum()
        outer = {}
        if momentum is not None:
            for (name, p), view in zip(self._model.named_parameters(), self._outer.shard_views(momentum)):
                if isinstance(p, DTensor):
                    outer[name] = DTensor.from_local(view.to(p.device), p.device_mesh, p.placements,
                                                     shape=p.shape, stride=p.stride(), run_check=False)
                else:
                    outer[name] = view
        state = {"model": model_sd, "optim": optim_sd, "outer_momentum": outer,
                 "inner_step": torch.tensor(self._inner_step)}
        dcp.save(state, checkpoint_id=path)
        return {"seconds": time.monotonic() - t0}

    def ping(self) -> bool:
        return self._ready
