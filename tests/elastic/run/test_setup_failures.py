"""A setup that fails the same way on every node rented ends the run with one line, instead of
renting node after node until the budget or a signal stops it."""

from __future__ import annotations

import pytest

from elastic.record.events import NodeJoinTimeout, ReplicaJoined, ReplicaLost
from elastic.record.ledger import Ledger
from elastic.run.rentals import SETUP_FAILURES_TO_STOP, Rentals
from providers.cloud import BOOT_FAILED_MARK
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
    assert rentals.failing.startswith(f"{SETUP_FAILURES_TO_STOP} nodes in a row failed their boot or setup")
    assert rentals.failing.endswith("last: setup failed: no CUDA device")
    ledger.close()


def test_failed_boots_count_with_failed_setups_and_a_vm_that_only_never_joined_does_not(tmp_path):
    """A VM whose boot script failed (`node_join_timeout` with boot_failed) counts toward the stop
    and is named by its log's failing line; one that merely did not join in time does not count.
    (The machine's own line may come before the script's last ones: they pass through its tee.)"""
    log = ("+ pip install /nonexistent/elastic.whl\n"
           "ERROR: Could not find /nonexistent/elastic.whl\n"
           "\n"
           "lab: user data exited with status 1\n"
           f"{BOOT_FAILED_MARK} (status 1): this VM shuts down in 10 minutes\n")
    ledger = Ledger(tmp_path / "events.jsonl")
    rentals = Rentals({}, "run", ledger, None, None, lambda *a: None)
    ledger.append(lost(0))
    for n in range(1, 4):
        ledger.append(NodeJoinTimeout(instance_id=f"i-{n}", timeout_s=600, boot_log=log, boot_failed=False))
    assert rentals.failing is None   # slow boots, an unreachable head: not the same failure again
    for n in range(4, 4 + SETUP_FAILURES_TO_STOP - 1):
        ledger.append(NodeJoinTimeout(instance_id=f"i-{n}", timeout_s=600, boot_log=log, boot_failed=True))
    assert rentals.failing == (f"{SETUP_FAILURES_TO_STOP} nodes in a row failed their boot or setup and none "
                               f"joined, so no more nodes are rented; last: the boot script of "
                               f"i-{4 + SETUP_FAILURES_TO_STOP - 2} failed: ERROR: Could not find /nonexistent/elastic.whl")
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
