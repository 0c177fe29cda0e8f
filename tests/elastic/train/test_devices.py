"""One GPU per rank: what Ray assigns, what each rank sees, and how many ranks a replica gets."""

from __future__ import annotations

import time

import pytest

from elastic.train.world import World
from tests.conftest import run_cli, tiny_recipe


def test_ranks_default_to_the_gpus_of_a_vm():
    unset = {"world.ranks_per_replica": "null"}
    aws = tiny_recipe(**unset, **{"resources.clouds": ["aws"], "resources.accelerators": "A100:8", "train.batch_size": 8})
    assert aws.world.ranks_per_replica == 8 and aws.gpus_per_node() == 8
    told = tiny_recipe(**{"resources.clouds": ["aws"], "resources.accelerators": "A100:8", "train.batch_size": 8,
                          "world.ranks_per_replica": 2})
    assert told.world.ranks_per_replica == 2          # the recipe says otherwise
    local = tiny_recipe(**unset, **{"local.instance_types": [{"name": "gpu4", "cpus": 4, "gpus": 4}]})
    assert local.world.ranks_per_replica == 4
    assert tiny_recipe(**unset).world.ranks_per_replica == 1   # CPU-only nodes: one rank


def test_a_batch_that_does_not_split_over_the_gpus_is_refused(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("name: r\ntrain: {outer_steps: 1, batch_size: 6}\n"
                    "local: {instance_types: [{name: gpu4, cpus: 4, gpus: 4}]}\n")
    proc = run_cli("validate", str(path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "world.ranks_per_replica (4)" in proc.stderr


def test_plan_counts_one_rank_per_gpu(tmp_path):
    import json

    path = tmp_path / "r.yaml"
    path.write_text("name: r\ntrain: {outer_steps: 1, batch_size: 8}\nworld: {replicas: 1}\n"
                    "local: {instance_types: [{name: gpu4, cpus: 4, gpus: 4}]}\n")
    proc = run_cli("plan", str(path), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["ranks_per_replica"] == 4
    assert [(s["gpus"], s["ranks"]) for s in doc["placement"]] == [(4, 4)]
    table = run_cli("plan", str(path), COLUMNS="200")
    assert "4×GPU" in table.stdout, table.stdout


@pytest.mark.slow
def test_each_rank_of_a_replica_holds_its_own_gpu_from_ray(nodes):
    import ray

    recipe = tiny_recipe(**{"world.ranks_per_replica": "null", "local.instance_types": [{"name": "gpu4", "cpus": 4, "gpus": 4}]})
    assert recipe.world.ranks_per_replica == 4
    lost = []
    world = World(recipe)
    try:
        node_id, small = nodes(1, cpus=4, gpus=4)[0], nodes(1, cpus=4, gpus=2)[0]
        rep = world.start_replica("vm-gpu4", node_id)
        seen = ray.get([a.devices.remote() for a in rep.actors], timeout=60)
        ids = [d["gpu_ids"] for d in seen]
        assert sorted(i for one in ids for i in one) == ["0", "1", "2", "3"]   # distinct, all of the node's
        assert all(len(one) == 1 for one in ids)
        # Each rank's process sees exactly its own device.
        assert [d["cuda_visible_devices"] for d in seen] == [one[0] for one in ids]
        # Torch here has no CUDA: the setup says so, it never falls back to training on the CPU.
        deadline = time.monotonic() + 60
        while not lost and time.monotonic() < deadline:
            world.ready_joiners()
            lost += world.take_events()
            time.sleep(0.1)   # polling the setup with a deadline
        assert [(x.replica_id, x.rule) for x in lost] == [(rep.replica_id, "setup_failed")]
        assert "torch sees no CUDA device" in lost[0].reason
        # A node with fewer GPUs than the replica's ranks fails at once, saying why.
        short = world.start_replica("vm-gpu2", small)
        world.ready_joiners()
        lost += world.take_events()
        assert lost[-1].replica_id == short.replica_id and "has 2 GPU(s) for 4 ranks" in lost[-1].reason
    finally:
        world.shutdown()


def test_the_local_gpu_recipe_parses_to_one_rank_per_gpu():
    from elastic.recipe.model import load_recipe
    from tests.conftest import REPO

    recipe = load_recipe(REPO / "recipes" / "local-gpu.yaml", [])
    assert recipe.gpus_per_node() == 1 and recipe.world.ranks_per_replica == 1
    four = load_recipe(REPO / "recipes" / "local-gpu.yaml",
                       ["local.instance_types=[{name: gpu4, cpus: 4, gpus: 4}]"])
    assert four.world.ranks_per_replica == 4
