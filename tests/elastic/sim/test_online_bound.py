"""bench/online_bound.py: the online (non-anticipating) slot MDP checked on cases whose answer is
known by hand, against bound.py's clairvoyant slot where the future is certain, and against the
clairvoyant average where it is not (foresight can only help)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest

from bench.online_bound import Family, online_value, rouwenhorst
from elastic.sim.bound import _slot
from providers.simmarket import read_trace_rows

ROW_S = 300.0


def test_rouwenhorst_has_the_walks_variance_and_autocorrelation():
    grid, p = rouwenhorst(5, 0.9, 0.3)
    assert np.allclose(p.sum(axis=1), 1.0)
    w, v = np.linalg.eig(p.T)
    pi = np.real(v[:, np.argmin(abs(w - 1))])
    pi /= pi.sum()
    mean = pi @ grid
    var = pi @ (grid - mean) ** 2
    lag1 = (pi * grid) @ p @ grid - mean ** 2
    assert mean == pytest.approx(0.0, abs=1e-12)
    assert math.sqrt(var) == pytest.approx(0.3)
    assert lag1 / var == pytest.approx(0.9)


def test_a_constant_price_worth_training_is_held_from_the_start():
    usd, tps, lam, rows, boot_s = 10.0, 1000.0, 5e-6, 12, 600.0    # earns 0.005 $/s, costs 0.0028 $/s
    v, k, _ = online_value([np.eye(1)], [np.array([usd])], [0.0], [tps], rows, ROW_S, boot_s, lam)
    assert v[0] == pytest.approx(rows * ROW_S * (usd / 3600 - lam * tps) + lam * tps * boot_s)
    assert k[0] == pytest.approx(tps * (rows * ROW_S - boot_s))
    v, k, _ = online_value([np.eye(1)], [np.array([usd])], [0.0], [tps], rows, ROW_S, boot_s, 1e-6)   # not worth it
    assert (v[0], k[0]) == (0.0, 0.0)


def test_with_free_boots_the_slot_takes_whatever_pays_now():
    """No boot, no preemption: each row, the best of off and every offer, on its own."""
    rng = np.random.default_rng(1)
    chains = [rng.dirichlet(np.ones(3), size=3), rng.dirichlet(np.ones(2), size=2)]
    usd = [np.array([4.0, 9.0, 15.0]), np.array([6.0, 12.0])]
    tps, lam, rows = [1000.0, 1500.0], 2.5e-6, 6
    v, k, _ = online_value(chains, usd, [0.0, 0.0], tps, rows, ROW_S, 0.0, lam)
    start = (0, 1)
    dist = np.zeros((3, 2))
    dist[start] = 1.0
    want = tokens = 0.0
    for _ in range(rows):
        net = [(usd[0][:, None] / 3600 - lam * tps[0]) * np.ones((1, 2)),
               (usd[1][None, :] / 3600 - lam * tps[1]) * np.ones((3, 1))]
        best = np.minimum(0.0, np.minimum(net[0], net[1]))
        want += (dist * best).sum() * ROW_S
        tokens += (dist * np.where(best < 0, np.where(net[0] <= net[1], tps[0], tps[1]), 0.0)).sum() * ROW_S
        dist = chains[0].T @ dist @ chains[1]
    assert v[start] == pytest.approx(want)
    assert k[start] == pytest.approx(tokens)


def _cycle(n):
    return np.roll(np.eye(n), 1, axis=1)     # state i goes to i + 1 (mod n) for sure


def test_a_certain_future_gives_bound_pys_clairvoyant_slot():
    """Deterministic chains: the online slot sees the whole future, so it is bound.py's `_slot` on
    the trace the chains spell out, boots and preemptions included."""
    usd = [np.array([5.0, 20.0, 8.0]), np.array([30.0, 11.0])]
    rates, tps, rows, boot_s = [0.3, 1.2], [1000.0, 2500.0], 9, 450.0
    for lam in (1e-6, 3e-6, 6e-6):
        v, k, _ = online_value([_cycle(3), _cycle(2)], usd, rates, tps, rows, ROW_S, boot_s, lam)
        trace = np.array([[usd[0][t % 3], usd[1][t % 2]] for t in range(rows)])
        value, _, tokens = _slot(trace, np.tile(rates, (rows, 1)), np.full(rows, ROW_S), np.array(tps), lam,
                                 np.zeros_like(trace), boot_s, np.zeros_like(trace))
        assert v[0, 0] == pytest.approx(value)
        assert k[0, 0] == pytest.approx(tokens)


def test_foresight_can_only_help():
    """The online slot costs at least the clairvoyant slot's mean over every path of the chain (all
    enumerated), and more where a boot must be risked on a price that may not last."""
    p = np.array([[0.7, 0.3], [0.4, 0.6]])
    usd, rate, tps, rows, boot_s, lam = np.array([3.0, 14.0]), 0.2, 1000.0, 5, 600.0, 2.5e-6
    v, _, _ = online_value([p], [usd], [rate], [tps], rows, ROW_S, boot_s, lam)
    mean = 0.0
    for path in itertools.product(range(2), repeat=rows - 1):
        states = (0,) + path
        prob = math.prod(p[a, b] for a, b in zip(states, states[1:]))
        trace = usd[list(states)][:, None]
        mean += prob * _slot(trace, np.full((rows, 1), rate), np.full(rows, ROW_S), np.array([tps]), lam,
                             np.zeros_like(trace), boot_s, np.zeros_like(trace))[0]
    assert v[0] >= mean - 1e-12
    assert v[0] > mean + 1e-4


def test_a_sampled_trace_is_a_trace_of_the_family(tmp_path):
    family = Family(levels=3, hours=2.0)
    path = family.sample_trace(np.random.default_rng(0), tmp_path / "f.csv")
    rows = read_trace_rows(path)
    assert len(rows) == family.rows * len(family.offers)
    for o in family.offers:
        _, usd, start = family.chain(o)
        mine = [r for r in rows if (r.zone, r.instance_type) == (o.zone, o.instance_type)]
        assert mine[0].state.spot_usd_per_hour == pytest.approx(usd[start])   # log-deviation 0, no spike
        assert mine[0].state.spot_usd_per_hour == pytest.approx(round(o.base * o.on_demand_usd_per_hour, 4))
        assert all(any(abs(r.state.spot_usd_per_hour - u) < 1e-9 for u in usd) for r in mine)


def test_a_token_price_set_by_the_trace_is_priced_by_what_is_known():
    """Λ = lam[H], H the rows of the whole trace in a counted state. Constant lam: the plain value.
    A certain future: H is known from the start, so it is bound.py's slot at that Λ."""
    usd, rates, tps, rows, boot_s = [np.array([5.0, 20.0, 8.0])], [0.3], [1000.0], 7, 450.0
    counted = np.array([1, 0, 1])
    flat = online_value([_cycle(3)], usd, rates, tps, rows, ROW_S, boot_s, 3e-6)
    same = online_value([_cycle(3)], usd, rates, tps, rows, ROW_S, boot_s, np.full(rows + 1, 3e-6), counted)
    assert same[0][:, 0] == pytest.approx(flat[0])
    lam = np.linspace(6e-6, 1e-6, rows + 1)
    v, k, price = online_value([_cycle(3)], usd, rates, tps, rows, ROW_S, boot_s, lam, counted)
    h = sum(counted[t % 3] for t in range(rows))        # 5 of the 7 rows: states 0, 2, 0, 2, 0
    assert price[0, 1] == pytest.approx(lam[h])          # start: state 0, counted once
    trace = usd[0][[t % 3 for t in range(rows)]][:, None]
    value, _, tokens = _slot(trace, np.full((rows, 1), 0.3), np.full(rows, ROW_S), np.array(tps), lam[h],
                             np.zeros_like(trace), boot_s, np.zeros_like(trace))
    assert v[0, 1] == pytest.approx(value)
    assert k[0, 1] == pytest.approx(tokens)


def test_a_flat_trace_set_price_is_the_plain_bound_at_that_price():
    from bench.online_bound import OFFERS, STEP_S, counted_lower_bound
    from elastic.policy.planner import run_tokens
    from elastic.recipe.model import load_recipe

    r = load_recipe(str(Path(__file__).resolve().parents[3] / "recipes/multi-cloud.yaml"), [])
    family = Family(offers=OFFERS[:2], levels=3, hours=4.0)
    chains, usd, start, rates, tps = family.market()
    lam, needed = 1.2e-7, run_tokens(r)
    plain = []
    for a in (0.9, 1.0, 1.1):
        v = online_value(chains, usd, rates, tps, family.rows, STEP_S, r.planner.recovery_s - STEP_S, a * lam)[0]
        plain.append((r.world.max_replicas * v[start] + a * lam * needed) / needed * 1e6)
    assert counted_lower_bound(family, r, lam, [0.0]) == pytest.approx(max(plain))
    assert counted_lower_bound(family, r, lam, [0.0, -0.5]) >= max(plain)
