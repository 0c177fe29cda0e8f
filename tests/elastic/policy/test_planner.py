"""The market and the planner on small hand-made markets whose best answer is known."""

from __future__ import annotations

import dataclasses

import pytest

from elastic.policy.market import Market, Quote, load_history, save_history
from elastic.policy.planner import (Progress, choose_launch, evaluate, launch_usd_per_mtok, leaves_at_once, lifetime_h, plan,
                             replan, replan_all, usd_per_mtok)
from providers.base import Offer
from tests.conftest import tiny_recipe


def offer(zone, usd, it="a100x8", gpu="A100", region=None, cloud="aws", spot=True, od=30.0):
    return Offer(cloud=cloud, region=region or zone[:-1], zone=zone, instance_type=it, gpu=gpu, gpus=8, cpus=96,
                 spot=spot, usd_per_hour=usd, on_demand_usd_per_hour=od, read_at=0.0)


def quote(o, risk=0.0, capacity=None):
    return Quote(o, risk, "test", capacity)


def recipe(**kw):
    base = {"planner.tokens_per_s": "{A100: 3000, H100: 7500}", "planner.recovery_s": 600,
            "planner.cross_region_sync_s": 20, "world.replicas": 4, "world.max_replicas": 6,
            "train.inner_steps": 500, "train.batch_size": 32, "train.seq_len": 1024, "model.context": 1024}
    return tiny_recipe(**{**base, **kw})


def places(pl):
    return sorted((q.offer.zone, q.offer.instance_type) for q in pl.quotes)


def test_cheapest_zone_takes_the_whole_world():
    r = recipe()
    qs = [quote(offer("r1a", 10.0)), quote(offer("r2a", 8.0)), quote(offer("r3a", 12.0))]
    assert places(plan(qs, r)) == [("r2a", "a100x8")] * 4


def test_capacity_spills_over_to_the_next_best():
    r = recipe()
    qs = [quote(offer("r1a", 10.0), capacity=3), quote(offer("r2a", 8.0), capacity=1), quote(offer("r3a", 12.0))]
    assert places(plan(qs, r)) == [("r1a", "a100x8")] * 3 + [("r2a", "a100x8")]


def test_risk_and_speed_decide_not_the_price_per_hour():
    r = recipe()
    # A risky zone that is cheaper per hour loses to a safe one: 2 preemptions per hour of a
    # ~700 s phase and a 600 s recovery lose about 70 % of the work.
    safe, risky = offer("r1a", 10.0), offer("r2a", 9.0)
    assert places(plan([quote(safe, 0.0), quote(risky, 2.0)], r)) == [("r1a", "a100x8")] * 4
    # 8×H100 at 2.5× the speed for 2.2× the price is cheaper per token.
    h100 = offer("r3a", 22.0, it="h100x8", gpu="H100")
    assert places(plan([quote(safe), quote(h100)], r)) == [("r3a", "h100x8")] * 4


def test_a_world_never_mixes_speeds_when_one_speed_is_cheaper_whole():
    r = recipe()
    # A100 alone is cheapest per token, but an H100 world is not slowed by A100s waiting.
    a, h = offer("r1a", 9.0), offer("r1b", 24.0, it="h100x8", gpu="H100")
    pl = plan([quote(a, capacity=2), quote(h)], r)
    mixed = evaluate([quote(a)] * 2 + [quote(h)] * 2, r)
    assert places(pl) == [("r1b", "h100x8")] * 4
    assert pl.usd_per_mtok < mixed.usd_per_mtok


def test_spread_over_regions_and_cross_region_sync_cost():
    r = recipe(**{"planner.spread_min": 2})
    qs = [quote(offer("r1a", 8.0)), quote(offer("r1b", 8.5)), quote(offer("r2a", 9.0)), quote(offer("r3a", 11.0))]
    pl = plan(qs, r)
    assert places(pl) == [("r1a", "a100x8")] * 3 + [("r2a", "a100x8")]
    assert pl.sync_penalty_s == 20
    r = recipe(**{"planner.spread_min": 2, "planner.spread_over": "zone"})
    assert places(plan(qs, r)) == [("r1a", "a100x8")] * 3 + [("r1b", "a100x8")]
    # Without spread, a slightly cheaper second region is not worth the cross-region sync.
    r = recipe(**{"planner.cross_region_sync_s": 300})
    pl = plan([quote(offer("r1a", 7.0), capacity=2), quote(offer("r1b", 8.1)), quote(offer("r2a", 8.0))], r)
    assert {q.offer.region for q in pl.quotes} == {"r1"}


def test_constraints_regions_price_cap_and_spot():
    r = recipe(**{"resources.regions": "[r2]", "resources.max_usd_per_hour": 9.5})
    qs = [quote(offer("r1a", 5.0)), quote(offer("r2a", 9.0)), quote(offer("r2b", 9.9)),
          quote(offer("r1c", 1.0, spot=False))]
    assert places(plan(qs, r)) == [("r2a", "a100x8")] * 4
    assert plan([quote(offer("r1a", 5.0))], r).feasible is False
    # A spot recipe falls back on on-demand offers where the policy quotes them (its deadline
    # rule); an on-demand recipe never takes a spot offer.
    from elastic.policy.planner import allowed
    assert allowed(offer("r2c", 1.0, spot=False), r.resources)
    assert not allowed(offer("r2c", 1.0), r.resources.model_copy(update={"spot": False}))


def test_budget_and_hours_are_planned():
    r = recipe(**{"train.token_budget": 10_000_000_000, "budget.max_usd": 100, "budget.max_hours": 15})
    qs = [quote(offer("r1a", 8.0))]
    pl = plan(qs, r)
    # 4 × 24k tokens/s would take ~29 h: the planner grows the world towards max_replicas (6).
    assert len(pl.quotes) == 6
    assert pl.expected_hours == pytest.approx(10e9 / pl.useful_tokens_per_s / 3600)
    assert any("budget.max_usd" in w for w in pl.warnings)
    assert any("budget.max_hours" in w for w in pl.warnings)


def test_choose_launch_fills_the_plan_one_replica_at_a_time():
    r = recipe(**{"planner.spread_min": 2})
    qs = [quote(offer("r1a", 8.0)), quote(offer("r2a", 9.0))]
    held = []
    for _ in range(4):
        held.append(choose_launch(qs, r, held))
    assert places(evaluate(held, r)) == places(plan(qs, r))


def test_replan_moves_when_much_cheaper_and_not_on_jitter():
    r = recipe(**{"planner.min_saving": 0.25})
    here = offer("r1a", 10.0)
    held = [(f"i{k}", quote(here)) for k in range(4)]
    # Jitter: other zones within a few percent never move a replica.
    for usd in (9.9, 9.5, 9.0, 8.0):
        assert replan([quote(here), quote(offer("r2a", usd))], held, r, remaining_hours=10) is None
    # A zone at half the price moves the most expensive replica, then (replan_all) the rest.
    cheap = offer("r2a", 5.0)
    move = replan([quote(here), quote(cheap)], held, r, remaining_hours=10)
    assert move is not None and move.add.offer.zone == "r2a" and move.drain.startswith("i")
    assert move.usd_per_mtok_after < move.usd_per_mtok_before
    moves = replan_all([quote(here), quote(cheap)], held, r, remaining_hours=10)
    assert sorted(m.drain for m in moves) == ["i0", "i1", "i2", "i3"]
    # Not when the run ends before the move pays for itself (the new VM boots for 600 s).
    assert replan([quote(here), quote(cheap)], held, r, remaining_hours=0.01) is None
    # A held replica whose price spiked is the one moved.
    spiked = [("i0", quote(offer("r1a", 10.0))), ("i1", quote(offer("r3a", 25.0)))]
    assert replan([quote(here), quote(offer("r3a", 25.0))], spiked, r, remaining_hours=10).drain == "i1"


def test_a_new_vms_boot_is_spread_over_its_expected_lifetime():
    r = recipe()   # recovery_s 600: a sixth of an hour billed before any token
    calm, stormy = quote(offer("r1a", 10.0), 0.1), quote(offer("r2a", 10.0), 3.0)
    assert lifetime_h(calm) == pytest.approx(10.0) and lifetime_h(stormy) == pytest.approx(1 / 3)
    assert lifetime_h(calm, hours_left=2.0) == 2.0 and lifetime_h(quote(offer("r3a", 10.0))) == float("inf")
    assert launch_usd_per_mtok(calm, r) == pytest.approx(usd_per_mtok(calm, r) * (1 + (1 / 6) / 10))
    assert launch_usd_per_mtok(stormy, r) == pytest.approx(usd_per_mtok(stormy, r) * 1.5)
    # The run's last half hour: the boot weighs against that, not against the VM's life.
    assert launch_usd_per_mtok(calm, r, hours_left=0.5) == pytest.approx(usd_per_mtok(calm, r) * (1 + 1 / 3))
    # A spiked replica leaves at once; one a little dearer than a stormy replacement stays.
    assert leaves_at_once(quote(offer("r1a", 40.0), 0.1), calm, r)
    assert not leaves_at_once(quote(offer("r1a", 11.0), 0.1), stormy, r)


def test_a_world_whose_region_is_hit_by_a_wave_leaves_it_whole():
    r = recipe(**{"planner.min_saving": 0.25})
    h100 = offer("r1a", 25.0, it="h100x8", gpu="H100")
    a100 = offer("r2a", 5.0)                          # half the H100s' price per token, another region
    held = [(f"i{k}", quote(h100, 2.0)) for k in range(4)]
    # r1 still offered: one A100 among the H100s would slow them all, so nothing moves.
    assert replan_all([quote(h100), quote(a100)], held, r, remaining_hours=10) == []
    # r1 rests after a spike of preemptions (the market leaves it out): the whole world leaves.
    moves = replan_all([quote(a100)], held, r, remaining_hours=10)
    assert sorted(m.drain for m in moves) == ["i0", "i1", "i2", "i3"] and {m.add.offer.zone for m in moves} == {"r2a"}
    # Not to a world that would finish after budget.max_hours, nor for a saving under min_saving.
    late = recipe(**{"planner.min_saving": 0.25, "train.token_budget": 4_000_000_000, "budget.max_hours": 10})
    assert replan_all([quote(a100)], held, late, progress=Progress(hours=1.0)) == []
    assert replan_all([quote(offer("r2a", 9.0))], [(f"i{k}", quote(h100)) for k in range(4)], r,
                      remaining_hours=10) == []


def _launched(iid, zone, t, spot=True):
    return {"t": t, "type": "node_launched", "instance_id": iid, **offer(zone, 8.0, spot=spot).to_dict()}


def test_a_spot_vm_reclaimed_within_two_minutes_of_its_launch_rests_its_offer():
    """A zone that takes back a VM it granted a minute ago is running out: for a run that can fall
    back on on-demand the offer rests planner.capacity_cooldown_s (left out of the quotes), as after
    a refused launch; a VM that lived past two minutes, and on-demand, rest nothing."""
    p = recipe(**{"planner.capacity_cooldown_s": 300}).planner
    m = Market(p)
    a, b, a_od = offer("r1a", 8.0), offer("r1b", 9.0), offer("r1a", 8.0, spot=False)
    m.observe([_launched("x1", "r1a", 1000), {"t": 1060, "type": "node_preempted", "instance_id": "x1"},
               _launched("x2", "r1b", 1000), {"t": 1130, "type": "node_preempted", "instance_id": "x2"}])
    assert m.resting_after_reclaim(a, 1061) and not m.resting_after_reclaim(b, 1131)
    assert not m.resting_after_reclaim(a_od, 1061)
    # The early reclaim is the zone's refusal, not a hazard of the VMs that live there: r1a's risk
    # counts its minute but no preemption; r1b's VM, past the two minutes, counts one.
    w, prior = p.prior_weight_hours, p.preempt_per_hour_prior
    assert m.risk(a, 1200) == (pytest.approx(prior * w / (w + 60 / 3600)), "observed")
    assert m.risk(b, 1200) == (pytest.approx((prior * w + 1) / (w + 130 / 3600)), "observed")
    # A run that can fall back on on-demand (a deadline) waits the zone out, even when it is the
    # only one; a run without that fallback keeps renting where it can.
    assert [q.offer.zone for q in m.quotes([a, b], 1100, rest_reclaimed=True)] == ["r1b"]
    assert [q.offer.zone for q in m.quotes([a], 1100, rest_reclaimed=True)] == []
    assert [q.offer.zone for q in m.quotes([a, b], 1100)] == ["r1a", "r1b"]
    assert [q.offer.zone for q in m.quotes([a, b], 1359, rest_reclaimed=True)] == ["r1b"]
    assert [q.offer.zone for q in m.quotes([a, b], 1360, rest_reclaimed=True)] == ["r1a", "r1b"]
    # A notice within the two minutes counts the same (the driver's AWS VMs: notice, then the loss).
    m.observe([_launched("x1", "r1a", 1000), {"t": 1060, "type": "node_preempted", "instance_id": "x1"},
               _launched("x2", "r1b", 1000), {"t": 1130, "type": "node_preempted", "instance_id": "x2"},
               _launched("x3", "r1b", 2000), {"t": 2100, "type": "node_notice", "instance_id": "x3"},
               {"t": 2220, "type": "node_preempted", "instance_id": "x3"}])
    assert m.resting_after_reclaim(b, 2221) and not m.resting_after_reclaim(b, 2400)


def test_an_offer_reclaimed_early_twice_in_a_row_rests_longer():
    """A second reclaim within two minutes of the launch, with no VM there living past two minutes
    between, rests the offer EARLY_AGAIN_REST cooldowns from it; a VM that lives past two minutes
    (preempted later or released) ends the run of early reclaims: the next rests one cooldown."""
    from elastic.policy.market import EARLY_AGAIN_REST

    p = recipe(**{"planner.capacity_cooldown_s": 300}).planner
    a = offer("r1a", 8.0)
    events = [_launched("x1", "r1a", 1000), {"t": 1060, "type": "node_preempted", "instance_id": "x1"}]
    m = Market(p)
    m.observe(events)
    assert m.resting_after_reclaim(a, 1359) and not m.resting_after_reclaim(a, 1360)
    events += [_launched("x2", "r1a", 1400), {"t": 1430, "type": "node_preempted", "instance_id": "x2"}]
    m.observe(events)
    until = 1430 + EARLY_AGAIN_REST * 300
    assert EARLY_AGAIN_REST > 1 and m.resting_after_reclaim(a, until - 1) and not m.resting_after_reclaim(a, until)
    for end in ({"t": 3000, "type": "node_released", "instance_id": "x3"},
                {"t": 3000, "type": "node_preempted", "instance_id": "x3"}):
        later = events + [_launched("x3", "r1a", 2000), end,
                          _launched("x4", "r1a", 3100), {"t": 3150, "type": "node_preempted", "instance_id": "x4"}]
        m = Market(p)
        m.observe(later)
        assert m.resting_after_reclaim(a, 3449) and not m.resting_after_reclaim(a, 3450), end



def test_a_reclaim_rests_its_offer_once_the_runs_relaunches_were_taken_young():
    """A VM taken after two minutes rests nothing until the run has seen a relaunch (a spot VM
    rented there within a cooldown and two minutes of such a reclaim) taken young; while more
    relaunches were taken young than lived, any reclaim rests its offer planner.capacity_cooldown_s.
    A relaunch that lives past two minutes counts against it; one let go younger, or a launch
    outside the window, counts in neither."""
    p = recipe(**{"planner.capacity_cooldown_s": 300}).planner
    a, b, b_od = offer("r1a", 8.0), offer("r1b", 9.0), offer("r1b", 9.0, spot=False)
    events = [_launched("x1", "r1a", 0), {"t": 1000, "type": "node_preempted", "instance_id": "x1"}]
    m = Market(p)
    m.observe(events)
    assert m.relaunches() == (0, 0) and not m.resting_after_reclaim(a, 1001)
    # Rented at once where the zone still offered room, and taken within a minute.
    events += [_launched("x2", "r1a", 1000), {"t": 1050, "type": "node_preempted", "instance_id": "x2"}]
    m.observe(events)
    assert m.relaunches() == (1, 0)
    # Now a reclaim of a VM that lived an hour rests its offer too, for a run that can wait it out.
    events += [_launched("x3", "r1b", 2000), {"t": 5600, "type": "node_preempted", "instance_id": "x3"}]
    m.observe(events)
    assert m.resting_after_reclaim(b, 5899) and not m.resting_after_reclaim(b, 5900)
    assert not m.resting_after_reclaim(b_od, 5700)
    assert [q.offer.zone for q in m.quotes([a, b], 5700, rest_reclaimed=True)] == ["r1a"]
    assert [q.offer.zone for q in m.quotes([a, b], 5700)] == ["r1a", "r1b"]
    # A relaunch rented as the rest ends that lives (released after five minutes): one each, and
    # the next reclaim rests nothing.
    events += [_launched("x4", "r1b", 5900), {"t": 6200, "type": "node_released", "instance_id": "x4"}]
    m.observe(events)
    assert m.relaunches() == (1, 1)
    events += [_launched("x5", "r1a", 7000), {"t": 9000, "type": "node_preempted", "instance_id": "x5"}]
    m.observe(events)
    assert not m.resting_after_reclaim(a, 9001)
    # Let go within its first two minutes: neither; rented past the window and taken young: neither
    # (the early reclaim rests its offer by its own rule).
    events += [_launched("x6", "r1a", 9010), {"t": 9050, "type": "node_released", "instance_id": "x6"},
               _launched("x7", "r1a", 9000 + 300 + 121), {"t": 9450, "type": "node_preempted", "instance_id": "x7"}]
    m.observe(events)
    assert m.relaunches() == (1, 1) and m.resting_after_reclaim(a, 9451)

def test_a_spot_offer_that_shows_no_capacity_is_believed_to_hold_what_the_run_held_when_it_refused():
    """AWS and GCP show no spot capacity. A launch refused for capacity while the run holds n VMs of
    the offer says it held n (`capacity_learned`), until CAPACITY_MEMORY_S after that refusal; a
    launch granted there beyond it makes its room unknown again. A refusal with none held, or a VM
    the zone takes back, says the zone is out now: the belief is not used until a launch there is
    granted again. An offer that shows its capacity, an on-demand refusal and a failed launch
    teach nothing."""
    from elastic.policy.market import CAPACITY_MEMORY_S

    p = recipe().planner
    a, b = offer("r1a", 8.0), offer("r1b", 9.0)

    def refused(zone, t, spot=True):
        return {"t": t, "type": "capacity_error", "zone": zone, "instance_type": "a100x8", "message": "full",
                "spot": spot}

    events = [_launched("x1", "r1a", 0), refused("r1a", 10), refused("r1b", 10)]
    m = Market(p)
    m.observe(events)
    assert m.capacity_learned(a, 20) == 1 and m.capacity_learned(b, 20) is None   # none held in r1b
    assert [q.capacity_learned for q in m.quotes([a, b], 20)] == [1, None]
    lapse = 10 + CAPACITY_MEMORY_S
    assert m.capacity_learned(a, lapse - 1) == 1 and m.capacity_learned(a, lapse) is None
    shown = dataclasses.replace(a, capacity=3)
    assert m.capacity_learned(shown, 20) is None and m.quote(shown, 20).capacity == 3
    # Let go, the belief stands; a refusal with none held puts it aside until a launch is granted.
    events += [{"t": 100, "type": "node_released", "instance_id": "x1"}]
    m.observe(events)
    assert m.capacity_learned(a, 200) == 1
    events += [refused("r1a", 300)]
    m.observe(events)
    assert m.capacity_learned(a, 400) is None
    events += [_launched("x2", "r1a", 600)]
    m.observe(events)
    assert m.capacity_learned(a, 700) == 1
    # Granted beyond it: it had more room than believed, so its room is unknown again.
    events += [_launched("x3", "r1a", 800)]
    m.observe(events)
    assert m.capacity_learned(a, 900) is None
    # Refused beside both: two. Then the zone takes one back: out now, until a launch is granted.
    events += [refused("r1a", 1000)]
    m.observe(events)
    assert m.capacity_learned(a, 1001) == 2
    events += [{"t": 1100, "type": "node_preempted", "instance_id": "x3"}]
    m.observe(events)
    assert m.capacity_learned(a, 1101) is None
    events += [_launched("x5", "r1a", 1200)]
    m.observe(events)
    assert m.capacity_learned(a, 1201) == 2
    # A launch granted after the belief lapsed does not bring it back.
    events += [{"t": 1300, "type": "node_released", "instance_id": "x5"},
               _launched("x6", "r1a", 1000 + CAPACITY_MEMORY_S)]
    m.observe(events)
    assert m.capacity_learned(a, 1001 + CAPACITY_MEMORY_S) is None
    # The driver launches in the background: a refusal that comes while the run's own launch of
    # the offer is still under way (`in_flight`) counts that one too.
    driver = Market(p)
    driver.observe([{**refused("r1b", 50), "in_flight": 1}])
    assert driver.capacity_learned(b, 60) == 1
    # On-demand refusals and failed launches say nothing of spot capacity.
    events += [_launched("x4", "r1b", 5000), refused("r1b", 5010, spot=False),
               {"t": 5010, "type": "launch_failed", "zone": "r1b", "instance_type": "a100x8", "message": "boom"}]
    m.observe(events)
    assert m.capacity_learned(b, 5020) is None


def test_market_learns_risk_and_cools_regions_and_offers(tmp_path):
    p = recipe(**{"planner.preempt_per_hour_prior": 0.2, "planner.prior_weight_hours": 4,
                  "planner.region_cooldown_preemptions": 2, "planner.region_cooldown_s": 1000}).planner
    m = Market(p)
    a, b = offer("r1a", 8.0), offer("r2a", 9.0)
    assert m.risk(a, 0) == (0.2, "prior")
    assert m.risk(offer("r1a", 8.0, spot=False), 0) == (0.0, "on-demand")
    events = [_launched("x1", "r1a", 0), _launched("x2", "r1a", 0),
              {"t": 3600, "type": "node_notice", "instance_id": "x1"},
              {"t": 3700, "type": "node_preempted", "instance_id": "x1"},   # one preemption, counted once
              {"t": 4 * 3600, "type": "node_released", "instance_id": "x2"}]
    m.observe(events)
    rate, source = m.risk(a, 4 * 3600)
    # (0.2 × 4 + 1 preemption) / (4 + 3700 s + 4 h of node time)
    assert source == "observed" and rate == pytest.approx((0.8 + 1) / (4 + 3700 / 3600 + 4))
    assert m.risk(b, 0) == (0.2, "prior")
    # Two preemptions within the window cool region r1 down: r2 first, r1 when nothing else is left.
    # (Each VM held ten minutes first: one reclaimed within two minutes of its launch rests its
    # offer, below.)
    events += [_launched("x3", "r1a", 5 * 3600 - 600), {"t": 5 * 3600 + 10, "type": "node_preempted", "instance_id": "x3"}]
    m.observe(events)
    now = 5 * 3600 + 20
    assert m.cooled_regions(now) == set()    # 3700 s and 18010 s are not within one hour
    events += [_launched("x4", "r1a", now - 600), {"t": now + 5, "type": "node_preempted", "instance_id": "x4"}]
    m.observe(events)
    assert m.cooled_regions(now + 10) == {"r1"}
    assert [q.offer.zone for q in m.quotes([a, b], now + 10)] == ["r2a"]
    assert [q.offer.zone for q in m.quotes([a], now + 10)] == ["r1a"]
    assert [q.offer.zone for q in m.quotes([a, b], now + 2000)] == ["r1a", "r2a"]
    assert not m.resting_after_reclaim(a, now + 10)
    # Observations carry over to later runs through the history file.
    path = tmp_path / "h.json"
    save_history(m.stats(now + 60), path)
    save_history(m.stats(now + 60), path)
    hist = load_history(path)
    key = ("aws", "r1", "r1a", "a100x8")
    assert hist[key][1] == 2 * 3
    later = Market(p, hist)
    assert later.risk(a, 0)[0] == pytest.approx((0.8 + 6) / (4 + hist[key][0]))
    (tmp_path / "bad.json").write_text("{not json")
    assert load_history(tmp_path / "bad.json") == {}


def test_ranking_key_is_usd_per_useful_token():
    r = recipe()
    q = quote(offer("r1a", 8.64), risk=0.0)
    # 24,000 tokens/s for $8.64/h: 8.64 / (24000 × 3600) × 1e6 = $0.1 per 1M tokens.
    assert usd_per_mtok(q, r) == pytest.approx(0.1)


def test_measured_throughput_replaces_the_recipe_figure():
    r = recipe()   # the recipe says 3000 tokens/s per A100: every 8×A100 VM 24,000
    m = Market(r.planner, tokens_per_inner_step=1000)
    slow, fast, unrun = offer("r1a", 8.0, it="p4d"), offer("r2a", 10.0, it="a2"), offer("r3a", 9.0, it="g2")
    assert m.quote(slow, 0).tokens_per_s is None
    before = plan([m.quote(o, 0) for o in (slow, fast)], r)
    assert places(before) == [("r1a", "p4d")] * 4          # same speed on paper: cheaper per hour wins
    events = [_launched("v1", "r1a", 0) | {"instance_type": "p4d"}, _launched("v2", "r2a", 0) | {"instance_type": "a2"},
              {"t": 1, "type": "replica_starting", "replica": 0, "instance_id": "v1"},
              {"t": 1, "type": "replica_starting", "replica": 1, "instance_id": "v2"},
              # as a ledger read back from JSON: replica ids are strings
              {"t": 9, "type": "outer_step", "steps_done": {"0": 6, "1": 6}, "inner_s_by_replica": {"0": 0.5, "1": 0.25}},
              {"t": 19, "type": "outer_step", "steps_done": {0: 6, 1: 3}, "inner_s_by_replica": {0: 0.5, 1: 0.125}}]
    m.observe(events)
    assert m.measured_tokens_per_s() == {("aws", "p4d"): pytest.approx(12000.0), ("aws", "a2"): pytest.approx(24000.0)}
    assert m.quote(slow, 20).tokens_per_s == pytest.approx(12000.0)
    # A type not run yet: the recipe's figure scaled like the measured ones (geometric mean of 0.5 and 1).
    assert m.quote(unrun, 20).tokens_per_s == pytest.approx(24000 * 0.5 ** 0.5)
    # Measured at half the recipe's speed, p4d costs twice as much per token: the world goes to a2.
    after = plan([m.quote(o, 20) for o in (slow, fast)], r)
    assert places(after) == [("r2a", "a2")] * 4
    assert after.to_dict(r)["placement"][0]["tokens_per_s"] == pytest.approx(24000.0)


def test_known_capacity_of_an_offer_reaches_the_plan():
    r = recipe()
    cheap_out = Offer(**{**offer("r1a", 5.0).to_dict(), "capacity": 0})       # a stock-out
    cheap_two = Offer(**{**offer("r2a", 6.0).to_dict(), "capacity": 2})
    dear = offer("r3a", 9.0)                                                   # capacity unknown
    qs = Market(r.planner).quotes([cheap_out, cheap_two, dear], 0.0)
    assert [q.capacity for q in qs] == [0, 2, None]
    assert places(plan(qs, r)) == [("r2a", "a100x8")] * 2 + [("r3a", "a100x8")] * 2


def test_budget_max_hours_buys_faster_gpus_or_more_replicas_only_when_needed():
    from elastic.policy.planner import Progress, hours_to_finish

    # 8×A100 at 24,000 tokens/s, cheapest per token; 8×H100 at 60,000, 25 % dearer per token.
    a100 = quote(offer("r1a", 8.64), capacity=6)                       # $0.100 per 1M tokens
    h100 = quote(offer("r1b", 27.0, it="h100x8", gpu="H100"))          # $0.125 per 1M tokens
    base = {"train.token_budget": 4 * 24000 * 3600 * 10, "train.outer_steps": "null", "world.replicas": 4,
            "world.max_replicas": 6, "planner.recovery_s": 0, "planner.deadline_slack": 0}
    loose = recipe(**base, **{"budget.max_hours": 20})
    assert places(plan([a100, h100], loose)) == [("r1a", "a100x8")] * 4          # 10 h: fits
    # 7.5 h: four A100s would take 10 h, five 8 h; six take 6.7 h and cost the same per token.
    grown = plan([a100, h100], recipe(**base, **{"budget.max_hours": 7.5}))
    assert places(grown) == [("r1a", "a100x8")] * 6
    # 5 h: no A100 world fits (at most six replicas); four H100s take 4 h.
    fast = plan([a100, h100], recipe(**base, **{"budget.max_hours": 5}))
    assert places(fast) == [("r1b", "h100x8")] * 4
    assert hours_to_finish(fast, recipe(**base)) == pytest.approx(4.0, rel=0.01)
    # 2 h: nothing fits; the world that finishes first (six H100s) and a warning.
    tight = plan([a100, h100], recipe(**base, **{"budget.max_hours": 2}))
    assert places(tight) == [("r1b", "h100x8")] * 6 and any("max_hours" in w for w in tight.warnings)
    # Half-way through, with 4.5 h of 9 gone: four A100s need 5 h for the rest, five 4 h;
    # with 6 h gone, only H100s finish the rest (2 h for four) in time.
    mid = recipe(**base, **{"budget.max_hours": 9})
    half = mid.train.token_budget // 2
    assert places(plan([a100, h100], mid, progress=Progress(tokens=half, hours=4.5))) == [("r1a", "a100x8")] * 5
    assert places(plan([a100, h100], mid, progress=Progress(tokens=half, hours=6.0))) == [("r1b", "h100x8")] * 4
    assert hours_to_finish(fast, mid, Progress(tokens=half)) == pytest.approx(2.0, rel=0.01)
    # A run counted in outer steps takes as long with more replicas: it stays at world.replicas.
    steps = recipe(**{**base, "train.token_budget": "null", "train.outer_steps": 1000, "budget.max_hours": 1})
    assert len(plan([a100], steps).quotes) == 4



def test_the_estimate_bills_each_vm_its_clouds_minimum():
    # One replica on a VM preempted every 10 s on average for about 100 s: about eleven VMs, each
    # billed gcp's one-minute minimum, not the 100 s held.
    r = recipe(**{"world.replicas": 1, "world.min_replicas": 1, "planner.recovery_s": 0,
                  "train.token_budget": 2_400_000, "train.inner_steps": 1, "train.batch_size": 1})
    pl = evaluate([quote(offer("r1a", 36.0, cloud="gcp"), risk=360.0)], r)
    vms = 1 + 360.0 * pl.expected_hours
    assert pl.expected_usd == pytest.approx(vms * 60 * 36.0 / 3600, rel=1e-6)
    assert pl.expected_usd > 5 * pl.usd_per_hour * pl.expected_hours
    # On a cloud billing per second from the first, the hours at the price (each VM's last second
    # rounded up).
    local = evaluate([quote(offer("r1a", 36.0, cloud="local"), risk=360.0)], r)
    assert local.usd_per_hour * local.expected_hours <= local.expected_usd < pl.expected_usd / 5


def test_the_estimate_takes_off_what_aws_does_not_bill_of_the_spot_vms_it_takes_in_their_first_hour():
    import math

    r = recipe(**{"world.replicas": 1, "world.min_replicas": 1, "planner.recovery_s": 0,
                  "train.token_budget": 2_400_000_000, "train.inner_steps": 1, "train.batch_size": 1})
    by = {(cloud, risk, spot): evaluate([quote(offer("r1a", 9.0, cloud=cloud, spot=spot), risk=risk)], r)
          for cloud in ("aws", "gcp") for risk in (0.0, 1.0, 0.01) for spot in (True, False)}
    hours = by["gcp", 1.0, True].expected_hours
    assert hours > 20
    # Reclaimed once an hour: of the lives that end in a preemption (all but the last), the share of
    # time in lives under an hour, 1 − 2/e, is not billed on AWS; GCP bills it all.
    ended = hours - (1 - math.exp(-hours))
    assert by["aws", 1.0, True].expected_usd == pytest.approx(
        by["gcp", 1.0, True].expected_usd - ended * (1 - 2 / math.e) * 9.0, rel=1e-6)
    # Never reclaimed, rarely reclaimed, or on demand: next to nothing, or nothing, taken off.
    assert by["aws", 0.0, True].expected_usd == by["gcp", 0.0, True].expected_usd
    assert by["aws", 0.01, True].expected_usd > 0.9999 * by["gcp", 0.01, True].expected_usd
    assert by["aws", 1.0, False].expected_usd == by["gcp", 1.0, False].expected_usd


def test_measured_links_replace_the_cross_region_guess_per_pair():
    """Once the run measured a pair of sites (link_measured) and knows how many bytes a sync sends
    (outer_step), that pair costs what the measurement says; an unmeasured pair keeps the guess."""
    from elastic.policy.market import link_sync_s, measured_links
    from elastic.record.events import read

    # 100 MB per sync over 800 Mbit/s with 40 ms RTT: 2 × 0.8 Gbit / 0.8 Gbit/s + 2 × 0.04 s.
    assert link_sync_s(40.0, 800.0, 100_000_000) == pytest.approx(2.0 + 0.08)
    records = [{"site": "aws/r1", "peer_site": "aws/r2", "rtt_ms": 100.0, "mbit_s": 10.0},
               {"site": "aws/r2", "peer_site": "aws/r1", "rtt_ms": 40.0, "mbit_s": 800.0},   # newest wins
               {"site": "aws/r1", "peer_site": "aws/r1", "rtt_ms": 1.0, "mbit_s": 9000.0}]   # same site: no cost
    links = read([{"type": "link_measured", "t": 1.0, **r} for r in records])
    assert measured_links(links, None) == {}      # no sync yet: nothing to price, the guess stays
    got = measured_links(links, 100_000_000)
    assert got == {frozenset(("aws/r1", "aws/r2")): pytest.approx(2.08)}
    r = recipe(**{"planner.cross_region_sync_s": 20})
    a, b, g = offer("r1a", 8.0), offer("r2a", 8.0), offer("r9a", 8.0, cloud="gcp")
    assert evaluate([quote(a), quote(b)], r).sync_penalty_s == 20                # guessed
    measured = [Quote(o, 0.0, "prior", links=got) for o in (a, b)]
    assert evaluate(measured, r).sync_penalty_s == pytest.approx(2.08)           # measured
    # A third site not measured against the others: the slowest pair (its guess, 2 × 20 across clouds) rules.
    assert evaluate(measured + [Quote(g, 0.0, "prior", links=got)], r).sync_penalty_s == 40
    # The market hands the measurement to every quote once a sync told it the bytes.
    m = Market(r.planner)
    m.observe([{"type": "link_measured", "t": 1.0, **records[1]},
               {"type": "outer_step", "t": 2.0, "bytes_sent": 100_000_000}])
    assert m.quote(a, 3.0).links == got
