"""The driver: keeps the world at its target size on whatever capacity the provider gives, runs the
outer loop, checkpoints, keeps the budget, and records everything in the ledger.

Preemption is the normal path. Each tick (between outer steps, and every 0.1 s while replicas
train) the driver reads the provider's events: a notice asks the replica to cut its inner phase
short in time to contribute, then it leaves cleanly; a preemption drops the replica and the world
re-forms over the survivors. Replacement nodes are rented in the background and their replicas
join at the next outer-step boundary with state copied from a live peer. `elastic.run.launch` wraps
the driver with signals and the report.

What to rent, move or pause is the recipe's policy's (`planner.policy`, `elastic.policy.registry`), carried
out by the executor (`elastic.policy.executor`; the driver is its host). Around the loop: the offer feed
(`elastic.run.offerfeed`), the VMs on their way (`elastic.run.rentals`), the price and spend watch
(`elastic.run.pricewatch`) and the pause (`elastic.run.pausing`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import replace
from pathlib import Path

from elastic.errors import UserError, first_line
from elastic.policy.executor import Executor
from elastic.policy.registry import POLICIES, policy
from elastic.policy.rules import CheckpointReason
from elastic.recipe.model import Recipe
from elastic.record.billing import cost_so_far
from elastic.record.events import (
    BudgetExhausted, CapacityRefused, CapacityWaitEnded, CapacityWaitStarted, CheckpointFailed, CheckpointSkipped,
    CheckpointUploadAbandoned, ClusterStarted, Error, LaunchHeldBack, LossPhase, LossRule, NetworkStarted,
    NodeJoinTimeout, NodeLeftToCloud, NodeNotice, NodePreempted, NodeRebalance, NodeReleased, OuterStep, ReplicaCopying,
    ReplicaDrained, ReplicaJoined, ReplicaLost, Resumed, RunEnded, RunStarted, RunStatus, SyncFailed, SyncRetried,
    Validation, ValidationFailed, WorldFormed, WorldRestored)
from elastic.record.ledger import Ledger
from elastic.run import stop
from elastic.run.pausing import Pauser
from elastic.run.pricewatch import PriceWatch
from elastic.storage import checkpoint as ckpt
from providers.base import NodeEventKind

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0        # real seconds between two driver heartbeats (the VMs' autodown watchers read them)
LEFT_TO_CLOUD_GRACE_S = 60.0   # a VM left to its cloud (`leaves_to_cloud`) this long past its deadline is terminated


class Driver:
    """Args:
        recipe: the resolved recipe.
        run_dir: the run directory (exists).
        ledger: the run's ledger.
        resume: continue from the latest complete checkpoint at `checkpoint.uri`.
    """

    def __init__(self, recipe: Recipe, run_dir: Path, ledger: Ledger, resume: bool = False):
        self.policy = policy(recipe.planner.policy)
        if self.policy.whole_job or self.policy.on_demand_fallback:
            why = ("a whole job that restarts after any loss" if self.policy.whole_job else
                   "it rents on-demand offers, which the driver's offer feed does not read for a spot recipe")
            raise UserError(f"planner.policy: {self.policy.name} is a baseline `elastic simulate` runs ({why}), not "
                            f"the driver; it runs "
                            f"{', '.join(n for n, p in POLICIES.items() if not (p.whole_job or p.on_demand_fallback))}")
        self.recipe = recipe
        self.run_dir = run_dir
        self.run_name = run_dir.name
        self.ledger = ledger
        self.cluster = None
        self.provider = None      # the first of `providers` (the only one for local runs)
        self.providers: dict = {}  # cloud name -> provider, one per `resources.clouds`
        self.market = None
        self.end_message: str | None = None   # why the run ended, when not obvious from its status
        self.world = None
        self._metrics = None
        self._t0 = time.time()
        c = recipe.checkpoint
        dest = ckpt.destination(c.uri, run_dir)
        self.ckpt = ckpt.Checkpointer(dest, ckpt.staging_root(c.local_dir, self.run_name, dest), c.keep_last,
                                      c.upload_threads, ledger, run=self.run_name, run_dir=run_dir)
        self.executor = Executor(self.policy, self, recipe, started_s=time.time())   # the driver is its host
        self.prices = PriceWatch(ledger)
        self.offer_feed = None                           # elastic.run.offerfeed.OfferFeed, once attached
        self.rentals = None                              # elastic.run.rentals.Rentals, once attached
        self._draining: dict[int, float] = {}            # replica id -> notice deadline (unix)
        self._noticed: dict[int, float] = {}             # replica id -> its interruption notice's deadline (unix)
        self._left_to_cloud: dict[str, float] = {}       # instance id -> the deadline its cloud reclaims it by
        self.pauser = Pauser(self, self._draining)
        self._members: list[int] = []
        self._restored = False   # the world was restored after losing every replica
        self._checkpointed_step = 0                      # outer step of the newest checkpoint saved or restored
        self._step_started_s: float | None = None       # unix time the outer step under way began
        self._budget_stop: str | None = None            # a price rise mid-step stopped the run (why)
        self._beat_stop = threading.Event()             # ends the heartbeat thread (release_all)
        self._controllers: list = []                     # (provider, controller VM) for release_controller
        self._view = None                                # the run's view, once `run` started
        # Told (phase, members) as each phase of an outer step gets under way (`run_attached`'s
        # on_phase: tests and benchmarks inject faults there).
        self.on_phase = None
        self._resume_from = next(iter(self.ckpt.candidates()[0]), None) if resume else None
        if resume and self._resume_from is None:
            raise UserError(f"--resume: no complete checkpoint at {self.ckpt.uri}")

    # -- setup -----------------------------------------------------------------------------------

    def start_cluster(self, address: str | None) -> None:
        """Start (or join) the Ray cluster, then attach to it."""
        from elastic.run.cluster import LOOPBACK, LocalCluster
        from elastic.run.zygote import recipe_modules
        from providers import provider_class

        # A provider with a network of its own (local.network's lab) puts the driver's host on it.
        network = next((n for name in dict.fromkeys(self.recipe.resources.clouds)
                        if (n := provider_class(name).start_network(self.recipe)) is not None), None)
        if network is not None:
            self.ledger.append(NetworkStarted(tag=network.tag, head_ip=network.head_ip))
        try:
            cluster = LocalCluster(address=address, node_ip=network.head_ip if network else LOOPBACK,
                                   network=network, preload=recipe_modules(self.recipe.model))
        except BaseException:
            if network is not None:
                network.down()
            raise
        self.ledger.append(ClusterStarted(address=cluster.address, session_dir=cluster.session_dir))
        self.attach(cluster)
        self._owns_cluster = True

    def attach(self, cluster) -> None:
        """Use a running local cluster: build the provider and the world on it."""
        from elastic.policy.market import Market, load_history, load_throughput, workload_key
        from elastic.run.offerfeed import OfferFeed
        from elastic.run.rentals import Rentals
        from elastic.train.world import World
        from providers import build

        self.cluster = cluster
        self.providers = {name: build(name, self.recipe, cluster, self.run_name)
                          for name in dict.fromkeys(self.recipe.resources.clouds)}
        self.provider = next(iter(self.providers.values()))
        t = self.recipe.train
        self.market = Market(self.recipe.planner, load_history(),
                             tokens_per_inner_step=t.batch_size * t.seq_len,
                             measured_before=load_throughput(workload_key(self.recipe)))
        self.world = World(self.recipe)
        self.offer_feed = OfferFeed(self.providers, self.recipe.resources, self.ledger,
                                    on_demand_too=self.recipe.budget.max_hours is not None)
        self.rentals = Rentals(self.providers, self.run_name, self.ledger, self.world, self.prices,
                               self.executor.refused)
        threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True).start()

    def _heartbeat(self) -> None:
        """The heartbeat every cloud VM's watcher reads (`resources.autodown_after_s`), from its own
        thread: a long blocking call of the main loop (a restore, a slow step) must not look like a
        dead driver; a killed process stops it at once. It is also written on the run's VMs in the
        cloud, where `elastic down --orphans` reads it from any machine: at the first beat that
        finds VMs there, then every HEARTBEAT_TAG_S (a beat that tagged nothing, before the first
        VM joined, does not start that wait)."""
        from elastic.run.fleet import HEARTBEAT_TAG_S
        from providers.watcher import beat

        tagged_at = None
        while not self._beat_stop.wait(HEARTBEAT_S):
            try:
                beat()
            except Exception as exc:   # the head is gone: the VMs' watchers will notice too
                log.warning("heartbeat: %s", exc)
            if tagged_at is None or time.monotonic() - tagged_at >= HEARTBEAT_TAG_S:
                if self.beat_in_clouds():
                    tagged_at = time.monotonic()

    def beat_in_clouds(self) -> int:
        """Write the heartbeat (now) on every VM of the run in every cloud; a cloud that fails is
        tried again at the next beat. The number of VMs tagged."""
        now_s = time.time()
        tagged = 0
        for name, p in self.providers.items():
            try:
                tagged += p.heartbeat(self.run_name, now_s)
            except Exception as exc:
                log.warning("heartbeat tag on %s: %s", name, exc)
        return tagged

    _owns_cluster = False

    # -- capacity --------------------------------------------------------------------------------

    def _progress(self):
        from elastic.policy.planner import Progress

        w, resumed = self.world, self._resume_from
        if resumed is not None and w.outer_step == 0:   # --resume: the world is restored at its first join
            return Progress(resumed["tokens"], resumed["step"], (time.time() - self._t0) / 3600)
        return Progress(w.tokens, w.outer_step, (time.time() - self._t0) / 3600)

    def held(self) -> list:
        """Every VM the run holds, across providers."""
        return [i for p in self.providers.values() for i in p.list_instances(self.run_name)]

    def _snapshot(self, quotes=(), on_demand=()):
        """What the policy sees now (`policy.Snapshot`): the VMs held that joined the cluster (a
        cloud VM still booting is a launch under way), launches under way, `quotes` (the market's;
        `on_demand`: a spot run's on-demand offers, for the deadline rule), progress, spend and the
        policy's own state."""
        from elastic.policy.rules import Node, Snapshot

        now, w = time.time(), self.world
        moving = self.rentals.moving()
        nodes = []
        for inst in self.held():
            if inst.ray_node_id is None or inst.instance_id in self._left_to_cloud:
                continue   # booting (a launch under way), or gone from the run: its cloud reclaims it
            rep = w.replica_on(inst.instance_id)
            rid = rep.replica_id if rep is not None else None
            offer = replace(inst.offer, usd_per_hour=self.prices.usd_per_hour(inst.instance_id, inst.offer.usd_per_hour))
            nodes.append(Node(inst.instance_id, self.market.quote(offer, now), inst.launched_at,
                              ready=rid in w.replicas, leaving=rid in self._draining,
                              notice_deadline_s=self._draining.get(rid), moving=inst.instance_id in moving))
        return Snapshot(self.recipe, now, self._t0, nodes=tuple(nodes), pending=tuple(self.rentals.under_way),
                        quotes=tuple(quotes), on_demand_quotes=tuple(on_demand), progress=self._progress(),
                        spent_usd=self.prices.spent_usd(now),
                        budget_horizon_s=self._last_step_s, checkpointed_step=self._checkpointed_step,
                        between_steps=self._step_started_s is None, step_s=self._last_step_s,
                        step_end_s=(self._step_started_s or now) + self._last_step_s if self._last_step_s else None,
                        member_lost_at_s=self._member_lost_at_s, **self.executor.fed(now))

    def decide(self) -> None:
        """Gather a snapshot, ask the policy and have the executor do what it says (rent in the
        background; a move's old replica drains once the new one trains). Offers are read only when
        the policy has something to decide (`Policy.due`)."""
        if not self.policy.due(self._snapshot()):
            return
        every = self.offer_feed.to_decide_on()
        if every is None:
            return
        self.market.observe(self.ledger.events)
        now, spot = time.time(), self.recipe.resources.spot
        on_demand = [self.market.quote(o, now) for o in every if spot and not o.spot]
        quotes = self.market.quotes([o for o in every if o.spot == spot], now, rest_reclaimed=bool(on_demand))
        self.executor.act(self._snapshot(quotes, on_demand))

    # -- the executor's host (elastic.policy.executor.Host) ---------------------------------------------

    def record(self, event) -> None:
        self.ledger.append(event)

    def rent(self, quote, move) -> bool:
        self.rentals.launch(quote.offer, move)
        return True   # launched in the background: a refusal comes later (`Rentals.collect`)

    def trains(self, instance_id: str) -> bool:
        rep = self.world.replica_on(instance_id)
        return rep is not None and rep.replica_id in self.world.replicas

    def release(self, instance_id: str) -> None:
        self._draining[self.world.replica_on(instance_id).replica_id] = time.time()

    # -- events ----------------------------------------------------------------------------------

    def tick(self) -> None:
        """Read the provider's notices and preemptions; collect finished launches. Called between
        outer steps and while replicas train. A stop signal whose KeyboardInterrupt was lost is
        raised again here (`elastic.run.stop.check`)."""
        stop.check()
        for ev in [ev for p in self.providers.values() for ev in p.events()]:
            rep = self.world.replica_on(ev.instance_id)
            if ev.kind == NodeEventKind.REBALANCE:   # elevated interruption risk, no deadline: recorded only
                self.ledger.append(NodeRebalance(instance_id=ev.instance_id,
                                                 replica=rep.replica_id if rep else None))
            elif ev.kind == NodeEventKind.NOTICE:
                self.ledger.append(NodeNotice(instance_id=ev.instance_id, deadline=ev.deadline,
                                              notice_s=round(ev.deadline - ev.at, 3),
                                              replica=rep.replica_id if rep else None))
                if rep is None:
                    continue
                if rep.replica_id in self.world.joining:
                    # Not training yet: nothing to save, leave now and stop paying (or let its cloud
                    # take it, where that costs nothing).
                    left = self.leaves_to_cloud(self._held_instance(ev.instance_id), ev.deadline)
                    self.world.drop(rep.replica_id, "notice while joining", phase=LossPhase.SETUP, rule=LossRule.NOTICE)
                    self.record_world(self.world.take_events())
                    if not left:
                        self.terminate(ev.instance_id)
                    continue
                # End the inner phase early enough to contribute before the node goes.
                self._member_lost_at_s = time.time()   # a training replica is going (the timing rule)
                margin_s = max(0.5, 2 * self._last_sync_s)
                self.world.request_stop(rep.replica_id, ev.deadline - margin_s)
                self._draining[rep.replica_id] = ev.deadline
                self._noticed[rep.replica_id] = ev.deadline
            elif ev.kind == NodeEventKind.PREEMPTED:
                self.prices.gone(ev.instance_id)
                self._left_to_cloud.pop(ev.instance_id, None)
                self.ledger.append(NodePreempted(instance_id=ev.instance_id, with_notice=ev.with_notice,
                                                 replica=rep.replica_id if rep else None, reclaimed=ev.reclaimed))
                if rep is not None:
                    phase = self.world.phase if rep.replica_id in self.world.replicas else "setup"
                    if rep.replica_id in self.world.replicas:
                        self._member_lost_at_s = time.time()
                    lost = self.recipe.train.inner_steps if phase in ("inner", "sync") else 0
                    self.world.drop(rep.replica_id, "preempted" + (" after notice" if ev.with_notice else ""),
                                    phase=phase, lost_inner_steps=lost)
                    self.record_world(self.world.take_events())
                    self._draining.pop(rep.replica_id, None)
                    self._noticed.pop(rep.replica_id, None)
        self._end_overdue_left()
        self.rentals.collect()
        self.ckpt.poll()
        if self.prices.poll(self.providers.values()):
            self._stop_mid_step_for_budget()
        # Replace what was lost or is about to go right away, not at the next step boundary.
        self.decide()

    def _stop_mid_step_for_budget(self) -> None:
        """A price rose during an inner phase: when the rest of the step would cross the budget
        (`PriceWatch.stop_mid_step`), every member ends its phase now and syncs what it trained, and
        the run stops at the step's end, not one step later. (Between steps the check before each
        step does it; the first step has no length to go by yet.)"""
        if self._step_started_s is None or self.world.phase != "inner" or self._budget_stop:
            return
        self._budget_stop = self.prices.stop_mid_step(self.policy, self._snapshot(), self._step_started_s,
                                                      self._last_step_s, self.world.outer_step)
        if self._budget_stop:
            now = time.time()
            for rid in list(self.world.replicas):
                self.world.request_stop(rid, now)

    @property
    def draining(self) -> set[int]:
        """Replicas with a preemption notice, finishing their last phase."""
        return set(self._draining)

    @property
    def left_to_cloud(self) -> set[str]:
        """VMs out of the run that their cloud is about to reclaim (`leaves_to_cloud`)."""
        return set(self._left_to_cloud)

    _last_sync_s = 0.0
    _last_step_s = 0.0   # the budget is next checked about this long after a launch
    _member_lost_at_s = float("-inf")   # unix time a training replica was last preempted or noticed

    def _step_world(self):
        """One outer step. The world runs it and returns what happened at each pause; the driver
        records that, then does its own work before the world goes on (`tick`: notices, launches,
        renting). Returns the step's `StepResult` (None: every replica was lost)."""
        self._step_started_s = time.time()
        try:
            while True:
                done = self.record_world(self.world.step())
                if done is not None:
                    return done.result
                self.tick()
        finally:
            self._step_started_s = None

    def record_world(self, happened: list):
        """Record what the world returned (`World.step`, `World.take_events`); returns its
        `StepDone`, if the step ended."""
        from elastic.train.world import Loss, PhaseStarted, StepDone, SyncFailure

        done = None
        for h in happened:
            if isinstance(h, Loss):
                self._record_loss(h)
            elif isinstance(h, SyncFailure):
                self._record_sync_failed(h)
            elif isinstance(h, PhaseStarted):
                if self.on_phase is not None:
                    self.on_phase(h.phase, h.members)
            elif isinstance(h, StepDone):
                done = h
        return done

    def _record_loss(self, loss) -> None:
        self.ledger.append(ReplicaLost(replica=loss.replica_id, instance_id=loss.instance_id,
                                       reason=loss.reason, rule=loss.rule, phase=loss.phase,
                                       lost_inner_steps=loss.lost_inner_steps, outer_step=self.world.outer_step))
        self._draining.pop(loss.replica_id, None)
        deadline = self._noticed.pop(loss.replica_id, None)
        # A replica lost for any reason other than its node going: release the node too (unless
        # its cloud is about to reclaim it, at no charge: `leaves_to_cloud`).
        inst = self._held_instance(loss.instance_id)
        if inst is None or loss.reason.startswith("preempted") or loss.instance_id in self._left_to_cloud:
            return
        if deadline is None or not self.leaves_to_cloud(inst, deadline):
            self.terminate(loss.instance_id)

    def _record_sync_failed(self, fail) -> None:
        """An outer all-reduce attempt failed (a `world.SyncFailure`): a ledger event and a console
        line, never a silent shrink (a replica that cannot reach the others' outer group is a
        misconfigured network)."""
        self.ledger.append(SyncFailed(outer_step=fail.outer_step, attempt=fail.attempt,
                                      failures={str(rid): f for rid, f in fail.failures.items()}))
        for rid, f in fail.failures.items():
            what = "could not join the outer group" if f.get("stage") == "connect" else "failed in the all-reduce"
            self.warn(f"outer step {fail.outer_step}, attempt {fail.attempt}: replica {rid} ({f.get('addr')}) "
                       f"{what}: {f.get('error')}")

    def warn(self, text: str) -> None:
        """A line on the console (the run's view) and in driver.log."""
        log.warning("%s", text)
        if self._view is not None:
            self._view.warn(text)

    def _held_instance(self, instance_id: str):
        """The VM `instance_id` as its provider lists it, or None when the run no longer holds it."""
        return next((i for i in self.held() if i.instance_id == instance_id), None)

    def leaves_to_cloud(self, inst, deadline: float) -> bool:
        """Whether the VM `inst` (as held; None: no longer held), out of the world after an
        interruption notice that ends at `deadline`, is left for its cloud to reclaim rather than
        terminated now; if so, it is recorded as such (`node_left_to_cloud`; the policy no longer sees it; `tick` terminates it
        should it outlive its deadline by `LEFT_TO_CLOUD_GRACE_S`). It is where its cloud bills
        nothing for a spot VM it interrupts that young and bills the seconds of one the user
        terminates (`BillingTerms.interrupted_free_s`; AWS: the first hour). Terminating such a VM
        on its notice, as elsewhere, would turn a free VM into a billed one; waiting costs nothing."""
        from elastic.record.billing import terms

        if inst is None or not inst.offer.spot:
            return False
        free_s, age_s = terms(inst.offer.cloud).interrupted_free_s, deadline - inst.launched_at
        if age_s >= free_s:
            return False
        self._left_to_cloud[inst.instance_id] = deadline
        self.ledger.append(NodeLeftToCloud(instance_id=inst.instance_id, deadline=deadline, age_s=round(age_s, 3),
                                           free_s=free_s))
        return True

    def _end_overdue_left(self) -> None:
        """Terminate the VMs left to their cloud (`leaves_to_cloud`) that are still held
        `LEFT_TO_CLOUD_GRACE_S` past their notice's deadline: the interruption did not come."""
        now = time.time()
        for instance_id, deadline in list(self._left_to_cloud.items()):
            if now > deadline + LEFT_TO_CLOUD_GRACE_S:
                self._left_to_cloud.pop(instance_id)
                self.terminate(instance_id)

    def terminate(self, instance_id: str) -> None:
        """Release the VM `instance_id` now (ledger: `node_released`)."""
        self._left_to_cloud.pop(instance_id, None)
        self.prices.gone(instance_id)
        for p in self.providers.values():
            if any(i.instance_id == instance_id for i in p.list_instances(self.run_name)):
                p.terminate(instance_id)
                self.ledger.append(NodeReleased(instance_id=instance_id))
                return

    def admit_joiners(self) -> None:
        """At an outer-step boundary: bring every set-up joiner into the world. One that copies its
        state from a member does so in the background (`World.begin_copy`) and is admitted at a
        later boundary, once the copy is complete (`World.admit_copied`); the world keeps stepping."""
        joined = self.world.admit_copied()
        ready = self.world.ready_joiners()
        self.record_world(self.world.take_events())   # joiners (or donors) lost on the way
        for rep in ready:
            if self._resume_from is not None and not self.world.replicas and self.world.outer_step == 0:
                # --resume: the first replica loads the checkpoint (DCP reshards it to this world's
                # ranks); the rest copy from it as usual.
                source, manifest = self._admit_from_checkpoint(rep)
                if source == "lost":
                    continue   # the joiner died loading it; the next one tries
                if manifest is None:
                    raise UserError(f"--resume: no checkpoint at {self.ckpt.uri} could be loaded "
                                    "(see checkpoint_skipped in the ledger)")
                self.ledger.append(Resumed(from_step=manifest["step"], uri=self.ckpt.uri,
                                           saved_replicas=manifest.get("replicas"), saved_ranks=manifest.get("ranks")))
                self._resume_from = None
            elif not self.world.replicas and self.world.outer_step == 0 and not self._restored:
                self.world.admit_fresh(rep)
                source = "initial state"
            elif not self.world.replicas:
                self._restored = True
                after, self.pauser.after_pause = ("pause" if self.pauser.after_pause else "loss"), False
                source, manifest = self._admit_from_checkpoint(rep)
                if manifest is not None:
                    self.ledger.append(WorldRestored(from_step=manifest["step"], uri=self.ckpt.uri, after=after))
                else:
                    # Nothing was kept: start over from θ0 (fresh data; tokens count what is kept).
                    self.world.restore({"step": 0, "inner_step": 0, "data_cursor": self.world.cursor,
                                        "tokens": 0})
                    self._checkpointed_step = 0
                    self.world.admit_fresh(rep)
                    source = "initial state (no checkpoint yet)"
                    self.ledger.append(WorldRestored(from_step=0, uri=None, after=after))
            else:
                copying = self.world.begin_copy(rep)
                self.record_world(self.world.take_events())   # a donor lost exporting its state
                if copying:
                    self.ledger.append(ReplicaCopying(replica=rep.replica_id, instance_id=rep.instance_id,
                                                      donor=rep.copy.donor, outer_step=self.world.outer_step))
                continue
            joined.append((rep, source))
        for rep, source in joined:
            if source != "lost":
                self._drain_replaced(rep.instance_id)
                self.ledger.append(ReplicaJoined(replica=rep.replica_id, instance_id=rep.instance_id,
                                                 outer_step=self.world.outer_step, epoch=self.world.epoch,
                                                 source=source, setup_s=round(time.time() - rep.started_at, 3)))

    def _drain_replaced(self, instance_id: str) -> None:
        """A moved replica's replacement trains now: the old one drains at the next step boundary."""
        old = self.world.replica_on(self.rentals.replaced_by(instance_id) or "")
        if old is not None and old.replica_id in self.world.replicas:
            self._draining[old.replica_id] = time.time()

    def _admit_from_checkpoint(self, rep) -> tuple[str | None, dict | None]:
        """`rep` loads the newest usable checkpoint and the world takes its counters. One that is
        malformed, incomplete or altered is passed over for the one before it (ledger:
        `checkpoint_skipped`). Returns (where the state came from, the manifest loaded), both None
        when no checkpoint could be loaded."""
        found, skipped = self.ckpt.candidates()
        for line in skipped:
            self.ledger.append(CheckpointSkipped(step=None, message=line[:200]))
        for manifest in found:
            self.world.restore(manifest)
            try:
                source = self.world.admit(rep, checkpoint=(self.ckpt.uri, manifest, self.ckpt.staging))
                self._checkpointed_step = manifest["step"]
                return source, manifest
            except ckpt.CheckpointError as exc:
                cause = getattr(exc, "cause", None) or exc   # a rank's error arrives wrapped by Ray
                self.ledger.append(CheckpointSkipped(step=manifest["step"],
                                                     message=first_line(cause)))
        return None, None

    def wait_for_capacity(self, view) -> bool:
        """Pause until at least `world.min_replicas` are alive (renting and admitting meanwhile);
        False when `world.capacity_timeout_s` passes first."""
        w = self.recipe.world
        if len(self.world.replicas) >= w.min_replicas and not self.world.joining:
            return True
        start = time.monotonic()
        short_since = None   # when the capacity on its way last fell below min_replicas
        waited = False
        while True:
            self.tick()
            if self.executor.state.pause is not None:
                self.pauser.take_effect(view)
            self.admit_joiners()
            if self.rentals.failing:
                return False
            alive = len(self.world.replicas)
            # At start, wait for every replica already on its way, so all begin together.
            if alive >= w.min_replicas and (self.world.outer_step > 0 or not (self.world.joining or self.rentals.under_way)):
                self.executor.state.unpaused = False
                if waited:
                    self.ledger.append(CapacityWaitEnded(waited_s=round(time.monotonic() - start, 3),
                                                         replicas=alive))
                return True
            if self.executor.state.paused:   # a pause is no capacity shortage: no clock, no giving up
                if waited:
                    self.ledger.append(CapacityWaitEnded(waited_s=round(time.monotonic() - start, 3),
                                                         replicas=alive))
                short_since, waited, start = None, False, time.monotonic()
                reason = self._over_budget(0.0)
                if reason:   # budget.max_hours passed while paused (no price to unpause on)
                    self._budget_stop = f"{reason} (while paused)"
                    return True
                view.phase(self.pauser.line(self.executor.state.prices))
                self._wait_a_little()
                continue
            if not waited and self.world.outer_step > 0 and not self.executor.state.unpaused:
                self.ledger.append(CapacityWaitStarted(replicas=alive, min_replicas=w.min_replicas))
                waited = True
            # The clock runs only while even the replicas on their way would not be enough.
            on_way = alive + len(self.world.joining)   # launches may be refused: they do not count
            if self.executor.state.budget_held_back and on_way < w.min_replicas and not self.rentals.under_way:
                # The budget cannot pay for enough nodes: no point waiting.
                if waited:
                    self.ledger.append(CapacityWaitEnded(waited_s=round(time.monotonic() - start, 3),
                                                         replicas=alive, gave_up=True))
                return False
            short_since = (short_since or time.monotonic()) if on_way < w.min_replicas else None
            # With a deadline, the deadline rule replaces the timeout while on-demand could finish.
            if short_since is not None and time.monotonic() - short_since > w.capacity_timeout_s \
                    and not self.executor.state.waits_for_capacity:
                if not waited:
                    self.ledger.append(CapacityWaitStarted(replicas=alive, min_replicas=w.min_replicas))
                self.ledger.append(CapacityWaitEnded(waited_s=round(time.monotonic() - start, 3),
                                                     replicas=alive, gave_up=True))
                return False
            if self.world.outer_step == 0:
                view.phase(f"starting: {alive} replica(s) ready, {len(self.world.joining)} starting, "
                           f"{len(self.rentals.under_way)} node(s) renting")
            else:
                view.phase(f"waiting for capacity: {alive} of at least {w.min_replicas} replica(s) alive, "
                           f"{len(self.world.joining)} joining, {len(self.rentals.under_way)} renting")
            self._wait_a_little()

    def _wait_a_little(self) -> None:
        """Block briefly on whatever can change next: a joiner's setup or a launch."""
        import ray
        refs = [r for rep in self.world.joining.values() for r in rep.setup_refs]
        if refs:
            ray.wait(refs, num_returns=1, timeout=0.1)
        else:
            time.sleep(0.1)

    # -- the run ---------------------------------------------------------------------------------

    def run(self, view) -> str:
        """Train until done, out of budget or out of capacity; returns the run status once the
        last checkpoint is durable."""
        self._view = view
        status = self._train(view)
        self.finish_checkpoints(view)
        if self.ckpt.failed is not None and self.world.replicas:
            # The newest save did not land, and the world still holds what it trained: once more,
            # and if that fails too, the run says so rather than ending as if its work were saved.
            self.checkpoint(view)
            self.finish_checkpoints(view)
            if self.ckpt.failed is None:
                return status
            step, why = self.ckpt.failed
            raise UserError(f"checkpoint.uri: checkpoint {step} was not written ({why}), so the run's last steps "
                            f"are not saved; once {self.ckpt.uri} takes writes again, `elastic launch --resume` "
                            "trains them again from the newest complete checkpoint")
        return status

    def _train(self, view) -> str:
        recipe, world, ledger = self.recipe, self.world, self.ledger
        self._metrics = open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8")
        from elastic.train.metrics import Metrics
        scalars = Metrics(recipe, self.run_dir, ledger)
        train_s, last_step_s = 0.0, 0.0
        trained = 0   # tokens this run trained (not those of a checkpoint it resumed from)
        view.phase(f"renting {recipe.world.replicas} node(s), starting replicas")
        try:
            while not world.done():
                self.tick()
                if self.executor.state.pause is not None:
                    self.pauser.take_effect(view)
                self.admit_joiners()
                if self.rentals.failing or not self.wait_for_capacity(view):
                    if self.rentals.failing:   # the same setup failure again and again: renting more repeats it
                        self.end_message = self.rentals.failing
                        self.checkpoint_if_due(view, ending=True)
                        return RunStatus.FAILED
                    self.end_message = self._capacity_message()
                    self.checkpoint_if_due(view, ending=True)
                    if self.executor.state.budget_held_back:
                        ledger.append(BudgetExhausted(
                            outer_step=world.outer_step,
                            reason=f"budget.max_usd (${recipe.budget.max_usd:.2f}) cannot pay for "
                                   f"world.min_replicas ({recipe.world.min_replicas}) node(s)"))
                        return RunStatus.BUDGET_EXHAUSTED
                    return RunStatus.INSUFFICIENT_CAPACITY
                if world.done():   # --resume from a checkpoint already at train.outer_steps
                    break
                reason = self._budget_stop or self._over_budget(last_step_s)
                if reason:
                    ledger.append(BudgetExhausted(reason=reason, outer_step=world.outer_step))
                    self.checkpoint_if_due(view, ending=True)
                    return RunStatus.BUDGET_EXHAUSTED
                members = sorted(world.replicas)
                if members != self._members:
                    ledger.append(WorldFormed(epoch=world.epoch, replicas=members, outer_step=world.outer_step,
                                              params=world.params))
                    self._members = members
                # The saver's ranks load what a save imports beside this step.
                self.world.saver = self._saver() if world.replicas else None
                res = self._step_world()
                if res is None:
                    continue   # every replica was lost during the step; capacity wait next
                if not res.replicas:   # every member's notice deadline had passed: they leave now
                    self._release_drained(res)
                    continue
                self._last_sync_s = res.sync_s
                if res.sync_attempts > 1:
                    ledger.append(SyncRetried(outer_step=res.outer_step, attempts=res.sync_attempts))
                last_step_s = self._last_step_s = res.inner_s + res.sync_s
                train_s += last_step_s
                trained += res.tokens
                ledger.append(OuterStep(outer_step=res.outer_step, inner_step=world.inner_step, epoch=world.epoch,
                                        replicas=res.replicas, losses=[round(x, 6) for x in res.losses],
                                        tokens=res.tokens, tokens_total=world.tokens, inner_s=round(res.inner_s, 4),
                                        sync_s=round(res.sync_s, 4), bytes_sent=res.bytes_sent,
                                        network_s=round(res.network_s, 4), wait_s=round(res.wait_s, 4),
                                        overlapped_s=round(res.overlapped_s, 4), data_cursor=world.cursor,
                                        steps_done=res.steps_done,
                                        inner_s_by_replica={r: round(s, 4) for r, s in res.inner_s_by_replica.items()}))
                self._write_metrics(res)
                if self._budget_stop:   # a price rise ended this step early: stop now, its work saved
                    ledger.append(BudgetExhausted(reason=self._budget_stop, outer_step=world.outer_step))
                    self.checkpoint_if_due(view, ending=True)
                    return RunStatus.BUDGET_EXHAUSTED
                saved = self.checkpoint_if_due(view)   # before the replicas leaving go: they may be all there is
                if saved is not None and saved.reason == CheckpointReason.LEAVING:
                    # Saved from a leaving replica (there is no other): durable before its node goes.
                    self.finish_checkpoints(view)
                self._release_drained(res)
                view.step(res, world, trained / train_s if train_s else 0.0,
                          cost_so_far(ledger.events, time.time()))
                evals = recipe.eval.every_outer_steps
                if evals and (world.outer_step % evals == 0 or world.done()):
                    self.validate(view)
        finally:
            self._metrics.close()
            scalars.close()
        return RunStatus.COMPLETED

    def _release_drained(self, res) -> None:
        """Replicas that contributed after a notice leave now, before their node is taken."""
        for rid in list(self._draining):
            if (rid in res.replicas or rid in res.idle) and rid in self.world.replicas:
                rep = self.world.replicas[rid]
                self.world.release(rid)
                self._draining.pop(rid)
                self.ledger.append(ReplicaDrained(replica=rid, instance_id=rep.instance_id,
                                                  outer_step=res.outer_step, steps_done=res.steps_done.get(rid)))
                deadline = self._noticed.pop(rid, None)
                if deadline is None or not self.leaves_to_cloud(self._held_instance(rep.instance_id), deadline):
                    self.terminate(rep.instance_id)

    def _write_metrics(self, res) -> None:
        """Training curves: one line per inner step (mean loss over the world)."""
        first = self.world.inner_step - len(res.losses)
        for i, loss in enumerate(res.losses):
            self._metrics.write(json.dumps({"inner_step": first + i + 1, "outer_step": res.outer_step,
                                            "loss": round(loss, 6), "replicas": len(res.replicas)}) + "\n")
        self._metrics.flush()

    def validate(self, view) -> None:
        """Loss and perplexity of θ_outer on the validation windows (the lead replica's ranks share
        them); a `validation` event. A replica lost meanwhile costs this validation only."""
        import math

        view.phase(f"validation at outer step {self.world.outer_step}")
        try:
            parts = self.world.call_replica(self.world.lead_replica(), "evaluate")
        except Exception as exc:
            self.ledger.append(ValidationFailed(outer_step=self.world.outer_step, message=first_line(exc)))
            return
        tokens = sum(p["tokens"] for p in parts)
        if not tokens:
            return
        loss = sum(p["loss_sum"] for p in parts) / tokens
        ppl = math.exp(min(loss, 700.0))
        self.ledger.append(Validation(outer_step=self.world.outer_step, tokens_total=self.world.tokens,
                                      loss=round(loss, 6), perplexity=round(ppl, 4), tokens=tokens,
                                      seconds=round(max(p["seconds"] for p in parts), 4)))
        view.validation(self.world.outer_step, loss, ppl)

    def _over_budget(self, next_step_s: float) -> str | None:
        """Why the next outer step must not start (`Policy.stop_for_budget`), or None."""
        stop = self.policy.stop_for_budget(self._snapshot(), next_step_s)
        return stop.reason if stop else None

    def checkpoint_if_due(self, view, ending: bool = False):
        """Checkpoint when the policy says (`Policy.checkpoint_due`; `ending`: the run stops now)
        and a replica is there to save it; returns the `policy.Checkpoint` taken, or None."""
        due = self.policy.checkpoint_due(self._snapshot(), ending) if self.world.replicas else None
        if due is not None:
            self.checkpoint(view)
        return due

    def checkpoint(self, view) -> None:
        """Phase 1 now (training waits), phase 2 in the background (see elastic.storage.checkpoint)."""
        if self.ckpt.uploading is not None:
            view.phase(f"waiting for checkpoint {self.ckpt.uploading} to upload")
        view.phase(f"checkpoint at outer step {self.world.outer_step}")
        try:
            self.ckpt.save(self.world, self.world.replicas[self._saver()], self.recipe)
            self._checkpointed_step = self.world.outer_step
        except Exception as exc:  # the saving replica was lost mid-save: the partial one is ignored
            self.ledger.append(CheckpointFailed(step=self.world.outer_step, message=first_line(exc)))

    def _saver(self) -> int:
        """The replica checkpoints are saved from: one that is not about to leave, so its upload
        can finish (the lowest such id, so the choice holds while the world does)."""
        steady = [r for r in sorted(self.world.replicas) if r not in self._draining]
        return steady[0] if steady else min(self.world.replicas)

    def finish_checkpoints(self, view) -> None:
        """Wait until the last checkpoint is durable (phase 2 done) before the run lets its nodes go."""
        if self.ckpt.uploading is not None:
            view.phase(f"uploading checkpoint {self.ckpt.uploading} to {self.ckpt.uri}")
            self.ckpt.wait()

    # -- teardown --------------------------------------------------------------------------------

    def release_all(self) -> None:
        """Release every node the run holds and stop what it started; each part tolerates the others failing."""
        self._beat_stop.set()
        if self.ckpt.uploading is not None:  # interrupted mid-upload: the last complete one stands
            self.ledger.append(CheckpointUploadAbandoned(step=self.ckpt.uploading))
        if self.world is not None:
            try:
                self.world.shutdown()
            except Exception:
                log.exception("world shutdown")
        for p in self.providers.values():
            p.stop_launches()   # VMs still booting give up waiting now
        if self.rentals is not None:
            self.rentals.shutdown()
        if self.providers:
            for p in self.providers.values():
                for inst in p.list_instances(self.run_name):
                    try:
                        p.terminate(inst.instance_id)
                        self.ledger.append(NodeReleased(instance_id=inst.instance_id))
                    except Exception as exc:
                        self.ledger.append(Error(message=f"could not release {inst.instance_id}: {exc}"))
                self._release_leftovers(p)
                if not any(q is p for q, _ in self._controllers):
                    p.close()
        self._save_preemption_history()
        self.ckpt.close()
        if self.cluster is not None and self._owns_cluster:
            try:
                self.cluster.shutdown()
            except Exception:
                log.exception("cluster shutdown")

    def _release_leftovers(self, provider) -> None:
        """Terminate what the cloud still holds for this run that the run did not rent itself: any
        VM whose launch this process lost track of. The controller VM the driver runs on
        (`resources.head: controller`) is kept for `release_controller`, after the report."""
        try:
            left = provider.find_instances(self.run_name)
        except Exception as exc:
            self.ledger.append(Error(message=f"could not list the run's VMs on {provider.name}: {exc}"))
            return
        self._controllers += [(provider, i) for i in left if i.role == "controller"]
        for inst in (i for i in left if i.role != "controller"):
            try:
                provider.terminate(inst.instance_id)
                log.info("released %s (%s) of run %s", inst.instance_id, inst.role, self.run_name)
            except Exception as exc:
                self.ledger.append(Error(message=f"could not release {inst.instance_id}: {exc}"))

    def release_controller(self) -> None:
        """Terminate the controller VM this driver runs on, the run's last act: after the ledger,
        the report and the record in storage are written (`release_all` keeps it)."""
        for provider, inst in self._controllers:
            try:
                provider.terminate(inst.instance_id)
                log.info("released %s (controller) of run %s", inst.instance_id, self.run_name)
            except Exception:
                log.exception("could not release the controller %s", inst.instance_id)
        for provider in {id(p): p for p, _ in self._controllers}.values():
            provider.close()
        self._controllers = []

    def _save_preemption_history(self) -> None:
        """Add this run's preemptions per node-hour to the history later runs' risk estimates start
        from (real clouds only: a simulated local market says nothing about them)."""
        from elastic.policy.market import save_history

        if self.market is None:
            return
        try:
            self.market.observe(self.ledger.events)
            stats = {k: v for k, v in self.market.stats(time.time()).items() if k[0] != "local"}
            if stats:
                save_history(stats)
        except Exception:
            log.exception("saving the preemption history")

    def _capacity_message(self) -> str | None:
        """One line on why capacity never came: every offer at its known capacity, or (when no
        node ever joined) join timeouts and refused launches."""
        events = self.ledger.events
        held_back = [e for e in events if e["type"] == LaunchHeldBack.TYPE and e["reason"] == "capacity"]
        if held_back and self.executor.state.capacity_logged:   # the shortage is still on
            return (f"no capacity: {held_back[-1]['message']} (room for {held_back[-1]['held']} replica(s); "
                    f"world.min_replicas is {self.recipe.world.min_replicas})")
        if any(e["type"] == ReplicaJoined.TYPE for e in events):
            return None
        timeouts = [e for e in events if e["type"] == NodeJoinTimeout.TYPE]
        refused = [e for e in events if e["type"] == CapacityRefused.TYPE]
        if timeouts:
            failed = sum(1 for e in timeouts if e.get("boot_failed"))
            return (f"no node joined within {self.recipe.resources.join_timeout_s:g} s "
                    f"({len(timeouts)} VM(s) launched, none joined the Ray cluster"
                    + (f", {failed} of them because their boot script failed" if failed else "")
                    + f", all terminated; {len(refused)} launch(es) refused for capacity)")
        if refused:
            return (f"no capacity: {len(refused)} launch(es) refused within world.capacity_timeout_s "
                    f"({self.recipe.world.capacity_timeout_s:g} s); last: {refused[-1].get('message')}")
        return None



class QuietView:
    """A view that shows nothing (for runs driven from code: tests, benchmarks)."""

    def phase(self, text: str) -> None:
        pass

    def step(self, *args) -> None:
        pass

    def validation(self, *args) -> None:
        pass

    def warn(self, text: str) -> None:
        pass


def run_attached(recipe: Recipe, cluster, run_dir: Path, on_phase=None, run_name: str = "run",
                 resume: bool = False) -> tuple[str, list[dict]]:
    """Run a recipe on an already running local cluster, from code: the same driver and ledger as
    `elastic launch`, without the terminal view or signal handling. `on_phase(driver, phase,
    members)` is called as each phase of each outer step gets under way. Returns (status, events)."""
    from elastic.record.ledger import read_events

    run_dir.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(run_dir / "events.jsonl")
    ledger.append(RunStarted(run=run_name, recipe=recipe.name, recipe_digest=recipe.digest()))
    driver = Driver(recipe, run_dir, ledger, resume=resume)
    driver.attach(cluster)
    if on_phase is not None:
        driver.on_phase = lambda phase, members: on_phase(driver, phase, members)
    status = RunStatus.FAILED
    try:
        status = driver.run(QuietView())
    finally:
        driver.release_all()
        ledger.append(RunEnded(status=status))
        ledger.close()
        driver.release_controller()
    return status, read_events(run_dir / "events.jsonl")
