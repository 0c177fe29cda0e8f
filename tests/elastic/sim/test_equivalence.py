"""An equivalence test with teeth: one seeded trace, unscripted, run by the simulator and by the real
driver (a local Ray cluster, the local provider replaying the trace at one trace second per real
second); the policy decides everything, nothing is injected.

The trace: r1a is cheapest and holds one VM, so the world of two spills over to r1b; at
`DROP_S` r2a falls to a tenth of the price and the world moves there, by the market's own clock
(no hook moves it). No preemption: a trace's hazard is at most 60 per node-hour, which no test of
seconds can make certain, and the two sides draw from different generators (the simulator's
seeded `random.Random`, the local market's), so a drawn preemption would not be the same one.

Compared: the full interleaved sequence of what each host carried out (`Host.rent` with its
offer: zone, spot, and the zone of the VM a move replaces; `Host.release`; each `Checkpoint` the
policy asked for), in order, with the timestamps left out (the driver's wall clock jitters; the
simulator's phases are the planner's). The bills: each side's report prices its own ledger to
its own total, and every VM bills the same zone at the same price per hour on both sides, in the
same order (the hours themselves differ with the clocks, so the totals are not compared).

It found one divergence when written: the simulator trained past train.outer_steps when a step
had fewer replicas than world.replicas (it counted tokens, the driver's world counts steps);
`_Run.done` now judges as `World.done`."""

from __future__ import annotations

import pytest

from elastic.policy import executor
from elastic.policy.rules import ElasticPolicy
from elastic.record.billing import cost_so_far
from elastic.run.driver import Driver, run_attached
from elastic.sim import simulate as sim
from elastic.views.report import build_report
from tests.conftest import TRACE_HEADER, tiny_recipe

pytestmark = pytest.mark.slow

DROP_S = 10.0


def scenario(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE_HEADER
                     + "0,local,r1,r1a,cpu,,0,40,120,0,1\n"
                     "0,local,r1,r1b,cpu,,0,45,120,0,4\n"
                     "0,local,r2,r2a,cpu,,0,50,120,0,4\n"
                     f"{DROP_S:g},local,r2,r2a,cpu,,0,5,120,0,4\n")
    recipe = tiny_recipe(**{
        "world.replicas": 2, "world.max_replicas": 4, "train.outer_steps": 40, "train.inner_steps": 4,
        "checkpoint.every_outer_steps": 0, "local.market.time_compression": 1,
        "local.market.trace": str(trace), "local.market.notice_fraction": 1, "local.market.seed": 3,
        "planner.tokens_per_s": "{cpu: 1000}", "planner.replan_every_s": 0.5, "planner.recovery_s": 1,
        "planner.cross_region_sync_s": 0,
        "local.instance_types": "[{name: cpu, region: r1, zone: r1a}, {name: cpu, region: r1, zone: r1b}, "
                                "{name: cpu, region: r2, zone: r2a}]"})
    return trace, recipe


def recorded(monkeypatch, zone_of) -> list[tuple]:
    """What the hosts carry out, in order: wraps `rent` and `release` of both hosts and the
    policy's checkpoint rule. `zone_of(host, instance_id)`: the zone of a VM the host holds."""
    seq: list[tuple] = []

    def wrap_rent(cls):
        rent = cls.rent

        def recording(self, quote, move):
            drain = zone_of(self, move.drain) if move is not None else None
            seq.append(("rent", quote.offer.zone, quote.offer.spot, drain))
            return rent(self, quote, move)
        monkeypatch.setattr(cls, "rent", recording)

    def wrap_release(cls):
        release = cls.release

        def recording(self, instance_id):
            seq.append(("release", zone_of(self, instance_id)))
            return release(self, instance_id)
        monkeypatch.setattr(cls, "release", recording)

    for cls in (Driver, sim._Run):
        wrap_rent(cls)
        wrap_release(cls)
    due = ElasticPolicy.checkpoint_due

    def checkpoint(self, s, ending=False):
        c = due(self, s, ending)
        if c is not None:
            seq.append(("checkpoint", c.reason))
        return c
    monkeypatch.setattr(ElasticPolicy, "checkpoint_due", checkpoint)
    assert executor.Executor   # both hosts are driven by the one executor
    return seq


def zone_of(host, instance_id) -> str:
    if isinstance(host, sim._Run):
        return host.nodes[instance_id].offer.zone
    return next(i.offer.zone for i in host.held() if i.instance_id == instance_id)


def bill(report) -> list[tuple]:
    return [(i["zone"], round(i["mean_usd_per_hour"], 6)) for i in report["instances"]]


def test_the_simulator_and_the_driver_take_the_same_actions_and_bill_alike(local_cluster, tmp_path, monkeypatch):
    trace, recipe = scenario(tmp_path)
    seq = recorded(monkeypatch, zone_of)

    ledgers: dict[str, list[dict]] = {}
    (result,) = sim.simulate(recipe, str(trace), ["elastic"], seed=5, ledgers=ledgers)
    assert result["status"] == "completed" and result["preemptions"] == 0
    simulated, seq[:] = list(seq), []

    # Each inner step takes at least 40 ms (a slow VM), so the run outlasts DROP_S on any machine.
    monkeypatch.setenv("ELASTIC_FAULT_STEP_DELAY_S", "0.04")
    status, events = run_attached(recipe, local_cluster, tmp_path / "run", run_name="equivalence")
    assert status == "completed"
    driven = list(seq)

    # The sequence itself: two launches, the dearer r1b leaving at once for r2a, r1a moving to r2a
    # once its replacement trains, the final checkpoint.
    assert simulated == [("rent", "r1a", True, None), ("rent", "r1b", True, None), ("release", "r1b"),
                         ("rent", "r2a", True, None), ("rent", "r2a", True, "r1a"), ("checkpoint", "final")], simulated
    assert driven == simulated, (driven, simulated)

    # The bills: each side's report is its own ledger's total (one billing module), and VM by VM,
    # in launch order, the two sides bill the same zone at the same price per hour. The totals
    # differ by the clocks only (trace seconds of the planner's phases, real seconds of the driver's).
    sim_report, driver_report = build_report(ledgers["elastic"]), build_report(events)
    assert sim_report["cost_usd"] == pytest.approx(result["cost_usd"], abs=1e-4)
    assert cost_so_far(events, events[-1]["t"]) == pytest.approx(driver_report["cost_usd"], abs=1e-6)
    assert bill(sim_report) == bill(driver_report) == [("r1a", 40.0), ("r1b", 45.0), ("r2a", 5.0), ("r2a", 5.0)]
