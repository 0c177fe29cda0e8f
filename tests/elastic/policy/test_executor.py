"""The executor applies each kind of action to the policy's state and its host (a fake: no Ray, no
provider), and feeds the state back into the next snapshot."""

from __future__ import annotations

from elastic.policy.executor import Executor
from elastic.policy.planner import Move
from elastic.policy.rules import (ElasticPolicy, HoldBack, Pace, Pause, Place, PriceSeen, Release, Rent, Replan, Retarget,
                            Snapshot, Unpause)
from tests.elastic.policy.test_planner import offer, quote, recipe


class FakeHost:
    """Records what the executor asks; refuses launches of the zones in `refuse`."""

    def __init__(self, refuse=(), training=("old",)):
        self.events, self.rented, self.released = [], [], []
        self.refuse, self.training = set(refuse), set(training)

    def record(self, event) -> None:
        self.events.append(event.TYPE)

    def rent(self, q, move) -> bool:
        if q.offer.zone in self.refuse:
            return False
        self.rented.append((q.offer.zone, move.drain if move else None))
        return True

    def trains(self, instance_id: str) -> bool:
        return instance_id in self.training

    def release(self, instance_id: str) -> None:
        self.released.append(instance_id)


def executor(host, **kw):
    r = recipe(**kw)
    return Executor(ElasticPolicy(), host, r, started_s=5.0), r


def test_each_action_lands_in_the_state_or_the_host_and_comes_back_in_the_snapshot():
    host = FakeHost()
    ex, r = executor(host)
    assert ex.fed(5.0)["last_replan_s"] == 5.0
    new, old = quote(offer("r2a", 5.0)), quote(offer("r1a", 9.0))
    move = Move(new, "old", 0.2, 0.1)
    pace = Pace(0.3, 0.2, 0.5, trains=False)
    s = Snapshot(r, 100.0, spent_usd=1.5)
    assert ex.apply([Retarget(5, 3.0, grown=True), Replan(100.0), PriceSeen(100.0, 0.3, 900.0, "estimate"),
                     Place(old.offer), Release("old", move), Release("gone", move), Rent(new, move=move), Rent(new),
                     HoldBack("capacity", held=5), HoldBack("capacity", held=5)], s)
    fed = ex.fed(100.0)
    assert (fed["target_replicas"], fed["planned"], fed["last_replan_s"]) == (5, True, 100.0)
    assert fed["prices"] == ((0.3, 900.0, "estimate"),) and fed["priced_at_s"] == 100.0
    assert fed["place"] == old.offer
    assert host.released == ["old"] and host.rented == [("r2a", "old"), ("r2a", None)]
    # One replica_move per move carried out (none for a replica not training), one line per shortage.
    assert host.events == ["world_target", "replica_move", "replica_move", "launch_held_back"]

    # A refused launch rests its offer and stops the batch.
    host.refuse.add("r2a")
    assert not ex.apply([Rent(new), Rent(old)], Snapshot(r, 110.0))
    assert [x.key for x in ex.fed(110.0)["refusals"]] == [new.key] and host.rented[-1] == ("r2a", None)
    assert ex.fed(110.0 + r.planner.capacity_cooldown_s)["refusals"] == ()   # rested long enough

    # Pause: the world's target is forgotten until it unpauses; the host makes it take effect.
    ex.apply([Pause(pace)], Snapshot(r, 120.0))
    assert ex.fed(120.0)["paused"] and ex.state.pause == pace and ex.fed(120.0)["target_replicas"] == 0
    assert ex.pause_took_effect(130.0) == pace and ex.state.pause is None
    ex.apply([Unpause(pace)], Snapshot(r, 190.0))
    assert not ex.fed(190.0)["paused"] and ex.state.unpaused and host.events[-1] == "world_unpaused"

    # The budget: one line per run, and a hold-back that gives up says so.
    ex.apply([HoldBack("budget", held=1, usd_per_hour=5.0), HoldBack("budget", held=1, gives_up=True)],
             Snapshot(r, 200.0))
    assert ex.state.budget_held_back and ex.state.gave_up and host.events.count("launch_held_back") == 2

    # A spread held back: one line (with why) until the next launch, then again.
    host.events.clear()
    ex.apply([HoldBack("spread", held=3, message="why"), HoldBack("spread", held=3, message="why")], Snapshot(r, 300.0))
    assert host.events == ["launch_held_back"]
    host.refuse.clear()
    ex.apply([Rent(old), HoldBack("spread", held=4, message="why")], Snapshot(r, 310.0))
    assert host.events == ["launch_held_back", "launch_held_back"]

    # A wait for a world (no_world): one line until the next launch, then again.
    host.events.clear()
    ex.apply([HoldBack("no_world", held=0, message="why"), HoldBack("no_world", held=0, message="why")],
             Snapshot(r, 400.0))
    assert host.events == ["launch_held_back"]
    ex.apply([Rent(old), HoldBack("no_world", held=1, message="why")], Snapshot(r, 410.0))
    assert host.events == ["launch_held_back", "launch_held_back"]

    # A launch timed for a step boundary: one line (with when) until the next launch, then again.
    host.events.clear()
    ex.apply([HoldBack("timing", held=3, message="when", rent_at_s=600.0)] * 2, Snapshot(r, 500.0))
    assert host.events == ["launch_held_back"]
    ex.apply([Rent(old), HoldBack("timing", held=4, message="when", rent_at_s=700.0)], Snapshot(r, 610.0))
    assert host.events == ["launch_held_back", "launch_held_back"]
    ex.apply([Rent(old), HoldBack("timing", held=5)], Snapshot(r, 620.0))   # nothing it could launch: no line
    assert host.events == ["launch_held_back", "launch_held_back"]
