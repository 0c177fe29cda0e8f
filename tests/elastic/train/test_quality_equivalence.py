"""bench/quality.py's DDP baseline and the product's DiLoCo path train the same model: at H = 1,
one replica, float32 sync and outer SGD with lr 1 and no momentum, an outer step sets θ_outer to
the replica's θ_local (the inner AdamW state is kept across outer steps), so DiLoCo is plain AdamW
training, step for step: the same data, schedule, losses and parameters.

Not bit for bit: the outer step computes θ_outer − 1·(θ_outer − θ_local), which is θ_local exactly
only while the two are within a factor of 2 of each other (Sterbenz); a value near zero rounds by
an ulp, and that ulp travels on. Measured: losses within 5e-7, parameters within 3e-6 after 10
steps; a real difference (a reset AdamW, another batch, another rate) moves both by 1e-3 or more."""

from __future__ import annotations

import pytest
import torch

from bench.quality import run_ddp
from elastic.train.world import World
from tests.conftest import tiny_recipe

pytestmark = pytest.mark.slow

STEPS = 10


def test_ddp_baseline_and_diloco_at_h1_agree(nodes):
    recipe = tiny_recipe(**{"train.inner_steps": 1, "train.outer_steps": STEPS, "train.outer_lr": 1.0,
                            "train.outer_momentum": 0.0, "world.replicas": 1, "world.sync_dtype": "float32"})
    world = World(recipe)
    try:
        world.add_replicas([("vm0", nodes(1)[0])])
        losses = []
        while not world.done():
            result, _ = world.run_step()
            losses += result.losses
        state = world.call_replica(world.lead_replica(), "full_state")[0]
    finally:
        world.shutdown()

    ddp = run_ddp(recipe, STEPS, save_state=True)
    assert losses[0] == ddp["losses"][0]   # before any outer step
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ddp["losses"]), rtol=0, atol=5e-6)
    assert state.keys() == ddp["state"].keys()
    for name, p in state.items():
        torch.testing.assert_close(p, ddp["state"][name], rtol=0, atol=2e-5, msg=name)
