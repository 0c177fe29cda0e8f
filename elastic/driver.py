"""The driver: keeps the world at its target size on whatever capacity the provider gives, runs the
outer loop, checkpoints, keeps the budget, and records everything in the ledger.

Preemption is the normal path. Each tick (between outer steps, and every 0.1 s while replicas
train) the driver reads the provider's events: a notice asks the replica to cut its inner phase
short in time to contribute, then it leaves cleanly; a preemption drops the replica and the world
re-forms over the survivors. Replacement nodes are rented in the background and their replicas
join at the next outer-step boundary with state copied from a live peer. `elastic.launch` wraps
the driver with signals and the report.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from pathlib import Path

from elastic import checkpoint as ckpt
from elastic.errors import UserError, described, first_line
from elastic.events import (
    BudgetExhausted, CapacityRefused, CapacityWaitEnded, CapacityWaitStarted, CheckpointFailed,
    CheckpointSkipped, CheckpointUploadAbandoned, ClusterStarted, Error, LaunchFailed, LaunchHeldBack, LinkMeasured,
    MarketAvailable, MarketUnavailable, NetworkStarted, NodeJoinTimeout, NodeLaunched, NodeNotice, NodePreempted, NodePrice,
    NodeRebalance, NodeReleased, OuterStep, ReplicaCopying, ReplicaDrained, ReplicaJoined, ReplicaLost,
    ReplicaMove, ReplicaStarting, Resumed, RunEnded, RunStarted, SyncFailed, SyncRetried, Validation,
    ValidationFailed, WorldFormed, WorldPaused, WorldRestored, WorldTarget, WorldUnpaused)
from elastic.ledger import Ledger
from elastic.market import offer_key
from elastic.planner import site
from elastic.recipe import Recipe
from elastic.report import cost_so_far

log = logging.getLogger(__name__)

PRICE_POLL_S = 1.0       # real seconds between reads of the held VMs' current prices
OFFERS_WAIT_S = 0.2      # a tick waits this long for the clouds' offers, then goes on (asked in the background)
OFFERS_FRESH_S = 10.0    # an answer older than this when next wanted is asked again
HEARTBEAT_S = 5.0        # real seconds between two driver heartbeats (the VMs' autodown watchers read them)


class Driver:
    """Args:
        recipe: the resolved recipe.
        run_dir: the run directory (exists).
        ledger: the run's ledger.
        resume: continue from the latest complete checkpoint at `checkpoint.uri`.
    """

    def __init__(self, recipe: Recipe, run_dir: Path, ledger: Ledger, resume: bool = False):
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
        self.ckpt = ckpt.Checkpointer(ckpt.destination(c.uri, run_dir), ckpt.staging_root(c.local_dir, self.run_name),
                                      c.keep_last, c.upload_threads, ledger, run=self.run_name,
                                      run_dir=run_dir)
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="launch")
        self._launching: dict[Future, object] = {}
        self._joined_at: dict[str, tuple[str, str]] = {}  # instance id -> (site, Ray node) of nodes that joined
        self._refusals: list = []                        # policy.Refusal of launches refused (the cooldown rule)
        self._draining: dict[int, float] = {}            # replica id -> notice deadline (unix)
        self._members: list[int] = []
        self._move_of: dict[Future, str] = {}           # launch of a move -> instance id it replaces
        self._moves: dict[str, str] = {}                 # new instance id -> instance id it replaces
        self._replanned_at = time.time()                 # the policy's last re-plan (unix)
        self._budget_held_back = False                   # the last launch was held back by the budget
        self._budget_logged = False
        self._capacity_logged = False                    # launch_held_back (capacity) written for this shortage
        self._target = 0                                 # the world's target size (policy.Retarget)
        self._planned = False                            # the policy sized the world for budget.max_hours
        self._restored = False   # the world was restored after losing every replica
        self._checkpointed_step = 0                      # outer step of the newest checkpoint saved or restored
        self._step_started_s: float | None = None       # unix time the outer step under way began
        self._budget_stop: str | None = None            # a price rise mid-step stopped the run (why)
        self._price: dict[str, float] = {}               # held instance id -> USD/h last recorded
        self._price_poll_at = 0.0
        self._prices: tuple[tuple[float, float, str], ...] = ()   # the market's price and pace at each sample (PriceSeen)
        self._priced_at = float("-inf")                 # when the last sample was taken (unix)
        self._paused = False                             # the policy paused the run (policy.Pause, until Unpause)
        self._pause = None                               # the Pause's policy.Pace, until it takes effect
        self._paused_at: float | None = None            # when the pause took effect: every node released (unix)
        self._after_pause = False                        # the world is empty because of a pause
        self._pause_tried_step = -1                      # the outer step a pause last tried to checkpoint at
        self._unpaused = False                           # the world boots again after a pause: no capacity wait yet
        self._offered = False                            # the clouds offered something the recipe allows, once
        self._beat_stop = threading.Event()             # ends the heartbeat thread (release_all)
        self._market_seen: set[str] = set()             # clouds whose offers answered at least once
        self._market_down: set[str] = set()             # clouds whose offers fail now (market_unavailable)
        self._asking: Future | None = None               # the clouds' offers, asked in the background
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
        from elastic.cluster import LOOPBACK, LocalCluster
        from elastic.world import preload
        from providers import provider_class

        preload()   # torch loads while Ray starts
        # A provider with a network of its own (local.network's lab) puts the driver's host on it.
        network = next((n for name in dict.fromkeys(self.recipe.resources.clouds)
                        if (n := provider_class(name).start_network(self.recipe)) is not None), None)
        if network is not None:
            self.ledger.append(NetworkStarted(tag=network.tag, head_ip=network.head_ip))
        try:
            cluster = LocalCluster(address=address, node_ip=network.head_ip if network else LOOPBACK,
                                   network=network)
        except BaseException:
            if network is not None:
                network.down()
            raise
        self.ledger.append(ClusterStarted(address=cluster.address, session_dir=cluster.session_dir))
        self.attach(cluster)
        self._owns_cluster = True

    def attach(self, cluster) -> None:
        """Use a running local cluster: build the provider and the world on it."""
        from elastic.world import World
        from providers import build

        from elastic.market import Market, load_history, load_throughput, workload_key

        self.cluster = cluster
        self.providers = {name: build(name, self.recipe, cluster, self.run_name)
                          for name in dict.fromkeys(self.recipe.resources.clouds)}
        self.provider = next(iter(self.providers.values()))
        t = self.recipe.train
        self.market = Market(self.recipe.planner, load_history(),
                             tokens_per_inner_step=t.batch_size * t.seq_len,
                             measured_before=load_throughput(workload_key(self.recipe)))
        self.world = World(self.recipe)
        threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True).start()

    def _heartbeat(self) -> None:
        """The heartbeat every cloud VM's watcher reads (`resources.autodown_after_s`), from its own
        thread: a long blocking call of the main loop (a restore, a slow step) must not look like a
        dead driver; a killed process stops it at once. Every HEARTBEAT_TAG_S it is also written on
        the run's VMs in the cloud, where `elastic down --orphans` reads it from any machine."""
        from elastic.fleet import HEARTBEAT_TAG_S
        from providers.watcher import beat

        tagged_at = -HEARTBEAT_TAG_S
        while not self._beat_stop.wait(HEARTBEAT_S):
            try:
                beat()
            except Exception as exc:   # the head is gone: the VMs' watchers will notice too
                log.warning("heartbeat: %s", exc)
            if time.monotonic() - tagged_at >= HEARTBEAT_TAG_S:
                tagged_at = time.monotonic()
                self.beat_in_clouds()

    def beat_in_clouds(self) -> None:
        """Write the heartbeat (now) on every VM of the run in every cloud; a cloud that fails is
        tried again at the next beat."""
        now_s = time.time()
        for name, p in self.providers.items():
            try:
                p.heartbeat(self.run_name, now_s)
            except Exception as exc:
                log.warning("heartbeat tag on %s: %s", name, exc)

    _owns_cluster = False

    # -- capacity --------------------------------------------------------------------------------

    def _progress(self):
        from elastic.planner import Progress

        w, resumed = self.world, self._resume_from
        if resumed is not None and w.outer_step == 0:   # --resume: the world is restored at its first join
            return Progress(resumed["tokens"], resumed["step"], (time.time() - self._t0) / 3600)
        return Progress(w.tokens, w.outer_step, (time.time() - self._t0) / 3600)

    def _offers(self, wait_s: float = OFFERS_WAIT_S) -> list | None:
        """Every provider's offers, cheapest per GPU-hour first (per VM-hour for CPU-only VMs); None
        while the clouds have not answered within `wait_s`. They are asked on a thread of their own
        (`_ask_clouds`): a cloud that is slow to answer (its SDK retrying a throttled call for
        seconds) holds no tick, so notices and preemptions are still handled meanwhile, and a later
        tick takes the answer. A cloud that answered before but fails now (the SDK's retries spent,
        or an answer that does not parse) offers nothing until it answers again: the run trains on
        what it holds, and the ledger says `market_unavailable` once per outage."""
        if self._asking is None:
            self._asking = self._ask_clouds()
        try:
            answers, answered_at = self._asking.result(timeout=wait_s)
        except FutureTimeout:
            return None
        self._asking = None
        if time.monotonic() - answered_at > OFFERS_FRESH_S:   # left unread while nothing was due
            return self._offers(wait_s)
        every = []
        for name, offers in answers.items():
            if isinstance(offers, Exception):
                if name not in self._market_seen:
                    raise offers   # never answered: the setup is wrong, and the run says so
                if name not in self._market_down:
                    self._market_down.add(name)
                    message = described(offers)
                    log.warning("%s prices and capacity unavailable: %s", name, message)
                    self.ledger.append(MarketUnavailable(cloud=name, message=message))
                continue
            self._market_seen.add(name)
            if name in self._market_down:
                self._market_down.discard(name)
                self.ledger.append(MarketAvailable(cloud=name))
            every += offers
        return sorted(every, key=lambda o: (o.usd_per_hour / max(1, o.gpus), o.usd_per_hour))

    def _ask_clouds(self) -> Future:
        """Ask every provider for its offers on a daemon thread (one a hung cloud cannot keep the
        process from exiting): a future of ({cloud: offers, or the exception it raised}, when)."""
        asked: Future = Future()

        def ask() -> None:
            answers: dict = {}
            for name, p in self.providers.items():
                try:
                    answers[name] = p.offers(self.recipe.resources)
                except Exception as exc:
                    answers[name] = exc
            asked.set_result((answers, time.monotonic()))

        threading.Thread(target=ask, name="offers", daemon=True).start()
        return asked

    def _held(self) -> list:
        """Every VM the run holds, across providers."""
        return [i for p in self.providers.values() for i in p.list_instances(self.run_name)]

    def _snapshot(self, quotes=()):
        """What the policy sees now (`policy.Snapshot`): the VMs held that joined the cluster (a
        cloud VM still booting is a launch under way), launches under way, `quotes` (the market's),
        progress, spend and the policy's own state."""
        from elastic.policy import Node, Snapshot

        now, w = time.time(), self.world
        moving = set(self._moves.values()) | set(self._move_of.values())
        nodes = []
        for inst in self._held():
            if inst.ray_node_id is None:
                continue
            rep = w.replica_on(inst.instance_id)
            rid = rep.replica_id if rep is not None else None
            offer = replace(inst.offer, usd_per_hour=self._price.get(inst.instance_id, inst.offer.usd_per_hour))
            nodes.append(Node(inst.instance_id, self.market.quote(offer, now), inst.launched_at,
                              ready=rid in w.replicas, leaving=rid in self._draining,
                              notice_deadline_s=self._draining.get(rid), moving=inst.instance_id in moving))
        cooldown_s = self.recipe.planner.capacity_cooldown_s
        self._refusals = [r for r in self._refusals if now - r.at_s < cooldown_s]
        return Snapshot(self.recipe, now, self._t0, nodes=tuple(nodes), pending=tuple(self._launching.values()),
                        quotes=tuple(quotes), progress=self._progress(), spent_usd=self._spent(now),
                        refusals=tuple(self._refusals), target_replicas=self._target, planned=self._planned,
                        last_replan_s=self._replanned_at, budget_horizon_s=self._last_step_s,
                        checkpointed_step=self._checkpointed_step, prices=self._prices,
                        priced_at_s=self._priced_at, paused=self._paused)

    def decide(self) -> None:
        """Gather a snapshot, ask the policy (`policy.decide`) and do what it says: rent (in the
        background; a move's old replica drains once the new one trains), grow the world's target,
        record what was held back. Offers are read only when the policy has something to decide."""
        from elastic.policy import HoldBack, Pause, PriceSeen, Release, Rent, Replan, Retarget, Unpause, decide, due

        if not due(self._snapshot()):
            return
        every = self._offers()
        if every is None:
            return   # the clouds are still answering: a later tick decides
        if not every and (self._market_down or self._offered):
            # A cloud is unreachable, or every offer it had left the recipe's filters (a price above
            # resources.max_usd_per_hour): train on what is held, rent once one comes back.
            return
        if not every:
            raise UserError(f"resources: no offer from {', '.join(self.providers)} matches resources.accelerators / "
                            "resources.regions / resources.max_usd_per_hour")
        self._offered = True
        self.market.observe(self.ledger.events)
        snap = self._snapshot(self.market.quotes(every, time.time()))
        for a in decide(snap):
            if isinstance(a, Retarget):
                self._target, self._planned = a.replicas, True
                if a.grown:
                    self.ledger.append(WorldTarget(replicas=a.replicas, reason="budget.max_hours",
                                                   hours_to_finish=round(a.hours_to_finish, 4)))
            elif isinstance(a, Replan):
                self._replanned_at = a.at_s
            elif isinstance(a, PriceSeen):
                self._prices = a.kept(self._prices)
                self._priced_at = a.at_s
            elif isinstance(a, Pause):   # takes effect at the next outer-step boundary (`_pause_world`)
                self._paused, self._pause = True, a.pace
                self._target, self._planned = 0, False   # the world is sized again when it unpauses
            elif isinstance(a, Unpause):
                self._paused, self._pause = False, None
                if self._paused_at is not None:
                    self.ledger.append(WorldUnpaused(paused_s=round(time.time() - self._paused_at, 3),
                                                     usd_per_mtok=round(a.pace.usd_per_mtok, 6),
                                                     threshold_usd_per_mtok=round(a.pace.threshold_usd_per_mtok, 6),
                                                     need=round(a.pace.need, 4)))
                    self._paused_at, self._unpaused = None, True
            elif isinstance(a, HoldBack) and a.reason == "capacity":
                if not self._capacity_logged:   # once per shortage: every offer is at its known capacity
                    self._capacity_logged = True
                    self.ledger.append(LaunchHeldBack(reason="capacity", held=a.held,
                                                      message="every offer the recipe allows is at its known capacity"))
            elif isinstance(a, HoldBack) and a.reason == "budget":
                self._capacity_logged, self._budget_held_back = False, True
                if not self._budget_logged:
                    self._budget_logged = True
                    self.ledger.append(LaunchHeldBack(reason="budget.max_usd", spent_usd=round(snap.spent_usd, 6),
                                                      usd_per_hour=a.usd_per_hour))
            elif isinstance(a, Release):   # a move whose old replica leaves now, not once the new one trains
                rep = self.world.replica_on(a.instance_id)
                if rep is not None and rep.replica_id in self.world.replicas:
                    self._draining[rep.replica_id] = time.time()
                    self._record_move(a.move)
            elif isinstance(a, Rent):
                self._capacity_logged = self._budget_held_back = False
                fut = self._launch(a.quote.offer)
                if a.move is not None:
                    self._move_of[fut] = a.move.drain
                    self._record_move(a.move)

    def _record_move(self, move) -> None:
        self.ledger.append(ReplicaMove(drain_instance_id=move.drain, zone=move.add.offer.zone,
                                       instance_type=move.add.offer.instance_type,
                                       usd_per_hour=move.add.offer.usd_per_hour,
                                       usd_per_mtok_before=round(move.usd_per_mtok_before, 6),
                                       usd_per_mtok_after=round(move.usd_per_mtok_after, 6)))

    def _launch(self, offer) -> Future:
        fut = self._pool.submit(self.providers[offer.cloud].launch, offer, self.run_name, "replica")
        self._launching[fut] = offer
        return fut

    _spent_memo = (-1, 0.0, 0.0)   # (ledger events, unix time, USD)

    def _spent(self, now: float) -> float:
        """USD spent so far (the ledger priced up to `now`). Rebuilt only when the ledger grew or a
        second passed: the policy asks on every 0.1 s tick while it wants a node."""
        n, at, usd = self._spent_memo
        if n != len(self.ledger.events) or now - at >= 1.0:
            usd = cost_so_far(self.ledger.events, now)
            self._spent_memo = (len(self.ledger.events), now, usd)
        return usd

    def _collect_launches(self) -> None:
        from elastic.policy import Refusal
        from providers.base import CapacityError, JoinTimeout

        for fut in [f for f in self._launching if f.done()]:
            offer = self._launching.pop(fut)
            replaces = self._move_of.pop(fut, None)
            try:
                inst = fut.result()
            except JoinTimeout as exc:  # rented, never joined, terminated: bill it, rest the offer
                self._refusals.append(Refusal(offer_key(offer), time.time()))
                self._record_join_timeout(exc, offer)
                continue
            except UserError:   # the recipe or the account setup is wrong: no other offer will do better
                raise
            except Exception as exc:  # no capacity, or a VM that failed to come up: the offer rests
                self._refusals.append(Refusal(offer_key(offer), time.time()))
                refused = isinstance(exc, CapacityError)
                failed = CapacityRefused if refused else LaunchFailed
                self.ledger.append(failed(zone=offer.zone, instance_type=offer.instance_type,
                                          message=str(exc) if refused else f"{type(exc).__name__}: {str(exc)[:200]}"))
                continue
            self._record_launch(inst, offer)
            if replaces is not None:
                self._moves[inst.instance_id] = replaces
            peer = self._link_peer(offer)
            rep = self.world.start_replica(inst.instance_id, inst.ray_node_id)
            self.ledger.append(ReplicaStarting(replica=rep.replica_id, instance_id=inst.instance_id))
            self._joined_at[inst.instance_id] = (site(offer), inst.ray_node_id)
            if peer is not None:
                self._pool.submit(self._measure_link, inst.instance_id, site(offer), inst.ray_node_id, *peer)

    def _link_peer(self, offer) -> tuple[str, str, str] | None:
        """The peer a node joining from `offer` measures its link to: (instance id, site, Ray node)
        of a held node on another site (a pair the planner prices); None when every held node sits
        on its own site (a link inside one site costs the planner nothing: not measured)."""
        return next(((iid, at[0], at[1]) for iid, at in self._joined_at.items()
                     if at[0] != site(offer) and self.world.replica_on(iid) is not None), None)

    def _measure_link(self, instance_id: str, node_site: str, node_id: str, peer_id: str, peer_site: str,
                      peer_node: str) -> None:
        """Measure one link (runs in the launch pool: a few seconds beside training) and record it."""
        from elastic.linkprobe import measure

        try:
            got = measure(node_id, peer_node)
        except Exception as exc:   # either node went meanwhile: nothing measured, nothing lost
            log.info("link %s -> %s not measured: %s", instance_id, peer_id, exc)
            return
        self.ledger.append(LinkMeasured(instance_id=instance_id, peer_instance_id=peer_id, site=node_site,
                                        peer_site=peer_site, **got))

    # -- events ----------------------------------------------------------------------------------

    def tick(self) -> None:
        """Read the provider's notices and preemptions; collect finished launches. Called between
        outer steps and while replicas train."""
        for ev in [ev for p in self.providers.values() for ev in p.events()]:
            rep = self.world.replica_on(ev.instance_id)
            if ev.kind == "rebalance":   # elevated interruption risk, no deadline: recorded only
                self.ledger.append(NodeRebalance(instance_id=ev.instance_id,
                                                 replica=rep.replica_id if rep else None))
            elif ev.kind == "notice":
                self.ledger.append(NodeNotice(instance_id=ev.instance_id, deadline=ev.deadline,
                                              notice_s=round(ev.deadline - ev.at, 3),
                                              replica=rep.replica_id if rep else None))
                if rep is None:
                    continue
                if rep.replica_id in self.world.joining:
                    # Not training yet: nothing to save, leave now and stop paying.
                    self.world.drop(rep.replica_id, "notice while joining", phase="setup", rule="notice")
                    self._record_world(self.world.take_events())
                    self._terminate(ev.instance_id)
                    continue
                # End the inner phase early enough to contribute before the node goes.
                margin_s = max(0.5, 2 * self._last_sync_s)
                self.world.request_stop(rep.replica_id, ev.deadline - margin_s)
                self._draining[rep.replica_id] = ev.deadline
            elif ev.kind == "preempted":
                self._price.pop(ev.instance_id, None)
                self.ledger.append(NodePreempted(instance_id=ev.instance_id, with_notice=ev.with_notice,
                                                 replica=rep.replica_id if rep else None))
                if rep is not None:
                    phase = self.world.phase if rep.replica_id in self.world.replicas else "setup"
                    lost = self.recipe.train.inner_steps if phase in ("inner", "sync") else 0
                    self.world.drop(rep.replica_id, "preempted" + (" after notice" if ev.with_notice else ""),
                                    phase=phase, lost_inner_steps=lost)
                    self._record_world(self.world.take_events())
                    self._draining.pop(rep.replica_id, None)
        self._collect_launches()
        self.ckpt.poll()
        self._record_prices()
        # Replace what was lost or is about to go right away, not at the next step boundary.
        self.decide()

    def _record_prices(self) -> None:
        """A `node_price` event when the price in effect for a held VM changes (spot prices move)."""
        now = time.monotonic()
        if now < self._price_poll_at or not self._price:
            return
        self._price_poll_at = now + PRICE_POLL_S
        rose = False
        for p in self.providers.values():
            for iid, usd in p.prices(list(self._price)).items():
                if iid in self._price and round(usd, 6) != self._price[iid]:
                    rose |= round(usd, 6) > self._price[iid]
                    self._price[iid] = round(usd, 6)
                    self.ledger.append(NodePrice(instance_id=iid, usd_per_hour=round(usd, 6)))
        if rose:
            self._stop_mid_step_for_budget()

    def _stop_mid_step_for_budget(self) -> None:
        """A price rose during an inner phase: when the rest of the step (the last step's length
        less the time it has run) would cross the budget (`policy.stop_for_budget`), every member
        ends its phase now and syncs what it trained, and the run stops at the step's end, not one
        step later. (Between steps the check before each step does it; the first step has no
        length to go by yet.)"""
        from elastic.policy import stop_for_budget

        if self._step_started_s is None or self.world.phase != "inner" or self._budget_stop:
            return
        left_s = max(0.0, self._step_started_s + self._last_step_s - time.time())
        stop = stop_for_budget(self._snapshot(), left_s)
        if stop is None:
            return
        self._budget_stop = f"{stop.reason}: a price rose during outer step {self.world.outer_step + 1}"
        now = time.time()
        for rid in list(self.world.replicas):
            self.world.request_stop(rid, now)

    @property
    def draining(self) -> set[int]:
        """Replicas with a preemption notice, finishing their last phase."""
        return set(self._draining)

    _last_sync_s = 0.0
    _last_step_s = 0.0   # the budget is next checked about this long after a launch

    def _step_world(self):
        """One outer step. The world runs it and returns what happened at each pause; the driver
        records that, then does its own work before the world goes on (`tick`: notices, launches,
        renting). Returns the step's `StepResult` (None: every replica was lost)."""
        self._step_started_s = time.time()
        try:
            while True:
                done = self._record_world(self.world.step())
                if done is not None:
                    return done.result
                self.tick()
        finally:
            self._step_started_s = None

    def _record_world(self, happened: list):
        """Record what the world returned (`World.step`, `World.take_events`); returns its
        `StepDone`, if the step ended."""
        from elastic.world import Loss, PhaseStarted, StepDone, SyncFailure

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
        self._warn(f"replica {loss.replica_id} on {loss.instance_id} lost ({loss.rule}): {loss.reason}")
        self._draining.pop(loss.replica_id, None)
        # A replica lost for any reason other than its node going: release the node too.
        inst = next((i for i in self._held() if i.instance_id == loss.instance_id), None)
        if inst is not None and not loss.reason.startswith("preempted"):
            self._terminate(loss.instance_id)

    def _record_sync_failed(self, fail) -> None:
        """An outer all-reduce attempt failed (a `world.SyncFailure`): a ledger event and a console
        line, never a silent shrink (a replica that cannot reach the others' outer group is a
        misconfigured network)."""
        self.ledger.append(SyncFailed(outer_step=fail.outer_step, attempt=fail.attempt,
                                      failures={str(rid): f for rid, f in fail.failures.items()}))
        for rid, f in fail.failures.items():
            what = "could not join the outer group" if f.get("stage") == "connect" else "failed in the all-reduce"
            self._warn(f"outer step {fail.outer_step}, attempt {fail.attempt}: replica {rid} ({f.get('addr')}) "
                       f"{what}: {f.get('error')}")

    def _warn(self, text: str) -> None:
        """A line on the console (the run's view) and in driver.log."""
        log.warning("%s", text)
        if self._view is not None:
            self._view.warn(text)

    def _terminate(self, instance_id: str) -> None:
        self._price.pop(instance_id, None)
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
        self._record_world(self.world.take_events())   # joiners (or donors) lost on the way
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
                after, self._after_pause = ("pause" if self._after_pause else "loss"), False
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
                self._record_world(self.world.take_events())   # a donor lost exporting its state
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
        old = self.world.replica_on(self._moves.pop(instance_id, ""))
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
            if self._pause is not None:
                self._pause_world(view)
            self.admit_joiners()
            alive = len(self.world.replicas)
            # At start, wait for every replica already on its way, so all begin together.
            if alive >= w.min_replicas and (self.world.outer_step > 0 or not (self.world.joining or self._launching)):
                self._unpaused = False
                if waited:
                    self.ledger.append(CapacityWaitEnded(waited_s=round(time.monotonic() - start, 3),
                                                         replicas=alive))
                return True
            if self._paused:   # a pause is no capacity shortage: no clock, no giving up
                if waited:
                    self.ledger.append(CapacityWaitEnded(waited_s=round(time.monotonic() - start, 3),
                                                         replicas=alive))
                short_since, waited, start = None, False, time.monotonic()
                reason = self._over_budget(0.0)
                if reason:   # budget.max_hours passed while paused (no price to unpause on)
                    self._budget_stop = f"{reason} (while paused)"
                    return True
                view.phase(self._paused_line())
                self._wait_a_little()
                continue
            if not waited and self.world.outer_step > 0 and not self._unpaused:
                self.ledger.append(CapacityWaitStarted(replicas=alive, min_replicas=w.min_replicas))
                waited = True
            # The clock runs only while even the replicas on their way would not be enough.
            on_way = alive + len(self.world.joining)   # launches may be refused: they do not count
            if self._budget_held_back and on_way < w.min_replicas and not self._launching:
                # The budget cannot pay for enough nodes: no point waiting.
                if waited:
                    self.ledger.append(CapacityWaitEnded(waited_s=round(time.monotonic() - start, 3),
                                                         replicas=alive, gave_up=True))
                return False
            short_since = (short_since or time.monotonic()) if on_way < w.min_replicas else None
            if short_since is not None and time.monotonic() - short_since > w.capacity_timeout_s:
                if not waited:
                    self.ledger.append(CapacityWaitStarted(replicas=alive, min_replicas=w.min_replicas))
                self.ledger.append(CapacityWaitEnded(waited_s=round(time.monotonic() - start, 3),
                                                     replicas=alive, gave_up=True))
                return False
            if self.world.outer_step == 0:
                view.phase(f"starting: {alive} replica(s) ready, {len(self.world.joining)} starting, "
                           f"{len(self._launching)} node(s) renting")
            else:
                view.phase(f"waiting for capacity: {alive} of at least {w.min_replicas} replica(s) alive, "
                           f"{len(self.world.joining)} joining, {len(self._launching)} renting")
            self._wait_a_little()

    def _pause_world(self, view) -> None:
        """A `policy.Pause` takes effect, at an outer-step boundary: the progress not saved yet is
        checkpointed and made durable, then every replica leaves and every replica VM the run
        holds is released. The world waits, not against world.capacity_timeout_s, until
        `policy.Unpause`; its first joiner then restores the checkpoint (`world_restored`, after
        `pause`). Without a durable checkpoint of this outer step nothing is released: training
        goes on and the pause is tried again at the next step (once per step)."""
        w = self.world
        if w.replicas and w.outer_step > 0:
            if self._pause_tried_step == w.outer_step:
                return
            self._pause_tried_step = w.outer_step
            if not self._saved_durably(view):
                self._warn(f"pause put off: no durable checkpoint of outer step {w.outer_step} could be written "
                           "(see checkpoint events in the ledger); training goes on, the pause is tried again "
                           "at the next outer step")
                return
        p, self._pause = self._pause, None
        self._after_pause = w.outer_step > 0 and bool(w.replicas)
        for rid in list(w.joining):   # none in practice: the policy pauses a world with nothing joining
            w.drop(rid, "the run paused", phase="setup", rule="pause")
        self._record_world(w.take_events())
        for rid, rep in list(w.replicas.items()):
            w.release(rid)
            self.ledger.append(ReplicaDrained(replica=rid, instance_id=rep.instance_id, outer_step=w.outer_step,
                                              steps_done=None))
            self._terminate(rep.instance_id)
        for inst in self._held():     # replica VMs that never joined (a controller stays)
            if inst.role == "replica":
                self._terminate(inst.instance_id)
        self._draining.clear()
        self._moves.clear()
        self._move_of.clear()
        self.ledger.append(WorldPaused(outer_step=w.outer_step, usd_per_mtok=round(p.usd_per_mtok, 6),
                                       threshold_usd_per_mtok=round(p.threshold_usd_per_mtok, 6), need=round(p.need, 4)))
        self._paused_at = time.time()

    def _saved_durably(self, view) -> bool:
        """The world's progress is in a complete checkpoint at `checkpoint.uri`: saved now when the
        checkpoint rule says so, or again when the newest complete one is older (a save or an
        upload of this step failed)."""
        step = self.world.outer_step
        self._checkpoint_if_due(view, ending=True)
        self.finish_checkpoints(view)
        for attempt in range(2):
            found, _ = self.ckpt.candidates()
            if found and found[0]["step"] == step:
                return True
            if attempt == 0:
                self.checkpoint(view)
                self.finish_checkpoints(view)
        return False

    def _paused_line(self) -> str:
        """The console's phase line while paused: the market's price last seen, the price it trains at."""
        last = f"${self._prices[-1][0]:.4f} per 1M tokens" if self._prices else "no price yet"
        return f"paused while the market is dear ({last}); every replica VM released, training resumes when it falls"

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
        from elastic.metrics import Metrics
        scalars = Metrics(recipe, self.run_dir, ledger)
        train_s, last_step_s = 0.0, 0.0
        view.phase(f"renting {recipe.world.replicas} node(s), starting replicas")
        try:
            while not world.done():
                self.tick()
                if self._pause is not None:
                    self._pause_world(view)
                self.admit_joiners()
                if not self.wait_for_capacity(view):
                    self.end_message = self._capacity_message()
                    self._checkpoint_if_due(view, ending=True)
                    if self._budget_held_back:
                        ledger.append(BudgetExhausted(
                            outer_step=world.outer_step,
                            reason=f"budget.max_usd (${recipe.budget.max_usd:.2f}) cannot pay for "
                                   f"world.min_replicas ({recipe.world.min_replicas}) node(s)"))
                        return "budget_exhausted"
                    return "insufficient_capacity"
                if world.done():   # --resume from a checkpoint already at train.outer_steps
                    break
                reason = self._budget_stop or self._over_budget(last_step_s)
                if reason:
                    ledger.append(BudgetExhausted(reason=reason, outer_step=world.outer_step))
                    self._checkpoint_if_due(view, ending=True)
                    return "budget_exhausted"
                members = sorted(world.replicas)
                if members != self._members:
                    ledger.append(WorldFormed(epoch=world.epoch, replicas=members, outer_step=world.outer_step,
                                              params=world.params))
                    self._members = members
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
                    self._checkpoint_if_due(view, ending=True)
                    return "budget_exhausted"
                saved = self._checkpoint_if_due(view)   # before the replicas leaving go: they may be all there is
                if saved is not None and saved.reason == "leaving":
                    # Saved from a leaving replica (there is no other): durable before its node goes.
                    self.finish_checkpoints(view)
                self._release_drained(res)
                view.step(res, world, world.tokens / train_s if train_s else 0.0,
                          cost_so_far(ledger.events, time.time()))
                evals = recipe.eval.every_outer_steps
                if evals and (world.outer_step % evals == 0 or world.done()):
                    self.validate(view)
        finally:
            self._metrics.close()
            scalars.close()
        return "completed"

    def _release_drained(self, res) -> None:
        """Replicas that contributed after a notice leave now, before their node is taken."""
        for rid in list(self._draining):
            if (rid in res.replicas or rid in res.idle) and rid in self.world.replicas:
                rep = self.world.replicas[rid]
                self.world.release(rid)
                self._draining.pop(rid)
                self.ledger.append(ReplicaDrained(replica=rid, instance_id=rep.instance_id,
                                                  outer_step=res.outer_step, steps_done=res.steps_done.get(rid)))
                self._terminate(rep.instance_id)

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
        """Why the next outer step must not start (`policy.stop_for_budget`), or None."""
        from elastic.policy import stop_for_budget

        stop = stop_for_budget(self._snapshot(), next_step_s)
        return stop.reason if stop else None

    def _checkpoint_if_due(self, view, ending: bool = False):
        """Checkpoint when the policy says (`policy.checkpoint_due`; `ending`: the run stops now)
        and a replica is there to save it; returns the `policy.Checkpoint` taken, or None."""
        from elastic.policy import checkpoint_due

        due = checkpoint_due(self._snapshot(), ending) if self.world.replicas else None
        if due is not None:
            self.checkpoint(view)
        return due

    def checkpoint(self, view) -> None:
        """Phase 1 now (training waits), phase 2 in the background (see elastic.checkpoint)."""
        if self.ckpt.uploading is not None:
            view.phase(f"waiting for checkpoint {self.ckpt.uploading} to upload")
        view.phase(f"checkpoint at outer step {self.world.outer_step}")
        # Save from a replica that is not about to leave, so its upload can finish.
        steady = [r for r in sorted(self.world.replicas) if r not in self._draining]
        lead = self.world.replicas[steady[0] if steady else min(self.world.replicas)]
        try:
            self.ckpt.save(self.world, lead, self.recipe)
            self._checkpointed_step = self.world.outer_step
        except Exception as exc:  # the saving replica was lost mid-save: the partial one is ignored
            self.ledger.append(CheckpointFailed(step=self.world.outer_step, message=first_line(exc)))

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
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self.providers:
            if self.world is not None:
                self._collect_launches_quietly()
            for p in self.providers.values():
                for inst in p.list_instances(self.run_name):
                    try:
                        p.terminate(inst.instance_id)
                        self.ledger.append(NodeReleased(instance_id=inst.instance_id))
                    except Exception as exc:
                        self.ledger.append(Error(message=f"could not release {inst.instance_id}: {exc}"))
                self._release_leftovers(p)
                p.close()
        self._save_preemption_history()
        self.ckpt.close()
        if self.cluster is not None and self._owns_cluster:
            try:
                self.cluster.shutdown()
            except Exception:
                log.exception("cluster shutdown")

    def _release_leftovers(self, provider) -> None:
        """Terminate what the cloud still holds for this run that the run did not rent itself: the
        controller VM the driver runs on (`resources.head: controller`; last, so the rest goes
        first), and any VM whose launch this process lost track of."""
        try:
            left = provider.find_instances(self.run_name)
        except Exception as exc:
            self.ledger.append(Error(message=f"could not list the run's VMs on {provider.name}: {exc}"))
            return
        for inst in sorted(left, key=lambda i: i.role == "controller"):
            try:
                provider.terminate(inst.instance_id)
                log.info("released %s (%s) of run %s", inst.instance_id, inst.role, self.run_name)
            except Exception as exc:
                self.ledger.append(Error(message=f"could not release {inst.instance_id}: {exc}"))

    def _save_preemption_history(self) -> None:
        """Add this run's preemptions per node-hour to the history later runs' risk estimates start
        from (real clouds only: a simulated local market says nothing about them)."""
        from elastic.market import save_history

        if self.market is None:
            return
        try:
            self.market.observe(self.ledger.events)
            stats = {k: v for k, v in self.market.stats(time.time()).items() if k[0] != "local"}
            if stats:
                save_history(stats)
        except Exception:
            log.exception("saving the preemption history")

    def _collect_launches_quietly(self) -> None:
        """Launches that finished during shutdown: record them so their release is priced."""
        from providers.base import JoinTimeout

        for fut in list(self._launching):
            offer = self._launching.pop(fut)
            if not fut.done() or fut.cancelled():
                continue
            if fut.exception() is None:
                self._record_launch(fut.result(), offer)
            elif isinstance(fut.exception(), JoinTimeout):
                self._record_join_timeout(fut.exception(), offer)

    def _record_launch(self, inst, offer, joined: bool = True) -> None:
        if joined:
            self._price[inst.instance_id] = round(offer.usd_per_hour, 6)
        self.ledger.append(NodeLaunched(instance_id=inst.instance_id, ray_node_id=inst.ray_node_id,
                                        role=inst.role, launched_at=inst.launched_at, joined=joined,
                                        **offer.vm_fields()))

    def _record_join_timeout(self, exc, offer) -> None:
        """A VM that was rented but never joined: launched, timed out, released (billed between)."""
        self._record_launch(exc.instance, offer, joined=False)
        if exc.waited_s >= exc.timeout_s:   # not when the run stopped while it was still booting
            self.ledger.append(NodeJoinTimeout(instance_id=exc.instance.instance_id, timeout_s=exc.timeout_s))
        self.ledger.append(NodeReleased(instance_id=exc.instance.instance_id, released_at=exc.released_at))

    def _capacity_message(self) -> str | None:
        """One line on why capacity never came: every offer at its known capacity, or (when no
        node ever joined) join timeouts and refused launches."""
        events = self.ledger.events
        held_back = [e for e in events if e["type"] == LaunchHeldBack.TYPE and e["reason"] == "capacity"]
        if held_back and self._capacity_logged:   # the shortage is still on
            return (f"no capacity: {held_back[-1]['message']} (room for {held_back[-1]['held']} replica(s); "
                    f"world.min_replicas is {self.recipe.world.min_replicas})")
        if any(e["type"] == ReplicaJoined.TYPE for e in events):
            return None
        timeouts = [e for e in events if e["type"] == NodeJoinTimeout.TYPE]
        refused = [e for e in events if e["type"] == CapacityRefused.TYPE]
        if timeouts:
            return (f"no node joined within {self.recipe.resources.join_timeout_s:g} s "
                    f"({len(timeouts)} VM(s) launched, none joined the Ray cluster, all terminated; "
                    f"{len(refused)} launch(es) refused for capacity)")
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
    from elastic.ledger import read_events

    run_dir.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(run_dir / "events.jsonl")
    ledger.append(RunStarted(run=run_name, recipe=recipe.name, recipe_digest=recipe.digest()))
    driver = Driver(recipe, run_dir, ledger, resume=resume)
    driver.attach(cluster)
    if on_phase is not None:
        driver.on_phase = lambda phase, members: on_phase(driver, phase, members)
    status = "failed"
    try:
        status = driver.run(QuietView())
    finally:
        driver.release_all()
        ledger.append(RunEnded(status=status))
        ledger.close()
    return status, read_events(run_dir / "events.jsonl")
