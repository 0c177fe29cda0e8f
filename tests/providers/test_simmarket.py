"""The local provider's simulated spot market: generated from a seed, or replayed from a trace."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from providers.local.config import LocalInstanceType, MarketSection
from providers.simmarket import SimMarket, TraceError, hazard_budget, preempted_at_s, read_trace
from tests.conftest import cli_env

TYPES = [LocalInstanceType(name="cpu", region="r1", zone="r1a", spot_usd_per_hour=0.5, on_demand_usd_per_hour=1.5)]


def test_preemptions_follow_the_rate_and_notice_fraction():
    # 2 per node-hour: each VM's time to preemption is exponential with a mean of 1800 s (simulated).
    m = SimMarket(MarketSection(seed=3, preempt_per_hour=2.0, notice_fraction=0.25, time_compression=60), TYPES)
    n = 20_000
    draws = [m.preemption("r1a", "cpu", launch, launched_sim_s=100.0) for launch in range(1, n + 1)]
    mean_s = sum(at - 100.0 for at, _ in draws) / n
    assert abs(mean_s - 1800) < 4 * 1800 / math.sqrt(n)
    share = sum(notice for _, notice in draws) / n
    assert abs(share - 0.25) < 0.02


def test_same_seed_same_market_and_grace_period():
    a = SimMarket(MarketSection(seed=9, preempt_per_hour=5, volatility=0.5), TYPES)
    b = SimMarket(MarketSection(seed=9, preempt_per_hour=5, volatility=0.5), TYPES)
    for launch in range(1, 500):
        a.advance(0.1)
        b.advance(0.1)
        assert a.state("r1a", "cpu") == b.state("r1a", "cpu")
        assert a.preemption("r1a", "cpu", launch, 0.0) == b.preemption("r1a", "cpu", launch, 0.0)
    assert a.state("r1a", "cpu").spot_usd_per_hour != 0.5   # the price walked
    assert a.preemption("r1a", "cpu", 1, 0.0) != a.preemption("r1a", "cpu", 2, 0.0)   # each VM its own draw
    young = SimMarket(MarketSection(seed=1, preempt_per_hour=1e6, first_preemption_after_s=600), TYPES)
    at_s, _ = young.preemption("r1a", "cpu", 1, launched_sim_s=50.0)
    assert 650 < at_s < 651


def test_a_vm_is_preempted_once_its_hazard_budget_is_spent_across_rows():
    # Budget 1.5: 0.5 of it in the first hour at 0.5/h, none in the calm hour, 1.0 at 2/h (half an hour).
    times, rates = [0.0, 3600.0, 7200.0], [0.5, 0.0, 2.0]
    assert preempted_at_s(times, rates, 0.0, 1.5) == pytest.approx(7200 + 1800)
    assert preempted_at_s(times, rates, 1800.0, 0.25) == pytest.approx(3600)   # from mid-row, exactly at its end
    assert preempted_at_s([0.0, 60.0], [1.0, 0.0], 0.0, 0.5) == math.inf     # the hazard stops first
    assert preempted_at_s([100.0], [3600.0], 0.0, 1.0) == pytest.approx(1.0)  # the first row holds before it
    budgets = [hazard_budget(7, n) for n in range(1, 20_001)]
    assert abs(sum(budgets) / len(budgets) - 1) < 0.03 and hazard_budget(7, 1) == hazard_budget(7, 1)


def test_stockouts_take_capacity_to_zero_then_return():
    m = SimMarket(MarketSection(seed=2, stockout_per_hour=1e9, stockout_s=600, time_compression=60), TYPES, capacity=4)
    m.advance(0.1)
    assert m.state("r1a", "cpu").capacity == 0
    calm = SimMarket(MarketSection(seed=2, stockout_per_hour=0), TYPES, capacity=4)
    calm.advance(100)
    assert calm.state("r1a", "cpu").capacity == 4


def write_trace(path, rows):
    header = "timestamp_s,cloud,region,zone,instance_type,gpu,gpus,spot_usd_per_hour,on_demand_usd_per_hour,preempt_per_hour,capacity"
    path.write_text(header + "\n" + "\n".join(rows) + "\n")
    return path


def test_trace_replay_holds_each_row_until_the_next(tmp_path):
    trace = write_trace(tmp_path / "t.csv", [
        "0,local,r1,r1a,cpu,,0,0.40,1.50,0,2",
        "600,local,r1,r1a,cpu,,0,0.90,1.50,12,0",
        "1200,local,r1,r1a,cpu,,0,0.30,1.50,1,3",
    ])
    m = SimMarket(MarketSection(trace=str(trace), time_compression=60), TYPES)
    assert m.state("r1a", "cpu").spot_usd_per_hour == 0.40 and m.state("r1a", "cpu").capacity == 2
    m.advance(10)   # 600 simulated seconds
    st = m.state("r1a", "cpu")
    assert (st.spot_usd_per_hour, st.preempt_per_hour, st.capacity) == (0.90, 12.0, 0)
    m.advance(9.9)
    assert m.state("r1a", "cpu").capacity == 0
    m.advance(0.2)
    assert m.state("r1a", "cpu").capacity == 3


def test_bad_traces_are_one_line_errors(tmp_path):
    missing = tmp_path / "m.csv"
    missing.write_text("timestamp_s,zone\n0,a\n")
    with pytest.raises(TraceError, match="missing columns"):
        read_trace(missing)
    bad = write_trace(tmp_path / "b.csv", ["zero,local,r1,r1a,cpu,,0,0.4,1.5,0,2"])
    with pytest.raises(TraceError, match="row 2"):
        read_trace(bad)
    dear = write_trace(tmp_path / "d.csv", ["0,local,r1,r1a,cpu,,0,0.4,1.5,0,2", "300,local,r1,r1a,cpu,,0,1.6,1.5,0,2"])
    with pytest.raises(TraceError, match="row 3: spot_usd_per_hour 1.6 is above on_demand_usd_per_hour 1.5"):
        read_trace(dear)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: x\nlocal:\n  market:\n    trace: b.csv\n")
    out = subprocess.run([sys.executable, "-m", "elastic", "validate", str(recipe)], capture_output=True, text=True,
                         env=cli_env())
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "local.market.trace" in out.stderr and "row 2" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
