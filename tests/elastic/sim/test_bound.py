"""`elastic.sim.bound`: the least any policy could pay on a trace, checked on markets whose answer is
known by hand, and against the simulator's own policies."""

from __future__ import annotations

import math

import pytest

from elastic.sim.bound import lower_bound_usd_per_mtok
from elastic.sim.simulate import TraceMarket, simulate
from providers.simmarket import read_trace_rows
from tests.elastic.sim.test_simulate import recipe, row, write_trace

TPS = 24_000          # tokens/s of an 8×A100 VM in these recipes (3000 per GPU)
N = 2_000_000_000     # tokens the run trains


def bound(r, trace, finish_h=None):
    return lower_bound_usd_per_mtok(r, TraceMarket(read_trace_rows(trace), r), finish_h)


def raw(usd_per_hour):
    return usd_per_hour / (TPS * 3600) * 1e6


def hourly(tmp_path, name, offers, hours=400):
    """A trace of constant offers, one row per offer per hour."""
    return write_trace(tmp_path / name, [row(h * 3600, *o[:2], **o[2]) for h in range(hours) for o in offers])


def test_free_boots_and_no_preemption_give_the_cheapest_price(tmp_path):
    trace = hourly(tmp_path, "t.csv", [("r1a", 9.0, {}), ("r2a", 12.0, {})])
    assert bound(recipe(**{"planner.recovery_s": 0}), trace) == pytest.approx(raw(9.0), rel=1e-4)


def test_boots_and_preemptions_raise_it_but_not_past_a_known_schedule(tmp_path):
    calm = hourly(tmp_path, "calm.csv", [("r1a", 9.0, {})])
    risky = hourly(tmp_path, "risky.csv", [("r1a", 9.0, {"rate": 0.5})])
    r = recipe()
    # One VM booted once and kept: 9 $/h for N/TPS + 600 s; no policy pays less, the bound no more.
    one_vm = 9.0 * (N / TPS + 600) / 3600 / N * 1e6
    assert raw(9.0) < bound(r, calm) <= one_vm
    # Every preemption means paying another boot.
    assert bound(r, risky) > bound(r, calm)


def test_a_vm_preempted_within_its_clouds_minimum_bills_the_minimum(tmp_path):
    # No boot; a VM lives a minute on average (60 preemptions per hour). Billed per second from the
    # first (local), each VM bills the rest of the second it was preempted in (c s, about half of
    # one) for every 60 s it is expected to live; on gcp it also bills the seconds short of its
    # one-minute minimum, E[(60 − τ)⁺] = 60/e s, and the rest of its second only when it lived
    # past the minimum (probability 1/e).
    from elastic.sim.bound import _mean_rounding_s

    c = float(_mean_rounding_s(60.0, 1.0))
    r = recipe(**{"planner.recovery_s": 0})
    per_second = [row(h * 3600, "r1a", 9.0, rate=60.0, cloud="local") for h in range(400)]
    with_minimum = [row(h * 3600, "r1a", 9.0, rate=60.0, cloud="gcp") for h in range(400)]
    local = bound(r, write_trace(tmp_path / "local.csv", per_second))
    gcp = bound(r, write_trace(tmp_path / "gcp.csv", with_minimum))
    assert 0.5 < c < 0.51
    assert local == pytest.approx(raw(9.0) * (1 + c / 60), rel=1e-4)
    assert gcp == pytest.approx(raw(9.0) * (1 + math.exp(-1) * (1 + c / 60)), rel=1e-3)


def test_capacity_sends_the_rest_to_the_dearer_offer(tmp_path):
    # The cheap offer holds one VM; the run needs more than one VM trains by the deadline, so the
    # rest is trained at 15 $/h. Known optimum (no boots): the cheap VM all the time, the rest dear.
    trace = hourly(tmp_path, "t.csv", [("r1a", 9.0, {"cap": 1}), ("r2a", 15.0, {})], hours=20)
    hours = 10
    r = recipe(**{"planner.recovery_s": 0, "budget.max_hours": hours})
    cheap_tokens = TPS * hours * 3600
    best = (9.0 * hours + 15.0 * (N - cheap_tokens) / TPS / 3600) / N * 1e6
    assert raw(9.0) < bound(r, trace) <= best * (1 + 1e-9)
    assert bound(r, trace) == pytest.approx(best, rel=1e-6)


def test_a_deadline_spot_alone_cannot_meet_prices_the_on_demand_rest(tmp_path):
    # One spot VM at 9 $/h (capacity 1), on-demand at 30 $/h: within a 10 h deadline spot alone
    # trains too little, so a spot recipe with that deadline trains the rest on on-demand (its
    # deadline rule's fallback). Known optimum (no boots): the spot VM all the time, the rest on
    # demand. Without the deadline the bound has only spot, and spot cannot do it in 10 h.
    trace = hourly(tmp_path, "t.csv", [("r1a", 9.0, {"cap": 1, "od": 30.0})], hours=20)
    hours = 10
    r = recipe(**{"planner.recovery_s": 0, "budget.max_hours": hours})
    spot_tokens = TPS * hours * 3600
    best = (9.0 * hours + 30.0 * (N - spot_tokens) / TPS / 3600) / N * 1e6
    assert bound(r, trace) == pytest.approx(best, rel=1e-6)
    assert bound(recipe(**{"planner.recovery_s": 0}), trace, finish_h=hours) == float("inf")
    # No policy of the simulator pays less.
    for res in simulate(r, trace, None, seed=0):
        if res["status"] == "completed":
            assert res["list_usd_per_mtok"] >= bound(r, trace) * (1 - 1e-6), res


def test_too_little_time_is_infinite(tmp_path):
    trace = hourly(tmp_path, "t.csv", [("r1a", 9.0, {"cap": 1})], hours=10)
    assert bound(recipe(), trace, finish_h=5) == float("inf")


def test_no_policy_beats_it(tmp_path):
    # No preemptions: the simulator's runs are not random, so each must cost at least the bound.
    # Prices step up 30 % and 60 % every 3.5 h, by turns, over 20 h (the runs take about 6; the
    # bound's time grows with the trace's length).
    zones = (("r1a", 9.0), ("r2a", 10.5), ("r3a", 12.0))
    trace = write_trace(tmp_path / "t.csv", [row(h * 1800, z, p * (1 + 0.3 * ((h // 7) % 3)), cap=4)
                                             for h in range(40) for z, p in zones])
    r = recipe()
    least = bound(r, trace)
    for res in simulate(r, trace):
        assert res["status"] == "completed" and res["wall_h"] < 20
        assert res["list_usd_per_mtok"] >= least * (1 - 1e-3), res


def test_a_vm_preempted_mid_increment_bills_the_rest_of_it(tmp_path, monkeypatch):
    # Billed per 10 minutes past the same one-minute minimum, each VM preempted in its first hour
    # also bills the rest of the increment it was preempted in: the bound rises, never falls.
    from providers.base import BillingTerms
    from providers.gcp import facts

    r = recipe(**{"planner.recovery_s": 0})
    trace = write_trace(tmp_path / "gcp.csv", [row(h * 3600, "r1a", 9.0, rate=6.0, cloud="gcp") for h in range(400)])
    per_second = bound(r, trace)
    monkeypatch.setattr(facts, "BILLING", BillingTerms(minimum_s=60.0, increment_s=600.0))
    per_ten_minutes = bound(r, trace)
    assert per_ten_minutes > per_second * 1.01
    # At most one whole increment more per VM: a VM lives 10 min on average at 6 preemptions per hour.
    assert per_ten_minutes < per_second * 2


def test_the_min_replicas_floor_prices_the_worlds_spot_cannot_hold_alone(tmp_path):
    """Two zones of one spot VM each, never both at once, and on-demand at 30 $/h: a world of
    world.min_replicas = 2 trains only as a spot/on-demand pair (39 $/h for two VMs), which the
    floor says, while the plain bound (no world.min_replicas) trains each spot VM alone (9 $/h).
    With both zones at once for long enough, two spot VMs make the world and the floor is spot's."""
    from elastic.sim.bound import min_replicas_floor_usd_per_mtok

    hours = 400
    # A zone with no capacity takes its VM at 60 per hour (the traces' fall to 0): capacity bounds
    # launches only, a VM held through a fall goes through the hazard.
    apart = write_trace(tmp_path / "apart.csv", [row(h * 3600, z, 9.0, cap=int((h + k) % 2 == 0),
                                                     rate=60.0 * ((h + k) % 2))
                                                 for h in range(hours) for k, z in enumerate(("r1a", "r1b"))])
    together = write_trace(tmp_path / "together.csv", [row(h * 3600, z, 9.0, cap=1)
                                                       for h in range(hours) for z in ("r1a", "r1b")])
    r = recipe(**{"planner.recovery_s": 0, "world.min_replicas": 2, "budget.max_hours": hours})

    def floor(trace):
        return min_replicas_floor_usd_per_mtok(r, TraceMarket(read_trace_rows(trace), r))

    assert floor(apart) == pytest.approx(raw((9.0 + 30.0) / 2), rel=1e-4)
    assert bound(r, apart) <= raw(9.0) * 1.001 < floor(apart)
    assert floor(together) == pytest.approx(raw(9.0), rel=1e-4)
    # A lower bound still: no policy of the simulator pays less per token on either trace.
    for trace in (apart, together):
        for res in simulate(r, trace, None, seed=0):
            if res["status"] == "completed":
                assert res["list_usd_per_mtok"] >= floor(trace) * (1 - 1e-6), res


def test_the_bound_that_keeps_min_replicas_prices_each_members_boot(tmp_path):
    """The same two zones that never hold a VM at once, now with 15-minute boots: each hour's spot
    VM is a fresh boot and trains 45 minutes of it (9 $). A world of world.min_replicas = 2 needs an
    on-demand member (30 $/h) beside it; in expectation the program may hold that member exactly
    while the spot VM trains (three quarters of the time, no boot), so its optimum is 9 + 0.75·30 $
    for 1.5 hours of a VM's tokens: 21 $ per VM-hour. The floor pairs them but boots nothing (19.5);
    the plain bound trains a spot VM alone (9 $ per 45 minutes, 12). With world.min_replicas = 1 the
    bound that keeps it is the plain bound. No policy of the simulator pays less."""
    from elastic.sim.bound import min_replicas_floor_usd_per_mtok

    hours = 400
    apart = write_trace(tmp_path / "apart.csv", [row(h * 3600, z, 9.0, cap=int((h + k) % 2 == 0),
                                                     rate=60.0 * ((h + k) % 2))
                                                 for h in range(hours) for k, z in enumerate(("r1a", "r1b"))])
    r = recipe(**{"planner.recovery_s": 900, "world.min_replicas": 2, "budget.max_hours": hours})
    market = TraceMarket(read_trace_rows(apart), r)
    kept = lower_bound_usd_per_mtok(r, market, keep_min_replicas=True)
    assert kept == pytest.approx(raw((9.0 + 0.75 * 30.0) / 1.5), rel=2e-3)   # the first hour's boots: +0.03 %
    assert kept > 1.07 * min_replicas_floor_usd_per_mtok(r, market) and kept > 1.7 * bound(r, apart)
    one = recipe(**{"planner.recovery_s": 900, "world.min_replicas": 1, "budget.max_hours": hours})
    assert lower_bound_usd_per_mtok(one, market, keep_min_replicas=True) == pytest.approx(bound(one, apart), rel=1e-9)
    for res in simulate(r, apart, None, seed=0):
        if res["status"] == "completed":
            assert res["list_usd_per_mtok"] >= kept * (1 - 1e-6), res


def test_rows_shorter_than_a_boot_still_let_the_bound_that_keeps_min_replicas_boot(tmp_path):
    """Two calm zones of one spot VM each, restated every two minutes (a trace polled that often),
    and 10-minute boots: booting both VMs at once and training them together costs two boots and half
    the run's VM-hours at 9 $/h. A booted VM trains nothing in a two-minute row, and the bound's
    per-row cap must say so, not charge the boot's debt to that row (which left a zone that starts
    empty unable to boot at all: no bound, as if no policy could train the run). The run needs
    11.6 hours of the two VMs."""
    from elastic.sim.bound import min_replicas_floor_usd_per_mtok
    from elastic.sim.simulate import min_replicas_bound_usd_per_mtok

    hours = 16
    trace = write_trace(tmp_path / "minutes.csv", [row(m * 120, z, 9.0, cap=1, od=30.0)
                                                   for m in range(hours * 30) for z in ("r1a", "r1b")])
    r = recipe(**{"planner.recovery_s": 600, "world.min_replicas": 2, "world.replicas": 2,
                  "budget.max_hours": hours})
    market = TraceMarket(read_trace_rows(trace), r)
    kept = lower_bound_usd_per_mtok(r, market, keep_min_replicas=True)
    plan = 2 * (600 + N / (2 * TPS)) * 9.0 / 3600 / (N / 1e6)     # both booted at 0, trained together
    assert math.isfinite(kept) and min_replicas_floor_usd_per_mtok(r, market) * (1 - 1e-6) <= kept <= plan
    assert min_replicas_bound_usd_per_mtok(r, trace) == pytest.approx(kept, rel=1e-9)
    for res in simulate(r, trace, None, seed=0):
        if res["status"] == "completed":
            assert res["list_usd_per_mtok"] >= kept * (1 - 1e-6), res


def test_a_trace_shorter_than_the_deadline_holds_its_last_row_to_the_deadline(tmp_path):
    """The simulator replays a trace's last row for ever; so must the bounds. Two calm zones of one
    spot VM each, written for 2 hours, and a 16-hour deadline: the run needs 11.6 hours of the two
    VMs, which they hold after the trace ends. The bounds used to stop one row past its end, where
    no schedule could train the run (an infinite bound, or on a longer trace one that forced
    on-demand VMs: $174 against the $82 `elastic` paid on a 12-hour trace, docs/benchmarks.md,
    session 44)."""
    from elastic.sim.simulate import min_replicas_bound_usd_per_mtok

    trace = write_trace(tmp_path / "short.csv", [row(m * 600, z, 9.0, cap=1, od=30.0)
                                                 for m in range(12) for z in ("r1a", "r1b")])
    r = recipe(**{"world.min_replicas": 2, "world.replicas": 2, "budget.max_hours": 16})
    plan = 2 * (r.planner.recovery_s + N / (2 * TPS)) * 9.0 / 3600 / (N / 1e6)   # both booted at 0, trained together
    plain, kept = bound(r, trace), min_replicas_bound_usd_per_mtok(r, trace)
    assert math.isfinite(plain) and plain <= kept * (1 + 1e-9) and kept <= plan * (1 + 1e-6), (plain, kept, plan)
    runs = [res for res in simulate(r, trace, None, seed=0) if res["status"] == "completed"]
    assert runs
    for res in runs:
        assert res["list_usd_per_mtok"] >= kept * (1 - 1e-6), res
