"""The executor: carries out a policy's actions, for the driver and the simulator alike.

A `Policy` decides from a `Snapshot` (elastic.policy.rules); the executor keeps what the policy carries
between decisions (`PolicyState`: its target, re-plan time, prices seen, pause, place, refusals),
feeds it back into each snapshot (`fed`), and applies every action in one place (`apply`). What
differs between the two sides is only how a VM is rented and let go, behind `Host`: the driver
launches on a provider in the background and drains a replica (ledger lines at the wall clock),
the simulator launches on a trace that may refuse it (events at the trace's time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from elastic.policy.market import Quote, offer_key
from elastic.policy.planner import Move
from elastic.policy.rules import (Action, HoldBack, HoldReason, Look, Pace, Pause, Place, Policy, PriceSeen, Refusal, Release, Rent,
                            Replan, Retarget, Snapshot, Unpause)
from elastic.record.events import (HeldBack, LaunchHeldBack, OnDemandEnded, OnDemandReason, OnDemandStarted, ReplicaMove,
                                   TargetReason, WorldTarget, WorldUnpaused)
from providers.base import Offer


class Host(Protocol):
    """Where the actions land: the driver (providers, the world, the ledger) or the simulator (a
    trace, its events)."""

    def record(self, event) -> None:
        """Append a ledger event (`elastic.record.events`), stamped with the host's clock."""

    def rent(self, quote: Quote, move: Move | None) -> bool:
        """Rent one VM of `quote.offer` (with `move`: it replaces `move.drain` once it trains);
        False when the offer refused it now (the executor then rests the offer and stops)."""

    def trains(self, instance_id: str) -> bool:
        """A replica on `instance_id` trains (a move's old replica is there to let go)."""

    def release(self, instance_id: str) -> None:
        """A move's old replica leaves at the next step boundary (or now, between steps) and its VM
        is released."""


@dataclass
class PolicyState:
    """What a policy carries between decisions, and what the host reads of them.

    Args:
        target_replicas, planned, last_replan_s, prices, priced_at_s, paused, place: fed back as
            the `Snapshot` fields of the same names (`Retarget`, `Replan`, `PriceSeen`, `Pause`,
            `Place`).
        refusals: launches refused within `planner.capacity_cooldown_s` (`Snapshot.refusals`).
        pause: a `Pause`'s reading of the market, until the host makes it take effect at the next
            outer-step boundary (`pause_took_effect`).
        paused_at_s: when the pause took effect (every VM released); None: not paused.
        unpaused: the world boots again after a pause (the driver starts no capacity wait for it).
        budget_held_back: the last launch wanted was held back by the budget.
        gave_up: the budget cannot pay for world.min_replicas and nothing is on its way.
        capacity_logged, budget_logged: `launch_held_back` written for this shortage / this run.
        spread_logged: `launch_held_back` (spread) written since the last launch.
        no_world_logged: `launch_held_back` (no_world) written since the last launch.
        timing_logged: `launch_held_back` (timing) written since the last launch.
        waits_for_capacity: the policy's `waits_for_capacity` on the last decision's snapshot: a
            shortage does not end the run after world.capacity_timeout_s.
        next_look_at_s: when the policy wants to decide again though nothing else changes
            (`Policy.next_look_s` on the last decision's snapshot, or a `Look` it decided if
            sooner; inf: only on a change).
        on_demand_since: when the deadline rule's first on-demand VM was rented (`on_demand_started`);
            None: no on-demand VM held for it.
    """

    target_replicas: int = 0
    planned: bool = False
    last_replan_s: float = -math.inf
    prices: tuple[tuple[float, float, str], ...] = ()
    priced_at_s: float = -math.inf
    paused: bool = False
    place: Offer | None = None
    refusals: list[Refusal] = field(default_factory=list)
    pause: Pace | None = None
    paused_at_s: float | None = None
    unpaused: bool = False
    budget_held_back: bool = False
    gave_up: bool = False
    capacity_logged: bool = False
    spread_logged: bool = False
    no_world_logged: bool = False
    timing_logged: bool = False
    budget_logged: bool = False
    waits_for_capacity: bool = False
    next_look_at_s: float = math.inf
    on_demand_since: float | None = None


class Executor:
    """Args:
        policy: the policy that decides.
        host: where its actions land.
        recipe: the run's recipe (planner.capacity_cooldown_s is read).
        started_s: the run's start on the host's clock: the first re-plan is due one
            planner.replan_every_s later.
    """

    def __init__(self, policy: Policy, host: Host, recipe, started_s: float):
        self.policy, self.host, self.recipe = policy, host, recipe
        self.state = PolicyState(last_replan_s=started_s)

    def fed(self, time_s: float) -> dict:
        """The policy's state as `Snapshot` fields, at `time_s` (refusals past their cooldown dropped)."""
        st = self.state
        cooldown_s = self.recipe.planner.capacity_cooldown_s
        st.refusals = [r for r in st.refusals if time_s - r.at_s < cooldown_s]
        return {"refusals": tuple(st.refusals), "target_replicas": st.target_replicas, "planned": st.planned,
                "last_replan_s": st.last_replan_s, "prices": st.prices, "priced_at_s": st.priced_at_s,
                "paused": st.paused, "place": st.place, "next_look_at_s": st.next_look_at_s}

    def refused(self, offer: Offer, at_s: float) -> None:
        """A launch of `offer` was refused at `at_s` (capacity, a VM that failed or never joined):
        it rests (the cooldown rule)."""
        self.state.refusals.append(Refusal(offer_key(offer), at_s, offer.spot))

    def pause_took_effect(self, at_s: float) -> Pace:
        """The host made the pending `Pause` take effect (every VM released) at `at_s`: its reading."""
        p, self.state.pause, self.state.paused_at_s = self.state.pause, None, at_s
        return p

    def act(self, s: Snapshot) -> bool:
        """Ask the policy on `s` (built with `fed`) and apply its actions; False when a launch was
        refused (the rest not done: ask again, the refused offer now resting)."""
        self.state.waits_for_capacity = self.policy.waits_for_capacity(s)
        self.state.next_look_at_s = s.time_s + self.policy.next_look_s(s)
        return self.apply(self.policy.decide(s), s)

    def apply(self, actions: list[Action], s: Snapshot) -> bool:
        """Carry out `actions`, decided on `s`, in order; False when a launch was refused (the
        actions after it are not done)."""
        st, now = self.state, s.time_s
        if st.on_demand_since is not None and s.recipe.resources.spot \
                and all(n.quote.offer.spot for n in s.nodes) and all(o.spot for o in s.pending):
            self.host.record(OnDemandEnded(held_s=round(now - st.on_demand_since, 3)))
            st.on_demand_since = None
        for a in actions:
            if isinstance(a, Retarget):
                st.target_replicas, st.planned = a.replicas, True
                if a.grown:
                    self.host.record(WorldTarget(replicas=a.replicas, reason=TargetReason.DEADLINE,
                                                 hours_to_finish=round(a.hours_to_finish, 4)))
            elif isinstance(a, Replan):
                st.last_replan_s = a.at_s
            elif isinstance(a, PriceSeen):
                st.prices, st.priced_at_s = a.kept(st.prices), a.at_s
            elif isinstance(a, Place):
                st.place = a.offer
            elif isinstance(a, Look):
                st.next_look_at_s = min(st.next_look_at_s, a.at_s)
            elif isinstance(a, Pause):   # takes effect at the next outer-step boundary (the host's)
                st.paused, st.pause = True, a.pace
                st.target_replicas, st.planned = 0, False   # the world is sized again when it unpauses
            elif isinstance(a, Unpause):
                st.paused, st.pause = False, None
                if st.paused_at_s is not None:
                    self.host.record(WorldUnpaused(paused_s=round(now - st.paused_at_s, 3),
                                                   usd_per_mtok=round(a.pace.usd_per_mtok, 6),
                                                   threshold_usd_per_mtok=round(a.pace.threshold_usd_per_mtok, 6),
                                                   need=round(a.pace.need, 4)))
                    st.paused_at_s, st.unpaused = None, True
            elif isinstance(a, HoldBack):
                self._held_back(a, s)
            elif isinstance(a, Release):   # a move whose old replica leaves now, not once the new one trains
                if self.host.trains(a.instance_id):
                    if a.move is not None:
                        self._record_move(a.move)
                    self.host.release(a.instance_id)
            elif isinstance(a, Rent):
                if not self.host.rent(a.quote, a.move):
                    self.refused(a.quote.offer, now)
                    return False
                st.capacity_logged = st.budget_held_back = st.spread_logged = st.no_world_logged = False
                st.timing_logged = False
                if a.deadline is not None and st.on_demand_since is None:
                    d = a.deadline
                    st.on_demand_since = now
                    self.host.record(OnDemandStarted(reason=OnDemandReason.DEADLINE, slack_s=round(d.slack_s, 3),
                                                     margin_s=round(d.margin_s, 3),
                                                     hours_needed=round(d.need_s / 3600, 4), replicas=d.replicas,
                                                     usd_expected=round(d.usd, 4)))
                if a.move is not None:
                    self._record_move(a.move)
        return True

    def _held_back(self, a: HoldBack, s: Snapshot) -> None:
        """A launch not made: `launch_held_back` once per capacity shortage, once per spread held
        back, once per wait for a world and once per launch timed for a step boundary (each until
        the next launch; a timing hold with nothing to launch, none), and once per run for the budget."""
        st = self.state
        if a.reason == HoldReason.SPREAD and not st.spread_logged:
            st.spread_logged = True
            self.host.record(LaunchHeldBack(reason=HeldBack.SPREAD, held=a.held, message=a.message))
        elif a.reason == HoldReason.NO_WORLD and not st.no_world_logged:
            st.no_world_logged = True
            self.host.record(LaunchHeldBack(reason=HeldBack.NO_WORLD, held=a.held, message=a.message))
        elif a.reason == HoldReason.TIMING and a.rent_at_s is not None and not st.timing_logged:
            st.timing_logged = True
            self.host.record(LaunchHeldBack(reason=HeldBack.TIMING, held=a.held, message=a.message))
        elif a.reason == HoldReason.CAPACITY and not st.capacity_logged:   # every offer is at its known capacity
            st.capacity_logged = True
            self.host.record(LaunchHeldBack(reason=HeldBack.CAPACITY, held=a.held,
                                            message="every offer the recipe allows is at its known capacity"))
        elif a.reason == HoldReason.BUDGET:
            st.capacity_logged, st.budget_held_back = False, True
            st.gave_up = st.gave_up or a.gives_up
            if not st.budget_logged:
                st.budget_logged = True
                self.host.record(LaunchHeldBack(reason=HeldBack.BUDGET, spent_usd=round(s.spent_usd, 6),
                                                usd_per_hour=a.usd_per_hour))

    def _record_move(self, move: Move) -> None:
        self.host.record(ReplicaMove(drain_instance_id=move.drain, zone=move.add.offer.zone,
                                     instance_type=move.add.offer.instance_type,
                                     usd_per_hour=move.add.offer.usd_per_hour,
                                     usd_per_mtok_before=round(move.usd_per_mtok_before, 6),
                                     usd_per_mtok_after=round(move.usd_per_mtok_after, 6)))
