"""Live re-planning through the real driver on the local cluster: when a much cheaper offer appears
the new replica is rented first, and the expensive one drains once it has joined."""

from __future__ import annotations

import pytest

from elastic.run.driver import run_attached
from tests.conftest import TRACE_HEADER, tiny_recipe

pytestmark = pytest.mark.slow


def test_driver_moves_a_replica_to_a_much_cheaper_region(local_cluster, tmp_path):
    trace = tmp_path / "trace.csv"
    # r2 costs more at first; from simulated second 1000 on it costs a tenth. The market's own clock
    # barely moves (compression 0.001); the test moves it past the drop at outer step 2.
    trace.write_text(TRACE_HEADER
                     + "0,local,r1,r1a,cpu,,0,0.40,1.2,0,4\n"
                     "0,local,r2,r2a,cpu,,0,0.50,1.2,0,4\n"
                     "1000,local,r2,r2a,cpu,,0,0.05,1.2,0,4\n")
    recipe = tiny_recipe(**{
        "world.replicas": 1, "world.max_replicas": 2, "train.outer_steps": 150, "train.inner_steps": 20,
        "checkpoint.every_outer_steps": 0, "local.market.time_compression": 0.001,
        "local.market.trace": str(trace), "planner.replan_every_s": 0.5, "planner.recovery_s": 5,
        "local.instance_types": "[{name: cpu, region: r1, zone: r1a}, {name: cpu, region: r2, zone: r2a}]"})

    def prices_drop(driver, phase, members):
        if driver.world.outer_step == 2 and phase == "inner":
            with driver.provider._lock:
                if driver.provider.market.sim_time_s < 1000:
                    driver.provider.market.advance(1000 / 0.001)

    status, events = run_attached(recipe, local_cluster, tmp_path / "run", on_phase=prices_drop, run_name="replan")
    assert status == "completed"
    launched = [e for e in events if e["type"] == "node_launched"]
    assert launched[0]["zone"] == "r1a"            # cheapest at the start
    moves = [e for e in events if e["type"] == "replica_move"]
    assert len(moves) == 1 and moves[0]["zone"] == "r2a"    # once, and never back
    assert moves[0]["drain_instance_id"] == launched[0]["instance_id"]
    assert [e["zone"] for e in launched] == ["r1a", "r2a"]
    # Decided between outer steps, not at a tick inside one (the new replica could join only at the
    # step's end, and the old one trains to it anyway): before the next step's phases began. (Before
    # the rule, the move landed within the step's phases, 70-90 ms before its end.)
    nxt = next(e for e in events[events.index(moves[0]):] if e["type"] == "outer_step")
    assert moves[0]["t"] <= nxt["t"] - nxt["inner_s"] - nxt["sync_s"] + 1e-3   # (those figures are rounded)
    # The new replica joined before the old one drained; the old one was released.
    order = [(e["type"], e.get("instance_id")) for e in events]
    joined = order.index(("replica_joined", launched[1]["instance_id"]))
    drained = order.index(("replica_drained", launched[0]["instance_id"]))
    assert joined < drained < order.index(("node_released", launched[0]["instance_id"]))
    # Steps after the drain are trained by the new replica alone.
    after = [e for e in events[drained:] if e["type"] == "outer_step"]
    assert after and all(len(e["replicas"]) == 1 for e in after)


def test_driver_grows_the_world_to_finish_within_max_hours(local_cluster, tmp_path):
    # The planner's figure (1 token/s per replica) says two replicas need about 0.88 h for the
    # budget; budget.max_hours 0.8 less 10 % slack leaves 0.72 h: three replicas (0.59 h) fit.
    recipe = tiny_recipe(**{
        "world.replicas": 2, "world.max_replicas": 3, "train.outer_steps": "null",
        "train.token_budget": 6 * 2 * 4 * 4 * 32, "planner.default_tokens_per_s": 1, "budget.max_hours": 0.8,
        "checkpoint.every_outer_steps": 0})
    status, events = run_attached(recipe, local_cluster, tmp_path / "run", run_name="deadline")
    assert status == "completed"
    targets = [e for e in events if e["type"] == "world_target"]
    assert [e["replicas"] for e in targets] == [3] and targets[0]["reason"] == "budget.max_hours"
    assert targets[0]["hours_to_finish"] == pytest.approx(0.59, abs=0.02)
    # Rented at once, before any step, and every step trained by all three.
    order = [e["type"] for e in events]
    assert order.index("world_target") < order.index("node_launched")
    assert sum(e["type"] == "node_launched" for e in events) == 3
    steps = [e for e in events if e["type"] == "outer_step"]
    assert steps and all(len(e["replicas"]) == 3 for e in steps)
