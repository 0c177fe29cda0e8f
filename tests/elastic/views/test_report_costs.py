"""The billing model and the cost figures, from hand-made ledgers whose values are worked out here."""

from __future__ import annotations

import pytest

from elastic.record.billing import burn_usd_per_hour, cost_so_far
from elastic.views.report import build_report

T0 = 1_700_000_000.0


def vm(t: float, iid: str, usd: float, on_demand: float, cloud: str = "aws", region: str = "us-east-1",
       gpus: int = 1, **extra) -> dict:
    return {"t": t, "type": "node_launched", "instance_id": iid, "ray_node_id": f"ray-{iid}", "role": "replica",
            "cloud": cloud, "region": region, "zone": region + "a", "instance_type": f"{cloud}-g{gpus}",
            "gpu": "A10G", "gpus": gpus, "cpus": 8, "spot": True, "usd_per_hour": usd,
            "on_demand_usd_per_hour": on_demand, **extra}


def started(**kw) -> dict:
    return {"t": T0, "type": "run_started", "run": "costs", "recipe": "r", "recipe_digest": "d", **kw}


def ended(t: float, status: str = "completed") -> dict:
    return {"t": t, "type": "run_ended", "status": status, "wall_s": t - T0}


def test_spot_price_change_mid_life_bills_each_interval_at_its_price():
    events = [
        started(),
        vm(T0, "a", usd=0.36, on_demand=1.08),
        {"t": T0 + 100, "type": "node_price", "instance_id": "a", "usd_per_hour": 0.72},
        {"t": T0 + 300, "type": "node_released", "instance_id": "a"},
        {"t": T0 + 310, "type": "node_price", "instance_id": "a", "usd_per_hour": 9.99},   # after release: no bill
        ended(T0 + 320),
    ]
    r = build_report(events)
    (a,) = r["instances"]
    # 100 s at $0.36/h + 200 s at $0.72/h = $0.01 + $0.04.
    assert a["seconds"] == 300 and a["billed_seconds"] == 300
    assert a["cost_usd"] == pytest.approx(0.05)
    assert a["usd_per_hour"] == 0.36                     # the launch price, as before
    assert a["mean_usd_per_hour"] == pytest.approx(0.6)  # $0.05 over 300 s
    assert a["price_changes"] == 1
    # On demand: the same 300 s at $1.08/h = $0.09; the saving is 1 - 0.05/0.09.
    assert a["on_demand_cost_usd"] == pytest.approx(0.09)
    assert r["on_demand_equivalent_usd"] == pytest.approx(0.09)
    assert r["savings_pct"] == pytest.approx(100 * (1 - 0.05 / 0.09), abs=0.01)
    assert r["gpu_hours"] == pytest.approx(300 / 3600, abs=1e-6)
    # Halfway through the dearer interval: $0.01 + 100 s at $0.72/h.
    assert cost_so_far(events[:3], T0 + 200) == pytest.approx(0.01 + 0.02)
    assert burn_usd_per_hour(events[:3]) == 0.72


def test_gcp_vm_shorter_than_a_minute_bills_one_minute():
    events = [
        started(),
        vm(T0 + 10, "g", usd=1.20, on_demand=3.60, cloud="gcp", region="us-central1"),
        {"t": T0 + 40, "type": "node_preempted", "instance_id": "g", "with_notice": False},
        vm(T0 + 50, "w", usd=0.60, on_demand=1.80, cloud="local"),   # the local market: per second, no minimum
        {"t": T0 + 80, "type": "node_released", "instance_id": "w"},
        ended(T0 + 100),
    ]
    r = build_report(events)
    by_id = {i["instance_id"]: i for i in r["instances"]}
    g, w = by_id["g"], by_id["w"]
    assert g["seconds"] == 30 and g["billed_seconds"] == 60 and g["ended"] == "preempted"
    assert g["cost_usd"] == pytest.approx(60 * 1.20 / 3600)           # $0.02, not $0.01
    assert g["on_demand_cost_usd"] == pytest.approx(60 * 3.60 / 3600)
    assert w["billed_seconds"] == 30 and w["cost_usd"] == pytest.approx(30 * 0.60 / 3600)
    assert r["cost_usd"] == pytest.approx(0.02 + 0.005)
    assert r["gpu_hours"] == pytest.approx(90 / 3600, abs=1e-6)
    assert r["by_cloud"]["gcp"]["cost_usd"] == pytest.approx(0.02)
    assert r["by_cloud"]["local"]["cost_usd"] == pytest.approx(0.005)
    assert r["by_region"]["us-central1"]["instances"] == 1
    # Still held (the run goes on): no minimum yet, only the seconds so far.
    running = build_report(events[:2] + [{"t": T0 + 30, "type": "replica_starting", "replica": 0, "instance_id": "g"}])
    assert running["instances"][0]["billed_seconds"] == 20
    assert running["cost_usd"] == pytest.approx(20 * 1.20 / 3600, abs=1e-6)


def wasteful_run() -> list[dict]:
    """a (AWS, $0.36/h) and b (GCP, $0.72/h) train; a checkpoint stalls 10 s; b is preempted 50 s
    into an outer step; c is rented but never joins; training waits 20 s for capacity."""
    return [
        started(ranks_per_replica=1),
        vm(T0, "a", usd=0.36, on_demand=1.08),
        vm(T0, "b", usd=0.72, on_demand=2.16, cloud="gcp", region="us-central1"),
        {"t": T0 + 10, "type": "replica_joined", "replica": 0, "instance_id": "a", "outer_step": 0},
        {"t": T0 + 10, "type": "replica_joined", "replica": 1, "instance_id": "b", "outer_step": 0},
        {"t": T0 + 100, "type": "outer_step", "outer_step": 1, "inner_step": 10, "epoch": 0, "replicas": [0, 1],
         "losses": [4.0, 3.0], "tokens": 1000, "tokens_total": 1000, "inner_s": 80.0, "sync_s": 10.0,
         "bytes_sent": 1_000_000, "data_cursor": 10},
        {"t": T0 + 110, "type": "checkpoint_saved", "step": 1, "local": "/tmp/elastic-staging/x/step-00000001",
         "stall_s": 10.0, "replica": 0},
        {"t": T0 + 120, "type": "checkpoint_uploaded", "step": 1, "uri": "s3://bucket/x",
         "bytes": 2_000_000_000, "seconds": 9.0},
        {"t": T0 + 150, "type": "node_preempted", "instance_id": "b", "with_notice": False, "replica": 1},
        {"t": T0 + 150, "type": "replica_lost", "replica": 1, "instance_id": "b", "reason": "preempted",
         "phase": "inner", "lost_inner_steps": 10, "outer_step": 1},
        vm(T0 + 160, "c", usd=0.36, on_demand=1.08, ray_node_id=None, joined=False, launched_at=T0 + 160),
        {"t": T0 + 200, "type": "capacity_wait_ended", "waited_s": 20.0, "replicas": 1},
        {"t": T0 + 220, "type": "node_join_timeout", "instance_id": "c", "timeout_s": 60},
        {"t": T0 + 220, "type": "node_released", "instance_id": "c"},
        {"t": T0 + 290, "type": "node_released", "instance_id": "a"},
        ended(T0 + 300),
    ]


def test_wasted_usd_by_cause():
    r = build_report(wasteful_run())
    w = r["wasted_usd"]
    # Preemption: b's work since the outer step began (+100) until it went (+150): 50 s at $0.72/h.
    assert w["preemption"] == pytest.approx(50 * 0.72 / 3600)
    # Capacity wait +180..+200: only a was held among the VMs that joined: 20 s at $0.36/h.
    assert w["capacity_wait"] == pytest.approx(20 * 0.36 / 3600)
    # Checkpoint stall +100..+110: a and b both idle: 10 s at $1.08/h.
    assert w["checkpoint_stalls"] == pytest.approx(10 * 1.08 / 3600)
    # c: rented +160, released at the join timeout +220: 60 s at $0.36/h, all of it.
    assert w["never_joined"] == pytest.approx(60 * 0.36 / 3600)
    assert w["total"] == pytest.approx(0.01 + 0.002 + 0.003 + 0.006)
    assert r["nodes_never_joined"] == 1 and r["nodes_joined"] == 2
    c = next(i for i in r["instances"] if i["instance_id"] == "c")
    assert c["joined"] is False and c["seconds"] == 60 and c["launched_at"] == T0 + 160
    # a 290 s at $0.36/h + b 150 s at $0.72/h + c 60 s at $0.36/h.
    assert r["cost_usd"] == pytest.approx(0.029 + 0.03 + 0.006)
    assert r["by_cloud"]["aws"] == {"instances": 2, "seconds": 350.0, "cost_usd": pytest.approx(0.035),
                                    "on_demand_equivalent_usd": pytest.approx(350 * 1.08 / 3600),
                                    "gpu_hours": pytest.approx(350 / 3600, abs=1e-6)}
    assert r["by_instance_type"]["gcp-g1"]["cost_usd"] == pytest.approx(0.03)


def test_storage_and_egress_estimates():
    est = build_report(wasteful_run())["estimates"]
    assert est["checkpoint_bytes_written"] == 2_000_000_000   # what reached the bucket
    # Only the upload sits in object storage (s3: $0.023/GB-month), from +120 to the end (+300).
    assert est["checkpoint_storage_usd"] == pytest.approx(2 * 0.023 * 180 / (30 * 86400), abs=1e-6)
    # Outer step 1 spanned two regions (aws/us-east-1, gcp/us-central1): two crossings of 1 MB.
    assert est["cross_region_sync_bytes"] == 2_000_000
    assert est["egress_usd"] == pytest.approx(0.002 * 0.02)


def test_report_does_not_depend_on_when_it_is_built():
    events = wasteful_run()
    assert build_report(events) == build_report(list(events))
    # A running ledger ends at its last event, not at the clock.
    assert build_report(events[:-1])["wall_s"] == 290


def test_nodes_whose_replica_failed_its_setup_are_waste_and_lost_replicas():
    """Two local nodes rented, each replica failing its setup, each node released: their whole
    bill is waste (`setup_failed`) and both replicas count as lost."""
    events = [started(ranks_per_replica=1)]
    for n, iid in enumerate(("x", "y")):
        t = T0 + 100 * n
        events += [vm(t, iid, usd=0.36, on_demand=1.08, cloud="local", launched_at=t),
                   {"t": t + 30, "type": "replica_lost", "replica": n, "instance_id": iid, "rule": "setup_failed",
                    "reason": "setup failed: Ray assigned GPU 0 to this rank but torch sees no CUDA device",
                    "phase": "setup", "lost_inner_steps": 0, "outer_step": 0},
                   {"t": t + 31, "type": "node_released", "instance_id": iid}]
    events.append(ended(T0 + 200, "failed"))
    r = build_report(events)
    assert r["wasted_usd"]["setup_failed"] == pytest.approx(2 * 31 * 0.36 / 3600)
    assert r["wasted_usd"]["total"] == pytest.approx(r["cost_usd"])
    assert r["replicas_lost"] == 2
