"""The baselines `elastic simulate` compares the `elastic` policy with: whole jobs of a fixed world
in one place, each a `policy.Policy` deciding from snapshots.

- `on-demand`: the cheapest single region, on-demand, never preempted.
- `spot-static`: the cheapest spot offer at the start, never moves; a preemption stops the job,
  which restarts from its last checkpoint once the lost VM is replaced in the same place.
- `skypilot-like`: the cheapest spot offer at the start; a preemption restarts the whole job from
  its last checkpoint in the next-cheapest other region (SkyPilot's EAGER_NEXT_REGION).

Each keeps its place in the snapshot (`Place`, read back as `Snapshot.place`). The cheapest offer
is the least USD per raw token that can hold the whole world (risk ignored). A job that is whole
trains; any loss stops it (`Policy.whole_job`: the simulator's model of it), so the driver, whose
world trains through a loss, does not run these.
"""

from __future__ import annotations

import dataclasses

from elastic.policy.market import Quote, recipe_tokens_per_s
from elastic.policy.planner import allowed
from elastic.policy.rules import Action, HoldBack, Place, Policy, Rent, Snapshot, launch_fits_budget, usd_per_hour_held
from providers.base import Offer


def whole_world(recipe) -> int:
    """The VMs a whole job holds and trains on: world.replicas (at most world.max_replicas)."""
    return min(recipe.world.replicas, recipe.world.max_replicas)


class WholeJob(Policy):
    """A fixed world of `whole_world` VMs in one place: the place is chosen when nothing is held
    (once, or after each loss with `moves_on_loss`, away from the region it leaves), and topped up
    there, each launch within the budget (none fitting: the run gives up)."""

    whole_job = True

    def decide(self, s: Snapshot) -> list[Action]:
        r = s.recipe
        n = whole_world(r)
        out: list[Action] = []
        place = s.place
        if not s.nodes and (place is None or self.moves_on_loss):
            away = place.region if place is not None else None
            place = self._cheapest(s, exclude_region=away) or self._cheapest(s)
            out.append(Place(place))
        held, rate = len(s.nodes), usd_per_hour_held(s)
        while place is not None and held < n:
            fresh = place
            if place.spot:   # the spot price now (on-demand keeps the price it was placed at)
                now = next((q.offer for q in s.quotes if (q.offer.zone, q.offer.instance_type)
                            == (place.zone, place.instance_type)), place)
                fresh = dataclasses.replace(place, usd_per_hour=now.usd_per_hour)
            if not launch_fits_budget(s.spent_usd, rate, fresh, r):
                out.append(HoldBack("budget", held=held, usd_per_hour=fresh.usd_per_hour, gives_up=True))
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
        return min(fit, key=lambda o: o.usd_per_hour / recipe_tokens_per_s(o, r.planner))


class OnDemand(WholeJob):
    name = "on-demand"
    spot = False


class SpotStatic(WholeJob):
    name = "spot-static"
    spot = True


class SkypilotLike(WholeJob):
    name = "skypilot-like"
    spot = True
    moves_on_loss = True
