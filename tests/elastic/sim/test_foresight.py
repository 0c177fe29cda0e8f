"""bench/foresight.py: the twins are one market until they part, the floor is what the hand
argument says on the calmest market, it never claims more than bound.py allows, and no policy the
simulator runs comes in under it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bench.foresight import floor, slot_floor, still, token_floor, twins
from elastic.recipe.model import load_recipe
from elastic.sim.simulate import POLICIES, TraceMarket, simulate
from providers.simmarket import MarketState, TraceRow, read_trace_rows

ROOT = Path(__file__).resolve().parents[3]
AT_S = 24 * 3600.0


@pytest.fixture(scope="module")
def recipe():
    return load_recipe(ROOT / "recipes/multi-cloud.yaml")      # 12 B tokens, 6 replicas at most, 48 h deadline


def _calm_east():
    """calm.csv's four us-east-1 offers (preemptions and capacities as there): a quicker bound."""
    return [r for r in read_trace_rows(ROOT / "bench/traces/calm.csv") if r.region == "us-east-1"]


def test_the_twins_are_one_market_until_they_part_then_move_by_the_factor(recipe):
    row = TraceRow(t=0.0, cloud="aws", region="us-east-1", zone="z", instance_type="p4d.24xlarge", gpu="A100",
                   gpus=8, state=MarketState(10.0, 32.0, 0.1, 5))
    later = dataclasses.replace(row, t=3600.0, state=MarketState(20.0, 32.0, 0.2, 3))
    sparse = dataclasses.replace(row, zone="y", state=MarketState(12.0, 16.0, 0.0, 2))   # one row, held for ever
    down, up = twins([row, later, sparse], 1800.0, 2.0)
    for m in (TraceMarket(down, recipe), TraceMarket(up, recipe)):
        assert {o.zone: o.usd_per_hour for o in m.offers(1799.0, True)} == {"z": 10.0, "y": 12.0}
    d, u = TraceMarket(down, recipe), TraceMarket(up, recipe)
    assert {o.zone: o.usd_per_hour for o in d.offers(1800.0, True)} == {"z": 5.0, "y": 6.0}
    assert {o.zone: o.usd_per_hour for o in u.offers(1800.0, True)} == {"z": 20.0, "y": 16.0}   # y: on-demand caps it
    assert {o.zone: o.usd_per_hour for o in u.offers(7200.0, True)} == {"z": 32.0, "y": 16.0}
    assert d.state("z", "p4d.24xlarge", 7200.0).preempt_per_hour == 0.2             # only prices move


def test_on_the_calmest_market_a_lasting_move_of_half_is_worth_more_than_fifteen_percent(recipe):
    calmest = still(read_trace_rows(ROOT / "bench/traces/calm.csv"))
    down, up = (TraceMarket(t, recipe) for t in twins(calmest, AT_S, 1.5))
    got = floor(recipe, down, up, AT_S, token_floor)
    # By hand (bench/foresight.py): 1 + (f − 1)·x on the down twin, x + (1 − x)·f on the up twin,
    # least at x = 1/2: (1 + f) / 2 = 1.25, less what the bound pays for its boots.
    assert 1.22 < got["floor"] <= 1.25
    assert got["share_before"] == pytest.approx(0.5, abs=0.01)
    assert floor(recipe, down, up, AT_S, slot_floor, known=got)["floor"] == pytest.approx(got["floor"], abs=0.01)


def test_with_nothing_moving_the_floor_claims_nothing_above_the_bound(recipe):
    rows = _calm_east()
    one, same = (TraceMarket(t, recipe) for t in twins(rows, AT_S, 1.0))
    by_tokens = floor(recipe, one, same, AT_S, token_floor)
    assert by_tokens["floor"] <= 1.0
    assert floor(recipe, one, same, AT_S, slot_floor, known=by_tokens)["floor"] <= 1.0


def test_no_policy_comes_in_under_the_floor_on_its_worse_twin(recipe):
    """The token floor holds path by path: with one seed the twins draw the same preemptions before
    they part, so a policy trains the same there on both. The slots floor holds in expectation:
    checked where nothing is drawn."""
    for rows, factor, seeds in ((still(read_trace_rows(ROOT / "bench/traces/calm.csv")), 1.5, 1),   # no preemptions
                                (_calm_east(), 2.0, 3)):
        down, up = (TraceMarket(t, recipe) for t in twins(rows, AT_S, factor))
        by_tokens = floor(recipe, down, up, AT_S, token_floor)
        assert by_tokens["floor"] > 1.15
        least = by_tokens["floor"]
        if not any(r.state.preempt_per_hour for r in rows):   # nothing drawn: the slots floor holds run by run
            least = max(least, floor(recipe, down, up, AT_S, slot_floor, known=by_tokens)["floor"])
        for seed in range(seeds):
            ratio = {}
            for name, market in (("down", down), ("up", up)):
                for r in simulate(recipe, "", seed=seed, market=market):
                    assert r["status"] == "completed"
                    ratio.setdefault(r["policy"], []).append(r["list_usd"] / by_tokens[f"bound_{name}_usd"])
            assert set(ratio) == set(POLICIES)
            for policy, both in ratio.items():
                assert max(both) >= least, (policy, seed, both, least)


def test_where_spot_is_dearer_than_on_demand_the_token_floor_prices_on_demand(recipe):
    """A market built in memory may price spot above on-demand (a trace file may not: the reader
    refuses such a row); the on-demand baseline then pays less than any spot VM would, and the
    floor must not claim otherwise."""
    uncapped = recipe.model_copy(update={"resources": recipe.resources.model_copy(update={"max_usd_per_hour": None})})
    dear = [dataclasses.replace(r, state=dataclasses.replace(r.state, spot_usd_per_hour=1.6 * r.state.on_demand_usd_per_hour))
            for r in still(read_trace_rows(ROOT / "bench/traces/calm.csv"))]
    at_s = 40 * 3600.0
    down, up = (TraceMarket(t, uncapped) for t in twins(dear, at_s, 1.5))
    got = floor(uncapped, down, up, at_s, token_floor)
    ratios = [next(r for r in simulate(uncapped, "", market=m, policies=["on-demand"]))["list_usd"] / got[f"bound_{k}_usd"]
              for k, m in (("down", down), ("up", up))]
    assert max(ratios) >= got["floor"]
