"""One rank of one replica: a Ray actor that owns a shard of the model.

The ranks of a replica form an FSDP2 group (gloo on CPU; NCCL with bf16 mixed precision on
CUDA). The driver calls, per outer step: `inner_phase` (H AdamW steps on leased samples, then Δ is
formed), then `outer_sync` (average Δ over the live replicas, outer Nesterov step). The train loop
reads top to bottom in `inner_phase`.

This module is imported inside Ray worker processes; the driver only names `RankWorker`.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0   # a rank's heartbeat period; world.stall_timeout_s is many of these


def heartbeat_key(replica_id: int, rank: int) -> str:
    """Key of a rank's heartbeat in the driver's store: "BEAT WORK BYTES STATE". BEAT counts up
    every HEARTBEAT_S (the heartbeat thread is alive); WORK counts the inner steps, micro-batches,
    sync stages and copied chunks the rank has done and BYTES the shard bytes it has downloaded
    (either moves while the rank makes progress); STATE says which progress the driver expects:

    - `run`: in an inner phase, working on its own (fetching its lease, training): WORK or BYTES
      moves within `world.stall_timeout_s`;
    - `warm`: in its first inner step since setup (compiling, warming up), which has no progress of
      its own: WORK moves within `world.step_timeout_s` (or stall_timeout_s, if longer);
    - `wait`: waiting on other replicas (an outer sync, a streamed fragment's apply point, a state
      copy), or between calls: only BEAT must move.
    """
    return f"hb/{replica_id}/{rank}"


def fragment_key(epoch: int, inner_step: int, shard: int) -> str:
    """Prefix of the decision keys of an inner phase's streamed fragment syncs in the driver's
    store (`elastic.train.diloco.Fragments`): the phase's membership epoch, its first global inner step,
    the rank (shard) whose outer group decides."""
    return f"frag/{epoch}/{inner_step}/{shard}"


class Resolved:
    """The resolved recipe the driver sends its ranks, read by attribute as the `Recipe` it was
    dumped from: `recipe.train.seed`, `recipe.model.model_dump()`. The driver validated it; a rank
    does not import the recipe's pydantic model again (building its classes and validating took
    0.2-0.3 s of CPU in every rank's setup, on the way to the first step). A section's fields are
    its JSON values, sequences as tuples (`train.inner_betas`)."""

    def __init__(self, fields: dict, section: bool = False):
        self._fields, self._section = fields, section

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            value = self._fields[name]
        except KeyError:
            raise AttributeError(f"the recipe{' section' if self._section else ''} has no field {name!r}") from None
        if isinstance(value, dict) and not self._section:
            return Resolved(value, section=True)
        return tuple(value) if isinstance(value, list) else value

    def model_dump(self, mode: str = "python") -> dict:
        import copy

        return copy.deepcopy(self._fields)


@dataclass
class RankSpec:
    """What a rank needs to start.

    Args:
        recipe: the resolved recipe, as a JSON-able dict (`Recipe.model_dump(mode="json")`).
        replica_id: the replica this rank belongs to (unique for the run, never reused).
        rank: this rank's index inside its replica.
        ranks: ranks per replica.
        store_host: host of the driver's TCPStore.
        store_port: port of the driver's TCPStore.
        schedule: the inner learning-rate schedule (the same for every rank of the run).
    """

    recipe: dict
    replica_id: int
    rank: int
    ranks: int
    store_host: str
    store_port: int
    schedule: "Schedule"


@dataclass(frozen=True)
class Schedule:
    """The inner learning rate as a function of the tokens the world has trained: linear warm-up
    over `warmup_tokens`, then cosine decay to 10% of the peak at `total_tokens`. Tokens, not
    inner steps: a world that grows or shrinks reaches the end of warm-up and of the decay at the
    same token counts, and every replica computes the same rate for the same count.

    Args:
        peak_lr: the rate at the end of warm-up.
        warmup_tokens: tokens the warm-up spans.
        total_tokens: tokens the whole schedule spans (`train.token_budget`, or what
            `train.outer_steps` implies for `world.replicas` replicas).
    """

    peak_lr: float
    warmup_tokens: int
    total_tokens: int

    @classmethod
    def for_recipe(cls, recipe) -> "Schedule":
        """`train.warmup_steps` inner steps of a world of `world.replicas` replicas, in tokens."""
        t = recipe.train
        step_tokens = recipe.world.replicas * t.batch_size * t.seq_len
        total = t.token_budget if t.token_budget is not None else t.outer_steps * t.inner_steps * step_tokens
        return cls(t.inner_lr, t.warmup_steps * step_tokens, total)

    def lr(self, tokens: int, step_tokens: int) -> float:
        """Rate of an inner step the world starts with `tokens` trained and that trains
        `step_tokens` (all replicas together). Warm-up counts the step's own tokens, so the first
        step's rate is not 0."""
        if tokens < self.warmup_tokens:
            return self.peak_lr * min(1.0, (tokens + step_tokens) / self.warmup_tokens)
        span = max(1, self.total_tokens - self.warmup_tokens)
        frac = min(1.0, (tokens - self.warmup_tokens) / span)
        return self.peak_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


# How this process's pinned host memory (the checkpoint's snapshot buffers, the batches' staging)
# is allocated: plain pages touched by 8 threads, then registered with CUDA, instead of one
# single-threaded `cudaHostAlloc` per buffer (bench/gpu_host_memory.py measures both).
PINNED_BY_REGISTERING = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"


def _pin_host_memory_by_registering() -> None:
    """Set `PINNED_BY_REGISTERING` for this process, unless PYTORCH_CUDA_ALLOC_CONF already says how
    to pin. Before CUDA is first used: torch reads the setting once."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "pinned_" not in conf:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(filter(None, [conf, PINNED_BY_REGISTERING]))


def rank_device():
    """The device this rank trains on: the one GPU Ray assigned it, made current, or the CPU when
    Ray assigned none (a CPU node). Ray names the assigned GPU in CUDA_VISIBLE_DEVICES, so this
    process sees it alone, as cuda:0; where Ray was told not to set it, the id is the index.
    Raises when Ray assigned a GPU that torch cannot use (a CPU-only torch on a GPU node), except
    on the VM lab's machines (`ELASTIC_LAB_GPU_IS_CPU=1`, set by providers/lab/machine.py), whose
    "GPUs" are this host's CPU."""
    import ray
    import torch

    if not ray.is_initialized():   # a rank outside Ray (bench/gpu_smoke.py's reference): its own view
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    ids = [str(i) for i in ray.get_gpu_ids()]
    if not ids:
        return torch.device("cpu")
    if len(ids) != 1:
        raise RuntimeError(f"a rank takes one GPU; Ray assigned {ids}")
    if not torch.cuda.is_available() and os.environ.get("ELASTIC_LAB_GPU_IS_CPU") == "1":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"Ray assigned GPU {ids[0]} to this rank but torch sees no CUDA device "
                           f"(torch {torch.__version__}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    index = visible.index(ids[0]) if ids[0] in visible else int(ids[0])
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _like_param(p, local):
    """`local` (this rank's shard of something shaped like parameter `p`) laid out as `p` is: a
    DTensor on the same mesh and placements under FSDP2, else a plain tensor on p's device."""
    if _is_dtensor(p):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local.to(p.device), p.device_mesh, p.placements, shape=p.shape,
                                  stride=p.stride(), run_check=False)
    return local.to(p.device)


def _is_dtensor(x) -> bool:
    """Whether `x` is a DTensor, without importing torch.distributed.tensor (~1.5 s of a rank's
    setup on 2 cores) where none can exist: a DTensor exists only once that module is loaded (FSDP2,
    a checkpoint load)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(x, module.DTensor)


_CHECKPOINT_IMPORTS = threading.Lock()


def _checkpoint_modules() -> None:
    """Import torch.distributed.checkpoint's modules (the save's, the load's, the stager's), one
    thread at a time. Two threads importing that graph at once (the warm-up below and a
    `load_checkpoint` right after the setup) can each hold a module the other waits for: Python
    then raises `_DeadlockError` in one of them (seen: a restore failed so). Once imported, later
    imports of these modules take no lock."""
    with _CHECKPOINT_IMPORTS:
        import torch.distributed.checkpoint  # noqa: F401
        import torch.distributed.checkpoint.staging  # noqa: F401
        import torch.distributed.checkpoint.state_dict  # noqa: F401


_CHECKPOINT_WARM = threading.Event()   # set once this process started `_checkpoint_modules` on a thread


def _warm_checkpoint_imports() -> None:
    """Import what a checkpoint save needs (torch.distributed.checkpoint, DTensor and, through
    torch.fx's symbolic shapes, sympy: ~1.6 CPU-s, on 2 cores as many seconds) on a thread beside
    training, instead of in the save's stall (`_checkpoint_modules`: a save or load meanwhile
    waits for it). Only the replica the driver saves from asks (`inner_phase(warm_checkpoint=True)`):
    the others never save, and a world of R replicas would pay it R times. Once per process."""
    if not _CHECKPOINT_WARM.is_set():
        _CHECKPOINT_WARM.set()
        threading.Thread(target=_checkpoint_modules, name="checkpoint-imports", daemon=True).start()


class _Laps:
    """Seconds each phase of a setup took, in order (`lap(name)` ends the phase under way)."""

    def __init__(self):
        self._at = time.monotonic()
        self.seconds: dict[str, float] = {}

    def __call__(self, name: str) -> None:
        now = time.monotonic()
        self.seconds[name] = round(now - self._at, 3)
        self._at = now


def _rng_state() -> dict:
    """This rank's RNG state as JSON-able values (restored without unpickling anything)."""
    import base64
    import random

    import torch

    version, words, gauss = random.getstate()
    state = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
             "python": [version, list(words), gauss]}
    if torch.cuda.is_available():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def _set_rng_state(state: dict) -> None:
    """Restore `_rng_state()`'s output; ValueError/TypeError when it is not of that shape."""
    import base64
    import random

    import torch

    def tensor(text: str):
        return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8)

    version, words, gauss = state["python"]
    torch.set_rng_state(tensor(state["torch"]))
    random.setstate((int(version), tuple(int(w) for w in words), None if gauss is None else float(gauss)))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensor(state["cuda"]))


def _host_snapshot(cuda: bool):
    """The stager of a rank's checkpoints (`dcp.async_save`'s phase 1): a copy of the state dict
    in host buffers made at the first save and refilled at every later one (pinned on CUDA, where
    the copies from the GPU are queued without blocking and waited for once). DTensors stay
    DTensors on their mesh, holding a host copy of their local shard. (torch's `DefaultStager`
    cannot copy the DTensors of a sharded CPU replica, and its `BlockingAsyncStager` pins always.)"""
    import torch
    from torch.distributed.checkpoint.staging import AsyncStager
    from torch.distributed.tensor import DTensor

    class HostSnapshot(AsyncStager):
        _synchronize_after_execute = False

        def __init__(self):
            self._copies: dict[tuple, torch.Tensor] = {}   # path in the state dict -> host copy

        def stage(self, state_dict):
            with torch.no_grad():
                staged = self._copy(state_dict, ())
            if cuda:
                torch.cuda.synchronize()
            return staged

        def _copy(self, obj, path: tuple):
            if isinstance(obj, dict):
                return {k: self._copy(v, path + (k,)) for k, v in obj.items()}
            if isinstance(obj, list):
                return [self._copy(v, path + (i,)) for i, v in enumerate(obj)]
            if not isinstance(obj, torch.Tensor):
                return obj
            copy = self._copies.get(path)
            if copy is None or copy.shape != obj.shape or copy.dtype != obj.dtype:
                copy = self._copies[path] = self._host_like(obj)
            (copy.to_local() if isinstance(copy, DTensor) else copy).copy_(
                obj.to_local() if isinstance(obj, DTensor) else obj.detach(), non_blocking=cuda)
            return copy

        @staticmethod
        def _host_like(obj):
            if not isinstance(obj, DTensor):
                return torch.empty(obj.shape, dtype=obj.dtype, pin_memory=cuda)
            if obj.device.type == "cpu":
                return DTensor.from_local(torch.empty_like(obj.to_local()), obj.device_mesh, obj.placements,
                                          shape=obj.shape, stride=obj.stride(), run_check=False)
            host = obj.to("cpu")   # on the same mesh, its local shard on the host (as torch's own stagers do)
            host._local_tensor = torch.empty_like(host._local_tensor).pin_memory()
            return host

        def synchronize_staging(self) -> None:
            pass

        def close(self) -> None:
            self._copies.clear()

    return HostSnapshot()


def _gated(write, gate: Path):
    """`write` that first waits until the file `gate` exists (fault injection: a stuck disk)."""
    def run(*args, **kwargs):
        while not gate.exists():
            time.sleep(0.05)
        return write(*args, **kwargs)
    return run


class RankWorker:
    """Ray actor body for one rank (wrapped with `ray.remote` by the world)."""

    def __init__(self, spec: RankSpec):
        self._spec = spec
        self._ready = False
        # Set by request_stop (a second actor thread, possibly before inner_phase starts): the
        # global inner step of the phase it is for, and the unix time that phase must end by,
        # because a node of the world has a preemption notice.
        self._stop: tuple[int | None, float] = (None, float("inf"))
        self._stop_lock = threading.Lock()
        self._phase_step: int | None = None
        self._progress = 0   # inner steps, micro-batches, sync stages and copied chunks done
        self._state = "wait"   # what the heartbeat says the rank does: see heartbeat_key
        self._warmed_up = False   # whether this process has finished an inner step
        self._snapshots: dict[int, dict] = {}   # joiner replica id -> what it copies from this donor
        self._pulled_momentum = None             # a joiner's copied outer momentum, until replayed
        # Fault injection for tests: seconds added to every inner step (a slow VM), and a file
        # every checkpoint write waits for before it writes (a stuck disk).
        self._step_delay_s = float(os.environ.get("ELASTIC_FAULT_STEP_DELAY_S", "0") or 0)
        self._write_gate = os.environ.get("ELASTIC_FAULT_WRITE_GATE")

    # -- lifecycle -------------------------------------------------------------------------------

    def setup(self) -> dict:
        """Join the replica's process group, build and shard the model, build both optimizers."""
        lap = _Laps()
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from elastic.models import build_model, shard_units, wrap_blocks
        from elastic.train.data import BatchPrefetcher, open_stream
        from elastic.train.diloco import Fragments, OuterState, local_shard, outer_device
        from elastic.train.outer_sync import make_codec

        lap("imports")
        t0 = time.monotonic()
        spec = self._spec
        recipe = Resolved(spec.recipe)
        self._recipe = recipe
        _pin_host_memory_by_registering()
        self._device = rank_device()
        cuda = self._device.type == "cuda"
        if not cuda:
            torch.set_num_threads(recipe.world.cpu_threads_per_rank)
        elif os.environ.get("OMP_NUM_THREADS", "").isdigit():
            # What OpenMP would have read had torch been imported here, not in the zygote this
            # worker may be forked from (`elastic/run/zygote.py`): Ray sets it for the actor.
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

        from elastic.net.netaddr import gloo_device, node_ip

        self._node_ip = node_ip()
        self._gloo_device = gloo_device(self._node_ip)   # the outer group's, made once
        timeout = datetime.timedelta(seconds=recipe.world.step_timeout_s)
        self._store = dist.TCPStore(spec.store_host, spec.store_port, is_master=False, timeout=timeout)
        replica_store = dist.PrefixStore(f"replica/{spec.replica_id}", self._store)
        backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
        dist.init_process_group(backend, store=replica_store, rank=spec.rank, world_size=spec.ranks,
                                timeout=timeout)
        mesh = init_device_mesh(self._device.type, (spec.ranks,))
        # Checkpoint writes run in a thread beside training: their collectives (DCP's plan
        # exchange) go over a gloo group of their own, never interleaved with FSDP's.
        self._ckpt_pg = dist.new_group(backend="gloo")
        lap("process_group")

        # Same seed on every replica: every replica starts from the same θ.
        torch.manual_seed(recipe.train.seed)
        with torch.device(self._device):
            model = build_model(recipe.model)
        t = recipe.train
        wrap_blocks(model, compile=cuda if t.compile == "auto" else t.compile, checkpoint=t.activation_checkpointing)
        if spec.ranks > 1:
            # FSDP2 (and DTensor under it) is imported only where a replica shards: ~1.5 s of setup.
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else MixedPrecisionPolicy()
            for unit in shard_units(model):
                fully_shard(unit, mesh=mesh, mp_policy=mp)
            fully_shard(model, mesh=mesh, mp_policy=mp)
        # else: one rank has nothing to shard, and FSDP2's per-module hooks and DTensor
        # bookkeeping cost ~10% of a small model's step on CPU (bench/overhead.py) and ~23% on
        # one H100 (issue 20). Plain parameters save and load through DCP the same way (as full
        # tensors, resharded on load); on CUDA they train in fp32 under bf16 autocast.
        self._autocast = cuda and spec.ranks == 1
        self._model = model
        self._params = list(model.parameters())
        decay = [p for p in self._params if p.dim() >= 2]
        no_decay = [p for p in self._params if p.dim() < 2]
        # Fused AdamW (one kernel for every parameter) where the parameters are plain CUDA tensors.
        fused = cuda and not any(_is_dtensor(p) for p in self._params)
        lap("model")
        groups = [{"params": decay, "weight_decay": t.inner_weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        if fused:
            self._opt = torch.optim.AdamW(groups, lr=t.inner_lr, betas=t.inner_betas, fused=True)
        else:   # torch's foreach AdamW, without its torch._dynamo import (elastic.train.optim)
            from elastic.train.optim import AdamW
            self._opt = AdamW(groups, lr=t.inner_lr, betas=t.inner_betas)
        w = recipe.world
        local_numel = sum(local_shard(p).numel() for p in self._params)
        where = outer_device(t.outer_device, self._device, local_numel)
        # One OuterState (θ_outer, momentum, codec and its error feedback) per fragment.
        self._outer = Fragments(
            self._params, w.fragments, t.inner_steps,
            lambda params: OuterState(params, t.outer_lr, t.outer_momentum, t.outer_nesterov,
                                      lambda numel: make_codec(numel, w.sync, w.sync_dtype, w.error_feedback,
                                                               w.sync_density, w.sync_decay), device=where),
            on_apply=self._log_applied)
        # The streamed fragment syncs settle their decisions on a store connection of their own
        # (the background thread polls it while the training thread and the actor's others run).
        self._sync_store = dist.TCPStore(spec.store_host, spec.store_port, is_master=False, timeout=timeout) \
            if w.fragments > 1 else None

        lap("optimizers")
        self._data = open_stream(recipe.data, t.seq_len, t.seed)
        self._val = None   # the validation stream, opened at the first `evaluate`
        self._per_rank = t.batch_size // spec.ranks
        self._micro = t.micro_batch_size or self._per_rank
        self._prefetch = BatchPrefetcher(self._data, self._per_rank, self._device)
        # Phase 1 of a checkpoint copies the state into these host buffers (pinned on CUDA), kept
        # from one save to the next; the write runs beside training (`_saving`). Made at the
        # first save; what it imports loads beside training once the driver names this replica
        # its saver (`inner_phase`'s `warm_checkpoint`).
        self._stager = None
        self._saving = None
        self._losses = torch.zeros(t.inner_steps, dtype=torch.float32, device=self._device)
        self._stop_flag = torch.zeros(1)
        self._lrs = [0.0] * t.inner_steps
        self._inner_step = 0
        self._start_heartbeat()
        self._ready = True
        lap("data")
        return {"replica": spec.replica_id, "rank": spec.rank, "pid": os.getpid(), "device": str(self._device),
                "params": sum(p.numel() for p in self._params), "local_numel": self._outer.numel,
                "setup_s": time.monotonic() - t0, "phases_s": lap.seconds}

    # -- training --------------------------------------------------------------------------------

    def inner_phase(self, lease_start: int, inner_step: int, world_tokens: int, step_tokens: int,
                    next_lease: int | None = None, group: tuple[int, int, int] | None = None,
                    warm_checkpoint: bool = False) -> dict:
        """H inner AdamW steps on samples `lease_start ..` (this rank takes its slice of each batch).

        `inner_step` is the global inner step count at the start (names the phase for
        `request_stop`); `world_tokens` the world's trained tokens at the start and `step_tokens`
        what one inner step of the world trains (they drive the LR schedule); `next_lease`, the
        driver's guess of this replica's next lease, whose data is fetched in the background
        meanwhile; `group`, (epoch, index, size) of the phase's members: with `world.fragments` > 1
        the fragments' syncs run over it in the background while the phase trains (None: every
        fragment waits for the blocking `outer_sync`); `warm_checkpoint`, this replica is the one the
        driver saves checkpoints from: what a save imports loads beside this phase. Ends by forming
        the pseudo-gradient of every fragment not yet applied. Returns per-step losses and rates of
        this rank, tokens, seconds and `sync` (`Fragments.end_phase`'s report).
        """
        import torch

        if warm_checkpoint:
            _warm_checkpoint_imports()
        t0 = time.monotonic()
        self._state = "run"   # until the phase ends, this rank must make progress of its own
        self._phase_step = inner_step
        spec, t = self._spec, self._recipe.train
        opt, prefetch, losses, lrs = self._opt, self._prefetch, self._losses, self._lrs
        lease = t.inner_steps * t.batch_size
        self._data.fetch(lease_start, lease)   # a no-op once prefetched, or for local tokens
        if next_lease is not None:
            self._data.prefetch(next_lease, lease)
        first = lease_start + spec.rank * self._per_rank   # this rank's first sample of step 0
        prefetch.reset()
        prefetch.put(first)
        outer = self._outer
        outer.begin_phase(self._sync_store, fragment_key(group[0], inner_step, spec.rank) if group else "", group,
                          self._recipe.world.sync_timeout_s, spec.rank, self._gloo_device)
        steps = 0
        # Nothing in this loop waits for the GPU: the losses stay on the device until the phase
        # ends, and the next batch is cut and sent while the step just queued runs.
        for h in range(t.inner_steps):
            if self._should_stop():
                break
            self._state = "run" if self._warmed_up else "warm"
            lr = spec.schedule.lr(world_tokens + h * step_tokens, step_tokens)
            lrs[h] = lr
            for group in opt.param_groups:
                group["lr"] = lr
            losses[h] = self._accumulate(prefetch.take())
            if t.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(self._params, t.grad_clip, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if h + 1 < t.inner_steps:
                prefetch.put(first + (h + 1) * t.batch_size)
            steps += 1
            self._progress += 1
            self._warmed_up = True
            self._state = "wait"   # an apply point waits for the fragment's sync over the other replicas
            outer.after_inner_step(steps)
            self._state = "run"
            if self._step_delay_s:
                time.sleep(self._step_delay_s)
        self._state = "wait"
        sync = outer.end_phase()
        self._inner_step = inner_step + steps
        return {"losses": losses[:steps].tolist(), "lrs": lrs[:steps], "steps": steps,
                "tokens": steps * self._per_rank * t.seq_len, "seconds": time.monotonic() - t0, "sync": sync}

    def _accumulate(self, tokens):
        """Forward and backward over this rank's batch in micro-batches of `train.micro_batch_size`
        (gradients accumulate; FSDP reduces them once, after the last). Returns the mean loss."""
        import torch.nn.functional as F

        model, n = self._model, self._micro
        chunks = tokens.split(n)
        sync = getattr(model, "set_requires_gradient_sync", None)   # FSDP2-wrapped models only
        total = 0.0
        for i, chunk in enumerate(chunks):
            if sync is not None and len(chunks) > 1:
                sync(i == len(chunks) - 1)
            with self._forward_precision():
                logits = model(chunk[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), chunk[:, 1:].reshape(-1))
            (loss / len(chunks)).backward()
            total = total + loss.detach()
            self._progress += 1
        return total / len(chunks)

    def _forward_precision(self):
        """bf16 autocast for a one-rank CUDA replica's forward (its parameters are fp32; under
        FSDP2 the mixed-precision policy casts them instead); nothing on CPU."""
        import contextlib

        import torch

        return torch.autocast("cuda", dtype=torch.bfloat16) if self._autocast else contextlib.nullcontext()

    def evaluate(self) -> dict:
        """Loss of the current θ (θ_outer between outer steps) on the first `eval.windows` windows
        of the validation split, in order; this rank takes its share. A collective over the
        replica's ranks. Returns the summed token loss and the token count of this rank."""
        import torch
        import torch.nn.functional as F

        from elastic.train.data import open_stream

        t0 = time.monotonic()
        t, spec = self._recipe.train, self._spec
        if self._val is None:
            self._val = open_stream(self._recipe.data, t.seq_len, t.seed, split="val")
        share = min(self._recipe.eval.windows, self._val.windows) // spec.ranks
        first = spec.rank * share
        self._val.fetch(first, share)
        loss_sum, tokens = 0.0, 0
        self._model.eval()
        try:
            with torch.no_grad():
                for start in range(first, first + share, self._micro):
                    chunk = self._val.batch(start, min(self._micro, first + share - start)).to(self._device)
                    with self._forward_precision():
                        logits = self._model(chunk[:, :-1])
                    loss_sum += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                      chunk[:, 1:].reshape(-1), reduction="sum"))
                    tokens += chunk[:, 1:].numel()
        finally:
            self._model.train()
        return {"loss_sum": loss_sum, "tokens": tokens, "seconds": time.monotonic() - t0}

    def _start_heartbeat(self) -> None:
        """Publish "BEAT WORK BYTES STATE" under `heartbeat_key` every HEARTBEAT_S from a thread of
        its own, on a store connection of its own (gloo's rendezvous may hold the other one for
        long). The first beat is written before setup returns, so the driver can read it from
        admission on. A frozen or partitioned process stops beating, a rank stuck outside any
        collective (a fetch that never returns, a deadlocked step) stops making progress; the driver
        then drops its replica (`elastic.train.world.World`)."""
        import torch.distributed as dist

        spec = self._spec
        store = dist.TCPStore(spec.store_host, spec.store_port, is_master=False,
                              timeout=datetime.timedelta(seconds=self._recipe.world.stall_timeout_s))
        key = heartbeat_key(spec.replica_id, spec.rank)
        data = self._data
        store.set(key, f"0 {self._progress} {data.received_bytes} {self._state}")

        def beat() -> None:
            n = 0
            while True:
                time.sleep(HEARTBEAT_S)
                n += 1
                try:
                    store.set(key, f"{n} {self._progress} {data.received_bytes} {self._state}")
                except Exception:   # the driver's store is gone: the run ended
                    return

        threading.Thread(target=beat, name="heartbeat", daemon=True).start()

    def _should_stop(self) -> bool:
        """Whether the preemption deadline says: stop the inner phase now. The ranks of a replica
        agree (one-element MAX all-reduce), since FSDP needs them in lockstep."""
        import torch.distributed as dist

        phase, stop_at = self._stop
        stop = phase == self._phase_step and time.time() >= stop_at
        if self._spec.ranks == 1:
            return stop
        self._stop_flag.fill_(1.0 if stop else 0.0)
        dist.all_reduce(self._stop_flag, op=dist.ReduceOp.MAX)
        return bool(self._stop_flag.item())

    def request_stop(self, stop_at: float, inner_step: int) -> None:
        """End the inner phase that starts at global inner step `inner_step` by unix time `stop_at`
        (called concurrently; a request for a phase already over never touches a later one)."""
        with self._stop_lock:
            phase, earlier = self._stop
            self._stop = (inner_step, min(earlier, stop_at) if phase == inner_step else stop_at)

    def outer_sync(self, epoch: int, index: int, size: int) -> dict:
        """Phase 1 of the outer step: average Δ of the fragments still pending (all, with one
        fragment) over the `size` replicas of membership `epoch` (this replica is `index`). Failure is a value: {"ok": False, "stage": "connect" (the group did not
        form) or "all_reduce", "addr": this rank's advertised address, "error"}; Δ is kept for a
        retry over the survivors."""
        t0 = time.monotonic()
        stage = "connect"
        try:
            if size > 1 and self._outer.pending:
                self._outer.join_group(self._store, epoch, index, size, self._recipe.world.sync_timeout_s,
                                       shard=self._spec.rank, device=self._gloo_device)
            self._progress += 1
            stage = "all_reduce"
            self._outer.all_reduce(index, size)
            self._progress += 1
        except Exception as exc:  # a peer died, timed out or was unreachable: the driver re-forms the group
            return {"ok": False, "stage": stage, "addr": self._node_ip,
                    "error": f"{type(exc).__name__}: {str(exc)[:200]}", "seconds": time.monotonic() - t0,
                    "bytes": 0, "network_s": 0.0, "wait_s": 0.0, "overlapped_s": 0.0}
        # The outer step's whole traffic: the fragments streamed in the phase and this sync.
        o = self._outer
        return {"ok": True, "seconds": time.monotonic() - t0, "bytes": o.bytes_sent, "network_s": o.network_s,
                "wait_s": o.wait_s, "overlapped_s": o.overlapped_s}

    def outer_apply(self) -> None:
        """Phase 2: every member reduced, so take the outer step of the pending fragments."""
        self._outer.apply()

    def _log_applied(self, fragment: int, averaged) -> None:
        """A fragment's outer step was taken: log its averaged Δ for the joiners copying from this
        rank (every fragment steps once per outer step, in fragment order)."""
        if self._snapshots:
            applied = averaged.to("cpu", copy=True)
            for snap in self._snapshots.values():
                snap["log"].append(applied)

    # -- joining beside training: θ_outer and the outer momentum from a donor, in chunks ---------

    def snapshot_outer(self, joiner: int) -> bool:
        """Donor, at an outer-step boundary: hold a copy of this shard's θ_outer and outer momentum
        for replica `joiner` to pull, and log every averaged Δ applied from now on (the joiner
        replays them). Returns whether there is a momentum buffer (none before the first step)."""
        snap = self._outer.export()
        self._snapshots[joiner] = {**snap, "log": []}
        return snap["momentum"] is not None

    def outer_chunk(self, joiner: int, what: str, start: int, end: int):
        """Donor: elements start:end of the snapshot held for `joiner`: `theta`, `momentum`, or
        `delta:I`, the I-th averaged Δ applied since the snapshot (of fragment I mod `world.fragments`). Runs beside training."""
        snap = self._snapshots[joiner]
        src = snap["log"][int(what[6:])] if what.startswith("delta:") else snap[what]
        return src[start:end].clone()

    def drop_snapshot(self, joiner: int) -> None:
        """Donor: the joiner is in (or gone): free its snapshot and log."""
        self._snapshots.pop(joiner, None)

    def pull_outer(self, donor, joiner: int, momentum: bool, chunk_numel: int) -> int:
        """Joiner, while the world trains: copy the donor's snapshot (same rank) of θ_outer, the
        outer momentum and the sync's error feedback (when it has one) in chunks of `chunk_numel`
        elements, each a heartbeat of progress. Returns the chunks copied. (The inner AdamW state
        is not copied: a joiner starts it afresh.)"""
        import ray
        import torch

        outer = self._outer
        self._pulled_theta = torch.zeros(outer.numel)
        self._pulled_momentum = torch.zeros(outer.numel) if momentum else None
        self._pulled_error = torch.zeros(outer.numel) if outer.error is not None else None
        chunks = 0
        for what, dst in (("theta", self._pulled_theta), ("momentum", self._pulled_momentum),
                          ("error", self._pulled_error)):
            for start in range(0, outer.numel, chunk_numel) if dst is not None else ():
                end = min(outer.numel, start + chunk_numel)
                dst[start:end].copy_(ray.get(donor.outer_chunk.remote(joiner, what, start, end)))
                chunks += 1
                self._progress += 1
        return chunks

    def replay_outer(self, donor, joiner: int, steps: int, inner_step: int, chunk_numel: int) -> None:
        """Joiner, at its admission: take the pulled snapshot, then the `steps` outer steps the world
        applied since (each fragment's, in fragment order), with the averaged Δs the donor logged:
        the same updates from the same state, so θ_outer and the momentum end equal to every
        member's."""
        import ray

        outer = self._outer
        outer.load({"theta": self._pulled_theta, "momentum": self._pulled_momentum, "error": self._pulled_error})
        for i in range(steps * len(outer.parts)):
            part = outer.parts[i % len(outer.parts)]
            for start in range(0, part.numel, chunk_numel):
                end = min(part.numel, start + chunk_numel)
                part.delta[start:end].copy_(ray.get(donor.outer_chunk.remote(joiner, f"delta:{i}", start, end)))
            part.step_with_delta()
        self._pulled_theta = self._pulled_momentum = self._pulled_error = None
        self._inner_step = inner_step
        self._stop = (None, float("inf"))

    # -- inspection and state -------------------------------------------------------------------

    def outer_state(self) -> dict:
        """This shard's θ_outer, outer momentum and the sync's error feedback (copies)."""
        return self._outer.export()

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
        """Phase 1: snapshot this replica's model, inner optimizer, outer momentum and the sync's
        error feedback into host memory, then write them to `path` with
        torch.distributed.checkpoint in a thread beside training (`wait_saved` joins it; a
        collective over the replica's ranks on their checkpoint group). Waits first for the
        previous write: its snapshot buffers are the ones reused. Call after an outer sync (θ_outer
        is saved too where streamed fragments leave θ_local ≠ θ_outer). Returns the seconds training was held (the snapshot)."""
        import torch
        _checkpoint_modules()
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        t0 = time.monotonic()
        try:
            self.wait_saved()
        except Exception as exc:   # that checkpoint is lost (its upload reports it); this one starts afresh
            log.warning("the previous checkpoint write failed: %s", exc)
        model_sd, optim_sd = get_state_dict(self._model, self._opt)
        momentum = self._outer.momentum()
        if momentum is None:  # no momentum (outer_momentum 0, or before the first step): save zeros
            momentum = torch.zeros(self._outer.numel)
        state = {"model": model_sd, "optim": optim_sd, "outer_momentum": self._per_param(momentum),
                 "inner_step": torch.tensor(self._inner_step)}
        if len(self._outer.parts) > 1:   # streamed fragments keep local progress: θ_local ≠ θ_outer
            state["outer_theta"] = self._per_param(self._outer.theta)
        if self._outer.error is not None:   # this rank's error feedback, resharded like momentum
            state["outer_error"] = self._per_param(self._outer.error)
        # RNG state is per rank (not sharded): a small file beside the shards, restored when the
        # loading world has a rank of the same number.
        Path(path).mkdir(parents=True, exist_ok=True)
        Path(f"{path}/rng-{self._spec.rank}.json").write_text(json.dumps(_rng_state()))
        # The shards are only staged for upload: no fsync (a node that dies loses them anyway).
        # async_save copies `state` into the stager's buffers before it returns.
        if self._stager is None:
            self._stager = _host_snapshot(self._device.type == "cuda")
        writer = dcp.FileSystemWriter(path, sync_files=False, thread_count=2)
        if self._write_gate:
            writer.write_data = _gated(writer.write_data, Path(self._write_gate))
        self._saving = dcp.async_save(state, storage_writer=writer, process_group=self._ckpt_pg,
                                      async_stager=self._stager)
        return {"seconds": time.monotonic() - t0}

    def wait_saved(self) -> None:
        """Block until the write `save_checkpoint` started has ended (at once when none is under
        way); raises what the write raised. Safe from several actor threads at once (the upload's
        and the next save's)."""
        saving = self._saving
        if saving is not None:
            saving.result()

    def _per_param(self, flat) -> dict:
        """A flat tensor over this rank's shard (outer momentum, error feedback) as one tensor per
        parameter name, laid out like the parameter, so DCP reshards it to any world shape."""
        return {name: _like_param(p, view) for (name, p), view
                in zip(self._model.named_parameters(), self._outer.shard_views(flat))}

    def upload_checkpoint(self, local: str, uri: str, step: int, threads: int) -> list[dict]:
        """Phase 2: once phase 1's write has ended, upload the files this rank wrote (runs beside
        training)."""
        from elastic.storage import checkpoint as ckpt
        self.wait_saved()
        names = ckpt.rank_files(Path(local), self._spec.rank)
        return ckpt.upload(uri, Path(local), step, names, threads)

    def fetch_checkpoint(self, uri: str, manifest: dict, staging: str) -> str:
        """Make the checkpoint `manifest` describes loadable on this node (every file checked
        against it); returns its local directory."""
        from elastic.storage import checkpoint as ckpt
        return ckpt.fetch(uri, manifest, staging)

    def drop_staging(self, local: str) -> None:
        """Remove a phase-1 directory once it is durable at the destination."""
        import shutil

        shutil.rmtree(local, ignore_errors=True)

    def load_checkpoint(self, path: str) -> dict:
        """Load model, inner AdamW, outer momentum and error feedback (when the sync has one) from a
        DCP checkpoint written by any world shape (DCP reshards to this replica's ranks). A
        collective over the replica's ranks."""
        import torch
        _checkpoint_modules()
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        import pickle

        from elastic.storage.checkpoint import CheckpointError, dcp_load, stored_entries
        from elastic.train.diloco import local_shard

        t0 = time.monotonic()
        model_sd, optim_sd = get_state_dict(self._model, self._opt)
        state = {"model": model_sd, "optim": optim_sd, "outer_momentum": self._per_param(torch.zeros(self._outer.numel)),
                 "inner_step": torch.tensor(0)}
        if self._outer.error is not None:
            state["outer_error"] = self._per_param(torch.zeros(self._outer.numel))
        # θ_outer is stored where the saving world streamed fragments (θ_local ≠ θ_outer there); a
        # world of either kind loads a checkpoint of the other: without it, θ_outer = θ_local.
        try:
            streamed = "outer_theta" in stored_entries(path)
        except (OSError, pickle.UnpicklingError, EOFError) as exc:
            raise CheckpointError(f"{path}: unreadable checkpoint metadata ({type(exc).__name__})") from None
        if streamed:
            state["outer_theta"] = self._per_param(torch.zeros(self._outer.numel))
        dcp_load(state, path)
        set_state_dict(self._model, self._opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

        def flat(tensors) -> torch.Tensor:
            return torch.cat([local_shard(v).reshape(-1).cpu() for v in tensors])

        theta = flat(state["outer_theta"].values()) if "outer_theta" in state else flat(self._params)
        self._outer.load({"theta": theta, "momentum": flat(state["outer_momentum"].values()),
                          "error": flat(state["outer_error"].values()) if "outer_error" in state else None})
        self._inner_step = int(state["inner_step"])
        rng = Path(path) / f"rng-{self._spec.rank}.json"
        if rng.is_file():
            try:
                _set_rng_state(json.loads(rng.read_text()))
            except (ValueError, TypeError, KeyError, RuntimeError) as exc:
                raise CheckpointError(f"{rng.name}: not an RNG state ({type(exc).__name__})") from None
        return {"seconds": time.monotonic() - t0}

    def ping(self) -> bool:
        return self._ready

    def devices(self) -> dict:
        """What Ray gave this rank: its GPU ids and the CUDA_VISIBLE_DEVICES its process sees
        (answers before and without `setup`); once set up, also where its tensors live (the
        model's local shards, the loss buffer) and, on CUDA, how many devices the process sees and
        the UUID of its own."""
        import ray

        out = {"gpu_ids": [str(i) for i in ray.get_gpu_ids()], "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
               "node_ip": ray.util.get_node_ip_address(), "pid": os.getpid()}
        if self._ready:
            import torch

            from elastic.train.diloco import local_shard

            out["device"] = str(self._device)
            out["tensor_devices"] = sorted({str(local_shard(p).device) for p in self._params} | {str(self._losses.device)})
            if self._device.type == "cuda":
                out["visible_gpus"] = torch.cuda.device_count()
                out["gpu_uuid"] = str(torch.cuda.get_device_properties(self._device).uuid)
        return out
