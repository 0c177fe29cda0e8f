"""The deadline rule in the real driver: a spot run whose spot market is out of stock from the start
waits for spot while the slack to budget.max_hours allows (past world.capacity_timeout_s, which
would end it without the rule), then rents on-demand and finishes by its deadline; the simulator
takes the same actions on the same trace, and the report says what on-demand cost and why."""

from __future__ import annotations

import pytest

from elastic.record.events import OnDemandStarted, RunStarted
from elastic.run.driver import run_attached
from elastic.sim import simulate as sim
from elastic.views.report import build_report
from tests.conftest import TRACE_HEADER, tiny_recipe
from tests.elastic.sim.test_equivalence import recorded, zone_of

pytestmark = pytest.mark.slow

CAPACITY_TIMEOUT_S = 2.0


def scenario(tmp_path):
    """Two zones with no spot capacity at all (a stock-out), on-demand at 120 and 130 USD/h, a
    deadline of 72 s; the rule's boot allowance (planner.recovery_s) is 20 s, so it waits for
    spot for about half a minute, well past the capacity timeout."""
    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE_HEADER
                     + "0,local,r1,r1a,cpu,,0,40,120,0,0\n"
                     "0,local,r1,r1b,cpu,,0,45,130,0,0\n")
    recipe = tiny_recipe(**{
        "world.replicas": 1, "world.min_replicas": 1, "world.max_replicas": 1, "train.outer_steps": 6,
        "train.inner_steps": 4, "checkpoint.every_outer_steps": 0, "budget.max_hours": 0.02,
        "world.capacity_timeout_s": CAPACITY_TIMEOUT_S, "local.market.time_compression": 1,
        "local.market.trace": str(trace), "local.market.seed": 3, "planner.tokens_per_s": "{cpu: 1000}",
        "planner.replan_every_s": 0.5, "planner.recovery_s": 20, "planner.cross_region_sync_s": 0,
        "local.instance_types": "[{name: cpu, region: r1, zone: r1a}, {name: cpu, region: r1, zone: r1b}]"})
    return trace, recipe


def test_a_spot_stock_out_waits_then_finishes_on_demand_by_the_deadline(local_cluster, tmp_path, monkeypatch):
    trace, recipe = scenario(tmp_path)
    seq = recorded(monkeypatch, zone_of)

    (result,) = sim.simulate(recipe, str(trace), ["elastic"], seed=5)
    assert result["status"] == "completed", result
    simulated, seq[:] = list(seq), []
    assert simulated == [("rent", "r1a", False, None), ("checkpoint", "final")], simulated

    status, events = run_attached(recipe, local_cluster, tmp_path / "run", run_name="deadline")
    assert status == "completed", [e for e in events if e["type"] in ("run_ended", "error")]
    assert list(seq) == simulated

    # It waited for spot past the capacity timeout (the rule kept the run), then rented on-demand.
    started = next(e["t"] for e in events if e["type"] == RunStarted.TYPE)
    od = [e for e in events if e["type"] == OnDemandStarted.TYPE]
    assert len(od) == 1 and od[0]["reason"] == "deadline" and od[0]["t"] - started > CAPACITY_TIMEOUT_S, od
    assert [e["spot"] for e in events if e["type"] == "node_launched"] == [False]
    assert events[-1]["t"] - started <= recipe.budget.max_hours * 3600

    report = build_report(events)
    assert report["status"] == "completed"
    assert report["on_demand_usd"] == pytest.approx(report["cost_usd"]) and report["on_demand_usd"] > 0
    assert report["on_demand_vm_hours"] > 0 and len(report["on_demand_why"]) == 1, report["on_demand_why"]
