"""The elastic world under preemptions, on a real local Ray cluster: nodes are killed for real
(raylet and every process on it) through the local provider, at chosen moments of the outer loop."""

from __future__ import annotations

import random

import pytest

from elastic.run.driver import run_attached
from elastic.views.report import build_report
from providers.base import BillingTerms
from tests.conftest import tiny_recipe

pytestmark = pytest.mark.slow


def elastic_recipe(**overrides):
    base = {"world.replicas": 3, "world.min_replicas": 1, "world.max_replicas": 3,
            "world.sync_timeout_s": 5, "world.capacity_timeout_s": 60,
            "train.outer_steps": 12, "train.inner_steps": 8, "train.batch_size": 8,
            "model.width": 64, "model.layers": 2, "model.heads": 4, "model.context": 64, "train.seq_len": 64,
            "data.corpus_bytes": 400_000, "checkpoint.every_outer_steps": 3,
            # 300 simulated s at 60× = a 5 s notice: short, yet long enough to contribute on a
            # loaded 2-core machine (2 s was not, now and then).
            "local.market.time_compression": 60, "local.market.notice_s": 300}
    base.update(overrides)
    return tiny_recipe(**base)


def run_driver(recipe, cluster, tmp_path, faults=None):
    """Run the real driver on the shared cluster; `faults(driver, phase, members)` is called as
    each phase of each outer step gets under way."""
    status, events = run_attached(recipe, cluster, tmp_path / "run", on_phase=faults, run_name="test")
    return status, build_report(events), events


def instance_of(driver, replica_id):
    return driver.world.replicas[replica_id].instance_id


def test_chaos_run_completes_without_restart_and_matches_fault_free_loss(local_cluster, tmp_path):
    h = 12
    budget = 3 * 30 * h * 8 * 64   # the fault-free run's tokens: 3 replicas × 30 outer steps
    recipe = elastic_recipe(**{"train.token_budget": budget, "train.inner_steps": h})
    rng = random.Random(1234)
    # Faults in order; each fires at the first phase where it can (enough replicas live). Two lost
    # at once comes first, while the world is still whole: later, on a loaded machine, the token
    # budget could run out before three replicas were live again. Each later fault leaves a survivor.
    plan = [("two", "inner", 3), ("hard", "inner", 2), ("notice", "inner", 2), ("sync", "sync", 2)]
    done = []

    def faults(driver, phase, members):
        if len(done) == len(plan) or driver.world.outer_step < 1:
            return
        name, when, need = plan[len(done)]
        held = {i.instance_id for i in driver.provider.list_instances(driver.run_name)}
        live = [m for m in members if m in driver.world.replicas and instance_of(driver, m) in held
                and m not in driver.draining]
        if phase != when or len(live) < need:
            return
        done.append(name)
        p = driver.provider
        if name == "hard":          # a hard kill mid inner phase
            p.preempt(instance_of(driver, rng.choice(live)), notice=False)
        elif name == "notice":      # a 5 s notice: cut short, contribute, leave cleanly
            p.preempt(instance_of(driver, rng.choice(live)), notice=True)
        elif name == "sync":        # a member dies as the outer all-reduce starts
            p.preempt(instance_of(driver, rng.choice(live)), notice=False)
        else:                       # two replicas lost at once
            for rid in rng.sample(live, 2):
                p.preempt(instance_of(driver, rid), notice=False)

    status, report, events = run_driver(recipe, local_cluster, tmp_path / "chaos", faults)
    assert status == "completed"
    assert done == [name for name, _, _ in plan]
    assert report["driver_restarts"] == 0
    assert report["preemptions"] >= 5
    assert report["preemptions_with_notice"] >= 1 and report["preemptions_without_notice"] >= 4
    assert report["drained"] >= 1                       # the noticed replica contributed and left cleanly
    assert report["joins"] >= 3                         # replacements came back
    assert report["tokens"] >= budget
    lost_in_sync = [e for e in events if e["type"] == "replica_lost" and e["phase"] == "sync"]
    assert lost_in_sync or report["sync_retries"] >= 1
    # Survivors kept training through every loss: outer steps are consecutive, none repeated.
    steps = [e["outer_step"] for e in events if e["type"] == "outer_step"]
    assert steps == list(range(1, len(steps) + 1))
    # Joiners took state from a live peer, not from storage.
    assert all(e["source"].startswith("replica") for e in events
               if e["type"] == "replica_joined" and e["outer_step"] > 0)

    clean_status, clean, _ = run_driver(recipe, local_cluster, tmp_path / "clean")
    assert clean_status == "completed" and clean["preemptions"] == 0
    # Faults cost at most 10% of the final loss. (The LR schedule follows tokens: a world that lost
    # replicas takes more, smaller outer steps to the same token budget, at the rates of those
    # token counts, and on this tiny model ends lower, not higher.)
    assert report["loss_last"] <= 1.10 * clean["loss_last"], (report["loss_last"], clean["loss_last"])


def test_all_replicas_lost_resumes_from_the_latest_checkpoint(local_cluster, tmp_path):
    recipe = elastic_recipe(**{"world.replicas": 1, "world.max_replicas": 1, "train.outer_steps": 6,
                               "checkpoint.every_outer_steps": 2})
    killed, durable = [], []

    def faults(driver, phase, members):
        if driver.world.outer_step == 4 and phase == "inner" and not killed:
            # The newest checkpoint that is complete (uploaded, manifest written) at the kill.
            durable.append(max(e["step"] for e in driver.ledger.events if e["type"] == "checkpoint_uploaded"))
            killed.append(instance_of(driver, members[0]))
            driver.provider.preempt(killed[0], notice=False)

    status, report, events = run_driver(recipe, local_cluster, tmp_path, faults)
    assert status == "completed" and killed
    restored = [e for e in events if e["type"] == "world_restored"]
    # Step 4's upload may still have been under way on the node that died: then step 2 is the
    # newest complete one, and step 4's partial upload is never loaded.
    assert [e["from_step"] for e in restored] == durable and durable[0] in (2, 4)
    if durable[0] == 2:
        assert [e["step"] for e in events if e["type"] == "checkpoint_upload_failed"] == [4]
    joined = [e for e in events if e["type"] == "replica_joined" and e["outer_step"] > 0]
    assert joined and joined[0]["source"].startswith("checkpoint")
    assert report["outer_steps"] == 6 and report["restored_from_checkpoint"] == 1
    assert report["lost_inner_steps"] == recipe.train.inner_steps


def test_fewer_than_min_replicas_waits_then_stops_with_a_clear_status(local_cluster, tmp_path):
    # Capacity for one node only, but training needs two: wait, then give up.
    recipe = elastic_recipe(**{"world.replicas": 2, "world.min_replicas": 2, "world.max_replicas": 2,
                               "local.capacity": 1, "world.capacity_timeout_s": 3})
    status, report, events = run_driver(recipe, local_cluster, tmp_path)
    assert status == "insufficient_capacity"
    assert report["outer_steps"] == 0
    # The market says how many it has: no launch is tried beyond it, and the ledger says why.
    held_back = [e for e in events if e["type"] == "launch_held_back"]
    assert held_back and held_back[0]["reason"] == "capacity" and held_back[0]["held"] == 1
    launched = {e["instance_id"] for e in events if e["type"] == "node_launched"}
    released = {e["instance_id"] for e in events if e["type"] == "node_released"}
    assert len(launched) == 1 and launched == released


def test_a_rank_lost_inside_a_two_rank_replica_drops_the_whole_replica(local_cluster, tmp_path):
    recipe = elastic_recipe(**{"world.replicas": 2, "world.max_replicas": 2, "world.ranks_per_replica": 2,
                               "train.outer_steps": 5})
    killed = []

    def faults(driver, phase, members):
        import ray
        if driver.world.outer_step == 2 and phase == "inner" and not killed:
            rep = driver.world.replicas[members[-1]]
            killed.append(rep.replica_id)
            ray.kill(rep.actors[1], no_restart=True)    # one rank dies; its node stays up

    status, report, events = run_driver(recipe, local_cluster, tmp_path, faults)
    assert status == "completed" and killed
    lost = [e for e in events if e["type"] == "replica_lost"]
    assert [e["replica"] for e in lost] == killed
    # Its node was released (the replica is gone as a whole), a replacement was rented, and the
    # surviving replica trained on alone.
    assert lost[0]["instance_id"] in {e["instance_id"] for e in events if e["type"] == "node_released"}
    assert len([e for e in events if e["type"] == "node_launched"]) == 3
    assert report["outer_steps"] == 5
    after = [e for e in events if e["type"] == "outer_step" and e["t"] > lost[0]["t"]]
    assert after and all(e["replicas"] != killed for e in after)


def test_a_notice_early_in_a_long_phase_ends_every_replicas_phase_so_the_noticed_one_contributes(local_cluster,
                                                                                                  tmp_path):
    # Inner phases far longer than the 5 s notice (as on real clouds: minutes against AWS's 2 min
    # and GCP's 30 s): waiting for the others' full phase, the noticed replica would die first.
    # The notice comes as the run's one outer step gets under way: no full phase of H runs at all.
    h = 1500
    recipe = elastic_recipe(**{"world.replicas": 2, "world.max_replicas": 2, "train.outer_steps": 1,
                               "train.inner_steps": h, "checkpoint.every_outer_steps": 0,
                               "world.step_timeout_s": 300})
    noticed = []

    def faults(driver, phase, members):
        if phase == "inner" and not noticed:
            noticed.append(members[0])
            driver.provider.preempt(instance_of(driver, members[0]), notice=True)

    status, report, events = run_driver(recipe, local_cluster, tmp_path, faults)
    assert status == "completed" and noticed
    step = next(e for e in events if e["type"] == "outer_step" and e["outer_step"] == 1)
    done = {int(r): n for r, n in step["steps_done"].items()}
    # Both replicas stopped by the deadline and synced: the noticed one's partial phase counts.
    assert len(done) == 2 and noticed[0] in done and all(0 < n < h for n in done.values()), done
    assert any(e["type"] == "replica_drained" and e["replica"] == noticed[0] for e in events)
    assert not any(e["type"] == "replica_lost" and e["replica"] == noticed[0] for e in events)
    assert report["lost_inner_steps"] == 0
    # The schedule counts the inner steps taken, not H, for a step cut short.
    assert step["inner_step"] == max(done.values())


@pytest.mark.parametrize("free_s", [3600.0, 0.0])
def test_a_noticed_vm_its_cloud_bills_nothing_for_is_left_for_the_cloud_to_reclaim(local_cluster, tmp_path,
                                                                                    monkeypatch, free_s):
    # With 3600 s, the local market bills as AWS bills Linux spot VMs: nothing for one it interrupts
    # within an hour of its launch, the seconds of one the user terminates. Terminating the noticed VM
    # once its replica has contributed would turn a free VM into a billed one: the run leaves it for
    # the market to reclaim at the notice's deadline, and rents as if it were gone already. With 0
    # (the local market's own terms: every second billed), the run terminates it at once.
    monkeypatch.setattr("providers.local.facts.BILLING", BillingTerms(minimum_s=0.0, increment_s=1.0,
                                                                      interrupted_free_s=free_s))
    # 40 short steps: the run goes on for seconds past the 5 s notice (about 8 s on a 2-core machine).
    recipe = elastic_recipe(**{"world.replicas": 2, "world.max_replicas": 2, "train.outer_steps": 40 if free_s else 6,
                               "train.inner_steps": 20, "checkpoint.every_outer_steps": 0})
    noticed, unseen = [], []

    def faults(driver, phase, members):
        if phase == "inner" and not noticed and len(members) == 2:
            noticed.append((members[0], instance_of(driver, members[0])))
            driver.provider.preempt(noticed[0][1], notice=True)
        elif noticed and noticed[0][1] in driver.left_to_cloud:
            # Out of the run while its cloud still holds it: the policy does not count it as held.
            unseen.append(all(n.instance_id != noticed[0][1] for n in driver._snapshot().nodes))

    status, report, events = run_driver(recipe, local_cluster, tmp_path, faults)
    assert status == "completed" and noticed
    rid, vm = noticed[0]
    drained = next(e for e in events if e["type"] == "replica_drained" and e["replica"] == rid)
    ends = [e for e in events if e.get("instance_id") == vm and e["type"] in ("node_released", "node_preempted")]
    billed = next(i for i in report["instances"] if i["instance_id"] == vm)
    if not free_s:
        notice = next(e for e in events if e["type"] == "node_notice" and e["instance_id"] == vm)
        assert [e["type"] for e in ends] == ["node_released"], ends
        assert drained["t"] <= ends[0]["t"] < notice["deadline"], (drained, ends, notice)
        assert not unseen
        # Terminated by the run: billed its seconds, nothing refunded.
        assert billed["cost_usd"] > 0 and report["refunded_usd"] == 0
        return
    # The market took it at the deadline (the run went on far longer); the run never terminated it.
    assert [(e["type"], e.get("with_notice")) for e in ends] == [("node_preempted", True)], ends
    assert unseen and all(unseen), unseen
    # So its cloud bills it nothing: the report refunds what it would have cost, held until the
    # deadline (not until the poll that saw it gone).
    left = next(e for e in events if e["type"] == "node_left_to_cloud" and e["instance_id"] == vm)
    assert billed["cost_usd"] == 0 and billed["released_at"] == left["deadline"] <= ends[0]["t"]
    # (what its terms would have billed: its seconds, rounded to the increment, at its one price)
    assert billed["price_changes"] == 0 and billed["billed_seconds"] >= billed["seconds"] > 0
    assert report["refunded_usd"] == pytest.approx(billed["billed_seconds"] * billed["usd_per_hour"] / 3600, abs=1e-6)
