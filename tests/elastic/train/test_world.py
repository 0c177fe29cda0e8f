"""DiLoCo over FSDP2 replicas on a real local Ray cluster, checked against plain PyTorch."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from elastic.models import build_model
from elastic.train.data import SampleStream, load_tokens
from elastic.train.replica import Schedule
from elastic.train.world import World
from tests.conftest import tiny_recipe

pytestmark = pytest.mark.slow


def run_world(recipe, nodes, identical_data=False):
    world = World(recipe, identical_data=identical_data)
    try:
        ids = nodes(recipe.world.replicas, cpus=recipe.world.ranks_per_replica)
        world.add_replicas([(f"vm{i}", node_id) for i, node_id in enumerate(ids)])
        while not world.done():
            world.run_step()
        states = {rid: world.call_replica(rep, "full_state")[0] for rid, rep in world.replicas.items()}
        placements = {rid: world.call_replica(rep, "param_placements") for rid, rep in world.replicas.items()}
        return world, states, placements
    finally:
        world.shutdown()


def reference_diloco(recipe, replicas: int):
    """DiLoCo in plain PyTorch, one process, no Ray, no FSDP: the definition we check against."""
    t = recipe.train
    torch.manual_seed(t.seed)
    outer_model = build_model(recipe.model)
    theta = [p.detach().clone() for p in outer_model.parameters()]
    models = [copy.deepcopy(outer_model) for _ in range(replicas)]
    opts = []
    for m in models:
        ps = list(m.parameters())
        opts.append(torch.optim.AdamW(
            [{"params": [p for p in ps if p.dim() >= 2], "weight_decay": t.inner_weight_decay},
             {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}],
            lr=t.inner_lr, betas=t.inner_betas, foreach=True))
    outer_params = [torch.nn.Parameter(x.clone()) for x in theta]
    outer_opt = torch.optim.SGD(outer_params, lr=t.outer_lr, momentum=t.outer_momentum, nesterov=t.outer_nesterov)
    data = SampleStream(load_tokens(recipe.data.path, recipe.data.corpus_bytes), t.seq_len, t.seed)
    schedule, step_tokens = Schedule.for_recipe(recipe), replicas * t.batch_size * t.seq_len
    cursor, step = 0, 0
    for _ in range(t.outer_steps):
        deltas = []
        for m, opt in zip(models, opts):
            lease, cursor = cursor, cursor + t.inner_steps * t.batch_size
            for h in range(t.inner_steps):
                for g in opt.param_groups:
                    g["lr"] = schedule.lr((step + h) * step_tokens, step_tokens)
                batch = data.batch(lease + h * t.batch_size, t.batch_size)
                loss = F.cross_entropy(m(batch[:, :-1]).reshape(-1, recipe.model.vocab_size), batch[:, 1:].reshape(-1))
                loss.backward()
                torch.nn.utils.clip_grad_norm_(m.parameters(), t.grad_clip)
                opt.step()
                opt.zero_grad(set_to_none=True)
            deltas.append([o.detach() - p.detach() for o, p in zip(outer_params, m.parameters())])
        step += t.inner_steps
        for i, o in enumerate(outer_params):
            o.grad = sum(d[i] for d in deltas) / replicas
        outer_opt.step()
        for m in models:
            with torch.no_grad():
                for p, o in zip(m.parameters(), outer_params):
                    p.copy_(o)
    return {name: o.detach() for (name, _), o in zip(outer_model.named_parameters(), outer_params)}


def assert_states_close(a, b, atol=2e-5, rtol=1e-4):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=rtol, msg=lambda m: f"{k}: {m}")


def test_one_replica_with_outer_lr_1_momentum_0_equals_plain_training(nodes):
    recipe = tiny_recipe(**{"train.outer_lr": 1.0, "train.outer_momentum": 0.0})
    _, states, _ = run_world(recipe, nodes)
    # With lr 1 and no momentum the outer step sets θ to the replica's θ_local: plain AdamW training.
    plain = reference_diloco(recipe, replicas=1)
    assert_states_close(states[0], plain)
    # And it really trained: parameters moved away from the initialization.
    torch.manual_seed(recipe.train.seed)
    init = dict(build_model(recipe.model).named_parameters())
    assert any(not torch.allclose(states[0][k], init[k].detach()) for k in init)


def test_two_replicas_fed_identical_data_equal_one_replica(nodes):
    one = tiny_recipe()
    two = tiny_recipe(**{"world.replicas": 2})
    _, s1, _ = run_world(one, nodes)
    world2, s2, _ = run_world(two, nodes, identical_data=True)
    assert sorted(s2) == [0, 1]
    assert_states_close(s2[0], s2[1], atol=0, rtol=0)   # every replica holds the same θ after a sync
    assert_states_close(s2[0], s1[0])
    assert world2.tokens == 2 * one.train.outer_steps * one.train.inner_steps * one.train.batch_size * one.train.seq_len


def test_two_replicas_on_disjoint_data_match_reference_diloco(nodes):
    recipe = tiny_recipe(**{"world.replicas": 2})
    world, states, _ = run_world(recipe, nodes)
    ref = reference_diloco(recipe, replicas=2)
    assert_states_close(states[0], ref)
    assert_states_close(states[1], ref)
    # Disjoint leases: the data cursor advanced by both replicas' samples every outer step.
    assert world.cursor == 2 * recipe.train.outer_steps * recipe.train.inner_steps * recipe.train.batch_size


def test_one_replica_of_two_ranks_shards_parameters_and_matches_plain_training(nodes):
    recipe = tiny_recipe(**{"world.ranks_per_replica": 2, "train.outer_lr": 1.0, "train.outer_momentum": 0.0})
    _, states, placements = run_world(recipe, nodes)
    per_rank = placements[0]
    assert len(per_rank) == 2
    for name, info in per_rank[0].items():
        assert info["type"] == "DTensor", name
    big = [n for n, i in per_rank[0].items() if i["shape"][0] >= 2]
    assert big
    for name in big:
        shape = per_rank[0][name]["shape"]
        rows = [per_rank[r][name]["local_shape"][0] for r in range(2)]
        assert sum(rows) == shape[0] and max(rows) < shape[0], (name, rows)   # really split over the ranks
    # FSDP averages the two half-batch gradients: the same as one rank on the whole batch.
    assert_states_close(states[0], reference_diloco(recipe, replicas=1), atol=5e-5, rtol=5e-4)


def test_bfloat16_sync_stays_close_to_float32(nodes):
    recipe = tiny_recipe(**{"world.replicas": 2, "world.sync_dtype": "bfloat16"})
    _, states, _ = run_world(recipe, nodes)
    ref = reference_diloco(recipe, replicas=2)
    # bf16 has ~3 significant digits; the pseudo-gradients are small, so θ stays close.
    assert_states_close(states[0], ref, atol=2e-3, rtol=2e-2)
    assert_states_close(states[0], states[1], atol=0, rtol=0)


def test_notice_deadlines_end_the_phase_for_every_member_or_sit_the_late_out(nodes, monkeypatch):
    import time

    # Every inner step takes at least 10 ms (a slow VM), so a whole phase of 200 takes 2 s or more
    # on any machine: a notice 1 s ahead always ends it early, and leaves a loaded machine time to
    # start both members' phase before the deadline.
    monkeypatch.setenv("ELASTIC_FAULT_STEP_DELAY_S", "0.01")
    inner = 200
    recipe = tiny_recipe(**{"world.replicas": 2, "train.inner_steps": inner, "train.outer_steps": 3})
    world = World(recipe)
    try:
        ids = nodes(2)
        world.add_replicas([(f"vm{i}", node_id) for i, node_id in enumerate(ids)])
        a, b = sorted(world.replicas)
        # A deadline in the future ends the next phase for both (the noticed one contributes).
        world.request_stop(a, time.time() + 1.0)
        res = world.run_step()[0]
        assert res.replicas == [a, b] and all(0 < n < inner for n in res.steps_done.values()), res.steps_done
        assert world.inner_step == max(res.steps_done.values())
        # A request meant for that phase never touches the next one.
        res = world.run_step()[0]
        assert res.steps_done == {a: inner, b: inner}
        # A deadline already passed: the noticed replica sits the step out, the other trains it whole.
        cursor = world.cursor
        world.request_stop(b, time.time() - 1)
        res = world.run_step()[0]
        assert res.replicas == [a] and res.idle == [b] and res.steps_done == {a: inner}
        assert world.cursor == cursor + inner * recipe.train.batch_size      # no lease for the one sitting out
        # Every member late: no step is taken, and the result says who leaves.
        world.release(b)
        world.request_stop(a, time.time() - 1)
        step, inner = world.outer_step, world.inner_step
        res = world.run_step()[0]
        assert res.replicas == [] and res.idle == [a] and (world.outer_step, world.inner_step) == (step, inner)
    finally:
        world.shutdown()


def run_losses(recipe, nodes):
    """Train a world to the end; (last outer step's mean loss, each replica's θ, the last StepResult)."""
    world = World(recipe)
    try:
        ids = nodes(recipe.world.replicas, cpus=1)
        world.add_replicas([(f"vm{i}", node_id) for i, node_id in enumerate(ids)])
        while not world.done():
            res = world.run_step()[0]
        states = {rid: world.call_replica(rep, "full_state")[0] for rid, rep in world.replicas.items()}
        return sum(res.losses) / len(res.losses), states, res
    finally:
        world.shutdown()


def test_int8_and_sparse_worlds_train_like_float32_with_far_fewer_bytes(nodes):
    base = {"world.replicas": 2, "train.outer_steps": 6}
    loss32, _, res32 = run_losses(tiny_recipe(**base), nodes)
    loss8, s8, res8 = run_losses(tiny_recipe(**base, **{"world.sync_dtype": "int8"}), nodes)
    sparse, ss, res_sp = run_losses(tiny_recipe(**base, **{"world.sync": "sparse", "world.sync_density": 0.03,
                                                          "train.outer_momentum": 0.0, "train.outer_lr": 1.0}), nodes)
    assert_states_close(s8[0], s8[1], atol=0, rtol=0)   # identical θ on every replica
    assert_states_close(ss[0], ss[1], atol=0, rtol=0)
    assert abs(loss8 - loss32) <= 0.02 * loss32, (loss8, loss32)
    assert res32.bytes_sent / res8.bytes_sent > 3.5        # the tiny model's ragged last chunk costs a little
    assert res32.bytes_sent / res_sp.bytes_sent > 20
    assert sparse < math.log(256) - 0.3, (sparse, loss32)   # it trains (from uniform over bytes: ln 256)
