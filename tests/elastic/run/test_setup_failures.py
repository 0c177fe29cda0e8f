"""A setup that fails the same way on every node rented ends the run with one line, instead of
renting node after node until the budget or a signal stops it."""

from __future__ import annotations

import pytest

from elastic.record.events import ReplicaJoined, ReplicaLost
from elastic.record.ledger import Ledger
from elastic.run.rentals import SETUP_FAILURES_TO_STOP, Rentals
from tests.conftest import run_cli, tiny_recipe


def lost(n: int) -> ReplicaLost:
    return ReplicaLost(replica=n, instance_id=f"local-{n:04d}", reason="setup failed: no CUDA device",
                       rule="setup_failed", phase="setup", lost_inner_steps=0, outer_step=0)


def test_setup_failures_in_a_row_stop_the_renting_and_a_join_starts_the_count_again(tmp_path):
    ledger = Ledger(tmp_path / "events.jsonl")
    rentals = Rentals({}, "run", ledger, None, None, lambda *a: None)
    for n in range(SETUP_FAILURES_TO_STOP - 1):
        ledger.append(lost(n))
    assert rentals.failing is None
    ledger.append(ReplicaJoined(replica=9, instance_id="local-0009", outer_step=0, epoch=0, source="x", setup_s=1.0))
    ledger.append(lost(10))
    assert rentals.failing is None   # a replica joined between: not the same failure again and again
    for n in range(11, 11 + SETUP_FAILURES_TO_STOP - 1):
        ledger.append(lost(n))
    assert rentals.failing.startswith(f"{SETUP_FAILURES_TO_STOP} replicas in a row failed their setup")
    assert rentals.failing.endswith("last: setup failed: no CUDA device")
    ledger.close()


def test_validate_refuses_local_gpus_torch_does_not_see(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU torch can use")
    path = tmp_path / "r.yaml"
    path.write_text("name: r\nworld: {ranks_per_replica: 1}\n"
                    "local: {instance_types: [{name: gpu1, cpus: 2, gpus: 1}]}\n")
    proc = run_cli("validate", str(path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "local.instance_types: gpu1 offers 1 GPU(s) but torch" in proc.stderr


@pytest.mark.slow
def test_a_setup_failing_on_every_node_ends_the_run_failed(local_cluster, tmp_path):
    import torch

    from elastic.run.driver import run_attached
    from elastic.views.report import build_report

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU torch can use")
    # A node offering a GPU that torch on this machine cannot see: every rank fails its setup.
    recipe = tiny_recipe(**{"local.instance_types": [{"name": "gpu1", "cpus": 1, "gpus": 1}],
                            "local.capacity": 1, "world.capacity_timeout_s": 600})
    status, events = run_attached(recipe, local_cluster, tmp_path / "run", run_name="setupfail")
    assert status == "failed"
    failures = [e for e in events if e["type"] == "replica_lost" and e["rule"] == "setup_failed"]
    assert len(failures) == SETUP_FAILURES_TO_STOP
    assert "torch sees no CUDA device" in failures[-1]["reason"]
    report = build_report(events)
    assert report["replicas_lost"] == SETUP_FAILURES_TO_STOP
    assert report["wasted_usd"]["setup_failed"] > 0
    assert report["wasted_usd"]["setup_failed"] == pytest.approx(report["cost_usd"], rel=1e-3)
