"""The driver's budget under a price rise mid-step, on a real local Ray cluster and the local
simulated spot market replaying a trace: the rise is read while replicas train, and the run stops
within that step (its work synced and saved), not one step later."""

from __future__ import annotations

import pytest

from elastic.run import pricewatch as pricewatch_module
from elastic.run.driver import run_attached
from elastic.views.report import build_report
from tests.conftest import TRACE_HEADER, tiny_recipe

pytestmark = pytest.mark.slow

RISE_S = 5.0            # trace second from which r1a's price is 1,000 times higher
RISEN_USD = 10000.0     # $/h from then ($2.78/s, the most a trace may hold)
INNER_STEPS = 400       # a long inner phase (about a second here): the rise lands early in it
BUDGET_USD = 0.5        # setup and two steps at $10/h cost cents; the rest of a step at $2.78/s dollars


def test_a_price_rise_mid_step_stops_the_run_within_that_step(local_cluster, tmp_path, monkeypatch):
    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE_HEADER
                     + "0,local,r1,r1a,cpu,,0,10,30,0,4\n"
                     f"{RISE_S:g},local,r1,r1a,cpu,,0,{RISEN_USD:g},{RISEN_USD:g},0,4\n")
    recipe = tiny_recipe(**{
        "world.replicas": 1, "train.outer_steps": 30, "train.inner_steps": INNER_STEPS,
        "checkpoint.every_outer_steps": 0, "budget.max_usd": BUDGET_USD,
        "local.market.time_compression": 0.001, "local.market.trace": str(trace),
        "local.instance_types": "[{name: cpu, region: r1, zone: r1a}]"})
    # Read held prices on every tick (the driver reads them once a second): the rise is seen within
    # a tick of the jump, whatever the speed of this machine's inner steps.
    monkeypatch.setattr(pricewatch_module, "PRICE_POLL_S", 0.0)

    def price_rises(driver, phase, members):
        # Two steps trained at $10/h (cents): the third step's inner phase starts, the market's
        # clock jumps past the rise; the rest of the step at $10,000/h would cross the budget.
        if driver.world.outer_step == 2 and phase == "inner":
            with driver.provider._lock:
                if driver.provider.market.sim_time_s < RISE_S:
                    driver.provider.market.advance(RISE_S / 0.001)

    status, events = run_attached(recipe, local_cluster, tmp_path / "run", on_phase=price_rises,
                                  run_name="price-rise")
    assert status == "budget_exhausted"
    rose_at = next(i for i, e in enumerate(events) if e["type"] == "node_price" and e["usd_per_hour"] == RISEN_USD)
    before = [e for e in events[:rose_at] if e["type"] == "outer_step"]
    after = [e for e in events[rose_at:] if e["type"] == "outer_step"]
    assert [e["outer_step"] for e in before] == [1, 2]
    assert all(e["steps_done"][str(r)] == INNER_STEPS for e in before for r in e["replicas"])
    # The step the price rose in is the last: its phase ended early and what it trained was synced
    # (outer step 3). Had the stop reached the replica before its first inner step, it had nothing
    # to sync and the run ends at step 2; either way no step runs whole at the new price.
    assert len(after) <= 1 and all(0 < max(e["steps_done"].values()) < INNER_STEPS for e in after)
    last = 2 + len(after)
    stop = next(e for e in events if e["type"] == "budget_exhausted")
    assert stop["outer_step"] == last and "budget.max_usd" in stop["reason"]
    assert "price rose during outer step 3" in stop["reason"]
    assert [e["step"] for e in events if e["type"] == "checkpoint_saved"] == [last]
    assert build_report(events)["status"] == "budget_exhausted"
