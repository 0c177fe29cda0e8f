"""`bench/hedge_bound.py`: one schedule for a real trace and its variants, tied where they agree."""

from __future__ import annotations

import numpy as np
import pytest

from bench.hedge_bound import drop_tick_s, minimax, scenario_market, scenarios, split_times, variants
from bench.real_markets import recipe_for, window
from elastic.policy.planner import run_tokens
from elastic.recipe.model import load_recipe
from elastic.sim.bound import lower_bound_usd_per_mtok, min_replicas_floor_usd_per_mtok
from elastic.sim.simulate import TraceMarket
from providers.simmarket import read_trace_rows
from tests.conftest import REPO

TRACE = REPO / "bench" / "traces" / "real" / "aws-v100-2zones-2022.csv"
EVERY_H = 4.0   # at most one onset a zone every 4 h: a few seconds of programs


def test_variants_tied_to_the_traces_past_cannot_all_be_met_at_their_own_bounds(tmp_path):
    recipe = load_recipe(recipe_for(TRACE))
    rows = read_trace_rows(window(TRACE, 72, tmp_path))   # 72 h in: 8 variants, about a second
    varied, programs, ties, grid, _ = scenarios(recipe, rows, extend_h=12.0, min_outage_h=1.0, drops=False)
    assert len(varied) >= 5 and all(tie.any() for tie in ties[1:])
    # Restating every zone at every row of the common grid leaves the trace's bound as it is.
    t, bounds_usd, ratios, _, weights = minimax(programs, ties)
    plain = lower_bound_usd_per_mtok(recipe, TraceMarket(rows, recipe), keep_min_replicas=True)
    assert bounds_usd[0] * 1e6 / run_tokens(recipe) == pytest.approx(plain, rel=1e-6)
    # Untied, each scenario has its own optimum; tied, no one schedule is at every bound.
    untied, _, _, _, _ = minimax(programs, [np.zeros_like(tie) for tie in ties])
    assert untied == pytest.approx(1.0, abs=1e-6)
    assert t > 1.001 and all(r <= t + 1e-6 for r in ratios)
    # The worst case's weights: they sum to 1, and only scenarios at the worst ratio carry any.
    assert sum(weights) == pytest.approx(1.0, abs=1e-6) and min(weights) > -1e-9
    assert all(r == pytest.approx(t, abs=1e-6) for r, w in zip(ratios, weights) if w > 1e-6)


def test_an_onset_drops_a_calm_zone_and_holds_it_out_and_only_what_was_decided_before_is_shared(tmp_path):
    recipe = load_recipe(recipe_for(TRACE))
    rows = read_trace_rows(window(TRACE, 48, tmp_path))   # 48 h in: an onset whose zone writes no row for a while
    market = TraceMarket(rows, recipe)
    limit = recipe.budget.max_hours * 3600
    onsets = [v for v in variants(market, market.times(), limit, 3600.0, 12 * 3600.0, drops=False, onsets=True,
                                  onset_every_s=EVERY_H * 3600) if v.first is not None]
    assert onsets and all(v.unforeseen for v in onsets)
    v = onsets[len(onsets) // 2]
    before, calm = market.state(*v.key, v.parts_s - 1), market.state(*v.key, v.parts_s)
    assert before.capacity and not before.preempt_per_hour and calm.capacity and not calm.preempt_per_hour
    grid = sorted(set(market.times()) | {v.parts_s + v.extend_s, v.parts_s + v.tick_s})
    varied = scenario_market(market, rows, grid, recipe, v)
    drop = varied.state(*v.key, v.parts_s)
    # It parts with the tick of a drop (capacity kept, the converter's hazard) as long as the zone's
    # own drop ticks last (the trace writes a row only when a zone changes, so the next row may be
    # hours away: the tick still ends), then 0 for extend_s, then the trace again; before it, and in
    # every other zone, the trace as it was.
    assert drop.capacity == calm.capacity and drop.preempt_per_hour == max(
        market.state(*v.key, t).preempt_per_hour for t in market.times())
    assert v.tick_s == drop_tick_s(market, v.key, market.times()) > 0
    assert varied.state(*v.key, v.parts_s + v.tick_s / 2) == drop
    later = [t for t in grid if v.parts_s + v.tick_s <= t < v.parts_s + v.extend_s]
    assert later and all(varied.state(*v.key, t).capacity == 0 for t in later)
    after = [t for t in grid if t >= v.parts_s + v.extend_s]
    assert all(varied.state(*v.key, t) == market.state(*v.key, t) for t in after)
    for t in grid:
        for o in market.offers(0.0, True):
            if o.zone != v.key[0] or t < v.parts_s:
                assert varied.state(o.zone, o.instance_type, t) == market.state(o.zone, o.instance_type, t)
    # Tied: every variable of the rows before, and of the parting row only the VMs kept into it
    # (a policy may rent or pair within the row on what the drop takes).
    varied_all, programs, ties, grid, yardsticks = scenarios(recipe, rows, extend_h=12.0, min_outage_h=1.0,
                                                             drops=False, onsets=True, onset_every_h=EVERY_H)
    i = next(i for i, w in enumerate(varied_all, 1) if w == v)
    parts = grid.index(v.parts_s)
    program, tie = programs[i], ties[i]
    assert tie[program.row < parts].all() and not tie[program.row > parts].any()
    assert set(program.kind[tie & (program.row == parts)]) == {"k"}
    # The yardstick is the real-markets table's: the higher of the program's bound and the floor.
    m = scenario_market(market, rows, grid, recipe, v)
    # The programs' grid ends every onset's tick, the trace's next row or not (some come hours later).
    onsets_all = [w for w in varied_all if w.first is not None]
    assert any(min(t for t in market.times() if t > w.parts_s) > w.parts_s + w.tick_s for w in onsets_all)
    for w in onsets_all:
        assert scenario_market(market, rows, grid, recipe, w).state(*w.key, w.parts_s + w.tick_s).capacity == 0
    mtok = run_tokens(recipe) / 1e6
    assert yardsticks[i] == pytest.approx(max(lower_bound_usd_per_mtok(recipe, m, keep_min_replicas=True),
                                              min_replicas_floor_usd_per_mtok(recipe, m)) * mtok, rel=1e-6)
    # More variants a policy cannot tell apart can only raise the least worst ratio, and onsets do.
    t_onsets, _, ratios, _, _ = minimax(programs, ties, yardsticks)
    plain = [0] + [j for j, w in enumerate(varied_all, 1) if w.first is None]
    t_plain, _, _, _, _ = minimax([programs[j] for j in plain], [ties[j] for j in plain],
                                  [yardsticks[j] for j in plain])
    assert t_onsets > t_plain + 1e-3 and max(ratios) <= t_onsets + 1e-6


def test_split_restates_each_row_as_equal_rows_of_the_same_market(tmp_path):
    recipe = load_recipe(recipe_for(TRACE))
    rows = read_trace_rows(window(TRACE, 72, tmp_path))
    market = TraceMarket(rows, recipe)
    times, limit = market.times(), recipe.budget.max_hours * 3600
    cuts = split_times(times, limit, 3)
    before = [t for t in times[:-1] if t < limit]
    assert len(cuts) == 2 * len(before) and not cuts & set(times)
    _, programs, _, grid, _ = scenarios(recipe, rows, extend_h=12.0, min_outage_h=1.0, drops=False, split=3)
    assert cuts <= set(grid) and int(programs[0].row.max()) + 1 >= 3 * len(before)
    restated = scenario_market(market, rows, grid, recipe, None)
    for t in grid:
        for o in market.offers(0.0, True):
            assert restated.state(o.zone, o.instance_type, t) == market.state(o.zone, o.instance_type, t)
