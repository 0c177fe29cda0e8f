"""The published policies (whole-job baselines, Uniform Progress) decide from hand-made snapshots, as the
elastic policy does."""

from __future__ import annotations

import math

import pytest

from elastic.policy.baselines import whole_world
from elastic.policy.planner import Progress, run_tokens, tokens_per_phase
from elastic.policy.registry import policy
from elastic.policy.rules import HoldBack, Node, Place, Refusal, Release, Rent, Snapshot
from tests.elastic.policy.test_planner import offer, quote, recipe
from tests.elastic.policy.test_policy import held, rents


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


def test_skypilot_like_fails_over_to_the_next_zone_when_its_place_refuses_a_node():
    """SkyPilot's provisioner: a zone that cannot hold the cluster is torn down and the next
    cheapest zone tried (it knows no capacity before it tries); every zone refused: it waits."""
    r = recipe(**{"world.replicas": 2})
    quotes = (quote(offer("r1a", 8.0)), quote(offer("r1b", 8.5)), quote(offer("r2a", 9.0)))
    # Placed in r1a, one VM held, the second launch refused there just now.
    s = Snapshot(r, 10.0, nodes=tuple(held(1, "r1a")), quotes=quotes, place=quotes[0].offer,
                 refusals=(Refusal(quotes[0].key, 10.0),))
    acts = policy("skypilot-like").decide(s)
    assert acts[0] == Release("i0")
    assert acts[1] == Place(quotes[1].offer)   # the next cheapest zone, the same region allowed
    assert [a.quote.offer.zone for a in acts[2:]] == ["r1b", "r1b"]
    # Both r1 zones refused: r2a.
    s = Snapshot(r, 11.0, quotes=quotes, place=quotes[1].offer,
                 refusals=(Refusal(quotes[0].key, 10.0), Refusal(quotes[1].key, 11.0)))
    acts = policy("skypilot-like").decide(s)
    assert acts[0] == Place(quotes[2].offer) and rents(acts) == ["r2a", "r2a"]
    # Every zone refused within the cooldown: nothing rented until one rests no more.
    every = tuple(Refusal(q.key, 11.0) for q in quotes)
    acts = policy("skypilot-like").decide(Snapshot(r, 12.0, quotes=quotes, place=quotes[2].offer, refusals=every))
    assert acts == [HoldBack("capacity", held=0)]
    # Whole in its place: it keeps it (no failover without a refusal or a loss).
    acts = policy("skypilot-like").decide(Snapshot(r, 12.0, nodes=tuple(held(2, "r1a")), quotes=quotes,
                                                   place=quotes[0].offer))
    assert acts == []


# -- uniform-progress ---------------------------------------------------------------------------

DEADLINE_H = 10.0


def up_recipe(**kw):
    """A run of 2 replicas (1 at least) whose tokens take a whole world 5 h (2 × 24,000 tokens/s on
    A100×8): the straight line to the 10 h deadline goes at half the world's pace; a boot is 10 min."""
    return recipe(**{"world.replicas": 2, "world.min_replicas": 1, "world.max_replicas": 4,
                     "budget.max_hours": DEADLINE_H, "planner.recovery_s": 600,
                     "train.token_budget": 5 * 3600 * 2 * 24_000, **kw})


def up_snap(r, at_h, done, nodes=(), spot=(), od=(), **kw):
    """`done`: the share of the run's tokens trained at hour `at_h`."""
    return Snapshot(r, at_h * 3600, 0.0, nodes=tuple(nodes), quotes=tuple(spot), on_demand_quotes=tuple(od),
                    progress=Progress(round(done * run_tokens(r)), 0, at_h), **kw)


def on_demand(zone, usd=30.0):
    return Node(f"od-{zone}", quote(offer(zone, usd, spot=False)), launched_at_s=0.0)


def test_uniform_progress_behind_the_line_rents_on_demand_and_ahead_with_spot_rents_spot():
    r = up_recipe()
    spot = [quote(offer("r1a", 8.0), capacity=1), quote(offer("r2a", 9.0), capacity=0)]
    od = [quote(offer("r1a", 30.0, spot=False)), quote(offer("r2a", 25.0, spot=False))]
    up = policy("uniform-progress")
    assert up.on_demand_fallback and not up.whole_job
    # Behind (40 % done at 5 h of 10): spot where it has room (r1a holds 1), on-demand for the rest.
    acts = up.decide(up_snap(r, 5.0, 0.40, spot=spot, od=od))
    assert [(a.quote.offer.zone, a.quote.offer.spot) for a in acts if isinstance(a, Rent)] == \
        [("r1a", True), ("r2a", False)]
    # Ahead (60 %), spot with room: spot only (taking risks), up to the world.
    roomy = [quote(offer("r1a", 8.0), capacity=4)]
    acts = up.decide(up_snap(r, 5.0, 0.60, spot=roomy, od=od))
    assert [(a.quote.offer.zone, a.quote.offer.spot) for a in acts] == [("r1a", True), ("r1a", True)]
    # Ahead with no spot: idle, on-demand is not rented.
    acts = up.decide(up_snap(r, 5.0, 0.60, spot=[quote(offer("r1a", 8.0), capacity=0)], od=od))
    assert acts == [HoldBack("capacity", held=0)]
    # Spot replicas held stay, whatever the line says (exploitation): nothing released.
    acts = up.decide(up_snap(r, 5.0, 0.90, nodes=held(2, "r1a"), spot=roomy, od=od))
    assert acts == []


def test_uniform_progress_keeps_on_demand_until_ahead_by_two_boots_then_lets_it_go():
    r = up_recipe()
    up = policy("uniform-progress")
    spot = [quote(offer("r1a", 8.0), capacity=4)]
    od = [quote(offer("r2a", 25.0, spot=False))]
    world = [on_demand("r2a"), *held(1, "r1a")]
    # At 5 h the line is at 50 %, at 5 h + 2 boots (20 min) at 53.3 %: at 52 %, ahead but not by
    # two boots, the on-demand replica stays (hysteresis), spot available or not.
    assert up.decide(up_snap(r, 5.0, 0.52, nodes=world, spot=spot, od=od)) == []
    # At 54 % it leaves, and its slot takes spot.
    acts = up.decide(up_snap(r, 5.0, 0.54, nodes=world, spot=spot, od=od))
    assert acts[0] == Release("od-r2a") and rents(acts[1:]) == ["r1a"] and acts[1].quote.offer.spot
    # Caught up and no spot: it leaves and the slot stays idle.
    acts = up.decide(up_snap(r, 5.0, 0.54, nodes=world, spot=[quote(offer("r1a", 8.0), capacity=1)], od=od))
    assert acts == [Release("od-r2a"), HoldBack("capacity", held=1)]


def test_uniform_progress_safety_net_rents_on_demand_even_ahead_of_the_line():
    r = up_recipe()
    up = policy("uniform-progress")
    od = [quote(offer("r2a", 25.0, spot=False))]
    no_spot = [quote(offer("r1a", 8.0), capacity=0)]
    # At 8 h with 85 % done: ahead of the line (80 %), no spot: idle.
    assert up.decide(up_snap(r, 8.0, 0.85, spot=no_spot, od=od)) == [HoldBack("capacity", held=0)]
    # At 9.5 h with 95 % done: on the line, but the 5 % left take a whole world 15 min, and with the
    # net's 2d (two boots and two first phases, 42.8 min) that is more than the 30 min left: the
    # safety net rents on-demand.
    acts = up.decide(up_snap(r, 9.5, 0.95, spot=no_spot, od=od))
    assert rents(acts) == ["r2a", "r2a"] and not any(a.quote.offer.spot for a in acts)
    # At 9.2 h, ahead (the line at 92 %) with 48 min left: two boots alone (15 + 20 min) would wait,
    # but an on-demand replica's tokens count only when its first phase ends: the net rents.
    acts = up.decide(up_snap(r, 9.2, 0.95, spot=no_spot, od=od))
    assert rents(acts) == ["r2a", "r2a"] and not any(a.quote.offer.spot for a in acts)


def test_uniform_progress_looks_again_when_the_clock_alone_brings_the_safety_net():
    r = up_recipe()
    up = policy("uniform-progress")
    od = [quote(offer("r2a", 25.0, spot=False))]
    no_spot = [quote(offer("r1a", 8.0), capacity=0)]
    # At 8.5 h with 95 % done, idle and ahead (the line reaches 95 % at 9.5 h): the 5 % left take a
    # whole world 15 min, and the net's 2d is two boots (10 min each) and two first phases (16.4 M
    # tokens at 24,000 tokens/s, 11.4 min each: a replica's tokens count when its phase ends), so the
    # net is at 10 h − 57.8 min, 32.2 min from now. It asks to look again then, and there rents
    # on-demand; a minute before, it still waits.
    phase_s = tokens_per_phase(r) / 24_000
    look = up.next_look_s(up_snap(r, 8.5, 0.95, spot=no_spot, od=od))
    assert look == pytest.approx(1.5 * 3600 - 15 * 60 - 2 * (600 + phase_s), abs=1.0)
    assert up.decide(up_snap(r, 8.5 + (look - 60) / 3600, 0.95, spot=no_spot, od=od)) == [HoldBack("capacity", held=0)]
    acts = up.decide(up_snap(r, 8.5 + look / 3600, 0.95, spot=no_spot, od=od))
    assert rents(acts) == ["r2a", "r2a"] and not any(a.quote.offer.spot for a in acts)
    # Past the net, or without a deadline, nothing to wait for on the clock.
    assert up.next_look_s(up_snap(r, 9.5, 0.95, spot=no_spot, od=od)) == math.inf
    open_ended = r.model_copy(update={"budget": r.budget.model_copy(update={"max_hours": None})})
    assert up.next_look_s(up_snap(open_ended, 9.0, 0.95, spot=no_spot, od=od)) == math.inf


def test_the_registry_lists_the_published_policies():
    from elastic.policy.registry import POLICIES

    assert {"elastic", "on-demand", "spot-static", "skypilot-like", "uniform-progress"} <= set(POLICIES)
    assert policy("uniform-progress").name == "uniform-progress"
