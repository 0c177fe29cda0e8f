"""The world: the driver's view of the live replicas and the DiLoCo outer loop over them.

A replica is `ranks_per_replica` Ray actors pinned to one node. Per outer step the driver leases
each replica a disjoint range of sample indices, runs the inner phase on every rank, then the
outer sync over the replicas of the current membership epoch. The driver owns the TCPStore every
process group rendezvouses through, so the outer group can be re-formed (new epoch) whenever the
membership changes.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import time
from dataclasses import dataclass, field

from elastic.recipe import Recipe

log = logging.getLogger(__name__)


@dataclass
class Replica:
    """A replica the world trains with.

    Args:
        replica_id: unique id for the run (never reused).
        instance_id: the VM it runs on.
        node_id: Ray node id of that VM.
        actors: one actor handle per rank, rank order.
        joined_step: the outer step it first contributes to.
    """

    replica_id: int
    instance_id: str
    node_id: str
    actors: list = field(default_factory=list)
    joined_step: int = 0


@dataclass
class StepResult:
    """What one outer step produced.

    Args:
        outer_step: the step just completed (1-based).
        replicas: ids of the replicas that contributed.
        losses: mean loss over the world for each inner step.
        tokens: tokens trained in this step (all replicas).
        inner_s: slowest inner phase, seconds.
        sync_s: outer sync, seconds.
        bytes_sent: pseudo-gradient bytes each rank all-reduced.
    """

    outer_step: int
    replicas: list[int]
    losses: list[float]
    tokens: int
    inner_s: float
    sync_s: float
    bytes_sent: int


class World:
    """Args:
        recipe: the resolved recipe.
        store_host: address replicas reach the driver's store on.
        identical_data: feed every replica the same samples (tests DiLoCo against one replica);
            normal runs lease disjoint ranges.
    """

    def __init__(self, recipe: Recipe, store_host: str = "127.0.0.1", identical_data: bool = False):
        import ray
        import torch.distributed as dist

        self._ray = ray
        self._recipe = recipe
        self._identical = identical_data
        self._store = dist.TCPStore(store_host, 0, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=recipe.world.step_timeout_s))
        self._store_host = store_host
        self.replicas: dict[int, Replica] = {}
        self._ids = itertools.count(0)
        self.epoch = 0
        self.outer_step = 0
        self.inner_step = 0
        self.cursor = 0  # next unleased sample index: the run's data position
        self.tokens = 0
        self._actor_cls = ray.remote(_rank_worker_cls())
        self.total_inner_steps = self._plan_inner_steps()

    def _plan_inner_steps(self) -> int:
        t, w = self._recipe.train, self._recipe.world
        if t.token_budget is not None:
            per_outer = w.replicas * t.inner_steps * t.batch_size * t.seq_len
            return max(1, -(-t.token_budget // per_outer)) * t.inner_steps
        return t.outer_steps * t.inner_steps

    @property
    def total_outer_steps(self) -> int:
        return self.total_inner_steps // self._recipe.train.inner_steps

    def done(self) -> bool:
        t = self._recipe.train
        if t.token_budget is not None:
            return self.tokens >= t.token_budget
        return self.outer_step >= t.outer_steps

    # -- membership ------------------------------------------------------------------------------

    def add_replicas(self, placements: list[tuple[str, str]]) -> list[Replica]:
        """Start one replica per (instance_id, node_id) and wait until every rank is set up."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from elastic.replica import RankSpec

        ranks = self._recipe.world.ranks_per_replica
        spec = self._recipe.model_dump(mode="json")
        new = []
        for instance_id, node_id in placements:
            rep = Replica(next(self._ids), instance_id, node_id, joined_step=self.outer_step)
            strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
            for rank in range(ranks):
                rs = RankSpec(recipe=spec, replica_id=rep.replica_id, rank=rank, ranks=ranks,
                              store_host=self._store_host, store_port=self._store.port,
                              total_inner_steps=self.total_inner_steps)
                rep.actors.append(self._actor_cls.options(num_cpus=1, scheduling_strategy=strategy).remote(rs))
            new.append(rep)
        self._ray.get([a.setup.remote() for rep in new for a in rep.actors],
                      timeout=self._recipe.world.step_timeout_s)
        for rep in new:
            self.replicas[rep.replica_id] = rep
        self.epoch += 1
        return new

    def remove_replica(self, replica_id: int) -> None:
        rep = self.replicas.pop(replica_id, None)
        if rep is None:
            return
        for a in rep.actors:
            self._ray.kill(a, no_restart=True)
        self.epoch += 1

    # -- training --------------------------------------------------------------------------------

    def step(self) -> StepResult:
        """One outer step: every replica's inner phase, then the outer sync."""
        ray, t = self._ray, self._recipe.train
        timeout = self._recipe.world.step_timeout_s
        members = sorted(self.replicas)
        per_replica = t.inner_steps * t.batch_size
        leases = {}
        for rid in members:
            leases[rid] = self.cursor
            if not self._identical:
                self.cursor += per_replica
        if self._identical:
            self.cursor += per_replica

        t0 = time.monotonic()
        calls = {(rid, r): a.inner_phase.remote(leases[rid], self.inner_step)
                 for rid in members for r, a in enumerate(self.replicas[rid].actors)}
        results = dict(zip(calls, ray.get(list(calls.values()), timeout=timeout)))
        inner_s = time.monotonic() - t0

        t1 = time.monotonic()
        syncs = [a.outer_sync.remote(self.epoch, i, len(members))
                 for i, rid in enumerate(members) for a in self.replicas[rid].actors]
        sync_out = ray.get(syncs, timeout=timeout)
        sync_s = time.monotonic() - t1

        n = len(results)
        losses = [sum(res["losses"][h] for res in results.values()) / n for h in range(t.inner_steps)]
        tokens = sum(res["tokens"] for res in results.values())
        self.outer_step += 1
        self.inner_step += t.inner_steps
        self.tokens += tokens
        return StepResult(self.outer_step, members, losses, tokens, inner_s, sync_s,
                          max(s["bytes"] for s in sync_out))

    def lead_replica(self) -> Replica:
        return self.replicas[min(self.replicas)]

    def call_replica(self, replica: Replica, method: str, *args):
        """Call `method` on every rank of `replica` (a collective inside it); results in rank order."""
        return self._ray.get([getattr(a, method).remote(*args) for a in replica.actors],
                             timeout=self._recipe.world.step_timeout_s)

    def shutdown(self) -> None:
        for rid in list(self.replicas):
            rep = self.replicas.pop(rid)
            for a in rep.actors:
                try:
                    self._ray.kill(a, no_restart=True)
                except Exception:  # actor already gone with its node: nothing to release
                    pass


def _rank_worker_cls():
    from elastic.replica import RankWorker
    return RankWorker
