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

    # The market's clock is the wall clock: the run must still train at DROP_S and for the two moves
    # after it (each a VM to start and join). Its 160 inner steps take at least 120 ms each (a slow
    # VM): 19 s of training however fast the workers start (a zygote's fork joins in about a
    # second; 40 ms a step, which relied on slow starts, ended the run before DROP_S).
    monkeypatch.setenv("ELASTIC_FAULT_STEP_DELAY_S", "0.12")
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


# -- capacity not shown ----------------------------------------------------------------------------

def test_not_shown_the_capacity_both_learn_a_full_zone_from_the_same_refusal(local_cluster, tmp_path, monkeypatch):
    """The local market shows no capacity (`local.market.show_capacity: false`, as AWS and GCP):
    r1a, the cheaper zone, holds one VM, and the world of two asks it for both. The simulator is
    refused the second at once; the driver launches both in the background and hears of the
    refusal later, maybe while the first is still starting (`capacity_error.in_flight`). Both then
    rest r1a, rent r1b, and learn from their own ledger that r1a held one VM
    (`Quote.capacity_learned`)."""
    from elastic.policy.market import Market
    from providers.base import Offer

    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE_HEADER + "0,local,r1,r1a,cpu,,0,40,120,0,1\n" "0,local,r1,r1b,cpu,,0,45,120,0,4\n")
    recipe = tiny_recipe(**{
        "world.replicas": 2, "world.max_replicas": 2, "train.outer_steps": 20, "train.inner_steps": 4,
        "checkpoint.every_outer_steps": 0, "local.market.time_compression": 1, "local.market.show_capacity": False,
        "local.market.trace": str(trace), "local.market.seed": 3, "planner.tokens_per_s": "{cpu: 1000}",
        "planner.replan_every_s": 0.5, "planner.recovery_s": 1, "planner.cross_region_sync_s": 0,
        "local.instance_types": "[{name: cpu, region: r1, zone: r1a}, {name: cpu, region: r1, zone: r1b}]"})
    seq = recorded(monkeypatch, zone_of)

    ledgers: dict[str, list[dict]] = {}
    (result,) = sim.simulate(recipe, str(trace), ["elastic"], seed=5, ledgers=ledgers)
    assert result["status"] == "completed" and result["refused_launches"] == 1
    simulated, seq[:] = list(seq), []
    status, events = run_attached(recipe, local_cluster, tmp_path / "run", run_name="equivalence-hidden")
    assert status == "completed"
    driven = list(seq)

    assert simulated == [("rent", "r1a", True, None), ("rent", "r1a", True, None), ("rent", "r1b", True, None),
                         ("checkpoint", "final")], simulated
    assert driven == simulated, (driven, simulated)
    r1a = Offer(cloud="local", region="r1", zone="r1a", instance_type="cpu", gpu="", gpus=0, cpus=1, spot=True,
                usd_per_hour=40.0, on_demand_usd_per_hour=120.0, read_at=0.0)
    for ledger in (ledgers["elastic"], events):
        [refusal] = [e for e in ledger if e["type"] == "capacity_error"]
        assert refusal["zone"] == "r1a" and refusal["spot"] is True
        market = Market(recipe.planner)
        market.observe(ledger)
        assert market.capacity_learned(r1a, refusal["t"] + 1) == 1, refusal


# -- with preemptions -----------------------------------------------------------------------------

HAZARD_END_S = 200.0   # trace seconds: r1a's hazard (12 per node-hour) stops here
SEED = 3               # hazard budgets (providers.simmarket.hazard_budget) 0.32, 1.66, 0.88 for VMs 1-3


def preempting_scenario(tmp_path):
    """r1a, the cheaper zone, runs a hazard of 12 per node-hour until HAZARD_END_S. Under SEED the
    first VM runs through its budget (0.32 × 300 s) at 96 trace seconds, the second (1.66) and the
    replacement (0.88, from ~96 s on: at most 0.35 left) never do. At 10 trace seconds per real
    second, the driver's VM 1 hears its notice (10 trace s ahead) about 8.6 s after its launch."""
    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE_HEADER
                     + "0,local,r1,r1a,cpu,,0,40,120,12,4\n"
                     f"{HAZARD_END_S:g},local,r1,r1a,cpu,,0,40,120,0,4\n"
                     "0,local,r1,r1b,cpu,,0,45,120,0,4\n")
    recipe = tiny_recipe(**{
        "world.replicas": 2, "world.max_replicas": 2, "train.outer_steps": 40, "train.inner_steps": 4,
        "checkpoint.every_outer_steps": 0, "local.market.time_compression": 10,
        "local.market.trace": str(trace), "local.market.notice_fraction": 1, "local.market.notice_s": 10,
        "local.market.seed": SEED,
        "planner.tokens_per_s": "{cpu: 100}", "planner.replan_every_s": 5, "planner.recovery_s": 10,
        "planner.cross_region_sync_s": 0,
        "local.instance_types": "[{name: cpu, region: r1, zone: r1a}, {name: cpu, region: r1, zone: r1b}]"})
    return trace, recipe


def recorded_preemptions(monkeypatch, seq: list[tuple]) -> None:
    """Adds to `seq` each preemption as the host learns of it: ("preempted", zone, n), n the VM's
    launch order (both sides number their VMs 1, 2, … in the order they rent them). The driver
    learns of it at the notice (and then hands the VM back once it has synced: its ledger says
    node_notice, node_released), the simulator at the kill, which it treats as noticed (the notice
    is folded into the phase's share): one event each, at the same place in the sequence."""
    from providers.base import NodeEventKind
    from providers.local.provider import LocalProvider

    advance = sim._Run.advance

    def sim_advance(self, *args, **kwargs):
        gone = advance(self, *args, **kwargs)
        for iid, node in gone.items():
            seq.append(("preempted", node.offer.zone, int(iid.split("-")[1])))
        return gone
    monkeypatch.setattr(sim._Run, "advance", sim_advance)

    zones: dict[str, str] = {}
    heard: set[str] = set()
    launch, events = LocalProvider.launch, LocalProvider.events

    def local_launch(self, offer, run, role):
        inst = launch(self, offer, run, role)
        zones[inst.instance_id] = offer.zone
        return inst

    def local_events(self):
        out = events(self)
        for e in out:   # a VM's notice, or its kill when none came first
            if e.kind in (NodeEventKind.NOTICE, NodeEventKind.PREEMPTED) and e.instance_id not in heard:
                heard.add(e.instance_id)
                seq.append(("preempted", zones[e.instance_id], int(e.instance_id.split("-")[1])))
        return out
    monkeypatch.setattr(LocalProvider, "launch", local_launch)
    monkeypatch.setattr(LocalProvider, "events", local_events)


def test_a_seeded_run_loses_the_same_vm_in_the_simulator_and_the_driver(local_cluster, tmp_path, monkeypatch):
    """Unscripted: the preemption is the market's draw (providers.simmarket), the same on both
    sides; everything else is the policy's."""
    trace, recipe = preempting_scenario(tmp_path)
    seq = recorded(monkeypatch, zone_of)
    recorded_preemptions(monkeypatch, seq)

    ledgers: dict[str, list[dict]] = {}
    (result,) = sim.simulate(recipe, str(trace), ["elastic"], seed=SEED, ledgers=ledgers)
    assert result["status"] == "completed" and result["preemptions"] == 1
    simulated, seq[:] = list(seq), []

    # At least 80 ms per inner step: 40 outer steps outlast the preemption (~10 s after the launch).
    monkeypatch.setenv("ELASTIC_FAULT_STEP_DELAY_S", "0.08")
    status, events = run_attached(recipe, local_cluster, tmp_path / "run", run_name="equivalence-preempted")
    assert status == "completed"
    driven = list(seq)

    assert simulated == [("rent", "r1a", True, None), ("rent", "r1a", True, None), ("preempted", "r1a", 1),
                         ("rent", "r1a", True, None), ("checkpoint", "final")], simulated
    assert driven == simulated, (driven, simulated)

    # When: the preemption at the same trace second on both sides (the draw is the VM's own; the
    # driver's side is its launch, read on the market's clock, plus the same 96 s), within the
    # market's tick (0.1 real s = 1 trace s) and the jitter of reading the clock at the launch.
    sim_at = next(e["t"] for e in ledgers["elastic"] if e["type"] == "node_preempted")
    assert sim_at == pytest.approx(0.32 * 3600 / 12, abs=1)

    # The bills: each side's total is its ledger priced by elastic.record.billing; VM by VM, in
    # launch order, the same zone at the same price. The totals differ by the clocks only (the
    # planner's phases in trace seconds, the driver's real seconds), so they are not compared.
    sim_report, driver_report = build_report(ledgers["elastic"]), build_report(events)
    assert sim_report["cost_usd"] == pytest.approx(result["cost_usd"], abs=1e-4)
    assert cost_so_far(events, events[-1]["t"]) == pytest.approx(driver_report["cost_usd"], abs=1e-6)
    assert bill(sim_report) == bill(driver_report) == [("r1a", 40.0), ("r1a", 40.0), ("r1a", 40.0)]
