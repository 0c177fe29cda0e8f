"""Liveness by progress: a slow world keeps training, a frozen rank is dropped by its heartbeat."""

from __future__ import annotations

import os
import signal
import time

import pytest

from elastic.train.world import Loss, PhaseStarted, StepDone, World
from tests.conftest import tiny_recipe

pytestmark = pytest.mark.slow


def test_a_slow_phase_past_the_old_deadline_completes_while_a_frozen_rank_is_dropped(nodes, monkeypatch):
    # One world, two replicas, every inner step 3.5 s more (a slow VM): the phase lasts longer than
    # step_timeout_s, the inner phase's fixed deadline before heartbeats. Replica 0 keeps beating and
    # is never lost; replica 1's rank is frozen (SIGSTOP) and is dropped by its heartbeat within the
    # stall timeout, while replica 0 goes on to finish the step.
    import ray

    monkeypatch.setenv("ELASTIC_FAULT_STEP_DELAY_S", "3.5")
    stall_s = 3.0
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
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)   # polling the process table with a deadline
        assert not _alive(pid)
    finally:
        world.shutdown()
        for p in frozen:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether `pid` is a live process (not gone, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
