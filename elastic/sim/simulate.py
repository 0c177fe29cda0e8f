"""`elastic simulate`: rental policies (`elastic.policy.registry`) replayed on a price/preemption trace, in
simulated time.

No training runs: a replica trains `planner.tokens_per_s` (the recipe's figure), in inner phases of
`train.inner_steps × batch_size × seq_len` tokens. Preemptions follow the trace's
`preempt_per_hour`, drawn per VM as the local provider's market draws them (`providers.simmarket`:
the n-th VM rented under `seed` runs through its own hazard budget), so `simulate` and a run on
the local provider replaying the trace lose the same VMs; capacity is the trace's; a spot VM on `aws` gets a
120 s notice and on `gcp` 30 s (its provider's `notice_s`). Each decision is the policy's, on a
snapshot of the simulated run, and the driver's executor (`elastic.policy.executor`) carries it out against
the trace (`_Run` is its host). VMs bill through `elastic.record.billing` at the trace's prices; the budget
(`Policy.stop_for_budget`) is checked before every phase and wait and at every change of a held
VM's price, so no run ends above `budget.max_usd`. Every policy checkpoints when
`Policy.checkpoint_due` says (at each phase's end; a restore goes back to the newest).

Two models of the job, by the policy's `whole_job`:
- an elastic world (`_elastic_world`; the `elastic` policy): DiLoCo survivors keep training through
  a preemption. The snapshot quotes the offers through the market (its learnt risks and region
  cool-downs). A replica lost without notice loses its inner phase; with a notice longer than twice
  the sync, the world ends that phase early and syncs, the noticed replica's partial phase included,
  as in the driver. A move's old replica leaves at the step boundary, or once its replacement trains.
  The policy is asked where the driver's ticks (every 0.1 s, in a phase and between phases) would
  find it due (`Policy.due`): at each loss, row of the trace, boot's end, re-plan interval and
  wake-up the policy asked for, in a phase too (a replica is rented the moment a row gives room,
  not at the phase's end, or when the timing rule asked, `Policy.next_look_s`), and short of a
  world also every `WAIT_S`. A snapshot taken in a phase says so (`Snapshot.between_steps`), with
  the phase's end and length and when a member was last lost (the timing rule's inputs).
  Under the pause rule (budget.max_hours, `planner.pauses`) the policy is asked at each price sample
  (`planner.price_sample_s`), in a phase too, and a `Pause` takes effect at the next outer-step
  boundary: a checkpoint, every VM released, the wait not counted against world.capacity_timeout_s;
  after `Unpause` the world restarts from that checkpoint. A spot run with budget.max_hours is
  quoted the trace's on-demand offers too (the deadline rule's fallback), and a shortage does not
  end it while the policy `waits_for_capacity`.
- a whole job (`_whole_job`; the baselines of `elastic.policy.baselines`): a fixed world that trains only
  when every VM is up; any loss stops it, and it restarts from its last checkpoint once whole again
  (with `moves_on_loss`, every VM is released first). The snapshot quotes the trace's offers as
  they are.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math

from elastic.errors import UserError
from elastic.policy.baselines import whole_world
from elastic.policy.executor import Executor
from elastic.policy.market import Market, Quote, offer_key
from elastic.policy.planner import Move, Progress, allowed, evaluate, plan, run_tokens, tokens_per_phase
from elastic.policy.registry import POLICIES, policy
from elastic.policy.rules import Node, Policy, Snapshot, pauses
from elastic.record import billing
from elastic.record.events import (CapacityRefused, CheckpointSaved, NodeLaunched, NodePreempted, NodePrice, NodeReleased,
                            ReplicaMove, Role, WorldPaused)
from providers import notice_s
from providers.base import Offer
from providers.simmarket import hazard_budget, preempted_at_s

WAIT_S = 300.0                 # simulated seconds between looks at the market while nothing runs (and at each row)
DEFAULT_HORIZON_S = 60 * 86400  # without budget.max_hours, a run gives up after 60 simulated days


class TraceMarket:
    """The trace as a market: offers and their state at simulated time `t` (each row holds until
    the next row of its zone and instance type; the last one holds for ever).

    Args:
        rows: `providers.simmarket.read_trace_rows`.
        recipe: rows outside resources.regions, or whose cloud the recipe does not enable, are left
            out; a recipe on `[local]` takes the whole trace as its (simulated) local market.
        capacity_seen: the policy's offers carry the trace's capacity (as the local provider's
            do, unless the recipe's local.market.show_capacity is false); False: they carry none,
            as AWS's and GCP's offers do, and the policy learns a full zone only from a refused
            launch. Launches are refused by the trace's capacity either way.
    """

    def __init__(self, rows, recipe, capacity_seen: bool = True):
        self.capacity_seen = capacity_seen and recipe.local.market.show_capacity
        res = recipe.resources
        clouds = None if res.clouds == ["local"] else set(res.clouds)
        self._series: dict[tuple, tuple] = {}
        for r in rows:
            if (clouds is not None and r.cloud not in clouds) or (res.regions and r.region not in res.regions):
                continue
            s = self._series.setdefault((r.zone, r.instance_type), (r, [], []))
            s[1].append(r.t)
            s[2].append(r.state)
        if not self._series:
            raise UserError("the trace has no row for resources.clouds / resources.regions")
        # Each series' preemption hazard by row (rows come sorted by time: read_trace_rows).
        self._rates = {key: (times, [st.preempt_per_hour for st in states])
                       for key, (_, times, states) in self._series.items()}
        self._times = self.times()

    def times(self) -> list[float]:
        """Every time a row of the trace starts, in order."""
        return sorted({t for _, times, _ in self._series.values() for t in times})

    def next_row_s(self, t: float) -> float:
        """When the next row of the trace after `t` starts (inf: none)."""
        i = bisect.bisect_right(self._times, t + 1e-9)
        return self._times[i] if i < len(self._times) else math.inf

    def state(self, zone: str, instance_type: str, t: float):
        _, times, states = self._series[(zone, instance_type)]
        return states[max(0, bisect.bisect_right(times, t) - 1)]

    def segments(self, offer: Offer, t0: float, t1: float) -> list[tuple[float, float]]:
        """[(from_s, usd_per_hour)] a VM of `offer` bills over [t0, t1]: the trace's price in effect
        at t0, then each row of its zone and instance type that starts before t1."""
        _, times, states = self._series[(offer.zone, offer.instance_type)]

        def usd(st):
            return st.spot_usd_per_hour if offer.spot else st.on_demand_usd_per_hour

        i = max(0, bisect.bisect_right(times, t0) - 1)
        out = [(t0, usd(states[i]))]
        for t, st in zip(times[i + 1:], states[i + 1:]):
            if t >= t1:
                break
            if usd(st) != out[-1][1]:
                out.append((t, usd(st)))
        return out

    def next_change(self, offer: Offer, t: float) -> float:
        """When the price a VM of `offer` bills next changes after `t` (inf: never)."""
        _, times, states = self._series[(offer.zone, offer.instance_type)]
        now = self.segments(offer, t, t)[0][1]
        for i in range(bisect.bisect_right(times, t), len(times)):
            st = states[i]
            if (st.spot_usd_per_hour if offer.spot else st.on_demand_usd_per_hour) != now:
                return times[i]
        return math.inf

    def preempted_at_s(self, offer: Offer, t: float, budget: float) -> float:
        """When a VM of `offer` rented at `t` runs through its hazard `budget`
        (`providers.simmarket.preempted_at_s`; inf: never; on-demand VMs are never preempted)."""
        if not offer.spot:
            return math.inf
        times, rates = self._rates[(offer.zone, offer.instance_type)]
        return preempted_at_s(times, rates, t, budget)

    def offers(self, t: float, spot: bool) -> list[Offer]:
        """Offers now for spot or on-demand renting (spot ones with the trace's capacity)."""
        out = []
        for (zone, it), (r, _, _) in self._series.items():
            st = self.state(zone, it, t)
            usd = st.spot_usd_per_hour if spot else st.on_demand_usd_per_hour
            out.append(Offer(cloud=r.cloud, region=r.region, zone=zone, instance_type=it, gpu=r.gpu, gpus=r.gpus,
                             cpus=0, spot=spot, usd_per_hour=usd, on_demand_usd_per_hour=st.on_demand_usd_per_hour,
                             read_at=t, capacity=st.capacity if spot else None))
        return out

    def offers_seen(self, t: float, spot: bool) -> list[Offer]:
        """`offers` as the policy is shown them: without their capacity unless `capacity_seen`."""
        out = self.offers(t, spot)
        return out if self.capacity_seen else [dataclasses.replace(o, capacity=None) for o in out]


@dataclasses.dataclass
class _Node:
    iid: str
    offer: Offer
    launched_at: float
    ready_at: float
    drain_for: str | None = None   # instance id of the replica this one replaces (a move)
    preempted_at: float = math.inf   # simulated seconds (`TraceMarket.preempted_at_s`)


class _Run:
    """Simulated time, the VMs held, the bill and the ledger-shaped events of one policy's run; the
    executor's host (`executor.Host`: `record`, `rent`, `trains`, `release`)."""

    def __init__(self, recipe, market: TraceMarket, seed: int, policy: Policy):
        self.recipe, self.market, self.policy = recipe, market, policy
        self.seed = seed
        self.t = 0.0
        self.closed_usd = 0.0   # the bill of the VMs already gone
        self.refunded_usd = 0.0   # what the clouds refunded of the VMs already gone (`billing.free`)
        self.tokens = 0
        self.ckpt_tokens = 0
        self.phases = 0
        self.ckpt_phases = 0
        self.ckpt_kept = 0
        self.nodes: dict[str, _Node] = {}
        self.leaving: dict[str, None] = {}   # released by the policy mid-phase: they go at the step boundary, in order
        self.in_phase = False            # a phase is under way: a replica released leaves at its end
        self.events: list[dict] = []
        self.preemptions = 0
        self.useful_node_s = 0.0
        self.rented_node_s = 0.0
        self.kept: list[tuple[float, float, list[Offer], int]] = []   # (start_s, end_s, members, tokens)
        self.tpp = tokens_per_phase(recipe)
        self.target_tokens = run_tokens(recipe)
        b = recipe.budget
        self.horizon_s = b.max_hours * 3600 if b.max_hours is not None else DEFAULT_HORIZON_S
        self._ids = itertools.count(1)
        self.status: str | None = None

    # -- the market and the bill ----------------------------------------------------------------

    def usd(self, node: _Node, stop_s: float, ended: bool) -> float:
        """The VM's bill up to `stop_s` (`elastic.record.billing`, at the trace's prices), before
        any refund."""
        segments = self.market.segments(node.offer, node.launched_at, stop_s)
        return billing.vm_usd(node.offer.cloud, segments, stop_s, ended)

    @property
    def spent(self) -> float:
        """USD billed so far: every VM gone, and every VM held up to now."""
        return self.closed_usd + sum(self.usd(n, self.t, ended=False) for n in self.nodes.values())

    def price(self, node: _Node) -> float:
        st = self.market.state(node.offer.zone, node.offer.instance_type, self.t)
        return st.spot_usd_per_hour if node.offer.spot else st.on_demand_usd_per_hour

    def now_offer(self, node: _Node) -> Offer:
        return dataclasses.replace(node.offer, usd_per_hour=self.price(node), read_at=self.t)

    # -- the executor's host -----------------------------------------------------------------------

    def record(self, event) -> None:
        self.events.append(event.record(self.t))

    def rent(self, quote: Quote, move: Move | None) -> bool:
        """Rent one VM now (False: refused for capacity, recorded as a capacity error); with `move`
        it replaces `move.drain` once it trains (`hand_over`)."""
        offer = quote.offer
        st = self.market.state(offer.zone, offer.instance_type, self.t)
        held = sum(1 for n in self.nodes.values() if offer_key(n.offer) == offer_key(offer) and n.offer.spot)
        if offer.spot and st.capacity is not None and held >= st.capacity:
            self.record(CapacityRefused(zone=offer.zone, instance_type=offer.instance_type,
                                        message="the trace's capacity is held", spot=True))
            return False
        n = next(self._ids)
        iid = f"sim-{n:05d}"
        self.nodes[iid] = _Node(iid, offer, self.t, self.t + self.recipe.planner.recovery_s,
                                drain_for=move.drain if move is not None else None,
                                preempted_at=self.market.preempted_at_s(offer, self.t, hazard_budget(self.seed, n)))
        self.record(NodeLaunched.of(offer, instance_id=iid, ray_node_id=None, role=Role.REPLICA,
                                    launched_at=self.t, joined=True))
        return True

    def hand_over(self) -> None:
        """A moved replica leaves once its replacement trains."""
        for n in [n for n in self.nodes.values() if n.drain_for]:
            if n.ready_at <= self.t:
                self.drop(n.drain_for)
                n.drain_for = None
            elif n.drain_for not in self.nodes:
                n.drain_for = None

    def trains(self, iid: str) -> bool:
        return iid in self.nodes

    def release(self, iid: str) -> None:
        """Let the VM `iid` go: at the phase's end when one is under way (`in_phase`), else now."""
        if self.in_phase:
            self.leaving[iid] = None
        else:
            self.drop(iid)

    def drop(self, iid: str) -> None:
        """Release the VM `iid` now."""
        node = self.nodes.pop(iid, None)
        if node is not None:
            self.closed_usd += self.usd(node, self.t, ended=True)
            self.record(NodeReleased(instance_id=iid))

    def release_all(self) -> None:
        for iid in list(self.nodes):
            self.drop(iid)
        self.leaving.clear()

    def snapshot(self, **fields) -> Snapshot:
        """What the policy sees now (`fields`: the rest of `policy.Snapshot`)."""
        fields.setdefault("nodes", tuple(Node(n.iid, Quote(self.now_offer(n), 0.0, "trace"), n.launched_at,
                                              ready=n.ready_at <= self.t) for n in self.nodes.values()))
        return Snapshot(self.recipe, self.t, 0.0, spent_usd=self.spent,
                        progress=Progress(self.tokens, self.phases, self.t / 3600), **fields)

    def affordable(self, dt: float) -> bool:
        """The next `dt` seconds stay within the budget (`policy.stop_for_budget`) and, without
        budget.max_hours, the simulator's horizon."""
        if self.policy.stop_for_budget(self.snapshot(), dt):
            self.status = "budget_exhausted"
            return False
        if self.t + dt > self.horizon_s:
            self.status = "unfinished"
            return False
        return True

    def advance(self, dt: float, stop_at_first_loss: bool, rest_until: float | None = None) -> dict[str, _Node]:
        """Move time on by `dt` (or to the first preemption): preempt each VM whose drawn time
        (`_Node.preempted_at`, its hazard budget run through at the trace's rates) falls within,
        bill every VM. At each change of a held VM's price the budget is checked for the rest
        (`affordable`; the rest lasts until `rest_until`, the phase's end, when later than `dt`), as
        the driver does when it records a `node_price`: time stops there, with `status` set, when
        the rest would cross it. Returns the preempted VMs by instance id (gone from `nodes`).

        A trace's capacity bounds launches only: a VM held where the capacity falls below what is
        held goes through the hazard, as the trace states it (bench/traces/convert_real.py writes
        a fall from n to m VMs as a hazard of ln(n/m) over its row: m/n of them stay, on average),
        and as the driver's local market (providers.simmarket) does."""
        end = self.t + dt
        rest_until = max(end, rest_until or end)
        gone = {}
        while True:
            until = min([end] + [self.market.next_change(n.offer, self.t) for n in self.nodes.values()])
            due = {iid: n.preempted_at for iid, n in self.nodes.items() if n.preempted_at <= until}
            if stop_at_first_loss and due:
                first = min(due, key=due.get)
                end = until = due[first]
                due = {first: due[first]}
            for iid in self.nodes:
                self.rented_node_s += min(due.get(iid, until), until) - self.t
            for iid, at in sorted(due.items(), key=lambda kv: kv[1]):
                self.events.append(NodePreempted(instance_id=iid, with_notice=False, replica=None,
                                                 reclaimed=True).record(at))
                node = gone[iid] = self.nodes.pop(iid)
                listed = self.usd(node, at, ended=True)
                if billing.free(node.offer.cloud, at - node.launched_at, node.offer.spot):
                    self.refunded_usd += listed   # the market took it young: its cloud bills nothing
                else:
                    self.closed_usd += listed
                self.preemptions += 1
            self.t = until
            for n in self.nodes.values():   # the ledger's record of a price move, as the driver writes it
                if self.market.next_change(n.offer, until - 1e-9) <= until:
                    self.events.append(NodePrice(instance_id=n.iid, usd_per_hour=self.price(n)).record(until))
            at_end = self.t >= end - 1e-9
            if (not at_end or rest_until > end + 1e-9) and not self.affordable(rest_until - self.t):
                return gone   # checked mid-phase, a price change or not: the rest must fit
            if at_end:
                return gone

    def done(self) -> bool:
        """The run trained what it needs, as the driver's world judges it (`World.done`):
        train.token_budget tokens, else train.outer_steps outer steps (a step short of replicas
        still counts as one)."""
        t = self.recipe.train
        return self.tokens >= t.token_budget if t.token_budget is not None else self.phases >= t.outer_steps

    def train_phase(self, members: list[_Node], dt: float, share: float = 1.0) -> None:
        """Credit one outer step to `members` (they all kept their work; `share` of a whole inner
        phase each when a notice ended it early)."""
        tokens = round(self.tpp * len(members) * share)
        self.tokens += tokens
        self.useful_node_s += dt * len(members)
        self.kept.append((self.t - dt, self.t, [m.offer for m in members], tokens))
        self.phases += 1

    def checkpoint_if_due(self, leaving: tuple[Node, ...] = (), ending: bool = False) -> None:
        """Checkpoint when the policy says (`policy.checkpoint_due`), as the driver asks it at an
        outer-step boundary (`leaving`: replicas that contributed and go now) or when the run stops
        (`ending`). Taken at once: the work since is what a later `restore` loses, and a
        `checkpoint_saved` is recorded (no stall: the simulator does not time checkpoints)."""
        # The rule reads progress and which nodes train or leave, no price nor spend: a light
        # snapshot (pricing every held VM at every phase's end doubled the simulator's time).
        nodes = tuple(Node(n.iid, Quote(n.offer, 0.0, "trace"), n.launched_at, ready=n.ready_at <= self.t)
                      for n in self.nodes.values())
        snap = Snapshot(self.recipe, self.t, nodes=nodes + leaving, checkpointed_step=self.ckpt_phases,
                        progress=Progress(self.tokens, self.phases, self.t / 3600))
        if self.policy.checkpoint_due(snap, ending) is None:
            return
        self.ckpt_tokens, self.ckpt_phases, self.ckpt_kept = self.tokens, self.phases, len(self.kept)
        self.events.append(CheckpointSaved(step=self.phases, stall_s=0.0, write_s=0.0, local="",
                                           replica=0).record(self.t))

    def restore(self) -> None:
        """Back to the last checkpoint (or the start): the work since is lost."""
        self.tokens, self.phases = self.ckpt_tokens, self.ckpt_phases
        del self.kept[self.ckpt_kept:]

    def quotes_of(self, nodes) -> list[Quote]:
        return [Quote(self.now_offer(n), 0.0, "trace") for n in nodes]

    def phase_of(self, members: list[_Node]):
        """The planner's figures for an inner phase of `members` (`planner.evaluate`). A phase never
        has more than world.max_replicas members: every policy's figures (and bench/foresight.py's
        floor) rest on it, so a policy that broke it is a bug, raised here."""
        if len(members) > self.recipe.world.max_replicas:
            raise RuntimeError(f"{self.policy.name}: a phase of {len(members)} replicas at t={self.t:.0f} s, "
                               f"over world.max_replicas {self.recipe.world.max_replicas}")
        return evaluate(self.quotes_of(members), self.recipe)

    def result(self) -> dict:
        tokens = min(self.tokens, self.target_tokens)
        listed = self.spent + self.refunded_usd
        return {"policy": self.policy.name, "status": self.status or "completed", "cost_usd": round(self.spent, 4),
                "tokens": tokens, "usd_per_mtok": round(self.spent / tokens * 1e6, 4) if tokens else None,
                "list_usd": round(listed, 4), "list_usd_per_mtok": round(listed / tokens * 1e6, 4) if tokens else None,
                "wall_h": round(self.t / 3600, 4), "preemptions": self.preemptions,
                "moves": sum(e["type"] == ReplicaMove.TYPE for e in self.events),
                "refused_launches": sum(e["type"] == CapacityRefused.TYPE for e in self.events),
                "effective_training_time": round(self.useful_node_s / self.rented_node_s, 4)
                if self.rented_node_s else None}


# -- the two models of a job ------------------------------------------------------------------------

@dataclasses.dataclass
class _Step:
    """The outer step under way (or the last one, between steps), as the snapshot reports it."""
    end: float = 0.0   # when it ends (simulated seconds)
    s: float = 0.0     # its length; 0: no step yet
    member_lost_at: float = -math.inf   # when a member of a step was last lost
    members: frozenset[str] = frozenset()   # the VMs that train it (inside it, the only ones ready)


def _elastic_world(run: _Run) -> None:
    """A world whose DiLoCo survivors train through a preemption, run by the policy (the `elastic`
    one: the driver's) on the trace: its actions are carried out at once (a launch the trace's
    capacity refuses is a capacity error, as a provider's would be)."""
    recipe = run.recipe
    w = recipe.world
    market = Market(recipe.planner)
    ex = Executor(run.policy, run, recipe, started_s=0.0)   # as the driver: the first re-plan one interval in
    sample_s = recipe.planner.price_sample_s if pauses(recipe) else None
    # A spot run with a deadline is quoted on-demand offers too, as the driver's offer feed does:
    # the deadline rule's fallback (`policy.on_demand_need`), and a policy that falls back on them.
    on_demand = recipe.resources.spot and (recipe.budget.max_hours is not None or run.policy.on_demand_fallback)

    def to_next_sample() -> float:
        """Seconds to the next price sample under the pause rule (inf without it): the driver's
        ticks take one every planner.price_sample_s, in a phase and while waiting alike."""
        if not sample_s:
            return math.inf
        due_at = ex.state.priced_at_s + sample_s
        return due_at - run.t if due_at > run.t + 1e-6 else sample_s
    short_since = None
    step = _Step()

    def held(quote) -> tuple[Node, ...]:
        """The VMs held, as the snapshot shows them (`quote`: a `_Node`'s `Quote`). Ready, as the
        driver's (its replica is in the world): inside a step, the step's members only (a VM up
        since joins at its end); between steps, every VM up (it joins now)."""
        moving = {n.drain_for for n in run.nodes.values() if n.drain_for}
        return tuple(Node(n.iid, quote(n), n.launched_at, leaving=n.iid in run.leaving, moving=n.iid in moving,
                          ready=n.ready_at <= run.t and (not run.in_phase or n.iid in step.members))
                     for n in run.nodes.values())

    def due() -> bool:
        """The driver's question on each tick (`Policy.due`, the offers unread), on what is held now:
        the policy is asked only when it says it may act, in a phase and between phases alike."""
        nodes = held(lambda n: Quote(run.now_offer(n), 0.0, "trace"))
        return run.policy.due(run.snapshot(nodes=nodes, between_steps=not run.in_phase, **ex.fed(run.t)))

    def next_ask_at() -> float:
        """The next moment in a phase at which `due` may turn true though no VM is lost: a row of the
        trace (capacity or a price changed), a boot's end, the re-plan's interval, the policy's own
        clock (the driver's ticks ask at each)."""
        at = [run.market.next_row_s(run.t), ex.state.last_replan_s + recipe.planner.replan_every_s,
              ex.state.next_look_at_s] + [n.ready_at for n in run.nodes.values()]
        return min([a for a in at if a > run.t + 1e-6], default=math.inf)

    def act(horizon_s: float) -> None:
        """Ask the policy and do what it says, again after each refused launch (the refusal rests
        that offer), as the driver does on its next tick. `horizon_s`: the rest of the phase under
        way (0: at a step boundary)."""
        run.in_phase = bool(horizon_s)
        for _ in range(len(run.market.offers(run.t, recipe.resources.spot)) + 1):
            market.observe(run.events)
            snap = run.snapshot(nodes=held(lambda n: market.quote(run.now_offer(n), run.t)),
                                quotes=tuple(market.quotes(run.market.offers_seen(run.t, recipe.resources.spot), run.t,
                                                           rest_reclaimed=on_demand)),
                                budget_horizon_s=horizon_s,
                                on_demand_quotes=tuple(market.quote(o, run.t)
                                                       for o in run.market.offers_seen(run.t, False))
                                if on_demand else (), between_steps=not run.in_phase,
                                step_end_s=(step.end if run.in_phase else run.t + step.s) if step.s else None,
                                step_s=step.s, member_lost_at_s=step.member_lost_at, **ex.fed(run.t))
            if ex.act(snap):
                break
        if ex.state.gave_up:
            run.status = "budget_exhausted"

    while not run.done():
        for iid in run.leaving:
            run.drop(iid)
        run.leaving.clear()
        run.hand_over()
        run.in_phase = False
        if due():
            act(0.0)
        run.hand_over()                     # a replacement ready at once (planner.recovery_s 0) takes over now
        if run.status is not None:
            break
        if ex.state.pause is not None:   # as the driver: a checkpoint, then every VM goes
            if any(n.ready_at <= run.t for n in run.nodes.values()):
                run.checkpoint_if_due(ending=True)
            run.release_all()
            p = ex.pause_took_effect(run.t)
            run.record(WorldPaused(outer_step=run.phases, usd_per_mtok=p.usd_per_mtok,
                                   threshold_usd_per_mtok=p.threshold_usd_per_mtok, need=p.need))
        members = [n for n in run.nodes.values() if n.ready_at <= run.t]
        if len(members) < w.min_replicas:
            booting = [n.ready_at for n in run.nodes.values() if n.ready_at > run.t]
            if ex.state.paused:
                short_since = None        # a pause is no capacity shortage
            elif short_since is None:
                short_since = run.t
            if not booting and short_since is not None and run.t - short_since > w.capacity_timeout_s \
                    and not ex.state.waits_for_capacity:   # on-demand can still finish it, or the wait is the policy's
                run.status = "insufficient_capacity"
                break
            # Waiting for a world, the policy is asked again at a boot's end, a VM lost (a boot cut
            # short), a row of the trace (capacity or a price changed) and every WAIT_S, as the
            # driver's ticks would ask it at once.
            dt = (min(booting) - run.t) if booting else WAIT_S
            dt = min(dt, to_next_sample(), run.market.next_row_s(run.t) - run.t)
            if ex.state.next_look_at_s > run.t + 1e-6:   # the policy's own clock (the deadline rule, a `Look`)
                dt = min(dt, ex.state.next_look_at_s - run.t)
            if not run.affordable(dt):
                break
            run.advance(dt, stop_at_first_loss=True)
            continue
        short_since = None
        world = run.phase_of(members)
        dt = world.phase_s
        if not run.affordable(dt):
            break
        start, end, lost, share = run.t, run.t + dt, set(), None
        run.in_phase = True
        step.end, step.s = end, dt
        # As the driver does on a notice: the world's inner phase ends by the deadline less twice the
        # sync, everyone syncs, the noticed replica with its partial phase, then it leaves.
        margin_s = max(0.5, 2 * world.sync_penalty_s)
        ids = {m.iid for m in members}
        step.members = frozenset(ids)
        while run.t < end - 1e-6 and run.status is None:
            # Under the pause rule the policy samples the market every planner.price_sample_s, in
            # a phase too (as the driver's ticks do): a history sampled only at phase ends would
            # weigh a pause's prices (sampled while waiting) above a training spell's.
            # The driver's ticks ask the policy whenever it is due (`due`): at each row of the trace,
            # boot's end and interval the policy keeps, as well as at a loss.
            until = min(end, run.t + to_next_sample(), next_ask_at())
            gone = run.advance(until - run.t, stop_at_first_loss=True, rest_until=end)
            if not gone:
                if run.t < end - 1e-6 and run.status is None and due():
                    act(end - run.t)
                continue
            lost.update(gone)
            if ids & set(gone):
                step.member_lost_at = run.t
            if any(iid in ids and notice_s(n.offer.cloud) > margin_s for iid, n in gone.items()):
                share = min(1.0, max(0.0, run.t - margin_s - start) / max(dt - world.sync_penalty_s, 1e-9))
                break
            if due():
                act(end - run.t)              # the replacement is rented at once, not at the boundary
        if run.status is not None:
            # A price rise made the rest of the phase unaffordable: as the driver does, the phase
            # ends now and the members still there sync what they trained; the run stops.
            kept = [m for m in members if m.iid not in lost]
            if run.status == "budget_exhausted" and kept and run.t > start:
                run.train_phase(kept, run.t - start, min(1.0, (run.t - start) / max(dt - world.sync_penalty_s, 1e-9)))
            break
        if share is not None:   # the noticed replica and every member still alive contributed
            run.train_phase([m for m in members if m.iid not in lost or m.iid in gone], run.t - start, share)
            run.checkpoint_if_due(leaving=tuple(Node(iid, Quote(n.offer, 0.0, "trace"), n.launched_at, leaving=True,
                                                     notice_deadline_s=run.t) for iid, n in gone.items()))
            continue
        kept = [m for m in members if m.iid not in lost]
        if kept:
            run.train_phase(kept, dt)
            run.checkpoint_if_due()
        else:
            run.restore()                     # every replica lost: the world restarts from the checkpoint
    if run.status is not None and any(n.ready_at <= run.t for n in run.nodes.values()):
        run.checkpoint_if_due(ending=True)
    run.release_all()


def _whole_job(run: _Run) -> None:
    """A fixed world of `whole_world` VMs (a baseline's): it trains while every VM is up; any loss
    stops it until it is whole again and it restarts from its last checkpoint (with the policy's
    `moves_on_loss`, every VM released first, so the policy places it afresh). The policy is asked
    once per look at the market: a launch refused waits for the next, unless the policy places the
    job elsewhere on that refusal (a failover: asked again at once)."""
    recipe, pol = run.recipe, run.policy
    n = whole_world(recipe)
    ex = Executor(pol, run, recipe, started_s=0.0)
    while not run.done():
        quotes = tuple(Quote(o, 0.0, "trace") for o in run.market.offers_seen(run.t, pol.spot))
        for _ in range(len(quotes) + 1):
            place = ex.state.place
            if ex.act(run.snapshot(quotes=quotes, **ex.fed(run.t))) or ex.state.place == place:
                break
        if ex.state.gave_up:
            run.status = "budget_exhausted"
            break
        members = list(run.nodes.values())
        booting = [m.ready_at for m in members if m.ready_at > run.t]
        if len(members) < n or booting:
            dt = (max(booting) - run.t) if booting and len(members) == n else WAIT_S
            if not run.affordable(dt):
                break
            lost = run.advance(dt, stop_at_first_loss=True)
            if run.status is not None:
                break
        else:
            dt = run.phase_of(members).phase_s
            if not run.affordable(dt):
                break
            lost = run.advance(dt, stop_at_first_loss=True)
            if run.status is not None:
                break
            if not lost:
                run.train_phase(members, dt)
                run.checkpoint_if_due()
        if lost:
            run.restore()
            if pol.moves_on_loss:
                run.release_all()
    run.release_all()


def _market(recipe, trace_path: str, capacity_seen: bool = True) -> TraceMarket:
    from providers.simmarket import TraceError, read_trace_rows

    try:
        rows = read_trace_rows(trace_path)
    except TraceError as exc:
        raise UserError(str(exc)) from None
    return TraceMarket(rows, recipe, capacity_seen)


def why_nothing_trained(recipe, trace_path: str) -> str:
    """One line on why no policy trains a token of `recipe` on the trace (for a run of `simulate`
    whose every policy trained none): no offer the recipe allows, a budget that cannot pay for
    world.min_replicas VMs of the cheapest one for its cloud's billing minimum, or else what the
    trace offers."""
    market = _market(recipe, trace_path)
    res = recipe.resources
    every = market.offers(0.0, res.spot)
    fit = [o for o in every if allowed(o, res)]
    kinds = ", ".join(sorted({f"{o.instance_type} ({o.gpus}x{o.gpu or 'CPU'})" for o in every}))
    if not fit:
        return (f"no offer of {trace_path} matches resources.regions / resources.max_usd_per_hour / spot: "
                f"it offers {kinds}")
    cheapest = min(fit, key=lambda o: o.usd_per_hour)
    n = recipe.world.min_replicas
    min_usd = n * cheapest.usd_per_hour * billing.launch_span_s(cheapest.cloud) / 3600
    if recipe.budget.max_usd is not None and min_usd > recipe.budget.max_usd:
        return (f"budget.max_usd (${recipe.budget.max_usd:,.2f}) cannot pay for world.min_replicas ({n}) VM(s) of "
                f"{trace_path}: the cheapest, {cheapest.instance_type} in {cheapest.zone}, costs "
                f"${cheapest.usd_per_hour:,.2f}/h (it offers {kinds})")
    world = plan(Market(recipe.planner).quotes(fit, 0.0), recipe)
    step_usd = world.usd_per_hour * (world.phase_s + recipe.planner.recovery_s) / 3600
    if recipe.budget.max_usd is not None and world.quotes and step_usd > recipe.budget.max_usd:
        return (f"budget.max_usd (${recipe.budget.max_usd:,.2f}) cannot pay for one outer step on {trace_path}: "
                f"its cheapest world ({len(world.quotes)} x {world.quotes[0].offer.instance_type}) costs "
                f"${world.usd_per_hour:,.2f}/h and a step with its boot takes about "
                f"{(world.phase_s + recipe.planner.recovery_s) / 60:,.0f} min (${step_usd:,.2f}); it offers {kinds}")
    return (f"no policy trained a token on {trace_path} (it offers {kinds}): see each policy's status with "
            "--json")


def bound_usd_per_mtok(recipe, trace_path: str) -> float | None:
    """The least USD per 1M tokens any policy could pay on the trace (`elastic.sim.bound`); None when
    no policy can train the run's tokens in time."""
    from elastic.sim.bound import lower_bound_usd_per_mtok

    bound = lower_bound_usd_per_mtok(recipe, _market(recipe, trace_path))
    return bound if math.isfinite(bound) else None


def min_replicas_bound_usd_per_mtok(recipe, trace_path: str) -> float | None:
    """The least USD per 1M tokens any policy that trains only in worlds of at least
    world.min_replicas replicas could pay on the trace: the higher of
    `elastic.sim.bound.lower_bound_usd_per_mtok` keeping world.min_replicas (boots and preemptions
    priced) and `min_replicas_floor_usd_per_mtok` (whole worlds per row, no boots): each a lower
    bound, so their maximum is one; None when no policy can train the run's tokens in time."""
    from elastic.sim.bound import lower_bound_usd_per_mtok, min_replicas_floor_usd_per_mtok

    market = _market(recipe, trace_path)
    bound = max(lower_bound_usd_per_mtok(recipe, market, keep_min_replicas=True),
                min_replicas_floor_usd_per_mtok(recipe, market))
    return bound if math.isfinite(bound) else None


def simulate(recipe, trace_path: str, policies: list[str | Policy] | None = None, seed: int = 0,
             ledgers: dict[str, list[dict]] | None = None, kept: dict[str, list] | None = None,
             market: TraceMarket | None = None, capacity_seen: bool = True) -> list[dict]:
    """Each policy's figures on the trace: cost_usd, tokens, usd_per_mtok, wall_h, preemptions,
    moves, refused_launches (launches the trace's capacity refused: `capacity_error`),
    effective_training_time (kept node-seconds over rented node-seconds), status; list_usd and
    list_usd_per_mtok, the bill before the clouds' refunds of spot VMs they interrupted young
    (`elastic.record.billing.free`: cost_usd is after them, as the cloud invoices it), which is
    what the bounds (`bound_usd_per_mtok`) hold a policy to. `policies`: names
    of `elastic.policy.registry.POLICIES` or `Policy` objects (default: the recipe's `planner.policy`, then
    every other registered one). `ledgers`,
    when given, receives each policy's ledger-shaped events (in trace seconds), as the driver's ledger
    would hold them: node_launched, node_price, replica_move, capacity_error, launch_held_back,
    world_target, world_paused, world_unpaused, node_preempted, node_released, checkpoint_saved.
    `kept`, when given, receives each policy's outer steps whose work was kept, as (start_s, end_s,
    members' offers, tokens), for `bench/policies.py --explain`. `market`: the trace already read
    (`trace_path` is then unread), or another view of it (its own `capacity_seen` holds then).
    `capacity_seen` False (or the recipe's local.market.show_capacity false): the policies are not
    shown the trace's capacity (`TraceMarket`), as on AWS and GCP."""
    market = market or _market(recipe, trace_path, capacity_seen)
    out = []
    policies = policies or [recipe.planner.policy] + [n for n in POLICIES if n != recipe.planner.policy]
    for p in [x if isinstance(x, Policy) else policy(x) for x in policies]:
        run = _Run(recipe, market, seed, p)
        (_whole_job if p.whole_job else _elastic_world)(run)
        out.append(run.result())
        if ledgers is not None:
            ledgers[p.name] = run.events
        if kept is not None:
            kept[p.name] = run.kept
    return out
