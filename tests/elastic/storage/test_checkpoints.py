"""Phased checkpoints of a real world on the local cluster, through a real S3 server (moto on
127.0.0.1): phase 1 on node-local disk, phase 2 uploaded by the ranks, manifest last."""

from __future__ import annotations

import re
import time
import uuid

import pytest
import ray
import torch

from elastic.record.ledger import Ledger, read_events
from elastic.storage import checkpoint as ckpt
from elastic.storage.stores import open_storage
from elastic.train.world import World
from tests.conftest import tiny_recipe
from tests.servers.object_stores import GateProxy

pytestmark = pytest.mark.slow


def trained_world(recipe, nodes, steps: int) -> World:
    world = World(recipe)
    ids = nodes(recipe.world.replicas, cpus=recipe.world.ranks_per_replica)
    world.add_replicas([(f"vm{i}", n) for i, n in enumerate(ids)])
    for _ in range(steps):
        world.run_step()
    return world


def s3_saver(tmp_path, staging: str, keep_last: int, threads: int) -> tuple[str, ckpt.Checkpointer]:
    """A fresh bucket on the S3 server and a Checkpointer writing to it (ledger in tmp_path)."""
    uri = f"s3://ckpt-{uuid.uuid4().hex[:8]}/run"
    return uri, ckpt.Checkpointer(uri, str(tmp_path / staging), keep_last=keep_last, threads=threads,
                                  ledger=Ledger(tmp_path / "events.jsonl"), run="test", run_dir=tmp_path / "test")


def load_into_new_world(recipe, nodes, uri: str, step: int, staging: str) -> dict:
    """A new world of `recipe`'s shape fetches checkpoint `step` (downloading it) and loads it."""
    world = World(recipe)
    try:
        world.add_replicas([("vm-new", nodes(1, cpus=recipe.world.ranks_per_replica)[0])])
        rep = world.lead_replica()
        before = world.call_replica(rep, "full_state")[0]
        manifest = ckpt.read_manifest(open_storage(uri), step)
        local = ray.get(rep.actors[0].fetch_checkpoint.remote(uri, manifest, staging))
        world.call_replica(rep, "load_checkpoint", local)
        return {"before": before, "after": world.call_replica(rep, "full_state")[0],
                "placements": world.call_replica(rep, "param_placements")}
    finally:
        world.shutdown()


def test_checkpoint_resumes_exactly_into_a_different_world_shape(nodes, s3_server, tmp_path):
    """Saved by 2 replicas × 1 rank (plain tensors) to S3, loaded by 1 replica × 2 ranks (FSDP2
    DTensors): DCP reshards, and the parameters are exactly the ones saved."""
    uri, saver = s3_saver(tmp_path, "staging-a", keep_last=2, threads=4)
    recipe = tiny_recipe(**{"world.replicas": 2, "train.outer_steps": 2})
    world = trained_world(recipe, nodes, steps=2)
    try:
        saver.save(world, world.lead_replica(), recipe)
        assert saver.wait(timeout_s=120)
        saved = world.call_replica(world.lead_replica(), "full_state")[0]
    finally:
        world.shutdown()
    events = {e["type"]: e for e in read_events(tmp_path / "events.jsonl")}
    assert events["checkpoint_saved"]["step"] == 2 and events["checkpoint_uploaded"]["bytes"] > 0
    manifest = ckpt.latest(open_storage(uri), saver.keys)
    assert manifest["step"] == 2 and manifest["replicas"] == 2 and manifest["ranks"] == 1
    assert {f["name"] for f in manifest["files"]} >= {".metadata", "__0_0.distcp", "rng-0.json"}
    assert not (tmp_path / "staging-a" / "step-00000002").exists()   # phase-1 copy dropped once durable

    wider = tiny_recipe(**{"world.replicas": 1, "world.ranks_per_replica": 2, "train.outer_steps": 2})
    got = load_into_new_world(wider, nodes, uri, 2, str(tmp_path / "staging-b"))
    assert all(info["type"] == "DTensor" for info in got["placements"][0].values())
    assert any(not torch.equal(got["before"][k], saved[k]) for k in saved)    # the load had work to do
    for k in saved:
        assert torch.equal(got["after"][k], saved[k]), k


def test_node_lost_during_upload_leaves_the_previous_checkpoint(nodes, local_cluster, s3_server, tmp_path,
                                                                monkeypatch):
    """The saving node dies while its shards are going up: no manifest is written, listing shows a
    partial checkpoint, and the previous complete one is what loads."""
    proxy = GateProxy(s3_server)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)   # nodes started from here on upload through it
    uri, saver = s3_saver(tmp_path, "staging", keep_last=3, threads=2)
    recipe = tiny_recipe(**{"world.replicas": 2, "train.outer_steps": 4})
    world = trained_world(recipe, nodes, steps=2)
    try:
        lead = world.lead_replica()
        saver.save(world, lead, recipe)
        assert saver.wait(timeout_s=120)
        at_two = world.call_replica(lead, "full_state")[0]
        world.run_step()
        world.run_step()
        # Hold the model shard's upload of step 4; the small files may go through.
        proxy.hold = lambda method, path: method == "PUT" and "step-00000004/__0_0.distcp" in path
        saver.save(world, lead, recipe)
        assert proxy.held.wait(timeout=120), "the upload never reached the shard"
        local_cluster.remove_node(lead.node_id, graceful=False)
        proxy.release()
        assert saver.wait(timeout_s=120)
    finally:
        world.shutdown()
        proxy.stop()
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    events = read_events(tmp_path / "events.jsonl")
    assert [e["step"] for e in events if e["type"] == "checkpoint_uploaded"] == [2]
    assert [e["step"] for e in events if e["type"] == "checkpoint_upload_failed"] == [4]
    store = open_storage(uri)
    assert {c["step"]: c["complete"] for c in ckpt.listing(store)} == {2: True, 4: False}
    assert ckpt.latest(store, saver.keys)["step"] == 2

    got = load_into_new_world(recipe, nodes, uri, 2, str(tmp_path / "staging-new"))
    for k in at_two:
        assert torch.equal(got["after"][k], at_two[k]), k


def test_node_lost_during_the_write_leaves_the_previous_checkpoint(nodes, local_cluster, tmp_path, monkeypatch):
    """Phase 1 only snapshots the state; the write runs beside training. The saving node dies
    while its write is stuck: nothing of that step reaches the destination, and the previous
    complete checkpoint is what loads."""
    gate = tmp_path / "gate"
    gate.touch()
    monkeypatch.setenv("ELASTIC_FAULT_WRITE_GATE", str(gate))   # nodes started from here on wait on it
    uri = str(tmp_path / "ckpts")
    saver = ckpt.Checkpointer(uri, str(tmp_path / "staging"), keep_last=3, threads=2,
                              ledger=Ledger(tmp_path / "events.jsonl"), run="test", run_dir=tmp_path / "test")
    recipe = tiny_recipe(**{"train.outer_steps": 4})
    world = trained_world(recipe, nodes, steps=1)
    try:
        lead = world.lead_replica()
        saver.save(world, lead, recipe)
        assert saver.wait(timeout_s=120)
        at_one = world.call_replica(lead, "full_state")[0]
        gate.unlink()                                  # the next write sticks
        world.run_step()
        saver.save(world, lead, recipe)                # returns once the state is in host memory
        assert saver.uploading == 2
        world.run_step()                               # training goes on beside the write
        local_cluster.remove_node(lead.node_id, graceful=False)
        assert saver.wait(timeout_s=120)
    finally:
        world.shutdown()
    events = read_events(tmp_path / "events.jsonl")
    assert [e["step"] for e in events if e["type"] == "checkpoint_uploaded"] == [1]
    assert [e["step"] for e in events if e["type"] == "checkpoint_upload_failed"] == [2]
    store = open_storage(uri)
    assert [c["step"] for c in ckpt.listing(store)] == [1]
    assert ckpt.latest(store, saver.keys)["step"] == 1
    monkeypatch.delenv("ELASTIC_FAULT_WRITE_GATE")
    got = load_into_new_world(recipe, nodes, uri, 1, str(tmp_path / "staging-new"))
    for k in at_one:
        assert torch.equal(got["after"][k], at_one[k]), k


def test_a_store_that_refuses_the_manifest_or_the_prune_costs_that_step_not_the_run(nodes, s3_server, tmp_path,
                                                                                     monkeypatch):
    """The shards went up but the store refuses the manifest (AccessDenied): that step is a partial
    checkpoint and `checkpoint_upload_failed`, the previous one still loads, and saving goes on. A
    store that refuses deletes fails the save before anything is written (it could not clear an old
    manifest of that step), and a refused prune leaves old checkpoints for the next save to delete."""
    recipe = tiny_recipe(**{"train.outer_steps": 5})
    world = trained_world(recipe, nodes, steps=1)        # its ranks upload to the store directly
    proxy = GateProxy(s3_server)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)   # the saver's own writes (manifest, prune) go through it
    denied = (403, b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>AccessDenied</Code>"
                   b"<Message>Access Denied</Message></Error>", "application/xml")
    refuse = {"manifest": False, "delete": False}

    def answer(method, path, headers, body):
        if refuse["manifest"] and method == "PUT" and path.split("?")[0].endswith("/" + ckpt.MANIFEST):
            return denied
        if refuse["delete"] and method == "POST" and "delete" in path:
            # As S3 refuses a DeleteObjects it may not do: 200, and each key refused in the body.
            keys = re.findall(rb"<Key>(.*?)</Key>", body)
            return 200, (b'<?xml version="1.0" encoding="UTF-8"?><DeleteResult xmlns="http://s3.amazonaws.com/doc/'
                         b'2006-03-01/">' + b"".join(b"<Error><Key>%s</Key><Code>AccessDenied</Code><Message>Access"
                                                      b" Denied</Message></Error>" % k for k in keys)
                         + b"</DeleteResult>"), "application/xml"
        return None
    proxy.answer = answer
    uri, saver = s3_saver(tmp_path, "staging", keep_last=1, threads=2)
    try:
        lead = world.lead_replica()
        saver.save(world, lead, recipe)
        assert saver.wait(timeout_s=120)
        world.run_step()
        refuse["manifest"] = True
        saver.save(world, lead, recipe)
        assert saver.wait(timeout_s=120)                 # no error: the step is reported, not raised
        refuse["manifest"] = False
        assert ckpt.latest(open_storage(uri), saver.keys)["step"] == 1
        world.run_step()
        refuse["delete"] = True
        with pytest.raises(ckpt.CheckpointError, match="cannot clear step-00000003/elastic.json before saving"):
            saver.save(world, lead, recipe)
        refuse["delete"] = False
        saver.save(world, lead, recipe)
        refuse["delete"] = True                          # the prune after this upload is refused
        assert saver.wait(timeout_s=120)
        refuse["delete"] = False
        assert {c["step"]: c["complete"] for c in ckpt.listing(open_storage(uri))} == {1: True, 2: False, 3: True}
        world.run_step()
        saver.save(world, lead, recipe)
        assert saver.wait(timeout_s=120)
    finally:
        world.shutdown()
        proxy.stop()
    events = read_events(tmp_path / "events.jsonl")
    assert [e["step"] for e in events if e["type"] == "checkpoint_uploaded"] == [1, 3, 4]
    failed = [e for e in events if e["type"] == "checkpoint_upload_failed"]
    assert [e["step"] for e in failed] == [2] and "AccessDenied" in failed[0]["message"]
    assert [e["step"] for e in events if e["type"] == "checkpoint_deleted"] == [1, 3]   # both after step 4
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    store = open_storage(uri)
    assert {c["step"]: c["complete"] for c in ckpt.listing(store)} == {4: True}
    assert ckpt.latest(store, saver.keys)["step"] == 4


def error_feedback(rep) -> torch.Tensor:
    return ray.get(rep.actors[0].outer_state.remote())["error"]


def thetas_identical(world) -> None:
    states = [world.call_replica(rep, "full_state")[0] for rep in world.replicas.values()]
    for s in states[1:]:
        assert all(torch.equal(s[k], states[0][k]) for k in s)


def test_a_joiner_and_a_restore_carry_the_error_feedback(nodes, tmp_path):
    """int8 sync: a joiner takes its peer's error feedback, a checkpoint keeps it, a world restored
    from it has it back; after the next sync θ is identical on every replica."""
    recipe = tiny_recipe(**{"world.replicas": 2, "world.sync_dtype": "int8", "train.outer_steps": 6})
    uri = f"file://{tmp_path}/ckpt"
    saver = ckpt.Checkpointer(uri, str(tmp_path / "staging"), keep_last=2, threads=2,
                              ledger=Ledger(tmp_path / "events.jsonl"), run="test", run_dir=tmp_path / "test")
    world = trained_world(recipe, nodes, steps=2)
    try:
        lead = world.lead_replica()
        saver.save(world, lead, recipe)
        assert saver.wait(timeout_s=120)
        saved = error_feedback(lead)
        assert saved.abs().sum() > 0                  # int8 dropped something: there is state to carry
        rep = world.start_replica("vm-join", nodes(1)[0])
        deadline = time.monotonic() + 120
        while rep not in world.ready_joiners():
            assert time.monotonic() < deadline, "the joiner never finished its setup"
            time.sleep(0.1)
        assert world.admit(rep) == f"replica {lead.replica_id}"
        assert torch.equal(error_feedback(rep), saved)
        world.run_step()
        assert len(world.replicas) == 3
        thetas_identical(world)
    finally:
        world.shutdown()

    restored = World(recipe)
    try:
        restored.add_replicas([(f"vm-r{i}", n) for i, n in enumerate(nodes(2))])
        for rep in restored.replicas.values():
            assert not error_feedback(rep).any()       # fresh: no error feedback yet
            manifest = ckpt.read_manifest(open_storage(uri), 2)
            local = ray.get(rep.actors[0].fetch_checkpoint.remote(uri, manifest, str(tmp_path / "staging-r")))
            restored.call_replica(rep, "load_checkpoint", local)
            assert torch.equal(error_feedback(rep), saved)
        restored.run_step()
        thetas_identical(restored)
    finally:
        restored.shutdown()
