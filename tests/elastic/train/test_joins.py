"""A joiner copies θ_outer and the outer momentum beside training and enters holding the world's."""

from __future__ import annotations

import time

import pytest
import torch

from elastic.train.world import Loss, World
from tests.conftest import tiny_recipe

pytestmark = pytest.mark.slow


def test_a_joiner_copies_while_the_world_steps_and_enters_with_the_worlds_theta(nodes):
    recipe = tiny_recipe(**{"world.replicas": 2, "world.max_replicas": 3, "train.outer_steps": 6})
    world = World(recipe)
    try:
        ids = nodes(3)
        world.add_replicas([("vm0", ids[0]), ("vm1", ids[1])])
        world.run_step()
        joiner = world.start_replica("vm2", ids[2])
        deadline = time.monotonic() + 60
        while not world.ready_joiners() and time.monotonic() < deadline:
            time.sleep(0.1)   # polling the joiner's setup with a deadline
        assert world.begin_copy(joiner)
        snapshot_step = world.outer_step
        admitted, steps_while_copying, happened = [], 0, []
        while not admitted:
            res, in_step = world.run_step()          # the world does not wait for the copy
            assert res.replicas == [0, 1]
            steps_while_copying += 1
            admitted = world.admit_copied()
            happened += in_step + world.take_events()
        assert steps_while_copying >= 1 and world.outer_step == snapshot_step + steps_while_copying
        assert admitted == [(joiner, "replica 0")]
        assert [h for h in happened if isinstance(h, Loss)] == []
        # It replayed the steps taken since its snapshot: at admission it holds the world's θ_outer,
        # and after a step with it (the outer momentum counts there too) still every replica does.
        for _ in range(2):
            states = [world.call_replica(rep, "full_state")[0] for rep in world.replicas.values()]
            assert len(states) == 3
            for other in states[1:]:
                for name, value in states[0].items():
                    assert torch.equal(value, other[name]), name
            res, _ = world.run_step()
            assert res.replicas == [0, 1, joiner.replica_id]
    finally:
        world.shutdown()
