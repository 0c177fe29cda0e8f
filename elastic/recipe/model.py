"""The recipe: the single source of truth for a run.

Every field carries its docstring; the recipe reference (docs/recipe.md) and the
JSON schema for editors are generated from these models (`elastic schema`).
Loading never raises a traceback at the user: `load_recipe` collects every
problem as one line `FILE: field.path: what is wrong` and raises `RecipeError`.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, PositiveFloat, ValidationError, model_validator

from elastic.errors import RecipeError, described, first_line
from elastic.recipe.section import Section as _Section
from providers import PROVIDERS


def _uri_schemes() -> list[str]:
    """URI schemes data and checkpoints may live at: `file`, then each provider's object store's."""
    from providers import storage_schemes

    return ["file", *storage_schemes()]


class ModelSection(_Section):
    """The network to train: our GPT-style decoder, a Hugging Face causal LM (`hf`), or a user's
    own `nn.Module` (`factory`)."""

    hf: str | None = None
    """A Hugging Face causal LM (`AutoModelForCausalLM`): a hub name (`Qwen/Qwen2.5-0.5B`), a local
    directory, or a directory at `s3://`/`gs://` holding `config.json` (and, for `init:
    pretrained`, `*.safetensors`). Needs the `hf` extra (`pip install 'elastic[hf]'`). When set,
    `layers`/`width`/`heads`/`context`/`vocab_size` are not used: the model's config says them."""
    init: Literal["scratch", "pretrained"] = "scratch"
    """With `hf`: `scratch` builds the model from its config with seeded random weights;
    `pretrained` loads its safetensors weights (continued pre-training). Every replica starts from
    the same θ either way."""

    layers: int = Field(4, ge=1, le=256)
    """Number of transformer blocks."""
    width: int = Field(256, ge=8, le=65536)
    """Hidden size (embedding width) of the decoder."""
    heads: int = Field(4, ge=1, le=512)
    """Attention heads per block; must divide `width`."""
    context: int = Field(256, ge=8, le=1_048_576)
    """Longest sequence the model accepts, in tokens (learned positions)."""
    vocab_size: int = Field(256, ge=2, le=1_048_576)
    """Vocabulary size. 256 for the byte-level tokens `data` produces."""
    mlp_ratio: int = Field(4, ge=1, le=16)
    """MLP hidden size as a multiple of `width`."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Free-form settings passed to `factory` (inside the section dict it receives)."""
    factory: str | None = None
    """`package.module:function` returning a user's own `nn.Module` (called with this section as a
    dict). The module's `forward(tokens)` must return logits of shape [batch, seq, vocab_size].
    When set, `layers`/`width`/`heads` are passed through but not used by elastic."""

    @model_validator(mode="after")
    def _check(self) -> "ModelSection":
        if self.hf is not None and self.factory is not None:
            raise ValueError("@hf: set model.hf or model.factory, not both")
        if self.init == "pretrained" and self.hf is None:
            raise ValueError("@init: pretrained needs model.hf")
        if self.factory is None and self.hf is None and self.width % self.heads:
            raise ValueError(f"@heads: {self.heads} must divide width ({self.width})")
        return self


class DataSection(_Section):
    """Where tokens come from: pre-tokenized shards in object storage (`uri`), bytes of text (ids
    0..255), or a pre-tokenized `.bin` (`path`).

    Shards are plain files of little-endian token ids with a small JSON index (`index.json`: token
    dtype, vocabulary size, shards per split with their token counts), written by `elastic
    prepare-data`. Plain files rather than a streaming format (MosaicML MDS, litdata): a window
    of tokens is a byte range of one file that numpy memory-maps with no decoding, the lease model
    needs only "which shards hold samples a..b" (a cumulative sum over the index), and the files
    go through the same storage clients (`elastic/storage/stores.py`) and the same node credentials as
    checkpoints, with no second SDK on the nodes."""

    uri: str | None = None
    """A directory of token shards: `s3://bucket/prefix`, `gs://bucket/prefix` or `file:///abs/path`.
    Each replica downloads only the shards its leases touch, prefetches the next lease's while it
    trains and keeps them in a bounded cache (`cache_gb`). Nodes read it with the run's node role.
    Set this or `path`."""
    cache_gb: float = Field(20.0, gt=0)
    """Bound of each node's local shard cache, GB (least recently used shards go first; the
    current and the next lease's shards are always kept)."""

    path: str | None = None
    """A text file (its bytes are the tokens), or a pre-tokenized `.bin` of little-endian uint16 token
    ids below `model.vocab_size`. Relative paths are resolved against the directory `elastic` runs
    in. Empty: the default corpus built from this machine's Python standard library sources."""
    corpus_bytes: int = Field(8_000_000, ge=10_000)
    """Size cap of the default corpus, in bytes."""

    @model_validator(mode="after")
    def _check(self) -> "DataSection":
        if self.uri is not None and self.path is not None:
            raise ValueError("@uri: set data.uri or data.path, not both")
        if self.uri is not None:
            scheme, sep, rest = self.uri.partition("://")
            if not sep or scheme not in _uri_schemes():
                raise ValueError(f"@uri: {self.uri} is not a {', '.join(f'{s}://' for s in _uri_schemes())} URI")
            if scheme != "file" and not rest.split("/", 1)[0]:
                raise ValueError(f"@uri: {self.uri} names no bucket")
        return self


class EvalSection(_Section):
    """Validation: loss and perplexity of θ_outer on the held-out split (`val` in the shard index
    of `data.uri`), on the same windows every time."""

    every_outer_steps: int = Field(0, ge=0)
    """Validate every N outer steps, and after the last one (0: never). Needs `data.uri` with a
    `val` split."""
    windows: int = Field(64, ge=1)
    """Validation windows of `train.seq_len + 1` tokens: the first ones of the val split, in order."""


class WandbSection(_Section):
    """Weights & Biases."""

    project: str | None = None
    """Log the run's metrics to this W&B project (needs `pip install wandb`). Empty: no W&B."""
    entity: str | None = None
    """W&B entity (team or user). Empty: your default."""
    mode: Literal["online", "offline"] = "online"
    """`offline` writes the W&B run under the run directory for `wandb sync` later (no network)."""


class LoggingSection(_Section):
    """Where metrics go besides the ledger: TensorBoard event files in the run directory, and W&B."""

    tensorboard: bool = True
    """Write TensorBoard event files to `<run dir>/tensorboard` (loss, validation loss, tokens/s,
    replicas, USD/hour, cumulative USD, preemptions). Written by elastic itself, on any install;
    viewing them needs TensorBoard (`pip install tensorboard`, or the `hf` extra)."""
    wandb: WandbSection = Field(default_factory=WandbSection)
    """Weights & Biases."""


class TrainSection(_Section):
    """DiLoCo: H inner AdamW steps per replica, then one outer Nesterov step on the averaged
    pseudo-gradient."""

    inner_steps: int = Field(50, ge=1)
    """H: inner optimizer steps each replica takes between two outer syncs."""
    outer_steps: int | None = Field(20, ge=1)
    """Outer steps to run. Set this or `token_budget` (the budget wins when both are set)."""
    token_budget: int | None = Field(None, ge=1)
    """Stop after this many trained tokens, counted over all replicas."""
    batch_size: int = Field(16, ge=1)
    """Sequences per replica per inner step (split evenly over the replica's ranks)."""
    micro_batch_size: int | None = Field(None, ge=1)
    """Sequences per rank per forward/backward pass: a rank's share of `batch_size` is split into
    micro-batches of this size whose gradients accumulate into one inner step (for batches that
    do not fit in memory at once). Empty: the whole share at once."""
    seq_len: int = Field(128, ge=2)
    """Tokens per training sequence; at most `model.context`."""
    inner_lr: float = Field(1e-3, gt=0, le=10)
    """Peak AdamW learning rate of the inner optimizer."""
    inner_weight_decay: float = Field(0.1, ge=0, le=10)
    """AdamW weight decay of the inner optimizer."""
    inner_betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas of the inner optimizer."""
    warmup_steps: int = Field(50, ge=0)
    """Linear warmup of the inner learning rate, in inner steps; then cosine decay to 10%."""
    grad_clip: float | None = Field(1.0, gt=0)
    """Clip the inner gradient norm to this value; empty disables clipping."""
    outer_lr: float = Field(0.7, gt=0, le=10)
    """Outer SGD learning rate (DiLoCo paper: 0.7)."""
    outer_momentum: float = Field(0.9, ge=0, lt=1)
    """Outer SGD momentum (DiLoCo paper: 0.9)."""
    outer_nesterov: bool = True
    """Use Nesterov momentum for the outer step (DiLoCo paper: yes)."""
    seed: int = Field(0, ge=0)
    """Seed for initial weights and the data order."""
    compile: bool | Literal["auto"] = "auto"
    """Compile each transformer block with `torch.compile` (the model's repeated blocks, found as
    FSDP2 finds them; for `model.hf` too). `auto`: on when the rank trains on a GPU, off on CPU
    (where compiling a small model costs more than it saves)."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in the backward pass instead of keeping them
    (torch.utils.checkpoint per block): about a third more compute for a model or batch that does
    not fit in GPU memory otherwise."""
    outer_device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where θ_outer, the outer momentum and the outer SGD step live on a GPU rank. `cuda`: on the
    GPU (the fastest step; 12 bytes per parameter of this rank's shard); `cpu`: in pinned host
    memory. `auto`: the GPU when those 12 bytes per parameter fit in a quarter of its memory, else
    the host. CPU ranks always keep them on the CPU."""

    @model_validator(mode="after")
    def _check(self) -> "TrainSection":
        if self.outer_steps is None and self.token_budget is None:
            raise ValueError("@outer_steps: set train.outer_steps or train.token_budget")
        if self.outer_nesterov and self.outer_momentum == 0:
            # torch refuses Nesterov without momentum; plain SGD is what is meant.
            self.outer_nesterov = False
        return self


class WorldSection(_Section):
    """How many replicas train, and how many ranks (GPUs) each replica shards over."""

    min_replicas: int = Field(1, ge=1)
    """Fewest live replicas training continues with; below it, training pauses and waits for
    capacity (see `capacity_timeout_s`)."""
    replicas: int = Field(2, ge=1)
    """Target number of replicas: rented at start, and rented again when preemptions take some.
    With `budget.max_hours`, a replica that would spread the world over another region waits while
    the world held finishes well within the deadline (docs/guide.md, "Deadlines on spot")."""
    max_replicas: int = Field(4, ge=1)
    """Never run more replicas than this (upper bound for growing back)."""
    ranks_per_replica: int | None = Field(None, ge=1, le=1024)
    """Ranks in each replica; FSDP2 shards over them. Each rank takes one GPU of its node when the
    node has GPUs (one CPU process otherwise). Empty: as many as a VM has GPUs (the count of
    `resources.accelerators`, or the local instance types' `gpus`), 1 on CPU-only nodes."""
    sync: Literal["dense", "sparse"] = "dense"
    """How pseudo-gradients cross between replicas. `dense`: every value, in `sync_dtype`.
    `sparse` (SparseLoCo): per chunk of 4096 values only the `sync_density` largest entries of an
    error-feedback accumulator, as 2-bit values with two magnitudes per chunk; what is not sent
    stays in the accumulator. With `sparse` the accumulator does the work of outer momentum: set
    `train.outer_momentum: 0` (SparseLoCo's setting)."""
    sync_dtype: Literal["float32", "bfloat16", "int8", "fp8"] = "float32"
    """Dtype of the dense pseudo-gradient sync across replicas. float32 and bfloat16: one
    all-reduce (bfloat16 halves the bytes). int8 and fp8 (float8 e4m3): a quarter of float32's
    bytes, one absmax scale per 4096 values; summed in float32 (reduce-scatter, then all-gather of
    the re-quantized average), with `error_feedback`."""
    error_feedback: bool = True
    """With `sync_dtype` int8 or fp8: what quantization dropped from this outer step's
    pseudo-gradient is added to the next one's (per rank; joiners copy it, checkpoints keep it)."""
    sync_density: float = Field(0.02, gt=0, le=0.5)
    """With `sync: sparse`: share of values each replica sends per outer step (rounded up to a
    multiple of 4 per chunk of 4096)."""
    sync_decay: float = Field(0.95, gt=0, le=1)
    """With `sync: sparse`: the error-feedback accumulator is multiplied by this before each outer
    step's pseudo-gradient is added."""
    fragments: int = Field(1, ge=1, le=64)
    """Streaming DiLoCo: the model's parameters split into this many contiguous fragments of about
    equal size, each with its own outer momentum and sync state (error feedback), synced at
    staggered points of the inner phase: fragment f's pseudo-gradient is formed after
    (f+1)·⌊H/N⌋ − τ inner steps (τ = half a slot, ⌊H/(2N)⌋) and all-reduced in the background
    while training goes on; its outer update is applied after (f+1)·⌊H/N⌋ steps, keeping the
    steps trained meanwhile. Every fragment is synced once per outer step and the bytes are those
    of one whole sync, but they cross the network while the GPUs train. 1: one blocking sync at
    the end of the phase. See docs/architecture.md, "Streamed fragments"."""
    stall_timeout_s: float = Field(120.0, gt=0)
    """A member is lost (`stalled`) when one of its ranks sent no heartbeat for this long, in
    seconds (every rank publishes one each second from a thread of its own, during inner phases
    and syncs alike: a frozen process, a partitioned or vanished node), or when, in an inner phase,
    its ranks made no progress for this long while it should move: progress is an inner step, a
    micro-batch's forward and backward, or bytes of its lease's shards arriving, and it should move
    whenever every rank of the member works on its own (fetching its lease, training), not while
    one waits on other replicas (a streamed fragment's sync, the outer sync: those end by
    `sync_timeout_s`). A member's first inner step after setup (compiling, warming up) may take
    `step_timeout_s` if that is longer. So a fetch that never returns or a deadlocked step is
    dropped; a slow world is healthy as long as each micro-batch, and each chunk of a download,
    takes less than this. A rank whose process dies is noticed at once."""
    step_timeout_s: float = Field(600.0, gt=0)
    """Upper safety bound, in seconds, on a call that has no heartbeat of its own yet: a replica's
    setup (a replica not set up by then is lost and its node released), the store connection, each
    collective inside a replica (the FSDP process group's timeout), and a replica's first inner
    step (compiling: see `stall_timeout_s`). Never a phase's length."""
    sync_timeout_s: float = Field(60.0, gt=0)
    """Longest one collective of the outer group (forming it, each all-reduce) may wait on a
    silent member, in seconds; the attempt then fails and is retried over the survivors. (A
    member whose process dies is noticed at once: its connections close.)"""
    capacity_timeout_s: float = Field(14400.0, gt=0)
    """With fewer than `min_replicas` alive, training pauses and waits for capacity this long, in
    seconds, then ends with status `insufficient_capacity`. The default, 4 hours, outlasts the 90th
    percentile of the spot outages measured on AWS V100 markets (0.6-3.5 h on the four traces of
    bench/traces/real/; docs/benchmarks.md, "Real spot markets"). With budget.max_hours and a spot
    recipe the deadline rule replaces it: a shortage does not end the run while on-demand VMs could
    still finish it within the deadline and budget.max_usd (they are rented when the slack runs
    out)."""
    cpu_threads_per_rank: int = Field(1, ge=1, le=256)
    """torch intra-op threads per rank on CPU."""

    @model_validator(mode="after")
    def _check(self) -> "WorldSection":
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"@min_replicas: {self.min_replicas} must be <= max_replicas ({self.max_replicas})")
        if self.sync == "sparse" and self.sync_dtype != "float32":
            raise ValueError(f"@sync_dtype: sync sparse sends 2-bit values; leave sync_dtype at float32, "
                             f"not {self.sync_dtype}")
        if not self.min_replicas <= self.replicas <= self.max_replicas:
            raise ValueError(
                f"@replicas: {self.replicas} must lie between min_replicas ({self.min_replicas}) "
                f"and max_replicas ({self.max_replicas})")
        return self


class ResourcesSection(_Section):
    """What to rent."""

    # The registry's names, in its order: a new provider is a directory and a line in PROVIDERS.
    clouds: list[Literal[tuple(PROVIDERS)]] = Field(default_factory=lambda: ["local"], min_length=1)
    """Providers to rent from."""
    regions: list[str] = Field(default_factory=list)
    """Allowed regions (any provider's names); empty means all of them."""
    accelerators: str | None = None
    """GPU per VM as `MODEL:COUNT`, e.g. `A100:8`, `L4:1`, for the cloud providers. Empty for
    CPU-only runs; the local provider offers no GPUs and ignores it."""
    spot: bool = True
    """Rent spot/preemptible capacity (false: on-demand)."""
    max_usd_per_hour: float | None = Field(None, gt=0)
    """Never rent a VM whose price is above this, in USD per hour."""
    head: Literal["controller", "local"] = "controller"
    """Where the Ray head and the driver run for cloud runs. `controller`: `elastic launch` rents one
    small on-demand CPU VM that runs them, so the run outlives your machine. `local`: here, where
    `elastic launch` runs (for machines already inside the cloud, and for tests). Local-only runs
    always run here."""
    join_timeout_s: float = Field(600.0, gt=0)
    """Longest a rented VM may take to boot and join the Ray cluster, in seconds; after that it is
    terminated (billed for the seconds it ran) and its offer cools down. A VM whose boot script
    fails is terminated as soon as its console says so (read every 10 s), not after this."""
    autodown_after_s: float = Field(600.0, gt=0, le=7 * 86400)
    """Every cloud VM of the run (nodes and the controller) shuts itself down when the driver's
    heartbeat has not changed for this many seconds (the driver was killed, its machine went
    away): nothing bills long after its run is gone, whatever happened to the machine that
    launched it."""
    max_vm_hours: float = Field(72.0, gt=0, le=8760)
    """Hard limit on each GPU node's life, in hours: the node shuts itself down then (AWS: an OS
    shutdown, which terminates it; GCP: also the instance's max run duration, which deletes it),
    whatever the driver does; to the run it is a preemption without notice, and a new node is
    rented. The controller lives as long as its run (autodown ends it after the run)."""

    @model_validator(mode="after")
    def _check(self) -> "ResourcesSection":
        if self.accelerators is not None:
            model, _, count = self.accelerators.partition(":")
            if not model or (count and not (count.isdigit() and int(count) > 0)):
                raise ValueError(f"@accelerators: must look like MODEL:COUNT (e.g. A100:8), got {self.accelerators!r}")
        return self


class BudgetSection(_Section):
    """Hard limits on spend and duration."""

    max_usd: float | None = Field(None, gt=0)
    """Hard spend limit in USD: before each outer step the driver projects the spend at its end;
    when that would pass this, it takes a final checkpoint, releases everything and ends with status
    `budget_exhausted` (exit 3)."""
    max_hours: float | None = Field(None, gt=0)
    """Hard wall-clock limit in hours, enforced the same way."""


class PlannerSection(_Section):
    """How the planner values offers and when it moves replicas (`elastic plan`, `elastic simulate`,
    and the driver's choice of where to rent). Times are wall seconds (for the `local` provider,
    real seconds, not the market's simulated ones)."""

    tokens_per_s: dict[str, PositiveFloat] = Field(default_factory=dict)
    """Training throughput of one replica, tokens/s: by instance type (per VM), or by GPU model (per
    GPU, multiplied by the VM's GPU count). The instance type wins when both match."""
    default_tokens_per_s: float = Field(1000.0, gt=0)
    """Throughput for offers `tokens_per_s` does not name: tokens/s per GPU (per VM for CPU-only
    VMs)."""
    spread_min: int = Field(1, ge=1)
    """Place the world over at least this many distinct zones or regions (`spread_over`), so one
    capacity event cannot take it all. Capped at the number of replicas."""
    spread_over: Literal["zone", "region"] = "region"
    """What `spread_min` counts."""
    preempt_per_hour_prior: float = Field(0.2, ge=0)
    """Prior preemption rate of a spot VM, per node-hour, before the run (or earlier runs) observed
    any; on-demand VMs count as 0."""
    prior_weight_hours: float = Field(4.0, gt=0)
    """How many node-hours of observation the prior weighs as; observed preemptions outweigh it
    once a zone has been held longer than this."""
    recovery_s: float = Field(300.0, ge=0)
    """Seconds from losing a replica to its replacement training (boot, join, state copy): the
    work one preemption costs on top of the lost inner phase."""
    cross_region_sync_s: float = Field(20.0, ge=0)
    """Extra seconds an outer sync takes when the world spans regions (twice this across clouds):
    the guess for a pair of regions until the run has measured their link (`link_measured`)."""
    replan_every_s: float = Field(300.0, gt=0)
    """How often a running world re-reads prices and risks and considers moving a replica (at the
    first boundary between outer steps once that long has passed)."""
    min_saving: float = Field(0.25, ge=0, lt=1)
    """Move a replica only when the new offer's expected USD per useful token is at least this share
    below the held one's (hysteresis: price jitter never moves a replica)."""
    region_cooldown_preemptions: int = Field(3, ge=1)
    """This many preemptions in one region within `region_cooldown_window_s` cool the region down:
    no new replica is placed there for `region_cooldown_s`."""
    region_cooldown_window_s: float = Field(3600.0, gt=0)
    """Window over which a region's preemptions are counted, seconds."""
    region_cooldown_s: float = Field(3600.0, ge=0)
    """How long a region whose preemptions spiked rests, seconds."""
    capacity_cooldown_s: float = Field(300.0, ge=0)
    """How long an offer that answered with a capacity error rests, seconds; with budget.max_hours,
    a spot offer whose VM was reclaimed within two minutes of its launch rests as long, and one whose
    older VM was reclaimed too once the run's relaunches were mostly taken young (docs/guide.md)."""
    deadline_slack: float = Field(0.1, ge=0, lt=1)
    """Share of `budget.max_hours` the planner keeps spare: it places the world to finish within
    the rest (preemptions make the finish uncertain). When the cheapest world would not, it rents
    faster GPUs or more replicas (up to `world.max_replicas`)."""
    pauses: bool = False
    """With `budget.max_hours` set: the world trains at `world.max_replicas` while the market's price
    per token is low against the prices the run has seen, and pauses while it is dear (a checkpoint,
    every replica VM released) until it falls or the deadline needs the time (`elastic.policy.rules`'s
    pause rule). Off, or without `budget.max_hours`: a steady world of `world.replicas`. Off by
    default: on the simulator's traces it pays about what the steady world pays on average, less on
    some markets and more on others (docs/benchmarks.md)."""
    price_sample_s: float = Field(300.0, gt=0)
    """How often the pause rule samples the market's price, seconds (its history is these samples)."""
    pause_slack: float = Field(2.0, ge=1.25)
    """Margin of the pause rule over the time the run needs: it trains while the market's price is
    no dearer than the cheapest prices seen that would, in the hours left, train `pause_slack` times
    the tokens left and one boot (the market's future taken to look like its past). Larger: fewer
    pauses, an earlier finish, a dearer run; at least 1.25 (it trains whatever the price once it
    needs 95 % of the time left)."""
    billing_increment_s: float | None = Field(None, gt=0)
    """Billing increment of a VM, seconds: a launch is allowed only when the spend so far plus every
    held VM and the new one for one increment stays within `budget.max_usd`. Empty: the cloud's
    (60 s, the minimum AWS and GCP bill; 1 s for the `local` market, billed per second)."""
    policy: str = "elastic"
    """The rental policy, by its name in the registry (`elastic.policy.registry`): `elastic`, the project's
    (the rules above: DiLoCo's survivors train through a preemption, replicas move as prices do),
    or a baseline it is compared with (`on-demand`, `spot-static`, `skypilot-like`: whole jobs that
    restart from their last checkpoint after any loss), which only `elastic simulate` runs.
    `elastic simulate` runs this one first, then every other registered one."""

    @model_validator(mode="after")
    def _check_policy(self) -> "PlannerSection":
        from elastic.errors import UserError
        from elastic.policy.registry import policy

        try:
            policy(self.policy)
        except UserError as exc:
            raise ValueError(f"@policy: {exc}") from None
        return self


class CheckpointSection(_Section):
    """Where and how often the training state is saved."""

    uri: str | None = None
    """Destination: `s3://bucket/prefix`, `gs://bucket/prefix`, `file:///abs/path` or a plain path
    (file:// must be a filesystem every node sees). Empty: `<run dir>/checkpoints`. A missing bucket
    or directory is created."""
    every_outer_steps: int = Field(10, ge=0)
    """Save every N outer steps (0: only at the end). A run also saves when every replica training
    has a notice (the world would otherwise restart from the last checkpoint) and when it stops
    early (budget, capacity)."""
    keep_last: int = Field(3, ge=1)
    """Keep the newest K complete checkpoints; older ones are deleted (never the newest)."""
    local_dir: str | None = None
    """The saving node writes its snapshot here beside training: a path on fast local disk, or `shm`
    for /dev/shm (RAM; needs room for one replica's state). Empty: the temp directory. Phase 2
    then uploads to `uri` in the background."""
    upload_threads: int = Field(8, ge=1, le=64)
    """Files each rank uploads at once in phase 2 (large files also go up in parallel parts)."""

    @model_validator(mode="after")
    def _check(self) -> "CheckpointSection":
        if self.uri is not None and "://" in self.uri:
            scheme, _, rest = self.uri.partition("://")
            if scheme not in _uri_schemes():
                raise ValueError(f"@uri: unsupported scheme {scheme}:// "
                                 f"(use {', '.join(f'{s}://' for s in _uri_schemes())} or a path)")
            if scheme != "file" and not rest.split("/", 1)[0]:
                raise ValueError(f"@uri: {self.uri} names no bucket")
        if self.uri is not None and (problem := _local_path_problem(self.uri)):
            raise ValueError(f"@uri: {self.uri}: {problem}")
        return self


def _local_checkpoint_path(uri: str) -> Path | None:
    """The directory a `file://` URI or a plain path names (None for an object store's URI)."""
    scheme, sep, rest = uri.partition("://")
    if sep and scheme != "file":
        return None
    return Path(rest if sep else uri).expanduser()


def _local_path_problem(uri: str) -> str | None:
    """What is wrong with a local checkpoint path on its face (no filesystem access): a `..`
    (which directory it means depends on links, e.g. /proc/self/..) or a kernel pseudo-filesystem."""
    path = _local_checkpoint_path(uri)
    if path is None:
        return None
    if ".." in path.parts:
        return "'..' is not allowed in a checkpoint path (name the directory it means)"
    if path.is_absolute() and len(path.parts) > 1 and path.parts[1] in ("proc", "sys"):
        return f"/{path.parts[1]} is a kernel pseudo-filesystem, not a place for checkpoints"
    return None


def _checkpoint_dir_problem(uri: str | None) -> str | None:
    """Why checkpoints cannot be written at a local `checkpoint.uri` on this machine, or None: the
    directory (or the nearest part of its path that exists) must be a writable directory."""
    path = _local_checkpoint_path(uri) if uri else None
    if path is None:
        return None
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


class _RecipeCore(_Section):
    """A training run: model, data, schedule, world shape, what to rent and how much to spend."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
    """Run name: letters, digits, `_ . -`; used in run directories and cloud tags."""
    model: ModelSection = Field(default_factory=ModelSection)
    """The network."""
    data: DataSection = Field(default_factory=DataSection)
    """The token source."""
    eval: EvalSection = Field(default_factory=EvalSection)
    """Validation."""
    logging: LoggingSection = Field(default_factory=LoggingSection)
    """Metrics: TensorBoard and W&B."""
    train: TrainSection = Field(default_factory=TrainSection)
    """Optimizers and schedule."""
    world: WorldSection = Field(default_factory=WorldSection)
    """Replicas and ranks."""
    resources: ResourcesSection = Field(default_factory=ResourcesSection)
    """What to rent."""
    budget: BudgetSection = Field(default_factory=BudgetSection)
    """Spend and time limits."""
    planner: PlannerSection = Field(default_factory=PlannerSection)
    """Where to rent and when to move."""
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    """Checkpoints."""
    # Then one section per provider, named after it (`local:`, `aws:`, `gcp:`): see `Recipe` below.

    def gpus_per_node(self) -> int:
        """GPUs of each VM this recipe rents (0: CPU-only): `resources.accelerators`' count for the
        clouds, the local instance types' `gpus` (the fewest, when they differ) for local runs."""
        if any(c != "local" for c in self.resources.clouds) and self.resources.accelerators:
            return int(self.resources.accelerators.partition(":")[2] or 1)
        if "local" in self.resources.clouds:
            return min(it.gpus for it in self.local.instance_types)
        return 0

    @model_validator(mode="after")
    def _check(self) -> "_RecipeCore":
        problems = []
        if self.world.ranks_per_replica is None:
            self.world.ranks_per_replica = self.gpus_per_node() or 1
        if self.train.seq_len > self.model.context:
            problems.append(f"train.seq_len ({self.train.seq_len}) must be <= model.context ({self.model.context})")
        if self.train.batch_size % self.world.ranks_per_replica:
            problems.append(
                f"train.batch_size ({self.train.batch_size}) must be a multiple of "
                f"world.ranks_per_replica ({self.world.ranks_per_replica})")
        per_rank = self.train.batch_size // self.world.ranks_per_replica
        mb = self.train.micro_batch_size
        if mb is not None and per_rank % mb:
            problems.append(f"train.micro_batch_size ({mb}) must divide the sequences each rank takes per step "
                            f"(train.batch_size / world.ranks_per_replica = {per_rank})")
        if self.world.fragments > 1 and self.train.inner_steps < 2 * self.world.fragments:
            problems.append(f"world.fragments ({self.world.fragments}) needs train.inner_steps of at least "
                            f"2 × fragments ({2 * self.world.fragments}): each fragment's sync overlaps half a slot")
        if self.eval.every_outer_steps and self.data.uri is None:
            problems.append("eval.every_outer_steps: validation needs data.uri (a shard directory with a val split)")
        from providers import available

        clouds = set(self.resources.clouds) - {"local"}
        if clouds and self.world.capacity_timeout_s < self.resources.join_timeout_s:
            problems.append(f"world.capacity_timeout_s ({self.world.capacity_timeout_s:g}) must be at least "
                            f"resources.join_timeout_s ({self.resources.join_timeout_s:g}) for cloud runs: "
                            "a node gets that long to boot and join")

        missing = sorted(c for c in set(self.resources.clouds) if not available(c))
        if missing:
            problems.append(f"resources.clouds: provider(s) {', '.join(missing)} are not available in this version")

        if problems:
            # One line per problem: format_errors splits the message on newlines.
            raise ValueError("\n".join(problems))
        return self

    @property
    def sequences_per_outer_step(self) -> int:
        """Sequences one replica consumes in one inner phase."""
        return self.train.inner_steps * self.train.batch_size

    def digest(self) -> str:
        """Stable hash of the resolved recipe (stored with checkpoints)."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def _with_provider_sections(core: type[_RecipeCore]) -> type[_RecipeCore]:
    """The recipe model: the core's sections, then each registered provider's own section (its
    class's `section` model), named after the provider. A new provider's settings join the recipe,
    its JSON schema and docs/recipe.md without an edit here."""
    from pydantic import create_model

    from providers import PROVIDERS, available, provider_class

    sections = {}
    for name in PROVIDERS:
        if available(name):
            model = provider_class(name).section
            sections[name] = (model, Field(default_factory=model, description=f"Settings of the `{name}` provider."))
    return create_model("Recipe", __base__=core, __doc__=core.__doc__, __module__=__name__, **sections)


Recipe = _with_provider_sections(_RecipeCore)


# ----------------------------------------------------------------------------------------------
# Loading

def _set_path(doc: dict, dotted: str, value: Any, origin: str) -> None:
    keys = dotted.split(".")
    if not all(keys):
        raise RecipeError([f"{origin}: {dotted!r} is not a field path (like train.inner_steps)"])
    node = doc
    for key in keys[:-1]:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise RecipeError([f"{origin}: {dotted}: {key} is not a section"])
        node = child
    node[keys[-1]] = value


def apply_overrides(doc: dict, overrides: list[str]) -> None:
    """Apply `field.path=value` strings to a raw recipe dict (values parsed as YAML scalars)."""
    for item in overrides:
        origin = f"--set {item}"
        path, eq, raw = item.partition("=")
        if not eq:
            raise RecipeError([f"{origin}: expected field.path=value"])
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        _set_path(doc, path.strip(), value, origin)


def _loc(loc: tuple) -> str:
    parts = []
    for p in loc:
        if isinstance(p, int):
            parts[-1:] = [f"{parts[-1]}[{p}]"] if parts else [f"[{p}]"]
        elif p in ("function-after", "function-before") or str(p).startswith("function-"):
            continue
        else:
            parts.append(str(p))
    return ".".join(parts)


def _closest_field(loc: tuple) -> str | None:
    """For an unknown key at `loc` in a recipe, the section's field name it most looks like (a typo
    such as `inner_step` for `inner_steps`), or None."""
    import difflib
    import typing

    from pydantic import BaseModel

    model: type[BaseModel] | None = Recipe
    for part in loc[:-1]:
        if isinstance(part, int):   # an item of a list of sections: the same section type
            continue
        field = model.model_fields.get(part)
        if field is None:
            return None
        kinds = [field.annotation, *typing.get_args(field.annotation)]
        model = next((k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)), None)
        if model is None:
            return None
    found = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1, cutoff=0.6)
    return found[0] if found else None


def format_errors(source: str, err: ValidationError) -> list[str]:
    """pydantic's validation errors as lines for people, one per problem: `SOURCE: field.path: what`."""
    lines = []
    for e in err.errors(include_url=False):
        loc = _loc(e["loc"])
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
            if match := _closest_field(e["loc"]):
                msg += f" (did you mean {match}?)"
        elif e["type"] == "missing":
            msg = "required field is missing"
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
            if msg.startswith("@"):
                # A check across fields of one section names the field it is about: "@field: ...".
                field, _, msg = msg[1:].partition(": ")
                loc = f"{loc}.{field}" if loc else field
        if e["type"] not in ("extra_forbidden", "missing") and "input" in e and not isinstance(e["input"], (dict, list)):
            msg = f"{msg} (got {e['input']!r})"
        lines.extend(f"{source}: {loc + ': ' if loc else ''}{m}" for m in msg.splitlines())
    return lines


def _check_files(recipe: Recipe, source: str) -> list[str]:
    problems = []
    if recipe.data.path is not None:
        p = Path(recipe.data.path)
        if not p.is_file():
            problems.append(f"{source}: data.path: no such file: {recipe.data.path}")
        elif p.stat().st_size < 2 * (recipe.train.seq_len + 1) * (2 if p.suffix == ".bin" else 1):
            problems.append(f"{source}: data.path: {recipe.data.path} is too small for train.seq_len")
        elif p.suffix == ".bin":
            import numpy as np
            if p.stat().st_size % 2:
                problems.append(f"{source}: data.path: {recipe.data.path} is not uint16 tokens (odd size)")
            else:
                top = int(np.memmap(p, dtype="<u2", mode="r").max())
                if top >= recipe.model.vocab_size:
                    problems.append(f"{source}: data.path: token id {top} in {recipe.data.path} is not below "
                                    f"model.vocab_size ({recipe.model.vocab_size})")
    if recipe.model.factory is not None:
        mod, colon, fn = recipe.model.factory.partition(":")
        if not colon or not mod or not fn:
            problems.append(f"{source}: model.factory: expected package.module:function, got {recipe.model.factory!r}")
        else:
            try:
                obj = getattr(importlib.import_module(mod), fn, None)
            except Exception as exc:  # any import failure is the user's to see, in one line
                problems.append(f"{source}: model.factory: cannot import {mod}: {described(exc, 10_000)}")
            else:
                if not callable(obj):
                    problems.append(f"{source}: model.factory: {mod} has no callable {fn}")
                else:
                    problems += _check_factory(obj, recipe, source)
    return problems


def launch_problems(recipe: Recipe, source: str) -> list[str]:
    """What keeps a valid recipe from being launched as it is (`validate` and `launch` check it;
    `plan`, `prices` and `simulate` need no more than a valid recipe)."""
    uri = recipe.checkpoint.uri
    clouds = set(recipe.resources.clouds) - {"local"}
    if clouds and recipe.resources.head == "controller" and (not uri or uri.startswith("file://") or "://" not in uri):
        # The driver runs on the controller: its disk is neither durable nor visible to the nodes.
        return [f"{source}: checkpoint.uri: a cloud run with resources.head: controller needs an s3:// or gs:// "
                "destination (the controller's disk is not reachable from the nodes and goes with it)"]
    # The driver writes the manifests there: found now, before a run directory is made.
    if problem := _checkpoint_dir_problem(uri):
        return [f"{source}: checkpoint.uri: {uri}: {problem}"]
    return []


def launch_warnings(recipe: Recipe) -> list[str]:
    """What a launchable recipe may get wrong on real VMs (`validate` and `launch` print it and go
    on): with the head on this machine, a `file://` checkpoint (or the default, the run directory)
    is written shard by shard by each cloud VM to its own disk, so it is lost with the VM and no
    other node can restore it, unless that path is one filesystem every node mounts."""
    uri = recipe.checkpoint.uri
    clouds = sorted(set(recipe.resources.clouds) - {"local"})
    if clouds and (not uri or uri.startswith("file://") or "://" not in uri):
        where = uri or "<run dir>/checkpoints (checkpoint.uri is empty)"
        return [f"checkpoint.uri: {where} is on each {'/'.join(clouds)} VM's own disk: its shards go with "
                "the VM and no other node can restore them unless every node mounts that path as one "
                "shared filesystem; use an s3:// or gs:// destination"]
    return []


def _check_factory(factory, recipe: Recipe, source: str) -> list[str]:
    """Call `model.factory` as replicas will, on torch's meta device (no memory for weights): it must
    return an `nn.Module`."""
    import torch
    from torch import nn

    try:
        with torch.device("meta"):
            model = factory(recipe.model.model_dump())
    except Exception as exc:  # the user's code: its failure is theirs to see, in one line
        return [f"{source}: model.factory: {recipe.model.factory} failed: {described(exc, 10_000)}"[:300]]
    if not isinstance(model, nn.Module):
        return [f"{source}: model.factory: {recipe.model.factory} returned {type(model).__name__}, not an nn.Module"]
    return []


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load that refuses a key given twice in one mapping (YAML would keep the last one
    silently, so a recipe could say two things and mean one)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            try:
                seen.add(key)
            except TypeError:
                pass   # an unhashable key: SafeLoader reports it below
        return super().construct_mapping(node, deep=deep)


def _check_sources(recipe: Recipe, source: str) -> list[str]:
    """`model.hf` resolves and `data.uri` holds an index that fits the model (one line each)."""
    from elastic.errors import UserError

    problems, vocab, model_field = [], recipe.model.vocab_size, "model.vocab_size"
    if recipe.model.hf is not None:
        from elastic.models.hf import hf_config
        try:
            vocab, model_field = hf_config(recipe.model.hf).vocab_size, f"the vocabulary of {recipe.model.hf}"
        except UserError as exc:
            problems += [f"{source}: {line}" for line in exc.lines]
            vocab = None
    elif recipe.model.factory is not None:
        vocab = None   # a user's module: its vocabulary is its own business
    if recipe.data.uri is not None:
        from elastic.train.data import read_index
        try:
            index = read_index(recipe.data.uri)
        except UserError as exc:
            return problems + [f"{source}: data.uri: {line}" for line in exc.lines]
        if vocab is not None and index.vocab_size is not None and index.vocab_size > vocab:
            problems.append(f"{source}: data.uri: the shards' vocabulary ({index.vocab_size} ids, {index.dtype}) is "
                            f"larger than {model_field} ({vocab})")
        if index.dtype == "uint16" and index.vocab_size is not None and index.vocab_size > 65536:
            problems.append(f"{source}: data.uri: dtype uint16 cannot hold a vocabulary of {index.vocab_size}")
        if max(t for _, t in index.splits["train"]) < recipe.train.seq_len + 1:
            problems.append(f"{source}: data.uri: no train shard holds one window of train.seq_len + 1 "
                            f"({recipe.train.seq_len + 1}) tokens")
        if recipe.eval.every_outer_steps and not index.splits.get("val"):
            problems.append(f"{source}: eval.every_outer_steps: {recipe.data.uri} has no val split")
    return problems


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read, override and validate a recipe file. Raises RecipeError with one line per problem."""
    source = str(path)
    p = Path(path)
    if not p.exists():
        raise RecipeError([f"{source}: no such file"])
    if not p.is_file():
        raise RecipeError([f"{source}: not a file"])
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError([f"{source}: cannot read: {exc}"]) from None
    try:
        doc = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or first_line(exc, 10_000)
        raise RecipeError([f"{source}: invalid YAML: {where}{problem}"]) from None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise RecipeError([f"{source}: a recipe is a mapping of sections, got {type(doc).__name__}"])
    apply_overrides(doc, overrides or [])
    data = doc.get("data")
    if isinstance(data, dict) and isinstance(data.get("path"), str):
        # Every rank opens this file; make it absolute now (relative to where elastic runs).
        data["path"] = str(Path(data["path"]).expanduser().absolute())
    market = (doc.get("local") or {}).get("market") if isinstance(doc.get("local"), dict) else None
    if isinstance(market, dict) and isinstance(market.get("trace"), str):
        market["trace"] = str((p.parent / Path(market["trace"]).expanduser()).absolute())
    return validate_recipe(doc, source)


def validate_recipe(doc: dict, source: str = "<recipe>") -> Recipe:
    """Validate a raw recipe dict; RecipeError lists every problem."""
    try:
        recipe = Recipe.model_validate(doc)
    except ValidationError as err:
        raise RecipeError(format_errors(source, err)) from None
    problems = _check_files(recipe, source) + _check_sources(recipe, source)
    trace = recipe.local.market.trace
    if trace is not None:
        if not Path(trace).is_file():
            problems.append(f"{source}: local.market.trace: no such file: {trace}")
        else:
            from providers.simmarket import TraceError, read_trace
            try:
                rows = read_trace(trace)
            except (TraceError, OSError, UnicodeDecodeError) as exc:
                problems.append(f"{source}: local.market.trace: {first_line(exc, 10_000)}")
            else:
                known = {(it.zone, it.name) for it in recipe.local.instance_types}
                for zone, itype in sorted(set(rows) - known):
                    problems.append(f"{source}: local.market.trace: zone {zone} / instance type {itype} is not in "
                                    "local.instance_types")
    if problems:
        raise RecipeError(problems)
    return recipe


def dump_recipe(recipe: Recipe) -> str:
    """The resolved recipe as YAML (every default spelled out)."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
