"""DiLoCo outer state of one rank, and the reconfigurable outer process group.

Each rank of a replica holds the outer (global) parameters θ for *its own shard* of the model,
as one flat fp32 tensor: on the CPU (pinned when the model is on a GPU), or on the GPU
(`train.outer_device`). After H inner steps the pseudo-gradient Δ = θ − θ_local is formed in
a preallocated flat buffer (beside θ, then copied to a host buffer for the sync), averaged over
the replicas alive at this outer step (one outer group per rank, shard r of every replica talking
to shard r of every other; how Δ travels is the codec's business, elastic/train/outer_sync.py), and an
outer Nesterov SGD step updates θ; θ is then copied back into the model's local shards.

The outer group is a standalone gloo process group over a prefix of a store the driver owns, keyed
by the membership epoch: when replicas come or go the driver bumps the epoch and every survivor
builds a fresh group, without touching the replica's own (inner, FSDP) group. Same idea as
torchft's reconfigurable ProcessGroupGloo; see docs/architecture.md.

`Fragments` holds a rank's outer state as Streaming DiLoCo's fragments (`world.fragments`), one
`OuterState` each, synced in a background thread during the inner phase; with one fragment it is
the blocking sync above.
"""

from __future__ import annotations

import datetime
import logging
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from elastic.train.optim import SGD
from elastic.train.outer_sync import Dense

log = logging.getLogger(__name__)


def copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[i].copy_(src[i]) for every i: one fused call when all share a device, else queued one
    by one and waited for once (θ_outer in pinned host memory, a GPU replica's shards on the GPU:
    the copies run back to back, and the host buffer is free again when this returns)."""
    if not dst:
        return
    if dst[0].device == src[0].device:
        torch._foreach_copy_(dst, src)
        return
    for d, t in zip(dst, src):
        d.copy_(t, non_blocking=True)
    gpu = dst[0].device if dst[0].is_cuda else src[0].device
    torch.cuda.current_stream(gpu).synchronize()


def outer_device(choice: str, device: torch.device, numel: int) -> torch.device:
    """Where θ_outer, the outer momentum and the outer step live (`train.outer_device`) for a rank
    training on `device` with `numel` values in its shard: the CPU for a CPU rank; `auto` puts
    them on the GPU when their 12 bytes per value (θ, momentum, Δ in fp32) fit in a quarter of its
    memory (the rest is the model's, its optimizer's and the activations')."""
    if device.type != "cuda" or choice == "cpu":
        return torch.device("cpu")
    if choice == "cuda" or 12 * numel <= torch.cuda.get_device_properties(device).total_memory // 4:
        return device
    return torch.device("cpu")


def local_shard(p: torch.Tensor) -> torch.Tensor:
    """The tensor this rank actually holds for parameter `p` (a DTensor's local shard, or `p`)."""
    to_local = getattr(p, "to_local", None)
    return (to_local() if to_local is not None else p).detach()


class OuterState:
    """θ_outer, Δ and the outer optimizer for one rank's shard of the model.

    Args:
        params: the model's parameters (DTensors under FSDP2, or plain tensors), in a fixed order.
        lr: outer SGD learning rate.
        momentum: outer SGD momentum.
        nesterov: Nesterov momentum.
        codec: how Δ crosses to the other replicas (`elastic.train.outer_sync.make_codec(numel, ...)`);
            None: a float32 all-reduce.
        device: where θ, the outer momentum and the outer step live (`outer_device`); Δ for the
            sync is always on the host (the outer group is gloo), pinned when the model is on a GPU.
    """

    def __init__(self, params: list[nn.Parameter], lr: float, momentum: float, nesterov: bool,
                 codec: Callable[[int], object] | None = None, device: torch.device | str = "cpu"):
        self._locals = [local_shard(p) for p in params]
        sizes = [t.numel() for t in self._locals]
        self.numel = sum(sizes)
        self._sizes = sizes
        self._drift: torch.Tensor | None = None   # `apply(keep_drift=True)`'s buffer
        pin = any(t.is_cuda for t in self._locals)
        self.theta = nn.Parameter(torch.empty(self.numel, dtype=torch.float32, device=device, pin_memory=pin and
                                              torch.device(device).type == "cpu"), requires_grad=False)
        self.delta = torch.zeros(self.numel, dtype=torch.float32, pin_memory=pin)
        # Δ beside θ: the step's gradient. The host `delta` itself when θ is on the host; on the
        # GPU a buffer of its own, copied to and from `delta` around the sync.
        self._grad = self.delta if self.theta.device.type == "cpu" else torch.zeros_like(self.theta.data)
        self._theta_views = [v.view(t.shape) for v, t in zip(self.theta.data.split(sizes), self._locals)]
        self._grad_views = [v.view(t.shape) for v, t in zip(self._grad.split(sizes), self._locals)]
        # The codec reduces into its own buffers, never into Δ or its error feedback: an attempt
        # that a member dies in leaves both intact for the retry over the survivors.
        self.codec = codec(self.numel) if codec is not None else Dense(self.numel, torch.float32)
        self._average: torch.Tensor | None = None
        self.bytes_sent = 0     # by this rank in the last reduce
        self.network_s = 0.0    # inside its collectives
        self.theta.grad = self._grad
        self.optimizer = SGD([self.theta], lr=lr, momentum=momentum, nesterov=nesterov)
        copy_all(self._theta_views, self._locals)
        self._delta_on_host = True   # whether `delta` holds the Δ formed last (always, with θ on the host)
        self.pending = False   # Δ is formed and not yet applied
        self.reduced = False   # the codec holds the average of this epoch's Δs, ready to apply

    def form_pseudo_gradient(self) -> None:
        """Δ = θ_outer − θ_local, into the preallocated buffer beside θ (kept until an outer step
        applies it). On the GPU it is copied to the host only when a sync sends it."""
        copy_all(self._grad_views, self._locals)
        self._grad.sub_(self.theta.data).neg_()
        self._delta_on_host = self._grad is self.delta
        self.pending = True
        self.reduced = False

    def all_reduce(self, pg, index: int, size: int) -> None:
        """Average Δ over the outer group `pg` (this rank is `index` of `size`) through the codec
        (phase 1: nothing is applied yet). Raises if a member fails; Δ and the error feedback are
        untouched. Alone with the dense codec, the average is Δ itself, left where it was formed:
        no copy through the host."""
        self.reduced = False
        if size == 1 and isinstance(self.codec, Dense):
            self._average, self.bytes_sent, self.network_s = self._grad, 0, 0.0
        else:
            if not self._delta_on_host:
                copy_all([self.delta], [self._grad])
                self._delta_on_host = True
            self._average, self.bytes_sent, self.network_s = self.codec.reduce(pg, self.delta, index, size)
        self.reduced = True

    def apply(self, keep_drift: bool = False) -> None:
        """Phase 2, once every member reduced: the outer step with the averaged Δ, θ back into the
        model; what the codec did not send becomes this rank's error feedback.

        Args:
            keep_drift: Δ was formed some inner steps ago and training went on meanwhile (a
                streamed fragment): the model gets θ_outer_new + (θ_local_now − θ_local_at_Δ)
                instead of θ_outer_new, keeping those steps' progress (docs/architecture.md).
        """
        if not self.reduced:
            raise RuntimeError("outer apply without a completed all-reduce")
        if keep_drift:
            if self._drift is None:   # once: a buffer beside θ
                self._drift = torch.zeros_like(self.theta.data)
                self._drift_views = [v.view(t.shape) for v, t in zip(self._drift.split(self._sizes), self._locals)]
            copy_all(self._drift_views, self._locals)
            self._drift.sub_(self.theta.data).add_(self._grad)   # θ_local − (θ_outer − Δ): since Δ was formed
        self.codec.commit()
        if self._average is self._grad:   # alone: the average is Δ itself, beside θ
            self._step()
        else:                             # in the codec's buffer: through `delta`
            self.delta.copy_(self._average)
            self.step_with_delta()
        if keep_drift:
            self._drift.add_(self.theta.data)
            copy_all(self._locals, self._drift_views)

    @property
    def averaged(self) -> torch.Tensor:
        """The averaged Δ of the last completed all-reduce: what `apply` applies."""
        return self._average

    def step_with_delta(self) -> None:
        """An outer step with the averaged Δ already in `delta` (a joiner replaying a step the
        world took): what `apply` does, without the all-reduce or the codec's commit."""
        if self._grad is not self.delta:
            copy_all([self._grad], [self.delta])   # waited for: a joiner's replay refills delta next
        self._step()

    def _step(self) -> None:
        """The outer SGD step with the averaged Δ in `_grad`; θ back into the model."""
        self.optimizer.step()
        copy_all(self._locals, self._theta_views)
        self.pending = self.reduced = False

    def momentum(self) -> torch.Tensor | None:
        """The outer momentum buffer (flat, this rank's shard), or None before the first step."""
        return self.optimizer.state.get(self.theta, {}).get("momentum_buffer")

    def shard_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """`flat` (numel of this rank's shard) split into per-parameter views."""
        return [v.view(t.shape) for v, t in zip(flat.split([t.numel() for t in self._locals]), self._locals)]

    def export(self) -> dict:
        """θ_outer, the outer momentum and the codec's error feedback of this shard (for a joining
        replica's same rank)."""
        m, e = self.momentum(), self.codec.error
        return {"theta": self.theta.data.to("cpu", copy=True),
                "momentum": None if m is None else m.to("cpu", copy=True),
                "error": None if e is None else e.clone()}

    def load(self, state: dict) -> None:
        """Take θ_outer, the outer momentum and the error feedback from a peer (or a checkpoint); θ
        goes into the model. A joiner takes the peer's error feedback as its own: what is applied is
        the members' mean residual, and a copy keeps that mean, where zeros would dilute it."""
        self.theta.data.copy_(state["theta"])
        if state.get("momentum") is not None:
            self.optimizer.state[self.theta]["momentum_buffer"] = state["momentum"].to(self.theta.device, copy=True)
        if self.codec.error is not None and state.get("error") is not None:
            self.codec.error.copy_(state["error"])
        copy_all(self._locals, self._theta_views)
        self.pending = self.reduced = False


def split_fragments(numels: list[int], n: int) -> list[range]:
    """Streaming DiLoCo's fragments: `n` contiguous runs of parameter indices, balanced by numel
    (`numels`: each parameter's global numel, so every rank of every replica cuts alike). Fragment
    k ends at the first parameter where the running sum reaches (k+1)/n of the total; every
    fragment has at least one parameter. ValueError when there are fewer parameters than `n`."""
    if n > len(numels):
        raise ValueError(f"world.fragments {n}: the model has only {len(numels)} parameter tensors")
    total, cuts, run = sum(numels), [], 0
    for i, x in enumerate(numels):
        run += x
        left = len(numels) - i - 1   # parameters after this one
        # Cut here when this fragment is full, or when the remaining fragments need every parameter left.
        if len(cuts) < n - 1 and (run * n >= (len(cuts) + 1) * total or left == n - 1 - len(cuts)):
            cuts.append(i + 1)
    bounds = [0, *cuts, len(numels)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def fragment_schedule(inner_steps: int, n: int) -> list[tuple[int, int]]:
    """When each fragment syncs within an inner phase of `inner_steps` steps, as (start, apply):
    fragment f's Δ is formed and its all-reduce started once `start` inner steps are done, and its
    outer update applied once `apply` are done. Fragment f's slot ends at step (f+1)·⌊H/N⌋; its
    sync starts half a slot before (τ = ⌊slot/2⌋ steps of overlap), so every fragment is applied
    inside the phase and the outer-step boundary holds no sync in flight. One fragment: start =
    apply = H, today's blocking sync."""
    if n == 1:
        return [(inner_steps, inner_steps)]
    slot = inner_steps // n
    tau = slot // 2
    return [((f + 1) * slot - tau, (f + 1) * slot) for f in range(n)]


class Fragments:
    """The outer state of one rank as Streaming DiLoCo's fragments: one `OuterState` (θ_outer, Δ,
    outer momentum, codec with its error feedback) per contiguous group of parameters, each synced
    at its own point of the inner phase over one shared outer group.

    During the inner phase (`begin_phase`, `after_inner_step`, `end_phase`) fragment f's all-reduce
    runs in a background thread (one, so every rank issues the group's collectives in the same
    order) while inner steps go on; its update is applied by the training thread at its apply point
    (`fragment_schedule`). A fragment is applied only if every member of the group reduced it: each
    member counts itself in the driver's store, and the first to see the full count, or anyone to
    see a failure (a member whose collective failed, the driver dropping a member), settles the fragment's decision key with compare-and-set: `apply` or `abort`, the same
    answer for all. A fragment aborted, and every later one of that phase, is left *pending*: its
    Δ is formed again at the end of the phase and synced by the driver's blocking outer sync over
    the survivors (`join_group`, `all_reduce`, `apply`), like the whole model with one fragment.

    Args:
        params: the model's parameters, in order.
        n: fragments (`world.fragments`).
        inner_steps: H.
        make_outer: builds the OuterState of a list of parameters.
        on_apply: called with (fragment, averaged Δ) after each fragment's outer step (a donor's
            log for its joiners).
    """

    def __init__(self, params: list[nn.Parameter], n: int, inner_steps: int,
                 make_outer: Callable[[list[nn.Parameter]], OuterState],
                 on_apply: Callable[[int, torch.Tensor], None] = lambda f, delta: None):
        self.parts = [make_outer(params[r.start:r.stop]) for r in split_fragments([p.numel() for p in params], n)]
        self.numel = sum(p.numel for p in self.parts)
        self._schedule = fragment_schedule(inner_steps, n)
        self._on_apply = on_apply
        self._pg: dist.ProcessGroup | None = None
        self._epoch = -1
        self._pool = None   # the background sync thread (a one-worker executor), made at first use
        self._phase: dict | None = None   # the inner phase under way (`begin_phase`)
        self.pending: list[int] = [0] if n == 1 else []   # fragments the blocking sync reduces
        # This outer step's sync traffic of this rank, streamed and blocking: bytes sent; seconds
        # the sync was under way (a streamed fragment's from its start to its decision, the
        # blocking sync's inside its collectives); of those, seconds training waited for it, and
        # seconds it ran beside inner steps.
        self.bytes_sent = 0
        self.network_s = 0.0
        self.wait_s = 0.0
        self.overlapped_s = 0.0

    # -- the outer group ---------------------------------------------------------------------------

    def join_group(self, store: dist.Store, epoch: int, index: int, size: int, timeout_s: float, shard: int,
                   device) -> None:
        """Build (once per epoch) the outer group of shard `shard`: this rank is `index` of `size`,
        reachable at gloo `device` (elastic/net/netaddr.py decides its address)."""
        if epoch == self._epoch and self._pg is not None:
            return
        self._pg = None
        prefix = dist.PrefixStore(f"outer/e{epoch}/s{shard}", store)
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [device]
        opts._timeout = datetime.timedelta(seconds=timeout_s)
        self._pg = dist.ProcessGroupGloo(prefix, index, size, opts)
        self._epoch = epoch

    def _reduce(self, f: int, index: int, size: int) -> tuple[int, float]:
        """Fragment f's all-reduce over the group; (bytes sent, seconds in collectives). A failure
        forgets the group (the next epoch builds a fresh one) and raises."""
        part = self.parts[f]
        try:
            part.all_reduce(self._pg, index, size)
        except Exception:
            self._pg, self._epoch = None, -1
            raise
        return part.bytes_sent, part.network_s

    # -- the blocking sync (the driver's outer_sync / outer_apply) ---------------------------------

    def all_reduce(self, index: int, size: int) -> None:
        """Average the pending fragments' Δs over the outer group (phase 1: nothing is applied).
        Raises if a member fails; Δ and the error feedback are untouched."""
        sent, net = 0, 0.0
        for f in self.pending:
            b, s = self._reduce(f, index, size)
            sent, net = sent + b, net + s
        base = self._phase or {}
        self.bytes_sent = base.get("bytes", 0) + sent
        self.network_s = base.get("network_s", 0.0) + net
        self.wait_s = base.get("wait_s", 0.0) + net
        self.overlapped_s = base.get("overlapped_s", 0.0)

    def apply(self) -> None:
        """Phase 2: the outer step of each pending fragment (Δ formed at the end of the phase, so
        nothing to keep from after it)."""
        for f in self.pending:
            self.parts[f].apply()
            self._on_apply(f, self.parts[f].averaged)
        self.pending = [0] if len(self.parts) == 1 else []
        self._phase = None

    # -- the streamed syncs of an inner phase ------------------------------------------------------

    def begin_phase(self, store: dist.Store | None, key: str, group: tuple | None, timeout_s: float, shard: int,
                    device) -> None:
        """An inner phase begins. `group`: (epoch, index, size) of the phase's members, whose
        fragments are synced in the background (None: none is; every fragment waits for the
        blocking sync). `key`: this phase's prefix for the fragments' decision keys in `store`
        (unique per epoch, phase and shard)."""
        self._phase = {"store": store, "key": key, "group": group if len(self.parts) > 1 else None,
                       "timeout_s": timeout_s, "shard": shard, "device": device, "started": {},
                       "settled": set(), "applied": set(), "broken": False, "bytes": 0, "network_s": 0.0, "wait_s": 0.0,
                       "overlapped_s": 0.0}
        self.bytes_sent, self.network_s, self.wait_s, self.overlapped_s = 0, 0.0, 0.0, 0.0

    def after_inner_step(self, done: int) -> None:
        """`done` inner steps of the phase are done: start the fragment whose sync starts here, apply
        the one whose apply point this is (waiting for its all-reduce if it has not finished: the
        only time training waits on the network inside a phase)."""
        ph = self._phase
        if ph is None or ph["group"] is None:
            return
        for f, (start, apply) in enumerate(self._schedule):
            if done == start:
                self._start(f)
            if done == apply and f in ph["started"]:
                self._settle(f)

    def _start(self, f: int) -> None:
        """Form fragment f's Δ and queue its sync on the background thread."""
        self.parts[f].form_pseudo_gradient()
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="fragment-sync")
        self._phase["started"][f] = self._pool.submit(self._sync_in_background, f)

    def _settle(self, f: int) -> None:
        """Wait for fragment f's decision; apply it (keeping the steps trained since its Δ) if every
        member reduced it."""
        ph = self._phase
        t0 = time.monotonic()
        outcome, sent, busy_s = ph["started"][f].result()
        waited_s = time.monotonic() - t0
        ph["settled"].add(f)
        ph["bytes"] += sent
        ph["network_s"] += busy_s
        ph["wait_s"] += min(waited_s, busy_s)
        ph["overlapped_s"] += max(0.0, busy_s - waited_s)
        if outcome == "apply":
            self.parts[f].apply(keep_drift=True)
            self._on_apply(f, self.parts[f].averaged)
            ph["applied"].add(f)

    def _sync_in_background(self, f: int) -> tuple[str, int, float]:
        """The background thread's job for fragment f: all-reduce it, then settle its decision.
        Returns (`apply` or `abort`, bytes sent, seconds from its start to its decision)."""
        t0 = time.monotonic()
        ph = self._phase
        store, key = ph["store"], f"{ph['key']}/{f}"
        epoch, index, size = ph["group"]
        sent = 0
        try:
            if ph["broken"]:
                raise RuntimeError("an earlier fragment of this phase was aborted")
            if size > 1:
                self.join_group(store, epoch, index, size, ph["timeout_s"], ph["shard"], ph["device"])
            sent, _ = self._reduce(f, index, size)
            store.add(f"{key}/n", 1)
            while not store.check([key]):
                if int(store.add(f"{key}/n", 0)) >= size:
                    store.compare_set(key, "", "apply")
                else:
                    time.sleep(0.002)   # polling the driver's store while peers finish theirs
            outcome = store.get(key).decode()
        except Exception as exc:
            log.warning("fragment %d sync failed: %s", f, exc)
            outcome = store.compare_set(key, "", "abort").decode()
        if outcome != "apply":
            ph["broken"] = True
            self._pg, self._epoch = None, -1   # a collective may be left half done: a fresh group next
        return outcome, sent, time.monotonic() - t0

    def end_phase(self) -> dict:
        """The inner phase ended (after H steps, or earlier on a notice): start the fragments not
        started yet (their peers, further along, wait in those collectives: a phase cut short syncs
        them now, with the Δ it has), settle every fragment in order, and form Δ of every fragment
        not applied: the pending ones, for the blocking sync. Returns
        {"pending": count, "fresh_group": whether the blocking sync needs a new outer group (a
        background sync was aborted: its group may hold a half-done collective)}."""
        ph = self._phase
        streamed = ph is not None and ph["group"] is not None
        if streamed:
            for f in range(len(self.parts)):
                if f not in ph["started"]:   # the phase ended before its start point (a notice)
                    self._start(f)
                if f not in ph["settled"]:
                    self._settle(f)
        applied = ph["applied"] if streamed else set()
        self.pending = [f for f in range(len(self.parts)) if f not in applied]
        for f in self.pending:
            self.parts[f].form_pseudo_gradient()
        if ph is not None:
            self.bytes_sent, self.network_s, self.wait_s, self.overlapped_s = (
                ph["bytes"], ph["network_s"], ph["wait_s"], ph["overlapped_s"])
        return {"pending": len(self.pending), "fresh_group": streamed and bool(self.pending)}

    # -- state: one flat vector over all fragments, in parameter order -----------------------------

    @property
    def theta(self) -> torch.Tensor:
        """θ_outer of this shard, flat (a copy when there are several fragments)."""
        if len(self.parts) == 1:
            return self.parts[0].theta
        return torch.cat([p.theta.data.to("cpu") for p in self.parts])

    @property
    def error(self) -> torch.Tensor | None:
        """The codecs' error feedback, flat (None when the codec has none)."""
        errors = [p.codec.error for p in self.parts]
        return None if errors[0] is None else (errors[0] if len(errors) == 1 else torch.cat(errors))

    def momentum(self) -> torch.Tensor | None:
        """The outer momentum, flat, where it lives (the buffer itself with one fragment: a
        checkpoint's stager copies it to the host once, without a pageable copy first), or None
        before any fragment's first step (a fragment without one yet counts as zeros)."""
        ms = [p.momentum() for p in self.parts]
        if all(m is None for m in ms):
            return None
        if len(ms) == 1:
            return ms[0]
        return torch.cat([torch.zeros(p.numel) if m is None else m.to("cpu") for p, m in zip(self.parts, ms)])

    def shard_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """`flat` (numel of this rank's shard) split into per-parameter views."""
        out = []
        for part, piece in zip(self.parts, flat.split([p.numel for p in self.parts])):
            out += part.shard_views(piece)
        return out

    def split(self, flat: torch.Tensor | None) -> list[torch.Tensor | None]:
        """`flat` cut into the fragments' pieces (None stays None)."""
        return [None] * len(self.parts) if flat is None else list(flat.split([p.numel for p in self.parts]))

    def export(self) -> dict:
        """θ_outer, the outer momentum and the error feedback of this shard, flat."""
        e = self.error
        m = self.momentum()
        return {"theta": self.theta.data.to("cpu", copy=True), "momentum": None if m is None else m.to("cpu", copy=True),
                "error": None if e is None else e.clone()}

    def load(self, state: dict) -> None:
        """Take flat θ_outer, outer momentum and error feedback (a peer's or a checkpoint's)."""
        for part, theta, m, e in zip(self.parts, self.split(state["theta"]), self.split(state.get("momentum")),
                                     self.split(state.get("error"))):
            part.load({"theta": theta, "momentum": m, "error": e})
        self.pending = [0] if len(self.parts) == 1 else []
