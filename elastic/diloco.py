"""DiLoCo outer state of one rank, and the reconfigurable outer process group.

Each rank of a replica holds the outer (global) parameters θ for *its own shard* of the model,
as one flat fp32 tensor: on the CPU (pinned when the model is on a GPU), or on the GPU
(`train.outer_device`). After H inner steps the pseudo-gradient Δ = θ − θ_local is formed in
a preallocated flat buffer (beside θ, then copied to a host buffer for the sync), averaged over
the replicas alive at this outer step (one outer group per rank, shard r of every replica talking
to shard r of every other; how Δ travels is the codec's business, elastic/outer_sync.py), and an
outer Nesterov SGD step updates θ; θ is then copied back into the model's local shards.

The outer group is a standalone gloo process group over a prefix of a store the driver owns, keyed
by the membership epoch: when replicas come or go the driver bumps the epoch and every survivor
builds a fresh group, without touching the replica's own (inner, FSDP) group. Same idea as
torchft's reconfigurable ProcessGroupGloo; see docs/architecture.md.
"""

from __future__ import annotations

import datetime
import logging
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from elastic.outer_sync import Dense

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
        codec: how Δ crosses to the other replicas (`elastic.outer_sync.make_codec(numel, ...)`);
            None: a float32 all-reduce.
        device: where θ, the outer momentum and the outer step live (`outer_device`); Δ for the
            sync is always on the host (the outer group is gloo), pinned when the model is on a GPU.
    """

    def __init__(self, params: list[nn.Parameter], lr: float, momentum: float, nesterov: bool,
                 codec: Callable[[int], object] | None = None, device: torch.device | str = "cpu"):
        self._locals = [local_shard(p) for p in params]
        sizes = [t.numel() for t in self._locals]
        self.numel = sum(sizes)
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
        self.optimizer = torch.optim.SGD([self.theta], lr=lr, momentum=momentum, nesterov=nesterov)
        copy_all(self._theta_views, self._locals)
        self._pg: dist.ProcessGroup | None = None
        self._epoch = -1
        self.pending = False   # Δ is formed and not yet applied
        self.reduced = False   # the codec holds the average of this epoch's Δs, ready to apply

    def form_pseudo_gradient(self) -> None:
        """Δ = θ_outer − θ_local, into the preallocated buffer (kept until an outer step applies it)."""
        copy_all(self._grad_views, self._locals)
        self._grad.sub_(self.theta.data).neg_()
        if self._grad is not self.delta:
            copy_all([self.delta], [self._grad])
        self.pending = True
        self.reduced = False

    def join_group(self, store: dist.Store, epoch: int, index: int, size: int, timeout_s: float, shard: int,
                   device) -> None:
        """Build (once per epoch) the outer group of shard `shard`: this rank is `index` of `size`,
        reachable at gloo `device` (elastic/netaddr.py decides its address)."""
        if epoch == self._epoch and self._pg is not None:
            return
        self._pg = None
        prefix = dist.PrefixStore(f"outer/e{epoch}/s{shard}", store)
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [device]
        opts._timeout = datetime.timedelta(seconds=timeout_s)
        self._pg = dist.ProcessGroupGloo(prefix, index, size, opts)
        self._epoch = epoch

    def all_reduce(self, index: int, size: int) -> None:
        """Average Δ over the outer group (this rank is `index` of `size`) through the codec (phase
        1: nothing is applied yet). Raises if a member fails; Δ and the error feedback are untouched."""
        self.reduced = False
        try:
            self._average, self.bytes_sent, self.network_s = self.codec.reduce(self._pg, self.delta, index, size)
        except Exception:
            self._pg, self._epoch = None, -1
            raise
        self.reduced = True

    def apply(self) -> None:
        """Phase 2, once every member reduced: the outer step with the averaged Δ, θ back into the
        model; what the codec did not send becomes this rank's error feedback."""
        if not self.reduced:
            raise RuntimeError("outer apply without a completed all-reduce")
        self.delta.copy_(self._average)
        self.codec.commit()
        self.step_with_delta()

    @property
    def averaged(self) -> torch.Tensor:
        """The averaged Δ of the last completed all-reduce: what `apply` applies."""
        return self._average

    def step_with_delta(self) -> None:
        """An outer step with the averaged Δ already in `delta` (a joiner replaying a step the
        world took): what `apply` does, without the all-reduce or the codec's commit."""
        if self._grad is not self.delta:
            copy_all([self._grad], [self.delta])   # waited for: a joiner's replay refills delta next
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
