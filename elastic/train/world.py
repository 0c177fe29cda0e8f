"""The world: the driver's view of the live replicas and the DiLoCo outer loop over them.

A replica is `ranks_per_replica` Ray actors pinned to one node. Per outer step the driver leases
each replica a disjoint range of sample indices, runs the inner phase on every rank, then the
outer sync over the replicas that finished it. Failure is the normal path:

- a replica whose rank dies (its node was preempted) is dropped; the others go on, and the outer
  all-reduce is formed over the survivors under a new membership epoch;
- an all-reduce that a member dies in is retried over the survivors with the pseudo-gradients they
  still hold (the sync is two-phase: all-reduce, then apply once every member reduced);
- a replica started later copies θ_outer and the outer momentum from a live peer while the world
  keeps stepping, replays the outer steps taken meanwhile, and joins at the next outer-step
  boundary with a fresh inner optimizer (or loads a checkpoint when no peer is left).

The driver serves the store every process group rendezvouses through (torch's TCPStore protocol,
`elastic.train.store`), so a new epoch is just a new key prefix.

The world never calls its driver: `World.step()` advances the outer step under way to its next
pause (a phase starting, an all-reduce attempt failing, or about every 0.1 s while it waits on the
ranks) and returns what happened meanwhile as values (`PhaseStarted`, `Loss`, `SyncFailure`,
`StepDone`); the driver records them and does its own work between two calls (notices, launches,
renting), and those calls may drop replicas or ask a phase to end early. What happens outside a
step (a joiner's copy failing, a drop) is returned by `take_events`.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Generator

from elastic.recipe.model import Recipe
from elastic.record.events import LossPhase, LossRule
from elastic.train.store import StoreServer

log = logging.getLogger(__name__)

MAX_SYNC_ATTEMPTS = 4
HEARTBEAT_CHECK_S = 0.5   # how often a waiting driver reads the ranks' heartbeats
COPY_CHUNK_NUMEL = 1 << 22   # elements per chunk of a joiner's state copy (16 MiB of fp32)


@dataclass
class Replica:
    """A replica of the world.

    Args:
        replica_id: unique id for the run (never reused).
        instance_id: the VM it runs on.
        node_id: Ray node id of that VM.
        actors: one actor handle per rank, rank order.
        joined_step: the outer step it first contributes to.
        setup_refs: pending `setup` calls (a replica starting up).
        started_at: unix time its actors were created.
        error: why it cannot start (set instead of creating actors).
        copy: its state copy from a member, while under way.
    """

    replica_id: int
    instance_id: str
    node_id: str
    actors: list = field(default_factory=list)
    joined_step: int = 0
    setup_refs: list = field(default_factory=list)
    started_at: float = 0.0
    error: str | None = None
    copy: Copy | None = None


@dataclass
class Copy:
    """A joiner's state copy under way (`World.begin_copy`).

    Args:
        donor: the member it copies from.
        outer_step: the world's outer steps when the donor took its snapshot.
        refs: the joiner ranks' `pull_outer` calls.
        beats: what the looks at the joiner ranks' heartbeats saw (`stalled`).
    """

    donor: int
    outer_step: int
    refs: list
    beats: dict = field(default_factory=dict)


@dataclass
class Loss:
    """A replica the world lost.

    Args:
        replica_id: the replica.
        instance_id: its VM.
        reason: what happened.
        lost_inner_steps: inner steps of work it took with it.
        phase: `inner`, `sync`, `idle` or `setup`.
        rule: which rule removed it: `actor_died` (a call of one of its ranks failed: the process
            or its node died), `stalled` (no heartbeat, or no progress while training, for
            `world.stall_timeout_s`: see `stalled`), `preempted`
            (the provider saw its node go), `notice` (a notice while joining), `setup_failed`,
            `safety_bound` (a call past `world.step_timeout_s`), `export_failed` (a donor failing
            while giving its state away).
    """

    replica_id: int
    instance_id: str
    reason: str
    lost_inner_steps: int
    phase: LossPhase
    rule: LossRule = LossRule.ACTOR_DIED


@dataclass
class StepResult:
    """What one outer step produced.

    Args:
        outer_step: the step just completed (1-based).
        replicas: ids of the replicas whose pseudo-gradients were applied.
        losses: mean loss over those replicas for each inner step.
        tokens: tokens trained in this step by those replicas.
        inner_s: slowest inner phase, seconds.
        sync_s: outer sync (all attempts), seconds.
        bytes_sent: pseudo-gradient bytes each rank sent in the applied sync (the most of any rank).
        network_s: seconds the outer sync was under way on a rank this step (the most of any
            rank): each streamed fragment's from its start to its decision, and the blocking
            sync's inside its collectives.
        wait_s: of those, seconds training waited on the network (the blocking sync's, and a
            streamed fragment's not done by its apply point), the most of any rank.
        overlapped_s: seconds the streamed fragment syncs ran beside inner steps (the most of any
            rank).
        sync_attempts: all-reduce attempts (1 when nobody failed).
        steps_done: inner steps each contributing replica took (fewer when cut short by a notice).
        idle: replicas that took no inner step (a notice came before their first): nothing to add.
        inner_s_by_replica: each contributing replica's own inner phase (its slowest rank), seconds:
            with `steps_done`, the throughput this replica's VM measured for this model.
        lrs: each contributing replica's inner learning rate at each step it took.
        tokens_before: the world's trained tokens when the step began (the schedule's position).
        step_tokens: tokens one inner step of this phase's members trains (the schedule's stride).
    """

    outer_step: int
    replicas: list[int]
    losses: list[float]
    tokens: int
    inner_s: float
    sync_s: float
    bytes_sent: int
    sync_attempts: int = 1
    network_s: float = 0.0
    steps_done: dict = field(default_factory=dict)
    idle: list[int] = field(default_factory=list)
    inner_s_by_replica: dict = field(default_factory=dict)
    lrs: dict = field(default_factory=dict)
    tokens_before: int = 0
    step_tokens: int = 0
    wait_s: float = 0.0
    overlapped_s: float = 0.0


@dataclass(frozen=True)
class PhaseStarted:
    """A phase of the outer step began (`inner`: its calls are out; `sync`: an all-reduce attempt
    is about to start, and a replica dropped now is left out of it).

    Args:
        phase: `inner` or `sync`.
        members: the replicas taking part.
    """

    phase: LossPhase
    members: list[int]


@dataclass(frozen=True)
class SyncFailure:
    """An outer all-reduce attempt did not complete (the step retries over the survivors).

    Args:
        outer_step: the step under way (1-based).
        attempt: 1-based.
        failures: {replica_id: {"stage", "addr", "error"}} (stage `connect`: the replica could not
            join the outer group).
    """

    outer_step: int
    attempt: int
    failures: dict


@dataclass(frozen=True)
class StepDone:
    """The outer step under way ended. Args: result: what it produced (None: every replica was lost)."""

    result: StepResult | None


class World:
    """Args:
        recipe: the resolved recipe.
        store_host: address replicas reach the driver's store on (default: elastic/net/netaddr.py's
            choice, the driver node's Ray node IP).
        identical_data: feed every replica the same samples (tests DiLoCo against one replica);
            normal runs lease disjoint ranges.
    """

    def __init__(self, recipe: Recipe, store_host: str | None = None, identical_data: bool = False):
        import ray

        from elastic.net.netaddr import store_host as driver_store_host
        from elastic.net.netaddr import store_listener

        store_host = store_host or driver_store_host()
        self._ray = ray
        self._recipe = recipe
        self._identical = identical_data
        # The store every process group rendezvouses through, served from here in Python
        # (`elastic.train.store`: the driver never imports torch); ranks dial it on this address.
        self._store_host = store_host
        listen_fd, self._store_port = store_listener(store_host)
        self._store = StoreServer(listen_fd, timeout_s=recipe.world.step_timeout_s)
        self.replicas: dict[int, Replica] = {}    # live and training
        self.joining: dict[int, Replica] = {}     # started, not yet admitted
        self._ids = itertools.count(0)
        self.epoch = 0
        self.outer_step = 0
        self.inner_step = 0
        self.cursor = 0  # next unleased sample index: the run's data position
        self.tokens = 0
        self.params = 0   # the model's parameters, once a replica has set up
        self.phase = LossPhase.IDLE   # INNER or SYNC while a step is under way
        self._phase_members: list[int] = []   # the replicas of the inner phase under way
        self._phase_epoch = 0   # the membership epoch that phase began in (its fragments' group)
        self._stop_at: dict[int, float] = {}  # noticed replica -> unix time it must contribute by
        # The replica checkpoints are saved from (the driver's pick; None, or not a member: the
        # lowest member): it loads what a save imports beside its inner phases, the others never do.
        self.saver: int | None = None
        self._happened: list = []   # what happened since `step` or `take_events` last returned it
        self._under_way: Generator | None = None   # the outer step `step` advances
        self._actor_cls = ray.remote(_rank_worker_cls())
        from elastic.train.replica import Schedule

        self.schedule = Schedule.for_recipe(recipe)

    @property
    def total_outer_steps(self) -> int:
        """Outer steps the run takes: `train.outer_steps`, or what `train.token_budget` needs with
        `world.replicas` replicas (an estimate: the world may grow or shrink)."""
        t, w = self._recipe.train, self._recipe.world
        if t.token_budget is not None:
            return max(1, -(-t.token_budget // (w.replicas * t.inner_steps * t.batch_size * t.seq_len)))
        return t.outer_steps

    def done(self) -> bool:
        t = self._recipe.train
        if t.token_budget is not None:
            return self.tokens >= t.token_budget
        return self.outer_step >= t.outer_steps

    # -- membership ------------------------------------------------------------------------------

    def start_replica(self, instance_id: str, node_id: str) -> Replica:
        """Create a replica's actors on a node and start their setup (does not wait)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from elastic.train.replica import RankSpec

        ranks = self._recipe.world.ranks_per_replica
        spec = self._recipe.model_dump(mode="json")
        rep = Replica(next(self._ids), instance_id, node_id, started_at=time.time())
        strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
        # One GPU per rank when the node has GPUs: Ray then hands each rank its own device (and
        # knows the node's GPUs are spoken for); a CPU node's ranks take a CPU each.
        node_gpus = self.node_gpus(node_id)
        gpus = 1 if node_gpus else 0
        self.joining[rep.replica_id] = rep
        if 0 < node_gpus < ranks:
            # Ray would wait forever for GPUs the node does not have: the setup fails at once.
            rep.error = f"node {instance_id} has {node_gpus:g} GPU(s) for {ranks} ranks (world.ranks_per_replica)"
            return rep
        for rank in range(ranks):
            rs = RankSpec(recipe=spec, replica_id=rep.replica_id, rank=rank, ranks=ranks,
                          store_host=self._store_host, store_port=self._store_port,
                          schedule=self.schedule)
            # Four threads: request_stop must reach a rank while inner_phase runs, and a
            # checkpoint upload (phase 2) and a joiner's chunk requests run beside both.
            rep.actors.append(self._actor_cls.options(num_cpus=1, num_gpus=gpus, scheduling_strategy=strategy,
                                                      max_concurrency=4).remote(rs))
        rep.setup_refs = [a.setup.remote() for a in rep.actors]
        return rep

    def node_gpus(self, node_id: str) -> float:
        """GPUs the Ray node offers (0 for a CPU node, or a node no longer alive)."""
        return next((n["Resources"].get("GPU", 0) for n in self._ray.nodes()
                     if n["NodeID"] == node_id and n["Alive"]), 0)

    def add_replicas(self, placements: list[tuple[str, str]]) -> list[Replica]:
        """Start one replica per (instance_id, node_id), wait until all are set up, and admit them
        as the initial world (all start from the same seeded θ)."""
        new = [self.start_replica(i, n) for i, n in placements]
        if errors := [rep.error for rep in new if rep.error]:
            raise RuntimeError("; ".join(errors))
        self._setup_done(self._ray.get([r for rep in new for r in rep.setup_refs],
                                       timeout=self._recipe.world.step_timeout_s))
        for rep in new:
            self._enter(rep)
        return new

    def ready_joiners(self) -> list[Replica]:
        """Joining replicas whose setup has finished (failed ones are dropped as losses)."""
        ready = []
        for rep in list(self.joining.values()):
            if rep.error:
                self._lose(rep, f"setup failed: {rep.error}", 0, LossPhase.SETUP, LossRule.SETUP_FAILED)
                continue
            if rep.copy is not None:   # set up, and copying its state (`admit_copied`)
                continue
            done, _ = self._ray.wait(rep.setup_refs, num_returns=len(rep.setup_refs), timeout=0)
            if len(done) < len(rep.setup_refs):
                if time.time() - rep.started_at > self._recipe.world.step_timeout_s:
                    self._lose(rep, "setup timed out", 0, LossPhase.SETUP, LossRule.SAFETY_BOUND)
                continue
            try:
                self._setup_done(self._ray.get(done))
            except Exception as exc:
                self._lose(rep, f"setup failed: {_short(exc)}", 0, LossPhase.SETUP, LossRule.SETUP_FAILED)
                continue
            ready.append(rep)
        return ready

    def _setup_done(self, results: list[dict]) -> None:
        """Note what a finished setup reports: the model's parameter count. Each rank's setup
        phases go to the driver's log (`bench/overhead.py --profile` reads them)."""
        self.params = results[0]["params"]
        for r in results:
            log.info("setup of replica %s rank %s: %s", r["replica"], r["rank"], json.dumps(r.get("phases_s", {})))

    def begin_copy(self, rep: Replica) -> bool:
        """Start copying θ_outer and the outer momentum into set-up joiner `rep` from a member, in
        the background: each rank of the joiner pulls the same rank of the donor's snapshot in
        chunks while the world keeps stepping (`admit_copied` admits it later). Call at an
        outer-step boundary. False when no member could give a snapshot."""
        for peer in [self.replicas[r] for r in sorted(self.replicas)]:
            try:
                momentum = self._ray.get([peer.actors[r].snapshot_outer.remote(rep.replica_id)
                                          for r in range(len(rep.actors))], timeout=self._recipe.world.step_timeout_s)
            except Exception as exc:
                if self._is_dead(peer):
                    self._lose(peer, f"lost while exporting state: {_short(exc)}", 0, LossPhase.IDLE,
                               LossRule.EXPORT_FAILED)
                continue
            rep.copy = Copy(peer.replica_id, self.outer_step, [
                a.pull_outer.remote(peer.actors[r], rep.replica_id, momentum[r], COPY_CHUNK_NUMEL)
                for r, a in enumerate(rep.actors)])
            return True
        return False

    def admit_copied(self, wait: bool = False) -> list[tuple[Replica, str]]:
        """At an outer-step boundary: admit every joiner whose copy is complete, after it replayed
        the outer steps the world took since its snapshot (the averaged Δs its donor logged), so it
        holds the world's θ_outer. `wait`: block until the copies under way are done. A joiner
        whose copy fails, or whose heartbeat stops for `world.stall_timeout_s`, is dropped alone;
        a slow copy never drops the donor (a donor that died is a loss of its own, and its joiners
        copy again from another member). Returns [(replica, where its state came from)]."""
        admitted = []
        for rep in [r for r in list(self.joining.values()) if r.copy is not None]:
            c = rep.copy
            done, _ = self._ray.wait(c.refs, num_returns=len(c.refs), timeout=None if wait else 0)
            if len(done) < len(c.refs):
                if reason := self._stalled([(rep.replica_id, r) for r in range(len(rep.actors))], c.beats).get(rep.replica_id):
                    self._lose(rep, f"copying state: {reason}", 0, LossPhase.SETUP, LossRule.STALLED)
                continue
            donor = self.replicas.get(c.donor)
            try:
                self._ray.get(c.refs)
                if donor is None:
                    raise RuntimeError(f"donor replica {c.donor} left")
                self._ray.get([a.replay_outer.remote(donor.actors[r], rep.replica_id, self.outer_step - c.outer_step,
                                                     self.inner_step, COPY_CHUNK_NUMEL)
                               for r, a in enumerate(rep.actors)], timeout=self._recipe.world.step_timeout_s)
            except Exception as exc:
                rep.copy = None
                if donor is None or self._is_dead(donor):
                    if donor is not None:
                        self._lose(donor, f"lost while exporting state: {_short(exc)}", 0, LossPhase.IDLE,
                                   LossRule.EXPORT_FAILED)
                    self.begin_copy(rep)   # from another member (or at the next boundary)
                else:
                    self._lose(rep, f"state copy from replica {c.donor} failed: {_short(exc)}", 0, LossPhase.SETUP)
                continue
            for a in donor.actors:
                a.drop_snapshot.remote(rep.replica_id)
            rep.copy = None
            self._enter(rep)
            admitted.append((rep, f"replica {c.donor}"))
        return admitted

    def admit(self, rep: Replica, checkpoint: tuple[str, int, str] | None = None) -> str:
        """Admit a set-up joiner now, waiting for its state: from a live peer (the copy of
        `begin_copy`, waited for), or, when none is left, from `checkpoint` = (uri, its manifest,
        node staging dir). Returns where the state came from ("lost" if the joiner was dropped)."""
        if self.replicas and checkpoint is None:
            while rep.replica_id in self.joining:
                if rep.copy is None and not self.begin_copy(rep):
                    raise RuntimeError("no live peer to join from")
                for joined, source in self.admit_copied(wait=True):
                    if joined is rep:
                        return source
            return "lost"
        if checkpoint is None:
            raise RuntimeError("no live peer and no checkpoint to join from")
        # The replica's ranks share a node: one fetch (a download unless file://), then all load.
        local = self._ray.get(rep.actors[0].fetch_checkpoint.remote(*checkpoint), timeout=None)
        self._ray.get([a.load_checkpoint.remote(local) for a in rep.actors], timeout=self._recipe.world.step_timeout_s)
        self._enter(rep)
        return f"checkpoint step {checkpoint[1]['step']}"

    def _enter(self, rep: Replica) -> None:
        """A set-up joiner becomes a member: from this outer step on it trains and syncs."""
        del self.joining[rep.replica_id]
        rep.setup_refs = []
        rep.joined_step = self.outer_step
        self.replicas[rep.replica_id] = rep
        self.epoch += 1

    def admit_fresh(self, rep: Replica) -> None:
        """Admit a set-up joiner as it is: the seeded initial θ (only when no replica holds newer state)."""
        self._enter(rep)

    def restore(self, manifest: dict) -> None:
        """Set the driver-side counters from a checkpoint manifest (all replicas were lost)."""
        self.outer_step = manifest["step"]
        self.inner_step = manifest["inner_step"]
        self.cursor = manifest["data_cursor"]
        self.tokens = manifest["tokens"]

    def replica_on(self, instance_id: str) -> Replica | None:
        for rep in list(self.replicas.values()) + list(self.joining.values()):
            if rep.instance_id == instance_id:
                return rep
        return None

    def request_stop(self, replica_id: int, stop_at: float) -> None:
        """A notice: `replica_id` must contribute by unix time `stop_at`. The inner phase under way
        (or the next one) ends by then for every member, so the outer sync happens while the
        noticed node is still alive: the others keep what they trained, their step is shorter.
        (Only the noticed replica stopping would leave it waiting for the others' full phase, on
        real clouds minutes against a notice of 30 s to 2 min.)"""
        self._stop_at[replica_id] = min(stop_at, self._stop_at.get(replica_id, float("inf")))
        if self.phase == LossPhase.INNER and replica_id in self._phase_members:
            self._end_phase_by(self._phase_members)

    def _end_phase_by(self, members: list[int]) -> None:
        """Send the earliest deadline of the noticed members to the phase under way: to every
        member while there is time to sync, else (too late to train more) to the noticed ones
        only: the rest of the world's phase is not given up for a node about to go."""
        noticed = {rid: at for rid, at in self._stop_at.items() if rid in members}
        if noticed:
            stop_at = min(noticed.values())
            self._send_stop(members if stop_at > time.time() else list(noticed), stop_at)

    def _send_stop(self, members: list[int], stop_at: float) -> None:
        for rid in members:
            rep = self.replicas.get(rid)
            for a in (rep.actors if rep else []):
                a.request_stop.remote(stop_at, self.inner_step)

    def drop(self, replica_id: int, reason: str, phase: LossPhase = LossPhase.IDLE, lost_inner_steps: int = 0,
             rule: LossRule = LossRule.PREEMPTED) -> None:
        """Remove a replica (its node is gone or going): kill its actors, record the loss."""
        rep = self.replicas.get(replica_id) or self.joining.get(replica_id)
        if rep is not None:
            self._lose(rep, reason, lost_inner_steps, phase, rule)

    def release(self, replica_id: int) -> None:
        """Remove a replica that left cleanly (drained after a notice): no loss."""
        rep = self.replicas.pop(replica_id, None)
        if rep is not None:
            self._kill(rep)
            self.epoch += 1

    def _lose(self, rep: Replica, reason: str, lost_inner_steps: int, phase: LossPhase,
              rule: LossRule = LossRule.ACTOR_DIED) -> None:
        donor = self.replicas.get(rep.copy.donor) if rep.copy is not None else None
        for a in donor.actors if donor is not None else []:
            a.drop_snapshot.remote(rep.replica_id)   # nobody will pull it now
        was_member = self.replicas.pop(rep.replica_id, None) is not None
        self.joining.pop(rep.replica_id, None)
        self._kill(rep)
        if was_member:
            if self.phase == LossPhase.INNER and rep.replica_id in self._phase_members:
                self._abort_fragments()
            self.epoch += 1
        self._happened.append(Loss(rep.replica_id, rep.instance_id, reason, lost_inner_steps, phase, rule))

    def _abort_fragments(self) -> None:
        """A member of the inner phase under way is gone: settle every streamed fragment sync of the
        phase not yet decided as `abort` (survivors waiting for its count go on; the fragments are
        synced over the survivors at the end of the phase). See elastic.train.diloco.Fragments."""
        from elastic.train.replica import fragment_key

        if self._recipe.world.fragments == 1:
            return
        for shard in range(self._recipe.world.ranks_per_replica):
            key = fragment_key(self._phase_epoch, self.inner_step, shard)
            for f in range(self._recipe.world.fragments):
                self._store.compare_set(f"{key}/{f}", "", "abort")

    def _kill(self, rep: Replica) -> None:
        # A rank lost inside a multi-rank replica drops the whole replica: its other ranks would
        # wait in an FSDP collective for a peer that will never come.
        for a in rep.actors:
            try:
                self._ray.kill(a, no_restart=True)
            except Exception:  # already gone with its node
                pass

    def _is_dead(self, rep: Replica) -> bool:
        try:
            self._ray.get([a.ping.remote() for a in rep.actors], timeout=10)
            return False
        except Exception:
            return True

    # -- training --------------------------------------------------------------------------------

    def _gather(self, calls: dict, phase: LossPhase, lost_steps: int) -> Generator[None, None, dict]:
        """Wait for {(replica_id, rank): ref}, however long it takes while the ranks make progress,
        pausing (a `yield`) about every 0.1 s. A replica is dropped when a call of it fails (its
        process died), when the driver drops it during a pause (its node is gone), or when its
        heartbeat or its progress stands still for `world.stall_timeout_s` (`stalled`). Returns
        {(replica_id, rank): result}."""
        ray = self._ray
        owner = {ref: key for key, ref in calls.items()}
        pending = list(owner)
        results = {}
        beats = {}   # what the looks at the heartbeats saw (`stalled`)
        check_at = time.monotonic()
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=0.1)
            for ref in done:
                rid, rank = owner[ref]
                try:
                    results[(rid, rank)] = ray.get(ref)
                except Exception as exc:
                    if rid in self.replicas:
                        self._lose(self.replicas[rid], f"{phase}: {_short(exc)}", lost_steps, phase)
            if pending:
                yield   # the driver's turn: it may drop replicas whose nodes the provider saw go
            pending = [r for r in pending if owner[r][0] in self.replicas]
            if pending and time.monotonic() >= check_at:
                check_at = time.monotonic() + HEARTBEAT_CHECK_S
                for rid, reason in self._stalled([owner[r] for r in pending], beats).items():
                    self._lose(self.replicas[rid], f"{phase}: {reason}", lost_steps, phase, LossRule.STALLED)
                pending = [r for r in pending if owner[r][0] in self.replicas]
        return {k: v for k, v in results.items() if k[0] in self.replicas}

    def _stalled(self, keys: list[tuple[int, int]], beats: dict) -> dict[int, str]:
        """Replicas (of these (replica_id, rank) keys, members or joiners) to drop as stalled, with
        why (`stalled`, on the ranks' heartbeats as they are now). Updates `beats`."""
        from elastic.train.replica import heartbeat_key

        w = self._recipe.world
        values = self._store.multi_get([heartbeat_key(*k) for k in keys])
        out = stalled({k: v.decode() for k, v in zip(keys, values)}, beats, time.monotonic(),
                      w.stall_timeout_s, w.step_timeout_s)
        return {rid: why for rid, why in out.items() if rid in self.replicas or rid in self.joining}

    def step(self) -> list:
        """Advance the outer step under way (beginning one when none is) to its next pause, and
        return what happened since the last call: `PhaseStarted`, `Loss`, `SyncFailure`, and last,
        once the step ended, `StepDone`. Between two calls the caller may drop replicas or ask for
        a stop (`drop`, `request_stop`); the step goes on over the rest."""
        if self._under_way is None:
            self._under_way = self._outer_step()
        try:
            next(self._under_way)
        except StopIteration as end:
            self._under_way = None
            self._happened.append(StepDone(end.value))
        except BaseException:
            self._under_way = None
            raise
        return self.take_events()

    def take_events(self) -> list:
        """What happened since it was last returned (`step` returns it too): the `Loss`es of calls
        made between steps (`drop`, `begin_copy`, `admit_copied`, `admit`)."""
        out, self._happened = self._happened, []
        return out

    def run_step(self) -> tuple[StepResult | None, list]:
        """One whole outer step with nothing done at its pauses, for code that drives a world
        alone (tests, benchmarks). Returns (its result, everything `step` returned)."""
        happened = []
        while not (happened and isinstance(happened[-1], StepDone)):
            happened += self.step()
        return happened[-1].result, happened

    def _outer_step(self) -> Generator[None, None, StepResult | None]:
        """One outer step over the live replicas, pausing where `step` returns. None if every
        replica was lost during it. A replica whose notice deadline has already passed sits the
        step out (in `idle`, nothing to add); when every member does, the result has no `replicas`
        and no step was taken."""
        t = self._recipe.train
        now = time.time()
        late = sorted(rid for rid, at in self._stop_at.items() if rid in self.replicas and at <= now)
        members = sorted(rid for rid in self.replicas if rid not in late)
        if not members:
            self._stop_at.clear()
            return StepResult(self.outer_step, [], [], 0, 0.0, 0.0, 0, idle=late) if late else None
        per_replica = t.inner_steps * t.batch_size
        leases = {}
        for rid in members:
            leases[rid] = self.cursor
            if not self._identical:
                self.cursor += per_replica
        if self._identical:
            self.cursor += per_replica
        # Each member's lease at the next step if the world stays as it is: its data is prefetched.
        nexts = {rid: self.cursor + (0 if self._identical else i * per_replica) for i, rid in enumerate(members)}

        self.phase, self._phase_members, self._phase_epoch = LossPhase.INNER, members, self.epoch
        t0 = time.monotonic()
        # The schedule's token count is the world's: every member trains its steps at the same rates.
        step_tokens = len(members) * t.batch_size * t.seq_len
        # Streamed fragments sync during the phase over the outer group of its members.
        group = (lambda i: (self.epoch, i, len(members))) if self._recipe.world.fragments > 1 else (lambda i: None)
        saver = self.saver if self.saver in members else members[0]
        calls = {(rid, r): a.inner_phase.remote(leases[rid], self.inner_step, self.tokens, step_tokens, nexts[rid],
                                                group(i), warm_checkpoint=rid == saver)
                 for i, rid in enumerate(members) for r, a in enumerate(self.replicas[rid].actors)}
        self._end_phase_by(members)   # a notice came between steps: this phase ends by its deadline
        self._happened.append(PhaseStarted(LossPhase.INNER, members))
        yield
        results = yield from self._gather(calls, LossPhase.INNER, t.inner_steps)
        inner_s = time.monotonic() - t0
        self._stop_at.clear()   # served: the noticed replicas contribute at this sync (or are gone)

        # A replica whose notice came before its first inner step has Δ = 0: it sits this sync out
        # (averaging it in would shrink everyone's step).
        idle = sorted({rid for (rid, _), res in results.items() if res["steps"] == 0} | set(late))
        if any(res["sync"]["fresh_group"] for res in results.values()):
            self.epoch += 1   # a streamed fragment sync was aborted: its group may hold a half-done collective
        self.phase = LossPhase.SYNC
        t1 = time.monotonic()
        attempts, sync_out = 0, {}
        while True:
            members = sorted(rid for rid in self.replicas if rid not in idle
                             and all((rid, r) in results for r in range(len(self.replicas[rid].actors))))
            if not members:
                self.phase = LossPhase.IDLE
                return None
            attempts += 1
            if attempts > 1:
                self.epoch += 1   # a fresh group over the survivors
            self._happened.append(PhaseStarted(LossPhase.SYNC, members))
            yield
            members = [rid for rid in members if rid in self.replicas]
            if not members:   # dropped during the pause
                self.phase = LossPhase.IDLE
                return None
            calls = {(rid, r): a.outer_sync.remote(self.epoch, i, len(members))
                     for i, rid in enumerate(members) for r, a in enumerate(self.replicas[rid].actors)}
            sync_out = yield from self._gather(calls, LossPhase.SYNC, t.inner_steps)
            ok = set(members) <= set(self.replicas) and all(
                sync_out.get((rid, r), {}).get("ok") for rid in members for r in range(len(self.replicas[rid].actors)))
            if ok:
                break
            failures = {rid: {k: out.get(k) for k in ("stage", "addr", "error")}
                        for (rid, _), out in sorted(sync_out.items()) if not out.get("ok")}
            self._happened.append(SyncFailure(self.outer_step + 1, attempts, failures))
            yield
            if attempts >= MAX_SYNC_ATTEMPTS:
                errors = {v.get("error") for v in sync_out.values() if not v.get("ok")}
                raise RuntimeError(f"outer all-reduce failed {attempts} times: {sorted(e for e in errors if e)[:2]}")
        applied = yield from self._gather({(rid, r): a.outer_apply.remote()
                                           for rid in members for r, a in enumerate(self.replicas[rid].actors)},
                                          "sync", t.inner_steps)
        members = sorted({rid for rid, _ in applied})
        if not members:   # every member was lost while applying
            self.phase = "idle"
            return None
        sync_s = time.monotonic() - t1
        self.phase = "idle"

        contrib = [results[(rid, r)] for rid in members for r in range(len(self.replicas[rid].actors))]
        longest = max(len(c["losses"]) for c in contrib)
        losses = []
        for h in range(longest):
            xs = [c["losses"][h] for c in contrib if h < len(c["losses"])]
            losses.append(sum(xs) / len(xs))
        tokens = sum(c["tokens"] for c in contrib)
        tokens_before = self.tokens
        self.outer_step += 1
        self.inner_step += longest   # fewer than H when a notice ended the phase early
        self.tokens += tokens
        return StepResult(self.outer_step, members, losses, tokens, inner_s, sync_s,
                          max((s["bytes"] for s in sync_out.values()), default=0), attempts,
                          max((s["network_s"] for s in sync_out.values()), default=0.0),
                          {rid: results[(rid, 0)]["steps"] for rid in members}, idle,
                          {rid: max(results[(rid, r)]["seconds"] for r in range(len(self.replicas[rid].actors)))
                           for rid in members},
                          {rid: results[(rid, 0)]["lrs"] for rid in members}, tokens_before, step_tokens,
                          max((s["wait_s"] for s in sync_out.values()), default=0.0),
                          max((s["overlapped_s"] for s in sync_out.values()), default=0.0))

    def lead_replica(self) -> Replica:
        return self.replicas[min(self.replicas)]

    def call_replica(self, replica: Replica, method: str, *args):
        """Call `method` on every rank of `replica` (a collective inside it); results in rank order."""
        return self._ray.get([getattr(a, method).remote(*args) for a in replica.actors],
                             timeout=self._recipe.world.step_timeout_s)

    def shutdown(self) -> None:
        for rep in list(self.replicas.values()) + list(self.joining.values()):
            self._kill(rep)
        self.replicas.clear()
        self.joining.clear()
        self._store.close()


def stalled(heartbeats: dict[tuple[int, int], str], clocks: dict, now_s: float, stall_timeout_s: float,
            step_timeout_s: float) -> dict[int, str]:
    """Which replicas are stalled, with why, from their ranks' heartbeats
    {(replica_id, rank): "BEAT WORK BYTES STATE"} (`elastic.train.replica.heartbeat_key`) read at
    monotonic time `now_s`. `clocks` carries what earlier looks saw ({(replica_id, rank): (beat,
    since when it has not changed)}, {replica_id: (progress of its ranks, since when it is expected
    and has not moved)}); start it empty when the wait begins, and it is updated here.

    A replica is stalled when a rank's BEAT has not changed for `stall_timeout_s` (its process is
    frozen or its node partitioned or gone), or when all of its ranks work on their own (STATE `run`
    or `warm`: none waits on other replicas) and their WORK and BYTES have all stood still for
    `stall_timeout_s` (`step_timeout_s`, if longer, while a rank is in its first step: compiling):
    a rank stuck outside any collective (a fetch that never returns, a deadlocked step) while its
    heartbeat thread beats. A rank waiting on other replicas (`wait`) restarts its replica's
    progress clock: that wait has a timeout of its own (`world.sync_timeout_s`)."""
    out: dict[int, str] = {}
    ranks: dict[int, list[tuple[int, str, str, str]]] = {}
    for key, raw in heartbeats.items():
        beat, work, received, state = raw.split()
        ranks.setdefault(key[0], []).append((key[1], work, received, state))
        last, since = clocks.get(key, (None, now_s))
        if beat != last:
            clocks[key] = (beat, now_s)
        elif now_s - since > stall_timeout_s and key[0] not in out:
            out[key[0]] = f"rank {key[1]} sent no heartbeat for {now_s - since:.1f} s (progress {work})"
    for rid, rs in ranks.items():
        progress = tuple((work, received) for _, work, received, _ in rs)
        states = {state for *_, state in rs}
        last, since = clocks.get(rid, (None, now_s))
        if progress != last or "wait" in states:   # moving, or not expected to move: the clock restarts
            clocks[rid] = (progress, now_s)
            continue
        limit_s = max(stall_timeout_s, step_timeout_s) if "warm" in states else stall_timeout_s
        if now_s - since > limit_s and rid not in out:
            at = "; ".join(f"rank {r}: progress {work}, {received} bytes fetched" for r, work, received, _ in rs)
            out[rid] = f"no progress for {now_s - since:.1f} s while training, heartbeat alive ({at})"
    return out


def _short(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)   # a RayTaskError: say what the rank raised, not where
    if isinstance(cause, BaseException):
        exc = cause
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}"


def _rank_worker_cls():
    from elastic.train.replica import RankWorker
    return RankWorker
