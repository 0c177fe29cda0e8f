"""bench/online_policy.py: the DP policy's decisions at extreme token prices, and the slot play's bill
and tokens where they are known by hand."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from bench.online_bound import OFFERS, STEP_S, Family
from bench.online_policy import make_plan, play
from elastic.recipe.model import load_recipe

RECIPE = Path(__file__).resolve().parents[3] / "recipes/multi-cloud.yaml"


def _setup(preempt_per_hour: float, token_budget: int):
    offer = dataclasses.replace(OFFERS[1], preempt_per_hour=preempt_per_hour)    # 8×A100, never above the cap
    family = Family(offers=(offer,), levels=1, hours=2.0)                        # 2 states: spike or not
    r = load_recipe(str(RECIPE), [])
    return family, r.model_copy(update={"train": r.train.model_copy(update={"token_budget": token_budget})})


def test_a_huge_token_price_always_trains_and_none_never_boots():
    family, recipe = _setup(0.05, 10**9)
    plan = make_plan(family, recipe, [0.0, 1e-3], stride=1)
    assert (plan.boot[0] == -1).all()                        # λ 0: nothing is worth a boot
    assert (plan.boot[1, :-2] == 0).all()                    # λ huge: an off slot boots, bar the last boot's rows
    assert (plan.stay[1] == 1).all()                         # ... and a slot on keeps its VM
    assert plan.k_off[1, 0, 0] == pytest.approx(
        (family.rows * STEP_S - recipe.planner.recovery_s) * 24_000, rel=0.02)    # about, preemptions aside


def test_the_play_bills_and_trains_what_a_calm_market_gives():
    """No preemption, the price never moving: six VMs boot at once, train `token_budget` and stop."""
    slots, tps, train_s = 6, 24_000, 3000.0
    family, recipe = _setup(0.0, int(slots * tps * train_s))
    plan = make_plan(family, recipe, [1e-3], stride=1)
    states = np.zeros((family.rows, 1), np.int64)
    usd_per_hour = family.chain(family.offers[0])[1][0]
    out = play(plan, family, states, recipe, np.random.default_rng(0), 1.0)
    end_s = recipe.planner.recovery_s + train_s
    assert out["finished"] and out["boots"] == slots and out["preemptions"] == 0
    assert out["tokens"] == pytest.approx(slots * tps * train_s)
    assert out["hours"] == pytest.approx(end_s / 3600)
    assert out["usd"] == pytest.approx(slots * usd_per_hour * end_s / 3600)


def test_a_run_that_cannot_finish_is_reported_unfinished():
    family, recipe = _setup(0.0, 10**12)
    plan = make_plan(family, recipe, [1e-3], stride=1)
    out = play(plan, family, np.zeros((family.rows, 1), np.int64), recipe, np.random.default_rng(0), 1.0)
    assert not out["finished"] and out["tokens"] == pytest.approx(6 * 24_000 * (family.rows * STEP_S - 600))


def test_the_play_at_a_fixed_price_pays_what_the_dynamic_program_expects():
    """No deadline (tokens never reached): over many drawn paths and preemptions, the play's mean
    cost − λ·tokens and tokens are the DP's expectation from the start state."""
    from bench.online_bound import online_value
    from bench.online_policy import capped_usd

    family, recipe = _setup(0.3, 10**15)
    family = dataclasses.replace(family, levels=3, spike_every_h=2.0)
    lam = 1.2 * family.chain(family.offers[0])[1][1] / 3600 / 24_000     # worth it at the middle level, not all
    plan = make_plan(family, recipe, [lam], stride=1)
    chains, _, start, rates, tps = family.market()
    v, k, _ = online_value(chains, capped_usd(family, recipe), rates, tps, family.rows, STEP_S,
                           recipe.planner.recovery_s, lam)
    rng = np.random.default_rng(3)
    runs = [play(plan, family, family.sample_states(rng), recipe, rng, 1.0) for _ in range(400)]
    value = np.array([r["usd"] - lam * r["tokens"] for r in runs])
    tokens = np.array([r["tokens"] for r in runs])
    assert 0 < k[start] and (tokens > 0).any() and (tokens == 0).any()      # it trains on some paths only
    for got, want in ((value, 6 * v[start]), (tokens, 6 * k[start])):
        assert abs(got.mean() - want) < 4 * got.std() / np.sqrt(len(got)) + 1e-9 * abs(want)


def test_the_fitted_chain_recovers_the_family_from_a_long_history_of_prices():
    """2000 h of one offer's prices (24 000 rows; about 500 independent draws of the walk, 125 spikes):
    the estimators land within about 4 of their standard errors of the family's figures (mean ± 0.06
    with a standard error near 0.013; sd ± 10 %; spike spacing and length ± 30 %, near 9 % each), and
    the states read from prices are the true ones outside spikes and the true spike flags."""
    import math

    from bench.online_policy import FittedFamily, seen_states

    family = Family(offers=(OFFERS[0],), hours=2000.0)
    states = family.sample_states(np.random.default_rng(7))
    fitted = FittedFamily.from_history(family, states, 48.0)
    f, o = fitted.fits[0], OFFERS[0]
    rho = 1 - STEP_S / 3600 / family.revert_h
    assert math.exp(f.threshold) == pytest.approx(0.85, rel=0.2)           # between the top level and 0.85
    assert f.mean == pytest.approx(math.log(o.base), abs=0.06)
    assert f.rho == pytest.approx(rho, abs=0.01)
    assert f.sd == pytest.approx(family.volatility * math.sqrt(STEP_S / 3600 / (1 - rho ** 2)), rel=0.1)
    assert STEP_S / 3600 / f.p_on == pytest.approx(family.spike_every_h, rel=0.3)
    assert STEP_S / 3600 / f.p_off == pytest.approx(family.spike_mean_h, rel=0.3)
    assert f.spike_usd_per_hour == pytest.approx(0.85 * o.on_demand_usd_per_hour, rel=1e-3)
    seen = seen_states(fitted, family.chain(o)[1][states])
    spike = states[:, 0] >= family.levels
    assert (seen[:, 0] >= family.levels).tolist() == spike.tolist()
    assert (seen[~spike, 0] == states[~spike, 0]).all()


def test_the_exact_fit_is_the_family_chain():
    from bench.online_policy import FittedFamily

    family = Family()
    exact = FittedFamily.exact(family)
    for o in family.offers:
        (p, usd, start), (q, usd_true, start_true) = exact.chain(o), family.chain(o)
        assert np.allclose(p, q) and np.allclose(usd, usd_true) and start == start_true
