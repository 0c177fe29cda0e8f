"""The published policies `elastic simulate` compares the `elastic` policy with, each a
`policy.Policy` deciding from snapshots.

Whole jobs of a fixed world in one place:

- `on-demand`: the cheapest single region, on-demand, never preempted.
- `spot-static`: the cheapest spot offer at the start, never moves; a preemption stops the job,
  which restarts from its last checkpoint once the lost VM is replaced in the same place.
- `skypilot-like`: SkyPilot's managed job with its default recovery, EAGER_NEXT_REGION
  (sky/jobs/recovery_strategy.py): the cluster is launched in the cheapest zone, every node in
  that zone (SkyPilot provisions a cluster in one zone); a zone that refuses a node (no capacity)
  is torn down and the next cheapest zone tried (the provisioner's failover), and when every zone
  has refused, the launch is retried from the cheapest at the next look at the market (SkyPilot's
  retry-until-up backoff; here the refusals rest `planner.capacity_cooldown_s`). It does not know
  a zone's capacity before it tries. A preemption tears the whole cluster down and relaunches it
  outside the region it was in first (EAGER_NEXT_REGION), anywhere when nothing else takes it.

Each keeps its place in the snapshot (`Place`, read back as `Snapshot.place`). The cheapest offer
is the least USD per raw token (risk ignored). A job that is whole trains; any loss stops it
(`Policy.whole_job`: the simulator's model of it), so the driver, whose world trains through a
loss, does not run these.

A world of DiLoCo replicas:

- `uniform-progress`: the Uniform Progress rule of "Can't Be Late" (Wu et al., NSDI'24, §5.2),
  mapped from the paper's one job (idle, spot or on-demand) to a world of up to `whole_world`
  replicas, each slot idle, spot or on-demand (`UniformProgress`).
"""

from __future__ import annotations

import dataclasses
import math

from elastic.policy.market import Quote, offer_key, recipe_tokens_per_s
from elastic.policy.planner import allowed, run_tokens, tokens_per_phase
from elastic.policy.rules import (LOOK_PAST_S, Action, HoldBack, HoldReason, Place, Policy, Release, Rent, Snapshot,
                                  launch_fits_budget, resting, usd_per_hour_held)
from providers.base import Offer


def whole_world(recipe) -> int:
    """The VMs a whole job holds and trains on: world.replicas (at most world.max_replicas)."""
    return min(recipe.world.replicas, recipe.world.max_replicas)


def _usd_per_raw_token(o: Offer, recipe) -> float:
    return o.usd_per_hour / recipe_tokens_per_s(o, recipe.planner)


class WholeJob(Policy):
    """A fixed world of `whole_world` VMs in one place: the place is chosen when nothing is held
    (once, or after each loss with `moves_on_loss`, away from the region it leaves), and topped up
    there, each launch within the budget (none fitting: the run gives up)."""

    whole_job = True

    def decide(self, s: Snapshot) -> list[Action]:
        place = s.place
        out: list[Action] = []
        if not s.nodes and (place is None or self.moves_on_loss):
            away = place.region if place is not None else None
            place = self._cheapest(s, exclude_region=away) or self._cheapest(s)
            out.append(Place(place))
        return out + self._fill(s, place, len(s.nodes))

    def _fill(self, s: Snapshot, place: Offer | None, held: int) -> list[Action]:
        """Rent in `place` up to the whole world from `held` VMs, each launch within the budget."""
        r = s.recipe
        out: list[Action] = []
        rate = usd_per_hour_held(s)
        while place is not None and held < whole_world(r):
            fresh = place
            if place.spot:   # the spot price now (on-demand keeps the price it was placed at)
                now = next((q.offer for q in s.quotes if (q.offer.zone, q.offer.instance_type)
                            == (place.zone, place.instance_type)), place)
                fresh = dataclasses.replace(place, usd_per_hour=now.usd_per_hour)
            if not launch_fits_budget(s.spent_usd, rate, fresh, r):
                out.append(HoldBack(HoldReason.BUDGET, held=held, usd_per_hour=fresh.usd_per_hour, gives_up=True))
                break
            out.append(Rent(Quote(fresh, 0.0, "trace")))
            held += 1
            rate += fresh.usd_per_hour
        return out

    def _cheapest(self, s: Snapshot, exclude_region: str | None = None) -> Offer | None:
        """The offer quoted with the least USD per raw token that can hold the whole world."""
        r = s.recipe
        n = whole_world(r)
        resources = r.resources.model_copy(update={"spot": self.spot})
        fit = [q.offer for q in s.quotes if allowed(q.offer, resources) and q.offer.region != exclude_region
               and (q.offer.capacity is None or q.offer.capacity >= n)]
        if not fit:
            return None
        return min(fit, key=lambda o: _usd_per_raw_token(o, r))


class OnDemand(WholeJob):
    name = "on-demand"
    spot = False


class SpotStatic(WholeJob):
    name = "spot-static"
    spot = True


class SkypilotLike(WholeJob):
    """SkyPilot's EAGER_NEXT_REGION (see the module's docstring): the place is tried without
    knowing its capacity; a refusal there (`Snapshot.refusals`) tears the partial cluster down and
    places it in the next cheapest zone not refused; a loss places it outside the region it was in."""

    name = "skypilot-like"
    spot = True
    moves_on_loss = True

    def decide(self, s: Snapshot) -> list[Action]:
        place = s.place
        refused = place is not None and resting(s, place) and len(s.nodes) < whole_world(s.recipe)
        if s.nodes and not refused:
            return self._fill(s, place, len(s.nodes))
        # Nothing held (the start, or after a loss: EAGER_NEXT_REGION leaves the region first), or
        # the place refused a node: the provisioner tears the partial cluster down and fails over.
        out: list[Action] = [Release(n.instance_id) for n in s.nodes]
        away = place.region if place is not None and not refused else None
        place = self._next(s, exclude_region=away) or self._next(s)
        if place is None:   # every zone refused within the cooldown: retried at a later look
            return out + [HoldBack(HoldReason.CAPACITY, held=0)]
        return out + [Place(place)] + self._fill(s, place, 0)

    def _next(self, s: Snapshot, exclude_region: str | None = None) -> Offer | None:
        """The cheapest spot offer (USD per raw token) not refused within the cooldown, its
        capacity unknown to SkyPilot (a launch finds it out)."""
        r = s.recipe
        resources = r.resources.model_copy(update={"spot": True})
        fit = [q.offer for q in s.quotes if allowed(q.offer, resources) and q.offer.region != exclude_region
               and not resting(s, q.offer)]
        return min(fit, key=lambda o: _usd_per_raw_token(o, r)) if fit else None


class UniformProgress(Policy):
    """Uniform Progress (Can't Be Late, NSDI'24), for a world of DiLoCo replicas.

    The paper's job is one instance, idle, spot or on-demand, with progress cp(t) against the
    straight line to the deadline ep(t) = C(0) · t / R(0) and a changeover delay d. Its rules:
    (1) uniform progress: idle and behind (cp(t) < ep(t)), go on-demand; (2) taking risks: go to
    spot whenever it is available, and stay on it until preempted (exploitation); (3) hysteresis:
    on on-demand, stay until cp(t) ≥ ep(t + 2d); (4) safety net: idle with R(t) < C(t) + 2d, go
    on-demand until the end. Its multi-instance form keeps N instances, all spot or all on-demand,
    spot "available" when N spot instances are.

    Here the job is `whole_world` replicas whose survivors train on (DiLoCo: no gang), so each
    replica slot follows the rules on its own:
        cp(t): tokens trained (`Snapshot.progress.tokens`); C(0): the run's tokens (`run_tokens`);
        R(0): budget.max_hours (none: the line is 0, the policy is spot-only); t: seconds since
        the start; d: planner.recovery_s (a replica's boot) in the hysteresis, and a boot and an
        inner phase at the on-demand pace in the safety net (a replica's tokens count when its
        first phase ends: the net's guarantee needs the whole delay); C(t) in seconds: the tokens
        left at the recipe's pace of a whole world of on-demand replicas.
    - spot replicas are rented into empty slots whenever a spot offer has room (the cheapest per
      raw token first, an offer's known capacity counted, a refused offer resting) and are never
      let go (exploitation). Ahead of the line, spot counts as available only when it can hold
      world.min_replicas (with the spot replicas held): fewer would not train (the paper's
      "a(t) < N is unavailable", relaxed to DiLoCo's least world);
    - behind the line (cp < ep(t)) or under the safety net, the slots spot cannot fill are rented
      on-demand (the cheapest, `Snapshot.on_demand_quotes`);
    - on-demand replicas stay until cp ≥ ep(t + 2d) (never, under the safety net), then leave
      (`Release`): their slots take spot where it has room, else stay idle;
    - ahead with no spot, slots stay idle: the world's wait is the policy's choice, not a capacity
      shortage (`waits_for_capacity`).
    """

    name = "uniform-progress"
    on_demand_fallback = True

    def waits_for_capacity(self, s: Snapshot) -> bool:
        return True   # its idle world is its choice (ahead of the line), and on-demand is its net

    def next_look_s(self, s: Snapshot) -> float:
        # The paper's policy decides at its trace's ticks, as this one at the rows of a trace and at
        # the world's own events. The safety net is the exception: the time left falls to C(t) + 2d
        # by the clock alone, and seen only at the next row (up to ten minutes later on the real
        # traces), the margin left can be less than an on-demand world needs to boot and count its
        # first phase, and the deadline it guards is missed. It looks again at that moment.
        od = self._on_demand(s)
        net_s = self._net_s(s, od) if od is not None else None
        t_s = s.time_s - s.started_s
        return net_s - t_s + LOOK_PAST_S if net_s is not None and net_s > t_s else math.inf

    def _deadline_s(self, s: Snapshot) -> float | None:
        """R(0), seconds from the start (None: no deadline)."""
        return s.recipe.budget.max_hours * 3600 if s.recipe.budget.max_hours is not None else None

    def _net_s(self, s: Snapshot, od: Offer) -> float | None:
        """When, in seconds from the start, the safety net falls due with the tokens left now: R(t) =
        C(t) + 2d, C(t) the seconds a whole world of `od` takes to train them. The paper's d is the
        changeover delay, after which its instance makes progress; an on-demand replica's tokens
        count only when its first phase ends, so the net's d is a boot and a phase of `od` (the
        hysteresis keeps d a boot). None: no deadline."""
        r, deadline_s = s.recipe, self._deadline_s(s)
        if deadline_s is None:
            return None
        tps = recipe_tokens_per_s(od, r.planner)
        finish_s = (run_tokens(r) - s.progress.tokens) / (whole_world(r) * tps)
        return deadline_s - finish_s - 2 * (r.planner.recovery_s + tokens_per_phase(r) / tps)

    def decide(self, s: Snapshot) -> list[Action]:
        r = s.recipe
        n = whole_world(r)
        d_s = r.planner.recovery_s
        t_s = s.time_s - s.started_s
        deadline_s = self._deadline_s(s)
        total, cp = run_tokens(r), s.progress.tokens

        def ep(at_s: float) -> float:
            return total * at_s / deadline_s if deadline_s else 0.0

        od = self._on_demand(s)
        net_s = self._net_s(s, od) if od is not None else None
        safety = net_s is not None and t_s > net_s
        behind = cp < ep(t_s) or safety
        out: list[Action] = []
        world = [m for m in s.nodes if not m.leaving]
        if not safety and cp >= ep(t_s + 2 * d_s):   # hysteresis: caught up, on-demand replicas go
            gone = [m for m in world if not m.quote.offer.spot and m.ready]
            out += [Release(m.instance_id) for m in gone]
            world = [m for m in world if m not in gone]
        held = len(world) + len(s.pending)
        rooms = self._spot_rooms(s)
        spot_held = sum(m.quote.offer.spot for m in world) + sum(o.spot for o in s.pending)
        spot_ok = behind or spot_held + min(n - held, sum(c for _, c in rooms)) >= r.world.min_replicas
        rate = usd_per_hour_held(s)
        while held < n:
            offer = None
            if spot_ok and rooms:
                offer, left = rooms[0]
                rooms = rooms[1:] if left <= 1 else [(offer, left - 1)] + rooms[1:]
            elif behind:
                offer = od
            if offer is None:   # ahead with no spot: idle (or nothing on-demand to fall back to)
                out.append(HoldBack(HoldReason.CAPACITY, held=held))
                break
            if not launch_fits_budget(s.spent_usd, rate, offer, r, horizon_s=s.budget_horizon_s):
                on_way = bool(s.pending) or any(isinstance(a, Rent) for a in out)
                out.append(HoldBack(HoldReason.BUDGET, held=held, usd_per_hour=offer.usd_per_hour,
                                    gives_up=not on_way and len(world) < r.world.min_replicas))
                break
            out.append(Rent(next(q for q in s.quotes + s.on_demand_quotes if q.offer is offer)))
            held += 1
            rate += offer.usd_per_hour
        return out

    def _spot_rooms(self, s: Snapshot) -> list[tuple[Offer, float]]:
        """Spot offers with room, cheapest per raw token first, each with the VMs it can still take
        (its known capacity less those held or on their way there; inf when unknown)."""
        r = s.recipe
        resources = r.resources.model_copy(update={"spot": True})
        used: dict = {}
        for key in [offer_key(m.quote.offer) for m in s.nodes] + [offer_key(o) for o in s.pending]:
            used[key] = used.get(key, 0) + 1
        out = []
        for q in sorted(s.quotes, key=lambda q: _usd_per_raw_token(q.offer, r)):
            if not allowed(q.offer, resources) or resting(s, q.offer):
                continue
            room = math.inf if q.capacity is None else q.capacity - used.get(q.key, 0)
            if room > 0:
                out.append((q.offer, room))
        return out

    def _on_demand(self, s: Snapshot) -> Offer | None:
        """The cheapest on-demand offer per raw token the recipe allows, not resting."""
        r = s.recipe
        resources = r.resources.model_copy(update={"spot": False})
        fit = [q.offer for q in s.on_demand_quotes if allowed(q.offer, resources) and not resting(s, q.offer)]
        return min(fit, key=lambda o: _usd_per_raw_token(o, r)) if fit else None
