"""The simulator replays the driver: one recipe and one trace, run by `elastic simulate`'s elastic
policy and by the real driver on the local simulated-spot provider (`local.market` replaying the
trace); both execute `policy.decide`, so they take the same actions in the same order. Both bill through
`elastic.record.billing`: the simulator's cost is its ledger's cost as the report prices it, and the
driver's ledger prices its VMs as the trace does."""

from __future__ import annotations

import time

import pytest

from elastic.record import billing
from elastic.record.billing import cost_so_far
from elastic.run.driver import run_attached
from elastic.sim.simulate import TraceMarket, simulate
from elastic.views.report import build_report
from providers.simmarket import read_trace_rows
from tests.conftest import TRACE_HEADER, tiny_recipe

pytestmark = pytest.mark.slow

DROP_S = 5.0   # trace second from which r2a costs a tenth


def actions(events: list[dict]) -> list[tuple]:
    """What the policy did, in order, free of instance ids: each launch's zone, and each move's
    zone with the zone of the VM it replaces."""
    zone = {e["instance_id"]: e["zone"] for e in events if e["type"] == "node_launched"}
    out = []
    for e in events:
        if e["type"] == "node_launched":
            out.append(("launch", e["zone"]))
        elif e["type"] == "replica_move":
            out.append(("move", e["zone"], zone[e["drain_instance_id"]]))
    return out


def scenario(tmp_path):
    """The trace and the recipe. r1a holds one VM, so the second replica spills over to r1b; r1a's
    price moves a little at 3 s (billed, not worth a move); at DROP_S r2a falls to a tenth of the
    price and both replicas move there, the dearer first. No preemptions: the run is decided by the
    policy alone, not by draws."""
    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE_HEADER
                     + "0,local,r1,r1a,cpu,,0,40,120,0,1\n"
                     "0,local,r1,r1b,cpu,,0,45,120,0,4\n"
                     "0,local,r2,r2a,cpu,,0,50,120,0,4\n"
                     "3,local,r1,r1a,cpu,,0,42,120,0,1\n"
                     f"{DROP_S:g},local,r2,r2a,cpu,,0,5,120,0,4\n")
    recipe = tiny_recipe(**{
        "world.replicas": 2, "world.max_replicas": 4, "train.outer_steps": 40, "train.inner_steps": 4,
        "checkpoint.every_outer_steps": 0, "local.market.time_compression": 0.001,
        "local.market.trace": str(trace), "planner.replan_every_s": 0.5, "planner.recovery_s": 1,
        "planner.cross_region_sync_s": 0,
        "local.instance_types": "[{name: cpu, region: r1, zone: r1a}, {name: cpu, region: r1, zone: r1b}, "
                                "{name: cpu, region: r2, zone: r2a}]"})
    return trace, recipe


def test_the_simulator_takes_the_drivers_actions_and_bills_as_the_report(local_cluster, tmp_path, monkeypatch):
    trace, recipe = scenario(tmp_path)
    expected = [("launch", "r1a"), ("launch", "r1b"), ("move", "r2a", "r1b"), ("move", "r2a", "r1a"),
                ("launch", "r2a"), ("launch", "r2a")]

    ledgers: dict[str, list[dict]] = {}
    sim = simulate(recipe, str(trace), ["elastic"], ledgers=ledgers)[0]
    assert sim["status"] == "completed"
    sim_events = ledgers["elastic"]
    # The moves are decided before their VMs launch: compare launches and moves each in order.
    assert [a for a in actions(sim_events) if a[0] == "launch"] == [a for a in expected if a[0] == "launch"]
    assert [a for a in actions(sim_events) if a[0] == "move"] == [a for a in expected if a[0] == "move"]
    # One bill: the simulator's cost is its ledger's, priced by the report (price moves included).
    assert any(e["type"] == "node_price" for e in sim_events)
    end = sim["wall_h"] * 3600
    assert cost_so_far(sim_events, end) == pytest.approx(sim["cost_usd"], abs=1e-4)

    # The driver: the market's own clock barely moves (compression 0.001); the test moves it past
    # the drop once the world trains, as the trace's time passes in the simulator.
    jumped_at = []

    def prices_drop(driver, phase, members):
        if driver.world.outer_step == 2 and phase == "inner":
            with driver.provider._lock:
                if driver.provider.market.sim_time_s < DROP_S:
                    driver.provider.market.advance(DROP_S / 0.001)
                    jumped_at.append(time.time())

    # Every inner step takes at least 40 ms (fault injection: a slow VM), so the 38 outer steps
    # after the jump last at least 6 s whatever this machine's speed: time for the driver to read
    # the moved prices and decide (about a second; the moves' VMs may launch after the last step).
    monkeypatch.setenv("ELASTIC_FAULT_STEP_DELAY_S", "0.04")
    status, events = run_attached(recipe, local_cluster, tmp_path / "run", on_phase=prices_drop, run_name="replay")
    assert status == "completed"
    driven = actions(events)
    assert [a for a in driven if a[0] == "launch"] == [a for a in expected if a[0] == "launch"]
    assert [a for a in driven if a[0] == "move"] == [a for a in expected if a[0] == "move"]
    # One bill: the driver's ledger, priced by the report, is what `elastic.record.billing` charges for the
    # driver's VMs at the trace's prices (the market's clock stood at 0 until the jump, at DROP_S
    # after), within the second the driver takes to read a moved price.
    market = TraceMarket(read_trace_rows(trace), recipe)
    ended = {e["instance_id"]: e["t"] for e in events if e["type"] in ("node_released", "node_preempted")}
    traced_usd = 0.0
    for e in (e for e in events if e["type"] == "node_launched"):
        start, stop = e.get("launched_at") or e["t"], ended[e["instance_id"]]
        before, after = (market.state(e["zone"], e["instance_type"], t).spot_usd_per_hour for t in (0.0, DROP_S))
        segments = [(start, after if start >= jumped_at[0] else before)]
        if start < jumped_at[0] < stop and after != before:
            segments.append((jumped_at[0], after))
        traced_usd += billing.vm_usd(e["cloud"], segments, stop, ended=True)
    assert any(e["type"] == "node_price" for e in events)
    assert build_report(events)["cost_usd"] == pytest.approx(traced_usd, abs=1e-3)
    # And the driver's running cost (what its budget checks read) is the report's cost.
    assert cost_so_far(events, events[-1]["t"]) == pytest.approx(build_report(events)["cost_usd"], abs=1e-6)


@pytest.mark.parametrize("deadline", [False, True], ids=["no-deadline", "deadline"])
def test_with_a_preemption_the_same_actions_checkpoint_and_bill_rates(local_cluster, tmp_path, deadline):
    """A preemption drawn by the simulator (seeded) is replayed in the driver at the same outer
    step: a notice comes to the world's only replica during its first step. Both executors rent
    the replacement at once, checkpoint the first step before the noticed replica leaves (the
    policy's `Checkpoint("leaving")`: the world would otherwise restart from nothing), and bill
    the same VMs at the same prices. The VM was lost within two minutes of its launch: with a
    deadline (an on-demand fallback) its zone rests on both sides and the replacement is the next
    zone's (`elastic.policy.market.RECLAIMED_EARLY_S`); without one it is rented in the same zone."""
    trace = tmp_path / "trace.csv"
    # r1a is cheapest by far (the risk either executor learns from one preemption does not move the
    # world) and, for its first 20 s, preempted 60 times an hour; with seed 8 the simulator draws
    # one preemption, 1.8 s into the first phase.
    trace.write_text(TRACE_HEADER
                     + "0,local,r1,r1a,cpu,,0,40,120,60,4\n"
                     "0,local,r1,r1b,cpu,,0,90,120,0,4\n"
                     "0,local,r2,r2a,cpu,,0,100,120,0,4\n"
                     "20,local,r1,r1a,cpu,,0,40,120,0,4\n")
    fields = {
        "world.replicas": 1, "world.max_replicas": 4, "train.outer_steps": 6, "train.inner_steps": 4,
        "checkpoint.every_outer_steps": 0, "local.market.time_compression": 0.001,
        "local.market.trace": str(trace), "planner.tokens_per_s": "{cpu: 50}", "planner.replan_every_s": 0.5,
        "planner.recovery_s": 1, "planner.cross_region_sync_s": 0,
        "local.instance_types": "[{name: cpu, region: r1, zone: r1a}, {name: cpu, region: r1, zone: r1b}, "
                                "{name: cpu, region: r2, zone: r2a}]"}
    if deadline:
        fields["budget.max_hours"] = 100   # far off: nothing else of the deadline rule acts
    recipe = tiny_recipe(**fields)
    # The driver's market replays the trace without its hazard: the notice is the test's, at the
    # step the simulator drew (its own draw would be the same VM's, but at a compression no test
    # of seconds can wait for, so it would notice at once; test_equivalence lets the market draw).
    calm = tmp_path / "calm.csv"
    calm.write_text(trace.read_text().replace(",60,4\n", ",0,4\n"))
    driver_recipe = tiny_recipe(**{**fields, "local.market.trace": str(calm)})
    replacement = "r1b" if deadline else "r1a"
    expected = [("launch", "r1a"), ("launch", replacement)]

    ledgers: dict[str, list[dict]] = {}
    sim = simulate(recipe, str(trace), ["elastic"], seed=8, ledgers=ledgers)[0]
    sim_events = ledgers["elastic"]
    assert sim["status"] == "completed" and sim["preemptions"] == 1
    kinds = [e["type"] for e in sim_events]
    # The preemption falls in the first phase; the first step is saved before the next launch.
    assert kinds[:4] == ["node_launched", "node_preempted", "checkpoint_saved", "node_launched"]
    assert actions(sim_events) == expected
    assert sim_events[2]["step"] == 1

    noticed = []

    def notice_in_first_step(driver, phase, members):
        if driver.world.outer_step == 0 and phase == "inner" and not noticed:
            (rep,) = driver.world.replicas.values()
            driver.provider.preempt(rep.instance_id, notice=True)
            noticed.append(rep.instance_id)

    status, events = run_attached(driver_recipe, local_cluster, tmp_path / "run", on_phase=notice_in_first_step,
                                  run_name="replay-preempt")
    assert status == "completed"
    assert actions(events) == expected
    assert [e["step"] for e in events if e["type"] == "checkpoint_saved"][0] == 1
    # The world emptied when the noticed replica left and restarted from that checkpoint (made
    # durable before the noticed node went).
    assert [e["from_step"] for e in events if e["type"] == "world_restored"] == [1]
    assert not any(e["type"] == "checkpoint_upload_failed" for e in events)

    # The two bills against each other: the same VMs, each billed at the same price per hour (the
    # clocks differ: trace seconds of the planner's phases, real seconds of a compressed market);
    # and each is the report's pricing of its own ledger.
    sim_report, driver_report = build_report(sim_events), build_report(events)
    assert sim_report["cost_usd"] == pytest.approx(sim["cost_usd"], abs=1e-4)
    for ledger, report in ((sim_events, sim_report), (events, driver_report)):
        assert cost_so_far(ledger, ledger[-1]["t"]) == pytest.approx(report["cost_usd"], abs=1e-6)

    def bill(report):
        return [(i["zone"], i["mean_usd_per_hour"]) for i in report["instances"]]

    assert bill(sim_report) == bill(driver_report) == [("r1a", 40.0), (replacement, 90.0 if deadline else 40.0)]

    def usd_per_billed_hour(report):
        return report["cost_usd"] / sum(i["billed_seconds"] for i in report["instances"]) * 3600

    if not deadline:   # (at two prices the rate over both VMs weighs them by the clocks' lifetimes)
        assert usd_per_billed_hour(sim_report) == pytest.approx(usd_per_billed_hour(driver_report), abs=1e-3)
