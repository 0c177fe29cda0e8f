"""`bench/hedge_bound.py`: one schedule for a real trace and its variants, tied where they agree."""

from __future__ import annotations

import numpy as np
import pytest

from bench.hedge_bound import minimax, scenarios
from bench.real_markets import recipe_for, window
from elastic.policy.planner import run_tokens
from elastic.recipe.model import load_recipe
from elastic.sim.bound import lower_bound_usd_per_mtok
from elastic.sim.simulate import TraceMarket
from providers.simmarket import read_trace_rows
from tests.conftest import REPO

TRACE = REPO / "bench" / "traces" / "real" / "aws-v100-2zones-2022.csv"


def test_variants_tied_to_the_traces_past_cannot_all_be_met_at_their_own_bounds(tmp_path):
    recipe = load_recipe(recipe_for(TRACE))
    rows = read_trace_rows(window(TRACE, 72, tmp_path))   # 72 h in: 8 variants, about a second
    varied, programs, ties, grid = scenarios(recipe, rows, extend_h=12.0, min_outage_h=1.0, drops=False)
    assert len(varied) >= 5 and all(tie.any() for tie in ties[1:])
    # Restating every zone at every row of the common grid leaves the trace's bound as it is.
    t, bounds_usd, ratios, _ = minimax(programs, ties)
    plain = lower_bound_usd_per_mtok(recipe, TraceMarket(rows, recipe), keep_min_replicas=True)
    assert bounds_usd[0] * 1e6 / run_tokens(recipe) == pytest.approx(plain, rel=1e-6)
    # Untied, each scenario has its own optimum; tied, no one schedule is at every bound.
    untied, _, _, _ = minimax(programs, [np.zeros_like(tie) for tie in ties])
    assert untied == pytest.approx(1.0, abs=1e-6)
    assert t > 1.001 and all(r <= t + 1e-6 for r in ratios)
