"""The inner learning rate follows trained tokens, whatever the world's size does."""

from __future__ import annotations

import math
import time

import pytest

from elastic.train.world import World
from tests.conftest import tiny_recipe


def expected_lr(tokens: int, step_tokens: int, peak: float, warmup_tokens: int, total_tokens: int) -> float:
    """The schedule's definition: linear warm-up over tokens, cosine decay to 10% at the budget."""
    if tokens < warmup_tokens:
        return peak * min(1.0, (tokens + step_tokens) / warmup_tokens)
    frac = min(1.0, (tokens - warmup_tokens) / (total_tokens - warmup_tokens))
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))


@pytest.mark.slow
def test_learning_rate_at_each_token_count_as_the_world_grows_from_one_to_three(nodes):
    recipe = tiny_recipe(**{"world.replicas": 2, "world.max_replicas": 3, "train.outer_steps": 4,
                            "train.warmup_steps": 6})
    t = recipe.train
    per_step = t.batch_size * t.seq_len                  # tokens of one replica's inner step
    warmup_tokens, total_tokens = 6 * 2 * per_step, 4 * t.inner_steps * 2 * per_step   # planned for 2 replicas
    world = World(recipe)
    try:
        ids = nodes(3)
        world.add_replicas([("vm0", ids[0])])
        results = [world.run_step()[0]]
        joiners = [world.start_replica(f"vm{i}", ids[i]) for i in (1, 2)]
        deadline = time.monotonic() + 120
        while world.joining and time.monotonic() < deadline:
            for rep in world.ready_joiners():
                world.admit(rep)
            time.sleep(0.1)   # polling the joiners' setup with a deadline
        assert sorted(world.replicas) == [0] + [j.replica_id for j in joiners]
        while not world.done():
            results.append(world.run_step()[0])
        assert [len(r.replicas) for r in results] == [1, 3, 3, 3]
        tokens = 0
        for res in results:
            assert res.tokens_before == tokens and res.step_tokens == len(res.replicas) * per_step
            want = [expected_lr(tokens + h * res.step_tokens, res.step_tokens, t.inner_lr, warmup_tokens, total_tokens)
                    for h in range(t.inner_steps)]
            for rid in res.replicas:                      # every replica, the same rates
                assert res.lrs[rid] == pytest.approx(want, rel=1e-12), (res.outer_step, rid)
            tokens += res.tokens
        # Warm-up ends at its token count: inside the second step, the first with three replicas
        # (a schedule in inner steps would still be warming up), and the grown world trains past
        # the planned total: the decay sits at its floor.
        assert results[0].lrs[0][-1] < t.inner_lr
        assert results[1].lrs[0][2] == t.inner_lr and results[1].lrs[0][3] < t.inner_lr
        assert results[-1].lrs[0][-1] == pytest.approx(0.1 * t.inner_lr)
    finally:
        world.shutdown()
