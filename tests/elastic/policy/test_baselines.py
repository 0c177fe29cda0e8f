"""The whole-job baselines decide from hand-made snapshots, as the elastic policy does."""

from __future__ import annotations

from elastic.policy.baselines import whole_world
from elastic.policy.registry import policy
from elastic.policy.rules import HoldBack, Place, Rent, Snapshot
from tests.elastic.policy.test_planner import offer, quote, recipe
from tests.elastic.policy.test_policy import held


def test_a_whole_job_is_placed_on_the_cheapest_offer_then_topped_up_there_within_the_budget():
    r = recipe(**{"world.replicas": 3})
    quotes = [quote(offer("r1a", 10.0)), quote(offer("r2a", 8.0)), quote(offer("r3a", 9.0))]
    acts = policy("spot-static").decide(Snapshot(r, 0.0, quotes=tuple(quotes)))
    assert acts[0] == Place(quotes[1].offer)
    assert [a.quote.offer.zone for a in acts[1:]] == ["r2a"] * whole_world(r)
    # Placed, one VM lost: the same place, at the spot price there now.
    now = [quote(offer("r1a", 4.0)), quote(offer("r2a", 8.5))]
    acts = policy("spot-static").decide(Snapshot(r, 60.0, nodes=tuple(held(2, "r2a")), quotes=tuple(now),
                                                 place=quotes[1].offer))
    assert [(a.quote.offer.zone, a.quote.offer.usd_per_hour) for a in acts] == [("r2a", 8.5)]
    # The budget cannot pay for the world: the run gives up.
    poor = recipe(**{"world.replicas": 3, "budget.max_usd": 0.1})   # not a minute of one VM
    (hold,) = policy("spot-static").decide(Snapshot(poor, 60.0, quotes=tuple(now), place=quotes[1].offer))
    assert isinstance(hold, HoldBack) and hold.reason == "budget" and hold.gives_up


def test_skypilot_like_moves_away_from_the_region_it_lost_and_on_demand_rents_on_demand():
    r = recipe(**{"world.replicas": 2})
    quotes = (quote(offer("r1a", 8.0)), quote(offer("r2a", 9.0)))
    acts = policy("skypilot-like").decide(Snapshot(r, 0.0, quotes=quotes, place=quotes[0].offer))
    assert acts[0] == Place(quotes[1].offer) and {a.quote.offer.zone for a in acts[1:]} == {"r2a"}
    # spot-static keeps its place whatever the prices.
    acts = policy("spot-static").decide(Snapshot(r, 0.0, quotes=quotes, place=quotes[1].offer))
    assert all(isinstance(a, Rent) and a.quote.offer.zone == "r2a" for a in acts)
    # on-demand places only on an on-demand offer, at the price it was placed at.
    od = (quote(offer("r1a", 30.0, spot=False)), quote(offer("r2a", 25.0, spot=False)))
    acts = policy("on-demand").decide(Snapshot(r, 0.0, quotes=quotes + od))
    assert acts[0] == Place(od[1].offer) and [a.quote.offer for a in acts[1:]] == [od[1].offer] * 2
