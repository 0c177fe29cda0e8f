"""The driver's budget under a price rise mid-step, on a real local Ray cluster and the local
simulated spot market replaying a trace: the rise is read while replicas train, and the run stops
within that step (its work synced and saved), not one step later."""

from __future__ import annotations

import pytest

from elastic import driver as driver_module
from elastic.driver import run_attached
from elastic.report import build_report
from tests.conftest import tiny_recipe

pytestmark = pytest.mark.slow

RISE_S = 5.0        # trace second from which r1a's price is 225 times higher
INNER_STEPS = 200   # a long inner phase: the rise lands early in it


def test_a_price_rise_mid_step_stops_the_run_within_that_step(local_cluster, tmp_path, monkeypatch):
    trace = tmp_path / "trace.csv"
    trace.write_text("timestamp_s,cloud,region,zone,instance_type,gpu,gpus,spot_usd_per_hour,"
                     "on_demand_usd_per_hour,preempt_per_hour,capacity\n"
                     "0,local,r1,r1a,cpu,,0,40,120,0,4\n"
                     f"{RISE_S:g},local,r1,r1a,cpu,,0,9000,10000,0,4\n")
    recipe = tiny_recipe(**{
        "world.replicas": 1, "train.outer_steps": 30, "train.inner_steps": INNER_STEPS,
        "checkpoint.every_outer_steps": 0, "budget.max_usd": 1.0,
        "local.market.time_compression": 0.001, "local.market.trace": str(trace),
        "local.instance_types": "[{name: cpu, region: r1, zone: r1a}]"})
    # Read held prices on every tick (the driver reads them once a second): the rise is seen within
    # a tick of the jump, whatever the speed of this machine's inner steps.
    monkeypatch.setattr(driver_module, "PRICE_POLL_S", 0.0)

    def price_rises(driver, phase, members):
        # Two steps trained at $40/h (cents): the third step's inner phase starts, the market's
        # clock jumps past the rise; the rest of the step at $9,000/h ($2.5/s) would cross $1.
        if driver.world.outer_step == 2 and phase == "inner":
            with driver.provider._lock:
                if driver.provider.market.sim_time_s < RISE_S:
                    driver.provider.market.advance(RISE_S / 0.001)

    status, events = run_attached(recipe, local_cluster, tmp_path / "run", on_phase=price_rises,
                                  run_name="price-rise")
    assert status == "budget_exhausted"
    steps = [e for e in events if e["type"] == "outer_step"]
    # The step the price rose in is the last: its phase ended early, what it trained was synced.
    assert [e["outer_step"] for e in steps] == [1, 2, 3]
    assert all(e["steps_done"][str(r)] == INNER_STEPS for e in steps[:2] for r in e["replicas"])
    assert 0 < max(steps[2]["steps_done"].values()) < INNER_STEPS
    stop = next(e for e in events if e["type"] == "budget_exhausted")
    assert stop["outer_step"] == 3 and "price rose" in stop["reason"] and "budget.max_usd" in stop["reason"]
    assert [e["step"] for e in events if e["type"] == "checkpoint_saved"] == [3]
    assert any(e["type"] == "node_price" and e["usd_per_hour"] == 9000 for e in events)
    assert build_report(events)["status"] == "budget_exhausted"
