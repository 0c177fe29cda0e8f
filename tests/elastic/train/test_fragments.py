"""Streaming DiLoCo (`world.fragments`): fragments synced in a background thread while the inner
phase trains, their outer update applied with the delayed-application rule; a member lost during a
fragment's sync, and a joiner copying every fragment's state.

The first tests drive `elastic.train.diloco.Fragments` directly, one thread per member over real gloo
groups and a TCPStore on loopback; the others run a `World` on the local Ray cluster."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elastic.train.diloco import Fragments, OuterState, fragment_schedule, split_fragments
from elastic.train.outer_sync import make_codec
from elastic.train.world import Loss, World
from tests.conftest import tiny_recipe


def test_fragments_are_contiguous_balanced_and_scheduled_inside_the_phase():
    assert split_fragments([10, 1, 1, 10, 5, 5, 1], 3) == [range(0, 2), range(2, 4), range(4, 7)]
    assert split_fragments([100, 1, 1], 3) == [range(0, 1), range(1, 2), range(2, 3)]   # never empty
    with pytest.raises(ValueError):
        split_fragments([1, 1], 3)
    # H = 20, N = 4: slots of 5 steps, each sync overlapping the 2 steps before its apply point.
    assert fragment_schedule(20, 4) == [(3, 5), (8, 10), (13, 15), (18, 20)]
    assert fragment_schedule(20, 1) == [(20, 20)]


def _members(n: int, fragments: int, inner_steps: int, codec: str = "float32"):
    """n members' (params, Fragments) of the same seeded toy model, one parameter per fragment."""
    out = []
    for _ in range(n):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(64 + 8 * i)) for i in range(fragments)]
        frag = Fragments(params, fragments, inner_steps,
                         lambda ps: OuterState(ps, 0.7, 0.9, True,
                                               lambda numel: make_codec(numel, "dense", codec, True, 0.02, 0.95)))
        out.append((params, frag))
    return out


def _phase(members, store_port: int, key: str, epoch: int, inner_steps: int, stop_at: dict | None = None):
    """Every member trains one inner phase at once (a fixed member-specific nudge per step), its
    fragments streamed; member i stops after stop_at[i] steps. Returns each member's end_phase."""
    device = dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
    out = [None] * len(members)

    def run(i):
        params, frag = members[i]
        store = dist.TCPStore("127.0.0.1", store_port, is_master=False)
        frag.begin_phase(store, key, (epoch, i, len(members)), 10, 0, device)
        for h in range((stop_at or {}).get(i, inner_steps)):
            with torch.no_grad():
                for j, p in enumerate(params):
                    p.add_(0.01 * (i + 1) * (j + 1))
            frag.after_inner_step(h + 1)
        out[i] = frag.end_phase()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(members))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return out


def _blocking_sync(members, store_port: int, epoch: int):
    device = dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")

    def run(i):
        frag = members[i][1]
        if frag.pending:
            frag.join_group(dist.TCPStore("127.0.0.1", store_port, is_master=False), epoch, i, len(members), 10,
                            shard=0, device=device)
        frag.all_reduce(i, len(members))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(members))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for _, frag in members:
        frag.apply()


@pytest.fixture
def store():
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))
    yield s


@pytest.mark.parametrize("codec", ["float32", "int8"])
def test_streamed_fragments_apply_in_the_phase_with_the_delayed_rule(store, codec):
    h = 8
    members = _members(2, 4, h, codec)
    before = [p.detach().clone() for p in members[0][0]]
    ends = _phase(members, store.port, "p0", 0, h)
    assert ends == [{"pending": 0, "fresh_group": False}] * 2   # every fragment applied during the phase
    theta = [frag.theta for _, frag in members]
    assert torch.equal(theta[0], theta[1])   # the same θ_outer on both
    assert not torch.equal(theta[0], torch.cat(before))
    # θ_local = θ_outer_new + every step trained after the fragment's Δ was formed (at `start`),
    # those overlapping its sync included.
    for (params, frag), i in zip(members, range(2)):
        for j, ((start, _), p) in enumerate(zip(fragment_schedule(h, 4), params)):
            drift = 0.01 * (i + 1) * (j + 1) * (h - start)
            torch.testing.assert_close(p.detach(), frag.parts[j].theta.data + drift, rtol=0, atol=1e-5)
    frag = members[0][1]
    assert frag.bytes_sent > 0 and frag.network_s > 0 and frag.wait_s <= frag.network_s
    _blocking_sync(members, store.port, 0)   # nothing pending: no group needed, nothing changes
    assert torch.equal(members[0][1].theta, theta[0])


def test_a_member_whose_phase_ends_early_syncs_the_rest_at_its_end(store):
    h = 8
    members = _members(3, 4, h)
    # Member 2's phase ends after 3 steps (a notice): it starts fragments 1 to 3 then, with the Δ
    # it has, and its peers, further along, meet it in those collectives: nothing is left over.
    t0 = time.monotonic()
    ends = _phase(members, store.port, "p1", 0, h, stop_at={2: 3})
    assert time.monotonic() - t0 < 5   # nobody waited for a collective's timeout (10 s)
    assert ends == [{"pending": 0, "fresh_group": False}] * 3
    theta = [frag.theta for _, frag in members]
    assert torch.equal(theta[0], theta[1]) and torch.equal(theta[0], theta[2])


def test_a_decision_settled_as_abort_leaves_the_fragment_pending_on_every_member(store):
    h = 8
    members = _members(2, 4, h)
    # The driver dropped a member of this phase: every fragment not yet decided is aborted.
    for f in range(4):
        store.compare_set(f"p2/{f}", "", "abort")
    ends = _phase(members, store.port, "p2", 0, h)
    assert ends == [{"pending": 4, "fresh_group": True}] * 2
    assert all(frag.pending == [0, 1, 2, 3] for _, frag in members)
    _blocking_sync(members, store.port, 2)   # over a fresh group (the driver bumped the epoch)
    assert torch.equal(members[0][1].theta, members[1][1].theta)


# -- on the local Ray cluster -------------------------------------------------------------------------

def _theta(world, rep) -> torch.Tensor:
    return world.call_replica(rep, "outer_state")[0]["theta"]


def _world(recipe, nodes, n: int) -> tuple[World, list[str]]:
    """A world of `world.replicas` replicas on n nodes; (it, the nodes left over)."""
    world = World(recipe)
    ids = nodes(n)
    world.add_replicas([(f"vm{i}", node_id) for i, node_id in enumerate(ids[:recipe.world.replicas])])
    return world, ids[recipe.world.replicas:]


@pytest.mark.slow
def test_a_fragmented_world_trains_like_one_fragment_with_identical_theta(nodes):
    base = {"world.replicas": 2, "train.outer_steps": 5, "train.inner_steps": 8, "model.layers": 2}
    results = {}
    for n in (1, 4):
        world, _ = _world(tiny_recipe(**base, **{"world.fragments": n}), nodes, 2)
        try:
            losses = []
            while not world.done():
                res = world.run_step()[0]
                assert res.replicas == [0, 1]
                losses.append(sum(res.losses) / len(res.losses))
            theta = [_theta(world, rep) for rep in world.replicas.values()]
            assert torch.equal(theta[0], theta[1])   # every fragment synced: one θ_outer
            results[n] = (losses, res)
        finally:
            world.shutdown()
    (one, res1), (four, res4) = results[1], results[4]
    assert four[-1] < four[0] - 0.3, four   # it learns
    assert abs(four[-1] - one[-1]) <= 0.03 * one[-1], (four, one)
    assert res4.bytes_sent == res1.bytes_sent   # the same bytes, streamed
    assert res4.overlapped_s > 0 and res1.overlapped_s == 0 and res1.wait_s > 0


@pytest.mark.slow
def test_a_replica_killed_during_a_fragment_sync_is_dropped_and_the_survivors_continue(nodes, monkeypatch):
    import ray

    # Inner steps of 0.1 s (the ranks' fault hook; set before the nodes start): the phase outlasts
    # the driver's 0.1 s pauses after fragment 0 is decided, so the kill lands inside the phase.
    monkeypatch.setenv("ELASTIC_FAULT_STEP_DELAY_S", "0.1")

    recipe = tiny_recipe(**{"world.replicas": 3, "world.fragments": 4, "train.outer_steps": 3,
                            "train.inner_steps": 8, "world.sync_timeout_s": 10})
    world, _ = _world(recipe, nodes, 3)
    try:
        world.run_step()
        victim = world.replicas[2]
        killed, happened = False, []
        key = f"frag/{world.epoch}/{world.inner_step}/0/0"   # the phase's first fragment, shard 0
        while not (happened and type(happened[-1]).__name__ == "StepDone"):
            happened += world.step()
            if not killed and world.phase == "inner" and world._store.check([key]):
                # Fragment 0 was decided; fragment 1's sync is under way or about to start.
                ray.kill(victim.actors[0], no_restart=True)
                killed = True
        res = happened[-1].result
        assert killed and res.replicas == [0, 1]
        assert [(h.replica_id, h.phase) for h in happened if isinstance(h, Loss)] == [(2, "inner")]
        assert torch.equal(_theta(world, world.replicas[0]), _theta(world, world.replicas[1]))
        res, _ = world.run_step()   # the survivors go on streaming over their own group
        assert res.replicas == [0, 1] and res.overlapped_s > 0
        assert torch.equal(_theta(world, world.replicas[0]), _theta(world, world.replicas[1]))
    finally:
        world.shutdown()


@pytest.mark.slow
def test_a_joiner_copies_every_fragments_state_and_holds_the_worlds_theta(nodes):
    recipe = tiny_recipe(**{"world.replicas": 2, "world.max_replicas": 3, "world.fragments": 4,
                            "world.sync_dtype": "int8", "train.outer_steps": 6, "train.inner_steps": 8})
    world, spare = _world(recipe, nodes, 3)
    try:
        world.run_step()
        joiner = world.start_replica("vm2", spare[0])
        deadline = time.monotonic() + 60
        while not world.ready_joiners():
            assert time.monotonic() < deadline
            time.sleep(0.1)   # polling the joiner's setup with a deadline
        assert world.begin_copy(joiner)
        admitted = []
        while not admitted:
            world.run_step()   # fragments applied during these phases are replayed by the joiner
            admitted = world.admit_copied()
        donor = world.call_replica(world.replicas[0], "outer_state")[0]
        mine = world.call_replica(joiner, "outer_state")[0]
        for what in ("theta", "momentum"):   # every fragment's
            assert torch.equal(donor[what], mine[what]), what
        # The donor's error feedback as of its snapshot (each rank's own from then on), in every
        # fragment's range (one rank per replica: its shard is the whole model).
        numels = [v.numel() for v in world.call_replica(joiner, "full_state")[0].values()]
        pieces = mine["error"].split([sum(numels[i] for i in r) for r in split_fragments(numels, 4)])
        assert all(piece.abs().sum() > 0 for piece in pieces)
        res, _ = world.run_step()
        assert res.replicas == [0, 1, joiner.replica_id]
        thetas = [_theta(world, rep) for rep in world.replicas.values()]
        assert all(torch.equal(thetas[0], t) for t in thetas[1:])
    finally:
        world.shutdown()


@pytest.mark.slow
def test_a_checkpoint_restores_theta_outer_across_fragment_counts(nodes, tmp_path):
    """A streamed world's checkpoint keeps θ_outer beside θ_local (they differ between outer
    steps); worlds of 1 and of 4 fragments both restore θ_outer exactly and start from it (the
    world's agreed state, where every replica's θ_local starts), and a 1-fragment checkpoint
    restores into a streamed world with θ_outer = its parameters."""
    base = {"world.replicas": 1, "train.outer_steps": 3, "train.inner_steps": 8}
    streamed, plain = str(tmp_path / "four"), str(tmp_path / "one")

    def flat(params: dict) -> torch.Tensor:
        return torch.cat([p.reshape(-1) for p in params.values()])

    def run(n: int, *steps):
        """A 1-replica world of n fragments doing `steps` (callables of the world and its replica)."""
        world, _ = _world(tiny_recipe(**base, **{"world.fragments": n}), nodes, 1)
        try:
            return [step(world, world.lead_replica()) for step in steps]
        finally:
            world.shutdown()

    def save(path: str):
        def step(world, rep):
            world.call_replica(rep, "save_checkpoint", path)
            world.call_replica(rep, "wait_saved")
            return flat(world.call_replica(rep, "full_state")[0]), _theta(world, rep)
        return step

    def load(path: str):
        def step(world, rep):
            world.call_replica(rep, "load_checkpoint", path)
            return flat(world.call_replica(rep, "full_state")[0]), _theta(world, rep)
        return step

    def train(world, rep):
        world.run_step()

    _, (local4, outer4) = run(4, train, save(streamed))
    assert not torch.equal(local4, outer4)   # θ_local ≠ θ_outer between outer steps
    (params, theta), _, (local1, outer1) = run(1, load(streamed), train, save(plain))
    assert torch.equal(theta, outer4) and torch.equal(params, outer4)
    assert torch.equal(local1, outer1)   # one fragment: θ_local = θ_outer at the boundary
    (params, theta), (params2, theta2) = run(4, load(plain), load(streamed))
    assert torch.equal(theta, outer1) and torch.equal(params, outer1)
    assert torch.equal(theta2, outer4) and torch.equal(params2, outer4)
