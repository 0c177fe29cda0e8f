"""Liveness by progress: a slow world keeps training, a frozen rank is dropped by its heartbeat, a
rank stuck outside any collective (a shard fetch that never returns) by its progress."""

from __future__ import annotations

import os
import signal
import time
import uuid

import numpy as np
import pytest

from elastic.train.data import ArraySource, SampleStream, ShardIndex, upload_shards
from elastic.train.world import Loss, PhaseStarted, StepDone, World, stalled
from tests.conftest import process_alive, tiny_recipe
from tests.servers.object_stores import GateProxy

STALL_S, STEP_S = 10.0, 60.0


def looks(beats_by_time: dict[float, dict]) -> dict[float, dict[int, str]]:
    """`stalled` at each monotonic time of {time: {(replica, rank): "BEAT WORK BYTES STATE"}}, one
    wait's looks in order: {time: what it found}."""
    clocks: dict = {}
    return {t: stalled(hb, clocks, t, STALL_S, STEP_S) for t, hb in sorted(beats_by_time.items())}


def test_a_rank_training_on_its_own_is_stalled_when_its_progress_stands_still_for_the_timeout():
    # Beating all along; replica 0 stuck at progress 7 (a fetch that never returns), replica 1's
    # fetch moving bytes, replica 2 stepping.
    found = looks({t: {(0, 0): f"{t:.0f} 7 0 run", (1, 0): f"{t:.0f} 7 {int(t) * 1000} run",
                       (2, 0): f"{t:.0f} {int(t)} 0 run"} for t in range(0, 13)})
    assert {t for t, out in found.items() if out} == {11, 12}
    assert list(found[11]) == [0] and "no progress for 11.0 s" in found[11][0] and "heartbeat alive" in found[11][0]


def test_no_progress_is_asked_of_a_rank_waiting_on_other_replicas_and_more_time_of_its_first_step():
    # Replica 0 waits in an outer collective (a hung peer: its own timeout ends it), replica 1
    # compiles its first step (allowed step_timeout_s); both beat. Replica 2 finished its first
    # step at 30 and then stands still: the stall timeout applies again.
    found = looks({t: {(0, 0): f"{t:.0f} 5 0 wait", (1, 0): f"{t:.0f} 5 0 warm",
                       (2, 0): f"{t:.0f} {5 if t < 30 else 6} 0 {'warm' if t < 30 else 'run'}"}
                   for t in range(0, 90, 5)})
    assert {t: sorted(out) for t, out in found.items() if out} == {
        45: [2], 50: [2], 55: [2], 60: [2], **{t: [1, 2] for t in range(65, 90, 5)}}


def test_one_rank_of_a_replica_waiting_on_the_world_spares_its_stuck_sibling_until_the_wait_ends():
    # Rank 0 waits for a streamed fragment's sync over the replicas; rank 1 waits for rank 0 in
    # the replica's FSDP collective (no progress of its own). At 30 rank 0 is back to training.
    found = looks({t: {(0, 0): f"{t:.0f} 3 0 {'wait' if t < 30 else 'run'}", (0, 1): f"{t:.0f} 3 0 run"}
                   for t in range(0, 50, 5)})
    assert {t for t, out in found.items() if out} == {40, 45}   # 10 s after the last look that saw the wait


def test_a_rank_whose_heartbeat_stops_is_stalled_whatever_it_does():
    found = looks({t: {(0, 0): f"{min(t, 4)} 3 0 wait", (1, 0): f"{t} 3 0 wait"} for t in range(0, 20)})
    assert {t: list(out) for t, out in found.items() if out} == {t: [0] for t in range(15, 20)}
    assert "rank 0 sent no heartbeat for 11.0 s" in found[15][0]


@pytest.mark.slow
def test_a_slow_phase_past_the_old_deadline_completes_while_a_frozen_rank_is_dropped(nodes, monkeypatch):
    # One world, two replicas, every inner step 3.5 s more (a slow VM): the phase lasts longer than
    # step_timeout_s, the inner phase's fixed deadline before heartbeats. Replica 0 keeps beating and
    # making progress (a step within the stall timeout) and is never lost; replica 1's rank is frozen
    # (SIGSTOP) and is dropped by its heartbeat within the stall timeout, while replica 0 goes on to
    # finish the step.
    import ray

    monkeypatch.setenv("ELASTIC_FAULT_STEP_DELAY_S", "3.5")
    stall_s = 6.0
    # step_timeout_s also bounds the replicas' setup: 12 s leaves a loaded 2-core machine room.
    recipe = tiny_recipe(**{"world.replicas": 2, "train.outer_steps": 1, "world.step_timeout_s": 12,
                            "world.stall_timeout_s": stall_s})
    assert recipe.train.inner_steps * 3.5 > recipe.world.step_timeout_s
    lost = []
    world = World(recipe)
    frozen = {}
    try:
        world.add_replicas([(f"vm{i}", n) for i, n in enumerate(nodes(2))])
        pid = ray.get(world.replicas[1].actors[0].devices.remote(), timeout=30)["pid"]

        done, pauses = None, 0
        while done is None:   # the world returns at each pause, within about 0.1 s of a loss
            pauses += 1
            for h in world.step():
                if isinstance(h, PhaseStarted) and h.phase == "inner" and not frozen:
                    os.kill(pid, signal.SIGSTOP)   # the process is alive but makes no progress
                    frozen[pid] = time.monotonic()
                elif isinstance(h, Loss):
                    lost.append((h, time.monotonic()))
                elif isinstance(h, StepDone):
                    done = h
        res = done.result
        assert pauses > 20   # it returned all along the phase, not only at its end
        assert frozen
        assert [(x.replica_id, x.rule, x.phase) for x, _ in lost] == [(1, "stalled", "inner")]
        assert "no heartbeat" in lost[0][0].reason
        waited_s = lost[0][1] - frozen[pid]
        assert stall_s <= waited_s <= stall_s + 3, waited_s
        # The slow replica went on, past step_timeout_s, and finished the step: nobody else lost.
        assert res.replicas == [0] and res.steps_done == {0: recipe.train.inner_steps}
        assert res.inner_s > recipe.world.step_timeout_s
        assert world.done()
        # The frozen rank was killed with its replica.
        deadline = time.monotonic() + 30
        while process_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)   # polling the process table with a deadline
        assert not process_alive(pid)
    finally:
        world.shutdown()
        for p in frozen:
            if process_alive(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.slow
def test_a_rank_whose_shard_fetch_never_returns_is_dropped_while_its_heartbeat_thread_beats(
        nodes, s3_server, tmp_path, monkeypatch):
    # Two replicas stream their leases from S3 through a proxy that accepts the GET of the one
    # shard only replica 1's first lease reads and never answers it. Replica 1's rank is alive,
    # outside any collective, its heartbeat thread beating: it is dropped (`stalled`) because its
    # progress stands still for stall_timeout_s, and replica 0 trains on, step after step.
    seq, steps, batch, stall_s = 32, 4, 4, 4.0
    per_lease = steps * batch
    uri = f"s3://hang-{uuid.uuid4().hex[:8]}/tok"
    shard_tokens = per_lease * seq + 1   # one lease = exactly one shard's windows
    files = {}
    for i in range(8):
        f = tmp_path / f"s{i}.bin"
        ((np.arange(shard_tokens) * 7 + i) % 256).astype("<u2").tofile(f)
        files[f"train/{i:05d}.bin"] = f
    index = ShardIndex("uint16", 256, {"train": [(n, shard_tokens) for n in files]}, {})
    upload_shards(uri, files, index)
    recipe = tiny_recipe(**{"world.replicas": 2, "train.outer_steps": 2, "train.inner_steps": steps,
                            "train.batch_size": batch, "train.seq_len": seq, "data.uri": uri,
                            "world.stall_timeout_s": stall_s})
    # Which shards the leases read (replica 0: samples 0.., replica 1: per_lease.., each prefetching
    # its next lease; then replica 0 alone).
    stream = SampleStream(ArraySource([np.zeros(shard_tokens, "<u2")] * len(files)), seq, recipe.train.seed)
    stuck = stream.shards(per_lease, per_lease)
    others = set().union(*(stream.shards(k * per_lease, per_lease) for k in (0, 2, 3, 4)))
    assert len(stuck) == 1 and not stuck & others
    name = f"/{sorted(files)[stuck.pop()]}"

    proxy = GateProxy(s3_server)
    proxy.hold = lambda method, path: method == "GET" and path.split("?")[0].endswith(name)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)   # the nodes started from here on read through it
    monkeypatch.setenv("ELASTIC_CACHE", str(tmp_path / "cache"))   # their shard cache starts empty
    world = World(recipe)
    lost, results = [], []
    try:
        world.add_replicas([(f"vm{i}", n) for i, n in enumerate(nodes(2))])
        deadline = time.monotonic() + 45   # the test ends, whatever the world does
        held_at = None
        while len(results) < recipe.train.outer_steps and time.monotonic() < deadline:
            for h in world.step():   # returns about every 0.1 s while it waits
                if isinstance(h, Loss):
                    lost.append((h, time.monotonic()))
                elif isinstance(h, StepDone):
                    results.append(h.result)
            if held_at is None and proxy.held.is_set():
                held_at = time.monotonic()
        assert held_at is not None, "replica 1 never asked for its shard"
        assert [(x.replica_id, x.rule, x.phase) for x, _ in lost] == [(1, "stalled", "inner")], lost
        assert "no progress" in lost[0][0].reason
        # The driver's clock starts at its first look at the phase under way, about when the GET went out.
        waited_s = lost[0][1] - held_at
        assert stall_s - 1 <= waited_s <= stall_s + 3, waited_s
        # Replica 0 went on: the step of the hang without replica 1, and the next one.
        assert [(r.outer_step, r.replicas, r.steps_done) for r in results] == [
            (1, [0], {0: steps}), (2, [0], {0: steps})]
    finally:
        world.shutdown()
        proxy.stop()

