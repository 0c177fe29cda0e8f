"""`elastic simulate`: rental policies replayed on a price/preemption trace, in simulated time.

No training runs: a replica trains `planner.tokens_per_s` (the recipe's figure), in inner phases of
`train.inner_steps × batch_size × seq_len` tokens. Preemptions are drawn from the trace's
`preempt_per_hour` with a seeded generator; capacity is the trace's; a spot VM on `aws` gets a
120 s notice and on `gcp` 30 s (`notice_s`). The `elastic` policy runs the same code the driver
uses: the market (risks learnt from the preemptions it sees, capacity cool-downs, region
cool-downs), the planner (`plan` for the world's size under budget.max_hours, `choose_launch`,
`replan`) and the budget check before every launch and every outer step, so no run ends above
`budget.max_usd`.

Policies:
- `elastic`: the planner's placement; DiLoCo survivors keep training through a preemption. A
  replica lost without notice loses its inner phase; with a notice longer than twice the sync, the
  world ends that phase early and syncs, the noticed replica's partial phase included (as the
  driver does). Replacements are rented where the planner says, replicas move when a clearly
  cheaper offer appears.
- `on-demand`: the cheapest single region, on-demand, never preempted.
- `spot-static`: the cheapest spot offer at the start, never moves; a preemption stops the job,
  which restarts from its last checkpoint once the lost VM is replaced in the same place.
- `skypilot-like`: the cheapest spot offer at the start; a preemption restarts the whole job from
  its last checkpoint in the next-cheapest other region (SkyPilot's EAGER_NEXT_REGION).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import random

from elastic.errors import UserError
from elastic.market import Market, Quote, offer_key, recipe_tokens_per_s
from elastic.planner import (Progress, allowed, choose_launch, evaluate, launch_fits_budget, plan, replan_all,
                             run_tokens, tokens_per_phase)
from providers import notice_s
from providers.base import Offer

POLICIES = ("elastic", "on-demand", "spot-static", "skypilot-like")
WAIT_S = 300.0                 # simulated seconds between looks at the market while nothing runs
DEFAULT_HORIZON_S = 60 * 86400  # without budget.max_hours, a run gives up after 60 simulated days


class TraceMarket:
    """The trace as a market: offers and their state at simulated time `t` (each row holds until
    the next row of its zone and instance type; the last one holds for ever).

    Args:
        rows: `providers.simmarket.read_trace_rows`.
        recipe: rows outside resources.regions, or whose cloud the recipe does not enable, are left
            out; a recipe on `[local]` takes the whole trace as its (simulated) local market.
    """

    def __init__(self, rows, recipe):
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

    def times(self) -> list[float]:
        """Every time a row of the trace starts, in order."""
        return sorted({t for _, times, _ in self._series.values() for t in times})

    def state(self, zone: str, instance_type: str, t: float):
        _, times, states = self._series[(zone, instance_type)]
        return states[max(0, bisect.bisect_right(times, t) - 1)]

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


@dataclasses.dataclass
class _Node:
    iid: str
    offer: Offer
    launched_at: float
    ready_at: float
    drain_for: str | None = None   # instance id of the replica that replaces this one


class _Run:
    """Simulated time, the VMs held, the bill and the ledger-shaped events of one policy's run."""

    def __init__(self, recipe, market: TraceMarket, seed: int, policy: str):
        self.recipe, self.market, self.policy = recipe, market, policy
        self.rng = random.Random(f"{seed}:{policy}")
        self.t = 0.0
        self.spent = 0.0
        self.tokens = 0
        self.ckpt_tokens = 0
        self.phases = 0
        self.ckpt_phases = 0
        self.refused: str | None = None   # why the last launch was refused: "budget" or "capacity"
        self.nodes: dict[str, _Node] = {}
        self.events: list[dict] = []
        self.preemptions = 0
        self.moves = 0
        self.useful_node_s = 0.0
        self.rented_node_s = 0.0
        self.tpp = tokens_per_phase(recipe)
        self.target_tokens = run_tokens(recipe)
        b = recipe.budget
        self.horizon_s = b.max_hours * 3600 if b.max_hours is not None else DEFAULT_HORIZON_S
        self._ids = itertools.count(1)
        self.status: str | None = None

    # -- the market and the bill ----------------------------------------------------------------

    def price(self, node: _Node) -> float:
        st = self.market.state(node.offer.zone, node.offer.instance_type, self.t)
        return st.spot_usd_per_hour if node.offer.spot else st.on_demand_usd_per_hour

    def now_offer(self, node: _Node) -> Offer:
        return dataclasses.replace(node.offer, usd_per_hour=self.price(node), read_at=self.t)

    def rate_usd_per_hour(self) -> float:
        return sum(self.price(n) for n in self.nodes.values())

    def launch(self, offer: Offer, horizon_s: float = 0.0) -> str | None:
        """Rent one VM now (None: refused for capacity or budget; a capacity error is recorded)."""
        self.refused = None
        if not launch_fits_budget(self.spent, self.rate_usd_per_hour(), offer, self.recipe, horizon_s):
            self.refused = "budget"
            return None
        st = self.market.state(offer.zone, offer.instance_type, self.t)
        held = sum(1 for n in self.nodes.values() if offer_key(n.offer) == offer_key(offer))
        if offer.spot and st.capacity is not None and held >= st.capacity:
            self.events.append({"t": self.t, "type": "capacity_error", "zone": offer.zone,
                                "instance_type": offer.instance_type})
            self.refused = "capacity"
            return None
        iid = f"sim-{next(self._ids):05d}"
        self.nodes[iid] = _Node(iid, offer, self.t, self.t + self.recipe.planner.recovery_s)
        self.events.append({"t": self.t, "type": "node_launched", "instance_id": iid, **offer.vm_fields()})
        return iid

    def release(self, iid: str) -> None:
        if self.nodes.pop(iid, None) is not None:
            self.events.append({"t": self.t, "type": "node_released", "instance_id": iid})

    def release_all(self) -> None:
        for iid in list(self.nodes):
            self.release(iid)

    def affordable(self, dt: float) -> bool:
        """The next `dt` seconds stay within budget.max_usd and budget.max_hours."""
        b = self.recipe.budget
        if b.max_usd is not None and self.spent + self.rate_usd_per_hour() * dt / 3600 > b.max_usd:
            self.status = "budget_exhausted"
            return False
        if self.t + dt > self.horizon_s:
            self.status = "budget_exhausted" if b.max_hours is not None else "unfinished"
            return False
        return True

    def advance(self, dt: float, stop_at_first_loss: bool) -> dict[str, _Node]:
        """Move time on by `dt` (or to the first preemption): bill every VM, draw preemptions.
        Returns the preempted VMs by instance id (gone from `nodes`)."""
        draws = {}
        for iid, n in self.nodes.items():
            rate = self.market.state(n.offer.zone, n.offer.instance_type, self.t).preempt_per_hour \
                if n.offer.spot else 0.0
            if rate > 0:
                at = self.rng.expovariate(rate / 3600)
                if at < dt:
                    draws[iid] = at
        if stop_at_first_loss and draws:
            first = min(draws, key=draws.get)
            dt, draws = draws[first], {first: draws[first]}
        for iid, n in self.nodes.items():
            held_s = draws.get(iid, dt)
            self.spent += self.price(n) * held_s / 3600
            self.rented_node_s += held_s
        gone = {}
        for iid, at in sorted(draws.items(), key=lambda kv: kv[1]):
            self.events.append({"t": self.t + at, "type": "node_preempted", "instance_id": iid})
            gone[iid] = self.nodes.pop(iid)
            self.preemptions += 1
        self.t += dt
        return gone

    def train_phase(self, members: list[_Node], dt: float, share: float = 1.0) -> None:
        """Credit one outer step to `members` (they all kept their work; `share` of a whole inner
        phase each when a notice ended it early), checkpoint on schedule."""
        self.tokens += round(self.tpp * len(members) * share)
        self.useful_node_s += dt * len(members)
        self.phases += 1
        every = self.recipe.checkpoint.every_outer_steps
        if every and self.phases % every == 0:
            self.ckpt_tokens, self.ckpt_phases = self.tokens, self.phases

    def restore(self) -> None:
        """Back to the last checkpoint (or the start): the work since is lost."""
        self.tokens, self.phases = self.ckpt_tokens, self.ckpt_phases

    def quotes_of(self, nodes) -> list[Quote]:
        return [Quote(self.now_offer(n), 0.0, "trace") for n in nodes]

    def result(self) -> dict:
        tokens = min(self.tokens, self.target_tokens)
        return {"policy": self.policy, "status": self.status or "completed", "cost_usd": round(self.spent, 4),
                "tokens": tokens, "usd_per_mtok": round(self.spent / tokens * 1e6, 4) if tokens else None,
                "wall_h": round(self.t / 3600, 4), "preemptions": self.preemptions, "moves": self.moves,
                "effective_training_time": round(self.useful_node_s / self.rented_node_s, 4)
                if self.rented_node_s else None}


# -- policies ---------------------------------------------------------------------------------------

def _elastic(run: _Run) -> None:
    recipe = run.recipe
    p, w = recipe.planner, recipe.world
    market = Market(p)
    last_replan = -math.inf
    short_since = None

    def progress() -> Progress:
        return Progress(run.tokens, run.phases, run.t / 3600)

    # The world's size: world.replicas, more when budget.max_hours needs it (it grows, never shrinks).
    n_target = max(1, len(plan(market.quotes(run.market.offers(0.0, recipe.resources.spot), 0.0), recipe).quotes),
                   min(w.replicas, w.max_replicas))

    def top_up(busy_s: float) -> None:
        """Rent up to the target where the planner says (as the driver does the moment a replica
        is lost); `busy_s`: seconds left of the phase under way, all of which the budget must cover."""
        offers = run.market.offers(run.t, recipe.resources.spot)
        for _ in range(len(offers)):
            market.observe(run.events)
            live = [n for n in run.nodes.values() if not n.drain_for]
            if len(live) >= n_target:
                return
            q = choose_launch(market.quotes(offers, run.t), recipe,
                              [market.quote(run.now_offer(n), run.t) for n in live], progress())
            if q is None:
                return
            if run.launch(q.offer, horizon_s=busy_s) is None and run.refused == "budget":
                return                        # the budget cannot take another VM

    while run.tokens < run.target_tokens:
        offers = run.market.offers(run.t, recipe.resources.spot)
        market.observe(run.events)
        quotes = market.quotes(offers, run.t)
        # Drain the replicas whose replacement now trains.
        for n in [n for n in run.nodes.values() if n.drain_for]:
            new = run.nodes.get(n.drain_for)
            if new is None:
                n.drain_for = None            # the replacement was lost: keep this one
            elif new.ready_at <= run.t:
                run.release(n.iid)
        live = [n for n in run.nodes.values() if not n.drain_for]
        ready = [n for n in live if n.ready_at <= run.t]
        # Move the most expensive replica when a clearly cheaper offer appears.
        if run.t - last_replan >= p.replan_every_s and len(ready) == len(live) == n_target:
            last_replan = run.t
            held = [(n.iid, market.quote(run.now_offer(n), run.t)) for n in ready]
            n_target = max(n_target, len(plan(quotes, recipe, [q for _, q in held], progress=progress()).quotes))
            for move in replan_all(quotes, held, recipe, progress=progress()):
                iid = run.launch(move.add.offer)
                if iid is None:
                    break
                run.nodes[move.drain].drain_for = iid
                run.moves += 1
            market.observe(run.events)
        top_up(0.0)
        members = [n for n in run.nodes.values() if n.ready_at <= run.t]
        if not run.nodes and run.refused == "budget":
            run.status = "budget_exhausted"
            break
        if len(members) < w.min_replicas:
            booting = [n.ready_at for n in run.nodes.values() if n.ready_at > run.t]
            short_since = short_since if short_since is not None else run.t
            if not booting and run.t - short_since > w.capacity_timeout_s:
                run.status = "insufficient_capacity"
                break
            dt = (min(booting) - run.t) if booting else WAIT_S
            if not run.affordable(dt):
                break
            run.advance(dt, stop_at_first_loss=False)
            continue
        short_since = None
        world = evaluate(run.quotes_of(members), recipe)
        dt = world.phase_s
        if not run.affordable(dt):
            break
        start, end, lost, share = run.t, run.t + dt, set(), None
        # As the driver does on a notice: the world's inner phase ends by the deadline less twice the
        # sync, everyone syncs, the noticed replica with its partial phase, then it leaves.
        margin_s = max(0.5, 2 * world.sync_penalty_s)
        ids = {m.iid for m in members}
        while run.t < end - 1e-6:
            gone = run.advance(end - run.t, stop_at_first_loss=True)
            if not gone:
                break
            lost.update(gone)
            if any(iid in ids and notice_s(n.offer.cloud) > margin_s for iid, n in gone.items()):
                share = min(1.0, max(0.0, run.t - margin_s - start) / max(dt - world.sync_penalty_s, 1e-9))
                break
            top_up(end - run.t)               # the replacement is rented at once, not at the boundary
        if share is not None:   # the noticed replica and every member still alive contributed
            run.train_phase([m for m in members if m.iid not in lost or m.iid in gone], run.t - start, share)
            continue
        kept = [m for m in members if m.iid not in lost]
        if kept:
            run.train_phase(kept, dt)
        else:
            run.restore()                     # every replica lost: the world restarts from the checkpoint
    run.release_all()


def _cheapest(run: _Run, spot: bool, exclude_region: str | None = None) -> Offer | None:
    """The offer with the least USD per raw token that can hold the whole world (risk ignored)."""
    recipe = run.recipe
    n = min(recipe.world.replicas, recipe.world.max_replicas)
    offers = run.market.offers(run.t, spot)
    fit = [o for o in offers if allowed(o, recipe.resources.model_copy(update={"spot": spot}))
           and o.region != exclude_region and (o.capacity is None or o.capacity >= n)]
    if not fit:
        return None
    return min(fit, key=lambda o: o.usd_per_hour / recipe_tokens_per_s(o, recipe.planner))


def _whole_job(run: _Run, spot: bool, on_loss: str) -> None:
    """A fixed world of n VMs in one place; any loss stops the job until it is whole again and it
    restarts from its last checkpoint (`same-place`: the lost VM is replaced where it was;
    `next-region`: the whole job moves to the cheapest offer in another region)."""
    recipe = run.recipe
    n = min(recipe.world.replicas, recipe.world.max_replicas)
    place: Offer | None = None
    while run.tokens < run.target_tokens:
        if not run.nodes and (place is None or on_loss == "next-region"):
            away = place.region if place is not None else None
            place = _cheapest(run, spot, exclude_region=away) or _cheapest(run, spot)
        while place is not None and len(run.nodes) < n:
            fresh = dataclasses.replace(place, usd_per_hour=(
                run.market.state(place.zone, place.instance_type, run.t).spot_usd_per_hour if spot
                else place.usd_per_hour))
            if run.launch(fresh) is None:
                break
        if run.refused == "budget" and len(run.nodes) < n:
            run.status = "budget_exhausted"
            break
        members = list(run.nodes.values())
        booting = [m.ready_at for m in members if m.ready_at > run.t]
        if len(members) < n or booting:
            dt = (max(booting) - run.t) if booting and len(members) == n else WAIT_S
            if not run.affordable(dt):
                break
            lost = run.advance(dt, stop_at_first_loss=True)
        else:
            dt = evaluate(run.quotes_of(members), recipe).phase_s
            if not run.affordable(dt):
                break
            lost = run.advance(dt, stop_at_first_loss=True)
            if not lost:
                run.train_phase(members, dt)
        if lost:
            run.restore()
            if on_loss == "next-region":
                run.release_all()
    run.release_all()


def simulate(recipe, trace_path: str, policies: list[str] | None = None, seed: int = 0) -> list[dict]:
    """Each policy's figures on the trace: cost_usd, tokens, usd_per_mtok, wall_h, preemptions,
    effective_training_time (kept node-seconds over rented node-seconds), status."""
    from providers.simmarket import TraceError, read_trace_rows

    try:
        rows = read_trace_rows(trace_path)
    except TraceError as exc:
        raise UserError(str(exc)) from None
    market = TraceMarket(rows, recipe)
    out = []
    for policy in policies or list(POLICIES):
        if policy not in POLICIES:
            raise UserError(f"--policy {policy!r}: choose from {', '.join(POLICIES)}")
        run = _Run(recipe, market, seed, policy)
        if policy == "elastic":
            _elastic(run)
        elif policy == "on-demand":
            _whole_job(run, spot=False, on_loss="same-place")
        elif policy == "spot-static":
            _whole_job(run, spot=True, on_loss="same-place")
        else:
            _whole_job(run, spot=True, on_loss="next-region")
        out.append(run.result())
    return out
