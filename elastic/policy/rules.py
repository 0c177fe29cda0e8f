"""Rental policies: what to rent, move, hold back or stop, as a pure function of a snapshot.

A `Policy` decides from a `Snapshot` and returns actions (`Rent`, `Release`, ...); one executor
(`elastic.policy.executor`) carries them out, for the driver against the providers and the world, for
`elastic simulate` against a trace. Policies are chosen by name from `elastic.policy.registry.POLICIES`
(the recipe's `planner.policy`, `elastic simulate --policy`). Nothing here reads a clock, does I/O
or talks to a cloud: the snapshot carries the time, what is held, what is offered (quoted by the
market, its learnt risks included), how far the run is, what it has spent and what the policy
carried over from its last decisions (fed back by the executor). The `elastic` policy's rules
(`ElasticPolicy`; the baselines are in `elastic.policy.baselines`), each written once:

- **cooldown**: an offer that refused capacity (or whose VM failed to come up) rests
  `planner.capacity_cooldown_s` from the refusal (with an on-demand fallback for the deadline, a
  spot offer whose VM was reclaimed within two minutes of its launch rests as long: the market
  leaves it out of the quotes, `elastic.policy.market.RECLAIMED_EARLY_S`);
- **probe** (spot offers that show no capacity, as AWS's and GCP's): where the spot replicas held
  and the room known (a trace's capacity, or what a refusal beside the run's own VMs taught,
  `Quote.capacity_learned`) fall short of world.min_replicas, launches go only to the offers of
  unknown room (`_probes`), so a zone known to hold only the VM it would get is not rented while
  the others may refuse (on the real two-zone V100 trace, capacity hidden: 164 → 110 spot launches
  a run, 67 → 13 let go within a minute); once they refuse, every room is known and the deadline's
  pairing and no-world rules judge;
- **renting**: up to the world's target size (world.replicas, grown when budget.max_hours needs a
  bigger world; world.max_replicas under the pause rule), counting nodes held, booting and on
  their way, not those leaving; each launch where the planner says (`planner.choose_launch`), at
  once, inside an outer step too, but while a world of world.min_replicas trains and no training
  replica was lost within `QUIET_AFTER_LOSS_S`, timed to end its boot just before the step
  boundary it joins at (`_rent_at_s`);
- **re-plan**: once `planner.replan_every_s` has passed since the last one, the world is steady
  (nothing booting, renting, leaving or moving) and no outer step is under way (a replica joins
  only at a step boundary), grow the target if the deadline needs it and move the replicas a
  clearly cheaper offer beats (`planner.replan_all`; the whole world when its region rests after a
  spike of preemptions). The new VM is rented; the old one leaves at once (`Release`)
  when its tokens cost more than the new VM's, boot included (`planner.leaves_at_once`), and the
  new offer's capacity is known to have room (a real cloud's offers say none, and a launch there
  may be refused), else drains once the new one trains;
- **deadline** (with budget.max_hours, a spot recipe and on-demand offers in the snapshot): the
  slack is the time left to the deadline less what the cheapest on-demand world of
  world.max_replicas would need to train the rest (one boot included). While spot is short and the
  slack is above `ON_DEMAND_MARGIN` of that need (at least two phases and a boot), the run waits
  for spot; at the margin, the world grows to world.max_replicas and every launch is the
  planner's pick among spot and on-demand offers together (`OnDemandNeed`): on-demand where spot
  has no room, spot where it has. A re-plan then moves on-demand replicas to spot once spot is back
  (the planner's usual move, hysteresis and payback: the old VM trains until the new one does, so
  the pace holds). While on-demand could still finish the run within the deadline and
  budget.max_usd, a shortage never ends the run (`waits_for_capacity`: world.capacity_timeout_s
  does not apply). Before the margin, where the spot market's known capacity has room for at least
  one replica but fewer than world.min_replicas and the run is more than `PAIR_BEHIND_S` (an
  hour of its pace) and `PAIR_BEHIND_SHARE` (a tenth) of the time left behind the straight line
  from its start to budget.max_hours (`_pairing_threshold_s`), the spot
  replicas are paired with on-demand ones up to world.min_replicas (`_pairs`), each once a spot
  replica has lived `RECLAIMED_EARLY_S` (two minutes; booting still, so both boots overlap, and
  the policy looks again at that moment, `Look`): the world trains at a mix of spot and on-demand prices
  while it would stand still, and less is left for the all on-demand world at the margin (on the
  real two-zone V100 trace, $157 → $125 a run). Before the margin, an on-demand replica leaves
  (`_spare_on_demand`) once world.min_replicas spot replicas train, and when no spot replica is
  left to pair it with (the partner was preempted): it would bill on-demand hours for nothing, or
  for what spot trains alone ($125 → $115 on that trace; no other trace's figure moves); and
  once the run is `PAIR_AHEAD_S` of the line's pace ahead of it: the pairing keeps the run on its
  line, and ahead of it the run waits for spot as it would unpaired (a paired world trains at
  twice the line's pace on that trace, and ran on until the run finished hours early, before the
  trace's last spells of spot in both zones: 1.25× → 1.20× the bound that keeps
  world.min_replicas there; no other trace or window moves). Pairing only once the run is an hour
  behind, not at once, spares the on-demand hours of runs that fall minutes behind while their VMs
  boot and then run ahead on spot (on the real two-zone V100 trace $118.88 → $118.11, 1.20× →
  1.19×, and $0.89 and $1.22 less at 72 and 168 h, $0.14 more at 144 h; on 30 two-zone markets
  no rule was tuned on, 11 cheaper and 2 dearer, $3,888.59 → $3,867.67 in all). The tenth of the
  time left on top: far from the deadline, spot worlds that come back a share of the time catch
  up on their own (they train faster than the line), so the run waits for them longer than near
  it ($117.27 → $113.99, 1.18× → 1.15× on the real two-zone trace; on the 30 two-zone markets, 10
  cheaper and 6 dearer, $3,838.59 → $3,819.94, median 1.11× → 1.09×). And
  where the known capacity cannot hold world.min_replicas spot replicas, none is held on-demand
  and the run is not that far behind that line, no spot replica is kept waiting for a
  partner (`_waits_for_world`): they are let go and none is rented (`launch_held_back`, reason
  `no_world`, once per spell) until spot has room for a world, the run falls that far
  behind the line (the pairing) or the margin comes. A replica alone bills and trains nothing, and
  waiting costs no time: when a second zone comes back, both boot at once (on the real two-zone
  V100 trace 1.26× → 1.25× the bound that keeps world.min_replicas, and 1.16-1.41× → 1.07-1.32×
  on its windows at 72-336 h; docs/benchmarks.md);
- **spread** (with budget.max_hours): a replica that would spread the world to a site (`cloud/region`)
  it is not in yet, so that every outer sync of every replica waits on the cross-site link
  (`planner.sync_penalty_s`), is not rented while its tokens would cost more than `SPREAD_TOLERANCE`
  times the world's (its price and the wait it adds to the others, over the tokens it adds) and
  the world already held (at least world.min_replicas) trains the rest, one boot included, within
  `SPREAD_PACE` of the time `hours_left` gives it (`_spreads_dear`; `launch_held_back` with reason
  `spread`, once per spell). The slack left is the deadline rule's: it rents on-demand when the
  world falls behind. On the real V100 traces, where zones hold one VM each, the fourth replica
  of a world otherwise crosses regions: 1.09× → 1.05× the bound on aws-v100-3zones, 1.08× →
  1.05× on aws-v100-9zones (docs/benchmarks.md);
- **budget**: a launch must leave the spend within budget.max_usd for its cloud's billing minimum
  (or until the budget is next checked, when longer) of every held VM and the new one
  (`launch_fits_budget`, inside `decide`); an outer step (or a wait) must not carry the spend past
  budget.max_usd nor the run past budget.max_hours (`stop_for_budget`, asked before each step);
- **pause** (with budget.max_hours and `planner.pauses`): the world is world.max_replicas and trains
  while the market's price now (`market_price`: the planner's world of that size, USD per 1M useful
  tokens) is at most θ, up to `HYSTERESIS` θ once training. θ is read off the prices seen so far
  (one sample per `planner.price_sample_s`, each standing for an equal share of the hours left to
  the deadline): the least price whose samples at or below it would train `planner.pause_slack` ×
  (the tokens left and one boot), plus two outer steps, at their own pace, and at least `MIN_SHARE`
  of what all of them would (`pace`). Dearer, it pauses (`Pause`: a checkpoint at the next
  outer-step boundary, every VM released, the wait not counted as a capacity shortage), and rents
  again (`Unpause`) once the price is at most `UNPAUSE_AT` θ or the deadline needs `GO_ON_NEED` of
  the time left. It never pauses on fewer than `MIN_SAMPLES` prices, with launches under way or
  with a replica booting. While training, a replica dearer than `HYSTERESIS` θ leaves at once when
  the planner's launch in its place is `DEAR_SAVING` cheaper (`_dear`). This is the shape of
  elastic/sim/bound.py's bound on a volatile market (every VM through the cheap spells, none in
  between) played with only the past in hand: the market's future is taken to look like its past;
- **checkpoint**: at an outer-step boundary with progress not saved yet, save every
  `checkpoint.every_outer_steps`, when the run has trained what it needs, when every replica
  training is leaving (their notices came: the world is about to empty and would restart from the
  last checkpoint), and when the run ends early (`checkpoint_due`, asked at each boundary before
  the leaving replicas go, and when the run stops).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar

from elastic.policy.market import RECLAIMED_EARLY_S, Key, Quote, offer_key
from elastic.policy.planner import (Move, Progress, choose_launch, evaluate, hours_left, hours_to_finish,
                             launch_usd_per_mtok, leaves_at_once, plan, replan_all, run_tokens, site, speed_source,
                             tokens_per_phase, usd_per_mtok)
from elastic.record import billing
from providers.base import Offer

PRICE_HISTORY = 4032     # samples kept: two weeks at one per 5 minutes
MIN_SAMPLES = 12         # an hour of prices before the policy ever pauses
HYSTERESIS = 1.3         # once training, it goes on up to this many times θ
UNPAUSE_AT = 1.05        # paused, it trains again at this many times θ (a price as cheap as θ, within noise)
MIN_SHARE = 0.05         # θ is never below the price of the cheapest 5 % of the samples' tokens (not an outlier)
DEAR_SAVING = 0.25       # a replica dearer than HYSTERESIS θ leaves for a launch this much cheaper
GO_ON_NEED = 0.95        # at this share of the time left needed, it trains whatever the price
ON_DEMAND_MARGIN = 0.10  # slack kept, as a share of the on-demand world's hours to finish the rest
SPREAD_TOLERANCE = 1.05  # a replica that spreads the world may cost this much more per token than the world
SPREAD_PACE = 0.5        # ... or more, while the world held finishes within this share of the time left
PAIR_AHEAD_S = 3600.0    # a pairing's on-demand replica leaves once the run is this far ahead of its line (s of its pace)
PAIR_BEHIND_S = 3600.0   # ... and is rented only once the run is more than this far behind it
PAIR_BEHIND_SHARE = 0.1  # ... plus this share of the time left to budget.max_hours (s of the line's pace)
JOIN_MARGIN = 0.1        # a launch timed for the step boundary it joins at is made this share of a step early
RENT_TICK_S = 1.0        # ... and at once when that is within this many seconds of now
QUIET_AFTER_LOSS_S = 3600.0   # ... and at once within this long of a training replica's loss (losses come in storms)
LOOK_PAST_S = 1e-3       # a wake-up (the deadline rule's margin, a spot replica's age) lands this far past it (s)


@dataclass(frozen=True)
class Node:
    """A VM the run holds.

    Args:
        instance_id: the provider's id.
        quote: its offer at the price in effect now, with the market's risk.
        launched_at_s: when it was launched (the snapshot's clock).
        ready: its replica trains (False: booting, joining, copying state).
        leaving: it is going (a notice came, or a move's replacement trains): not counted in the world.
        notice_deadline_s: when a notice says it goes, else None.
        moving: a move's replacement is on its way for it.
    """

    instance_id: str
    quote: Quote
    launched_at_s: float
    ready: bool = True
    leaving: bool = False
    notice_deadline_s: float | None = None
    moving: bool = False


@dataclass(frozen=True)
class Refusal:
    """A launch an offer refused (capacity error, a VM that failed or never joined).

    Args:
        key: the offer's market key.
        at_s: when (the snapshot's clock).
        spot: the launch was spot (a spot refusal does not rest the same VM on demand, nor the
            other way round).
    """

    key: Key
    at_s: float
    spot: bool = True


@dataclass(frozen=True)
class Snapshot:
    """What the policy sees, at one moment.

    Args:
        recipe: the run's recipe (world, planner and budget sections are read).
        time_s: now (unix seconds for the driver, trace seconds for the simulator).
        started_s: when the run started (budget.max_hours counts from here).
        nodes: VMs held.
        pending: offers of launches under way (no VM to show yet).
        quotes: what can be rented now, quoted by the market (regions resting after a spike of
            preemptions already left out).
        progress: tokens and outer steps done, hours since the start.
        spent_usd: USD billed so far (`elastic.record.billing`).
        refusals: recent launch refusals.
        target_replicas: the world's target size so far.
        planned: the target was sized for budget.max_hours at least once.
        last_replan_s: when the policy last re-planned.
        budget_horizon_s: seconds until the budget is next checked (the last outer step's length).
        checkpointed_step: the outer step of the newest checkpoint saved (or restored from); 0: none.
        prices: the market's price, pace and the pace's source (`market_price`: USD per 1M useful
            tokens, useful tokens/s, `measured`/`estimate`/`partly measured`) at each sample so
            far, oldest first (`PriceSeen`; at most `PRICE_HISTORY`).
        priced_at_s: when the last sample was taken.
        paused: the policy paused the run (`Pause`) and has not unpaused it.
        place: where a whole-job baseline keeps its world (`Place`); None: not chosen yet.
        on_demand_quotes: on-demand offers, quoted by the market, for a spot recipe with
            budget.max_hours (the deadline rule's fallback) or a policy that falls back on them
            (`Policy.on_demand_fallback`); empty otherwise.
        next_look_at_s: when the policy asked, at its last decision, to decide again though nothing
            else changes (`Policy.next_look_s`; the deadline rule's margin): `due` says so then.
        between_steps: no outer step is under way (between two, or waiting for a world): a re-plan
            is made only then (`_replan_due`).
        step_end_s: when the outer step under way is expected to end (between steps: the next
            one's, the world going on at once); None: unknown, or no world trains.
        step_s: the expected length of an outer step (the last one's); 0: unknown.
        member_lost_at_s: when a replica of the world (not one still joining) was last lost
            (preempted, or gone after a notice); -inf: none yet.
    """

    recipe: object
    time_s: float
    started_s: float = 0.0
    nodes: tuple[Node, ...] = ()
    pending: tuple[Offer, ...] = ()
    quotes: tuple[Quote, ...] = ()
    progress: Progress = Progress()
    spent_usd: float = 0.0
    refusals: tuple[Refusal, ...] = ()
    target_replicas: int = 0
    planned: bool = False
    last_replan_s: float = float("-inf")
    budget_horizon_s: float = 0.0
    checkpointed_step: int = 0
    prices: tuple[tuple[float, float, str], ...] = ()
    priced_at_s: float = float("-inf")
    paused: bool = False
    place: Offer | None = None
    on_demand_quotes: tuple[Quote, ...] = ()
    next_look_at_s: float = float("inf")
    between_steps: bool = True
    step_end_s: float | None = None
    step_s: float = 0.0
    member_lost_at_s: float = float("-inf")


@dataclass(frozen=True)
class OnDemandNeed:
    """The deadline rule's reading (see the module's docstring).

    Args:
        slack_s: seconds left to budget.max_hours less `need_s` (negative: on-demand is too slow).
        margin_s: the slack the rule keeps; below it, on-demand replicas are rented.
        need_s: seconds the cheapest on-demand world of world.max_replicas needs to train the rest,
            one boot included.
        usd: what that world is expected to cost for it (USD), if spot stays out.
        replicas: its size.
        fits_budget: the spend so far plus `usd` stays within budget.max_usd.
    """

    slack_s: float
    margin_s: float
    need_s: float
    usd: float
    replicas: int
    fits_budget: bool

    @property
    def late(self) -> bool:
        """The deadline needs on-demand replicas now."""
        return self.slack_s < self.margin_s

    @property
    def can_finish(self) -> bool:
        """On-demand could still finish the run within the deadline and budget.max_usd."""
        return self.slack_s >= 0 and self.fits_budget


@dataclass(frozen=True)
class Rent:
    """Rent one VM from `quote.offer`; with `move`, it replaces `move.drain` once it trains;
    `deadline`: rented because the deadline needs it (an on-demand offer in a spot run)."""

    quote: Quote
    move: Move | None = None
    deadline: OnDemandNeed | None = None


@dataclass(frozen=True)
class Retarget:
    """The world's target size is now `replicas` (`grown`: larger than before, for budget.max_hours)."""

    replicas: int
    hours_to_finish: float
    grown: bool


@dataclass(frozen=True)
class Replan:
    """The policy re-planned now (the next re-plan is due `planner.replan_every_s` later)."""

    at_s: float


class HoldReason(StrEnum):
    """Why a launch the world wants was not made (`HoldBack.reason`)."""

    CAPACITY = "capacity"   # every offer is at its known capacity
    RESTING = "resting"     # every offer rests after a refusal
    BUDGET = "budget"       # the launch would take the spend past budget.max_usd
    SPREAD = "spread"       # the launch would spread the world over another site while the deadline allows (`_spreads_dear`)
    NO_WORLD = "no_world"   # spot has no room for a world and the run is ahead of its line (`_waits_for_world`)
    TIMING = "timing"       # the VM would wait for a step boundary after its boot: rented later (`_rent_at_s`)


class CheckpointReason(StrEnum):
    """Why the policy checkpoints now (`Checkpoint.reason`)."""

    SCHEDULE = "schedule"   # checkpoint.every_outer_steps
    FINAL = "final"         # the run trained what it needs
    LEAVING = "leaving"     # every replica training is leaving
    ENDING = "ending"       # the run ends early


@dataclass(frozen=True)
class HoldBack:
    """A launch the world wants was not made.

    Args:
        reason: `capacity` (every offer is at its known capacity), `resting` (every offer rests
            after a refusal), `budget`, `spread` or `no_world`.
        held: nodes held or on their way.
        usd_per_hour: for `budget`, the price of the launch refused.
        gives_up: for `budget`, too few nodes for world.min_replicas and none on its way: the run
            cannot go on.
        message: for `spread`, `no_world` and `timing`, why, in words.
        rent_at_s: for `timing`, when the launches held are made (None: none could be made now; the
            executor records nothing then).
    """

    reason: HoldReason
    held: int
    usd_per_hour: float = 0.0
    gives_up: bool = False
    message: str = ""
    rent_at_s: float | None = None


@dataclass(frozen=True)
class StopForBudget:
    """End the run now (checkpoint, release everything): the next step would cross a hard limit."""

    reason: str


@dataclass(frozen=True)
class Checkpoint:
    """Save the world's state now, at this outer-step boundary.

    Args:
        reason: `schedule` (checkpoint.every_outer_steps), `final` (the run trained what it
            needs), `leaving` (every replica training is about to go), `ending` (the run stops
            early: budget, capacity).
    """

    reason: CheckpointReason


@dataclass(frozen=True)
class Release:
    """Let the replica on `instance_id` leave at the next step boundary and release its VM: the old
    replica of `move`, not worth keeping while its replacement (the `Rent` that follows) boots; or,
    without `move`, a VM the policy no longer wants (a baseline's on-demand replica once ahead)."""

    instance_id: str
    move: Move | None = None


@dataclass(frozen=True)
class PriceSeen:
    """A sample of the market's price and pace (`market_price`) at `at_s`: keep it in
    `Snapshot.prices`."""

    at_s: float
    usd_per_mtok: float
    tokens_per_s: float
    speed: str


    def kept(self, prices: tuple[tuple[float, float, str], ...]) -> tuple[tuple[float, float, str], ...]:
        """The history `prices` with this sample added (the newest `PRICE_HISTORY` kept): what
        the executor hands back as `Snapshot.prices`."""
        return (prices + ((self.usd_per_mtok, self.tokens_per_s, self.speed),))[-PRICE_HISTORY:]


@dataclass(frozen=True)
class Pace:
    """The pause rule's reading of the market now (see the module's docstring).

    Args:
        usd_per_mtok: the market's price now (`market_price`).
        threshold_usd_per_mtok: θ (inf: too few prices seen to judge).
        need: the share of the time left the run keeps for training (1: all of it).
        trains: the world should train now.
    """

    usd_per_mtok: float
    threshold_usd_per_mtok: float
    need: float
    trains: bool


@dataclass(frozen=True)
class Pause:
    """Pause the run: a checkpoint at the next outer-step boundary, then every VM released; rent
    nothing until `Unpause`."""

    pace: Pace


@dataclass(frozen=True)
class Unpause:
    """End the pause: the `Rent`s that follow start the world again (from the checkpoint)."""

    pace: Pace


@dataclass(frozen=True)
class Look:
    """Decide again at `at_s` though nothing else changes (kept as `Snapshot.next_look_at_s`, the
    earliest asked for): a rule that waits on the clock alone, as the pairing rule on a spot
    replica's age."""

    at_s: float


@dataclass(frozen=True)
class Place:
    """A whole-job baseline keeps its world on `offer` from now (None: nothing fits): kept in
    `Snapshot.place`."""

    offer: Offer | None


Action = Rent | Release | Retarget | Replan | HoldBack | PriceSeen | Pause | Unpause | Place | Look   # what `decide` returns
# `stop_for_budget` and `checkpoint_due` return the other two (StopForBudget, Checkpoint): each is
# asked at its own moment of an outer step, `decide` whenever the world may need capacity.


class Policy:
    """A rental policy: decides from snapshots, never from a clock or a cloud. To add one, subclass
    this, give it a `name`, and list an instance in `elastic.policy.registry.POLICIES`; the recipe's
    `planner.policy` and `elastic simulate --policy` then pick it by that name.

    Declared as data, for the simulator's model of the job (and the driver's check that it can
    run it):
        name: the registry's name.
        spot: the offers it is quoted: spot (True), on-demand (False), or the recipe's
            resources.spot (None).
        whole_job: a synchronous job of a fixed world (`baselines.whole_world`): any loss stops it
            until it is whole again, and it restarts from its last checkpoint. False: DiLoCo's
            survivors keep training (the driver runs only these).
        moves_on_loss: with `whole_job`, a loss releases every VM, so the next decision places the
            world afresh.
        on_demand_fallback: in a spot recipe, the snapshot also quotes on-demand offers
            (`Snapshot.on_demand_quotes`) and the policy may rent them.
    """

    name: ClassVar[str]
    spot: ClassVar[bool | None] = None
    whole_job: ClassVar[bool] = False
    moves_on_loss: ClassVar[bool] = False
    on_demand_fallback: ClassVar[bool] = False

    def due(self, s: Snapshot) -> bool:
        """Whether `decide` may do anything now, judged without the offers (`s.quotes` unread:
        reading offers costs the driver a cloud API call)."""
        return True

    def decide(self, s: Snapshot) -> list[Action]:
        """The actions to take now, in order."""
        raise NotImplementedError

    def stop_for_budget(self, s: Snapshot, span_s: float) -> StopForBudget | None:
        """Whether the run must end before the next `span_s` seconds (asked before each outer step)."""
        return stop_for_budget(s, span_s)

    def checkpoint_due(self, s: Snapshot, ending: bool = False) -> Checkpoint | None:
        """Whether to checkpoint at this outer-step boundary (`ending`: the run stops now)."""
        return checkpoint_due(s, ending)

    def waits_for_capacity(self, s: Snapshot) -> bool:
        """Whether a shortage of replicas may last past world.capacity_timeout_s without ending the
        run (asked on the snapshot of each decision): on-demand can still finish it, or the world
        below world.min_replicas is the policy's own choice (idle while ahead of its deadline)."""
        return False

    def next_look_s(self, s: Snapshot) -> float:
        """Seconds from `s` until the policy wants to decide again though nothing else changes (no
        price, capacity or membership move): a host that waits in long steps (the simulator,
        between looks at an idle market) wakes by then. inf: only when something changes."""
        return math.inf


class ElasticPolicy(Policy):
    """The project's policy: the rules of this module (`due`, `decide`), for a world whose DiLoCo
    survivors train through a preemption."""

    name = "elastic"

    def due(self, s: Snapshot) -> bool:
        return due(s)

    def decide(self, s: Snapshot) -> list[Action]:
        return decide(s)

    def waits_for_capacity(self, s: Snapshot) -> bool:
        need = on_demand_need(s)
        return need is not None and need.can_finish

    def next_look_s(self, s: Snapshot) -> float:
        # While it waits for spot, the deadline rule turns to on-demand when the slack reaches its
        # margin: the clock alone gets it there.
        need = on_demand_need(s)
        look = need.slack_s - need.margin_s + LOOK_PAST_S if need is not None and not need.late else math.inf
        if _initial_target(s) <= len(_in_world(s)) + len(s.pending):
            return look
        at = _rent_at_s(s)   # a launch held for the step boundary it will join at
        return min(look, at - s.time_s) if at > s.time_s else look


# -- the rules -------------------------------------------------------------------------------------

def resting(s: Snapshot, offer: Offer) -> bool:
    """The cooldown rule: an offer rests `planner.capacity_cooldown_s` after a refusal of a launch
    of its kind (spot or on-demand) there."""
    rest_s = s.recipe.planner.capacity_cooldown_s
    key = offer_key(offer)
    return any(r.key == key and r.spot == offer.spot and s.time_s - r.at_s < rest_s for r in s.refusals)


def launch_fits_budget(spent_usd: float, held_usd_per_hour: float, offer, recipe, horizon_s: float = 0.0) -> bool:
    """The budget rule for a launch: the spend stays within budget.max_usd with every held VM and
    the new one billed for the new one's certain minimum (`billing.launch_span_s`; the recipe's
    `planner.billing_increment_s` when set), or for `horizon_s` (until the budget is next checked)
    when that is longer."""
    cap = recipe.budget.max_usd
    if cap is None:
        return True
    span_h = max(billing.launch_span_s(offer.cloud, recipe.planner.billing_increment_s), horizon_s) / 3600
    return spent_usd + (held_usd_per_hour + offer.usd_per_hour) * span_h <= cap


def usd_per_hour_held(s: Snapshot) -> float:
    """What every held VM bills per hour now, and every launch under way will."""
    return sum(n.quote.offer.usd_per_hour for n in s.nodes) + sum(o.usd_per_hour for o in s.pending)


def stop_for_budget(s: Snapshot, span_s: float) -> StopForBudget | None:
    """The budget rule for time, asked before each outer step (and, in the simulator, each wait):
    stop when the next `span_s` seconds would pass budget.max_hours, or bill past budget.max_usd at
    today's prices (every VM held and every launch under way); else None."""
    b = s.recipe.budget
    if b.max_hours is not None and s.time_s - s.started_s + span_s > b.max_hours * 3600:
        return StopForBudget(f"budget.max_hours ({b.max_hours} h) would be passed by the next outer step")
    if b.max_usd is not None and s.spent_usd + usd_per_hour_held(s) * span_s / 3600 > b.max_usd:
        return StopForBudget(f"budget.max_usd (${b.max_usd:.2f}) would be passed by the next outer step "
                             f"(spent ${s.spent_usd:.4f})")
    return None


def finished(s: Snapshot) -> bool:
    """The run trained what it needs: train.token_budget tokens, else train.outer_steps steps."""
    t = s.recipe.train
    if t.token_budget is not None:
        return s.progress.tokens >= t.token_budget
    return s.progress.outer_steps >= t.outer_steps


def checkpoint_due(s: Snapshot, ending: bool = False) -> Checkpoint | None:
    """The checkpoint rule, asked at each outer-step boundary once the step's replicas contributed
    (before the leaving ones go), and with `ending` when the run stops early: a `Checkpoint` when
    some progress is not saved yet and the schedule (`checkpoint.every_outer_steps`) says so, the
    run is finished, every replica training is leaving (their notices came: the world would
    otherwise restart from the last checkpoint), or the run ends; else None."""
    step = s.progress.outer_steps
    if step <= s.checkpointed_step:
        return None
    if ending:
        return Checkpoint(CheckpointReason.ENDING)
    if finished(s):
        return Checkpoint(CheckpointReason.FINAL)
    every = s.recipe.checkpoint.every_outer_steps
    if every and step % every == 0:
        return Checkpoint(CheckpointReason.SCHEDULE)
    training = [n for n in s.nodes if n.ready]
    if training and all(n.leaving for n in training):
        return Checkpoint(CheckpointReason.LEAVING)
    return None


def pauses(recipe) -> bool:
    """Whether the pause rule applies: `planner.pauses` and a deadline (budget.max_hours) to keep."""
    return recipe.planner.pauses and recipe.budget.max_hours is not None


def _sized(recipe):
    """The recipe as the pause rule trains it: a world of world.max_replicas."""
    w = recipe.world
    if w.replicas == w.max_replicas:
        return recipe
    return recipe.model_copy(update={"world": w.model_copy(update={"replicas": w.max_replicas})})


def market_price(quotes: list[Quote], recipe) -> tuple[float, float, str]:
    """The market's price now: the planner's cheapest world of world.max_replicas on `quotes`, as
    (USD per 1M useful tokens, useful tokens/s, where that pace comes from: `measured`, `estimate`
    or `partly measured`); (inf, 0, `estimate`) when nothing can be placed."""
    world = plan(quotes, _sized(recipe), n=recipe.world.max_replicas)
    if not world.quotes or world.useful_tokens_per_s <= 0:
        return math.inf, 0.0, "estimate"
    return world.usd_per_mtok, world.useful_tokens_per_s, speed_source(world.quotes)


def pace(s: Snapshot, usd_per_mtok: float, prices: tuple[tuple[float, float], ...]) -> Pace:
    """The pause rule (see the module's docstring) at the market's price now, against the `prices`
    seen (the one now included). Each sample stands for an equal share of the hours left; θ is the
    least price whose samples at or below it would train `planner.pause_slack` × the tokens left
    at their own pace (the cheapest world's pace jumps with its GPUs: 8×H100 trains 2.5× faster
    than 8×A100). `need` is that many tokens over what every sample's hours would train."""
    r = s.recipe
    left_h = max(_left_s(s) / 3600, 1e-9)
    share_s = left_h * 3600 / len(prices)
    # The tokens left and one boot, with the slack; and two whole outer steps of the world, which
    # the slack of a nearly finished run would not cover (a step's tokens count only once synced).
    want = (r.planner.pause_slack * (max(0, run_tokens(r) - s.progress.tokens)
                                     + r.planner.recovery_s * statistics.median(t for _, t in prices))
            + 2 * tokens_per_phase(r) * r.world.max_replicas)
    total = sum(t for _, t in prices) * share_s
    need = min(1.0, want / max(total, 1e-9))
    theta, trained = math.inf, 0.0
    if len(prices) >= MIN_SAMPLES:
        for usd, tps in sorted(prices):
            trained += tps * share_s
            if trained >= max(want, MIN_SHARE * total):
                theta = usd
                break
    trains = need >= GO_ON_NEED or usd_per_mtok <= theta * (UNPAUSE_AT if s.paused else HYSTERESIS)
    return Pace(usd_per_mtok, theta, need, trains)


def _paced(s: Snapshot, quotes: list[Quote]) -> tuple[list[Action], Pace | None]:
    """The price sample due now (a `PriceSeen`) and the pause rule's reading of it; ([], None) when
    the rule does not apply, no sample is due, or nothing can be placed."""
    if not pauses(s.recipe) or not quotes:
        return [], None
    if s.time_s - s.priced_at_s < s.recipe.planner.price_sample_s and s.prices:
        return [], None   # no sample due: nothing to judge by
    usd, tps, speed = market_price(quotes, s.recipe)
    if not math.isfinite(usd):
        return [], None
    prices = s.prices + ((usd, tps, speed),)
    return [PriceSeen(s.time_s, usd, tps, speed)], pace(s, usd, _rescaled(prices, tps, speed))


def _rescaled(prices: tuple[tuple[float, float, str], ...], tps: float, speed: str) -> tuple[tuple[float, float], ...]:
    """The prices seen, each group priced at another source of pace than the one now (the run's
    first measured step rescales every estimate: by 20× on a small model) brought to the pace now:
    its prices × k, its paces ÷ k, k = its median pace ÷ the median pace of the samples at today's
    source (the worlds are taken to be alike on the whole; not one world's pace, which jumps with
    its GPUs)."""
    groups: dict[str, list[tuple[float, float]]] = {}
    for u, t, src in prices:
        groups.setdefault(src, []).append((u, t))
    out: list[tuple[float, float]] = list(groups.pop(speed, []))
    ref = statistics.median(t for _, t in out) if out else tps
    for group in groups.values():
        k = statistics.median(t for _, t in group) / ref
        out += [(u * k, t / k) for u, t in group]
    return tuple(out)


def _dear(s: Snapshot, quotes: list[Quote], p: Pace) -> list[Release]:
    """Replicas whose price per token passed `HYSTERESIS` θ leave at once (dearest first) when the
    planner's launch in their place (`choose_launch`, capacity kept) is `DEAR_SAVING` cheaper, its
    boot spread over its life, and fits the budget; world.min_replicas keep training. The world
    tops up there as usual."""
    if p.need >= GO_ON_NEED or not math.isfinite(p.threshold_usd_per_mtok) or not quotes:
        return []
    r = s.recipe
    staying = _in_world(s)
    rate = usd_per_hour_held(s)
    out: list[Release] = []
    for n in sorted((n for n in staying if n.ready), key=lambda n: -usd_per_mtok(n.quote, r)):
        now = usd_per_mtok(n.quote, r)
        if now <= p.threshold_usd_per_mtok * HYSTERESIS or len(staying) <= r.world.min_replicas:
            break
        rest = [m.quote for m in staying if m is not n] + [_pending_quote(s, o) for o in s.pending] + \
               [a.move.add for a in out]
        add = choose_launch(quotes, r, rest, s.progress)
        if add is None or add.key == n.quote.key or launch_usd_per_mtok(add, r) >= now * (1 - DEAR_SAVING):
            continue
        if not launch_fits_budget(s.spent_usd, rate, add.offer, r, horizon_s=s.budget_horizon_s):
            break
        out.append(Release(n.instance_id, Move(add, n.instance_id, now, usd_per_mtok(add, r))))
        staying = [m for m in staying if m is not n]
        rate += add.offer.usd_per_hour
    return out


def on_demand_need(s: Snapshot) -> OnDemandNeed | None:
    """The deadline rule's reading now; None where it does not apply (no budget.max_hours, no
    on-demand offer in the snapshot, nothing left to train)."""
    r = s.recipe
    if r.budget.max_hours is None or not s.on_demand_quotes or finished(s):
        return None
    world = plan(list(s.on_demand_quotes), r, n=r.world.max_replicas)
    if not world.quotes or world.useful_tokens_per_s <= 0:
        return None
    train_s = hours_to_finish(world, r, s.progress) * 3600
    need_s = train_s + r.planner.recovery_s
    left_s = _left_s(s)
    margin_s = max(ON_DEMAND_MARGIN * need_s, 2 * world.phase_s + r.planner.recovery_s)
    usd = world.usd_per_hour * need_s / 3600
    fits = r.budget.max_usd is None or s.spent_usd + usd <= r.budget.max_usd
    return OnDemandNeed(left_s - need_s, margin_s, need_s, usd, len(world.quotes), fits)


def _in_world(s: Snapshot) -> list[Node]:
    return [n for n in s.nodes if not n.leaving]


def _steady(s: Snapshot) -> bool:
    """Nothing booting, renting, leaving or moving: a re-plan sees the world as it is."""
    return not s.pending and all(n.ready and not n.leaving and not n.moving for n in s.nodes)


def _initial_target(s: Snapshot) -> int:
    w = s.recipe.world
    return max(s.target_replicas, min(w.replicas, w.max_replicas))


def _retarget(s: Snapshot, quotes: list[Quote], held: list[Quote], target: int) -> Retarget | None:
    """The world grows when the planner needs more replicas to finish within budget.max_hours
    (never shrinks: replicas that joined keep training)."""
    pl = plan(quotes, s.recipe, held, progress=s.progress)
    if len(pl.quotes) > target:
        return Retarget(len(pl.quotes), hours_to_finish(pl, s.recipe, s.progress), grown=True)
    return None


def _replan_due(s: Snapshot) -> bool:
    """The re-plan rule's timing: `planner.replan_every_s` since the last one, a steady world, and
    no outer step under way. A replica joins the world only at a step boundary and one that leaves
    trains to the end of the step, so a move decided inside a step gains no training before its
    end; it only chases the price of that moment (the driver asks on every tick, at each row of a
    price trace: on the synthetic spikes and waves markets 4.5 % and 3.2 % dearer on average over 20
    seeds than deciding at the boundary, docs/benchmarks.md). Renting to replace a lost replica or to reach the target is
    not held to the boundary: its boot starts at once."""
    return s.between_steps and s.time_s - s.last_replan_s >= s.recipe.planner.replan_every_s and _steady(s)


def due(s: Snapshot) -> bool:
    """Whether `decide` may do anything now, judged without the offers (`s.quotes` unread): the
    world was never sized, is below its target (and not paused), a re-plan is due, the time the
    last decision asked to look again has come (`next_look_at_s`: the deadline rule's margin,
    which a world at its target would otherwise reach unseen until the next re-plan), or (under the
    pause rule) a price sample. Reading offers costs a cloud API call; the driver asks this first
    on every tick."""
    if pauses(s.recipe) and s.time_s - s.priced_at_s >= s.recipe.planner.price_sample_s:
        return True
    if s.paused:
        return False
    return (not s.planned or s.time_s >= s.next_look_at_s or _initial_target(s) > len(_in_world(s)) + len(s.pending)
            or _replan_due(s))


def decide(s: Snapshot) -> list[Action]:
    """The actions the policy takes now (in order). See the module's docstring for the rules."""
    quotes = [q for q in s.quotes if not resting(s, q.offer)]
    out, p = _paced(s, quotes)
    if pauses(s.recipe):
        # The pause rule judges at each price sample only (`due` asks for one every
        # planner.price_sample_s): the driver and the simulator then judge at the same moments.
        if s.paused:
            if p is None or not p.trains:
                return out   # dear, or no price to judge by: stay paused
            out.append(Unpause(p))
            s = dataclasses.replace(s, paused=False)
        elif p is not None and not p.trains:
            if not s.pending and all(n.ready for n in s.nodes):
                return out + [Pause(p)]
            return out       # dear, with a launch or a boot under way: rent nothing more, pause at a later sample
        s = dataclasses.replace(s, recipe=_sized(s.recipe))
        dear = _dear(s, quotes, p) if p is not None else []
        if dear:   # they leave; the world tops up below, where the planner says
            out += dear
            gone = {r.instance_id for r in dear}
            s = dataclasses.replace(s, nodes=tuple(dataclasses.replace(n, leaving=True) if n.instance_id in gone
                                                   else n for n in s.nodes))
    out += _steady_world(s, quotes)
    return out


def _steady_world(s: Snapshot, quotes: list[Quote]) -> list[Action]:
    """Renting, re-planning and moving for the world's target size (the rules before the pause)."""
    out: list[Action] = []
    in_world = _in_world(s)
    held = [n.quote for n in in_world] + [_pending_quote(s, o) for o in s.pending]
    target = _initial_target(s)
    if not s.planned and s.quotes:
        grown = _retarget(s, quotes, held, target)
        target = grown.replicas if grown else target
        out.append(grown or Retarget(target, 0.0, grown=False))
    need = on_demand_need(s)
    rentable = quotes
    if need is not None and need.late:
        # The deadline needs the on-demand world's pace: the world grows to its size, and every
        # launch is the planner's cheapest among spot and on-demand offers.
        quotes = rentable = quotes + [q for q in s.on_demand_quotes if not resting(s, q.offer)]
        if need.replicas > target:
            target = need.replicas
            out.append(Retarget(target, need.need_s / 3600, grown=True))
    else:
        spare = _spare_on_demand(s, in_world)
        if spare:
            return out + spare
        rentable = _probes(s, quotes, held) or quotes
        room, pair, look = _pairs(s, rentable, held, need) or (None, 0, math.inf)
        if look < math.inf:
            out.append(Look(look))
        if pair:
            # Spot alone cannot make a world (world.min_replicas) and the run is far enough behind
            # the straight line to its deadline (`_pairing_threshold_s`): the spot replicas there
            # are paired with on-demand ones now, rather than the deadline's whole on-demand world
            # later.
            if room:
                out += _top_up(s, quotes, held, room, None)
                held = held + [a.quote for a in out if isinstance(a, Rent)]
            od_held = sum(1 for q in held if not q.offer.spot)
            od = [q for q in s.on_demand_quotes if not resting(s, q.offer)]
            return out + _top_up(s, od, held, max(0, pair - od_held), need)
        why = _waits_for_world(s, held, room)
        if why:
            return out + [Release(n.instance_id) for n in in_world if n.quote.offer.spot] + \
                [HoldBack(HoldReason.NO_WORLD, held=len(held), message=why)]
        need = None
    wanted = max(0, target - len(held))
    if wanted:
        rents = _top_up(s, rentable, held, wanted, need)
        if not _timed(rents):
            return out + rents
        out += rents   # timed for a later boundary: the world held may still re-plan now
    if _replan_due(s) and s.quotes:
        out.append(Replan(s.time_s))
        grown = _retarget(s, quotes, held, target)
        if grown:
            out.append(grown)
            return out + _top_up(s, quotes, held, grown.replicas - len(held), need)
        out += _moves(s, quotes, in_world)
    return out


def _spare_on_demand(s: Snapshot, in_world: list[Node]) -> list[Release]:
    """The pairing rule's on-demand replicas to let go before the deadline rule's margin (asked
    only then): every one, once world.min_replicas spot replicas train (spot alone holds the world),
    once no spot replica is held (none to pair with: fewer than world.min_replicas on-demand
    ones train nothing), or once the run is `PAIR_AHEAD_S` ahead of the straight line to
    budget.max_hours (the pairing has done its work). Fewer than world.min_replicas on-demand
    replicas only (a pairing's; an on-demand world the deadline rule grew moves back to spot at
    re-plans, `_moves`), and none while launches are under way."""
    od = [n for n in in_world if not n.quote.offer.spot]
    if not s.recipe.resources.spot or s.pending or not od or len(od) >= s.recipe.world.min_replicas:
        return []
    if _ahead_s(s) >= PAIR_AHEAD_S:
        return [Release(n.instance_id) for n in od]
    spot_ready = sum(1 for n in in_world if n.quote.offer.spot and n.ready)
    spot_held = sum(1 for n in in_world if n.quote.offer.spot)
    if 0 < spot_held and spot_ready < s.recipe.world.min_replicas:
        return []
    return [Release(n.instance_id) for n in od]


def _pairs(s: Snapshot, quotes: list[Quote], held: list[Quote],
           need: OnDemandNeed | None) -> tuple[int, int, float] | None:
    """(spot replicas that can still be rented, on-demand replicas the world should hold, when to
    look again for them: inf, or when a spot replica will have lived long enough) for the pairing
    rule; None where it does not apply. It applies with the deadline rule
    in force (`need`), progress more than `_pairing_threshold_s` behind the straight line from the
    start to budget.max_hours (a run minutes behind it, as every run is while its first VMs boot,
    waits for spot: on markets where spot holds a world most of the time, pairings begun at once
    billed on-demand for runs that finished hours early), and
    spot capacity (held, or offered with a known capacity) for at least one replica but fewer than
    world.min_replicas. The world then trains at a mix of spot and on-demand prices while it
    would otherwise stand still, and the deadline's all on-demand world later is smaller. The
    on-demand replicas are rented once a spot replica has lived `RECLAIMED_EARLY_S`, not as it is
    rented: where spot VMs are often reclaimed in their first minutes (on the real two-zone V100
    trace, four in five of them: a zone's capacity falls within the tick they were rented in), an
    on-demand VM rented beside each would boot and leave with nothing to pair (2.01× → 1.93× the
    bound there). Nor once it trains: past two minutes most live on, and a partner rented then
    boots beside it, where one rented at its boot's end keeps the world waiting a whole boot (on
    30 two-zone markets no rule was tuned on, $3,813.78 → $3,793.60; docs/benchmarks.md, session 41)."""
    r = s.recipe
    if need is None or r.budget.max_hours is None or not held and not quotes:
        return None
    spot_held = sum(1 for q in held if q.offer.spot)
    room = 0
    for q in quotes:
        here = _room(q, held)
        if here is None:
            return None   # unknown capacity (a real cloud): spot may well hold the world
        room += here
    spot = spot_held + room
    if not _pairing_behind(s) or not 1 <= spot < r.world.min_replicas:
        return room, 0, math.inf   # not far enough behind the line (wait for spot); no spot room, or a world's
    spot_nodes = [n for n in s.nodes if n.quote.offer.spot and not n.leaving]
    if not any(n.ready or s.time_s - n.launched_at_s >= RECLAIMED_EARLY_S for n in spot_nodes):
        # No spot replica has lived through the minutes most reclaims of a new one come in: look
        # again when the first will have (one rented now, too).
        ages = [n.launched_at_s for n in spot_nodes] + ([s.time_s] if room else [])
        return room, 0, min(ages, default=math.inf) + RECLAIMED_EARLY_S + LOOK_PAST_S
    return room, r.world.min_replicas - spot, math.inf


def _room(q: Quote, held: list[Quote]) -> int | None:
    """Spot replicas `q` still has room for beside `held`, by its capacity or what a refusal there
    taught (`Quote.capacity_learned`); None: unknown."""
    cap = q.capacity if q.capacity is not None else q.capacity_learned
    return None if cap is None else max(0, cap - sum(1 for h in held if h.key == q.key and h.offer.spot))


def _probes(s: Snapshot, quotes: list[Quote], held: list[Quote]) -> list[Quote] | None:
    """The spot offers of unknown capacity, to be tried before any other, where the spot replicas
    held and the room known elsewhere (`_room`) fall short of world.min_replicas; None where they
    do not, where every spot offer's capacity is known or none is, and for an on-demand recipe. A
    real cloud shows no capacity: a zone the run's own VM filled (a launch refused beside it) is
    known to have room for that one VM once it is let go, and renting it again before the other
    zones answer bills a VM that is let go at once when they refuse. Tried first, a refused zone
    leaves every capacity known, and the pairing and no-world rules judge."""
    if not s.recipe.resources.spot:
        return None
    rooms = [(q, _room(q, held)) for q in quotes if q.offer.spot]
    unknown = [q for q, room in rooms if room is None]
    if not unknown or len(unknown) == len(rooms):
        return None
    known = sum(1 for q in held if q.offer.spot) + sum(room for _, room in rooms if room is not None)
    return unknown if known < s.recipe.world.min_replicas else None


def _waits_for_world(s: Snapshot, held: list[Quote], room: int | None) -> str | None:
    """Why the world holds no spot replica and rents none now (None: it does not wait): the
    pairing rule applies (`room`: the spot replicas the known capacity still has room for, None
    where it does not apply), no on-demand replica is held or on its way, the spot replicas held
    and that room are fewer than world.min_replicas (no world can train on spot), and the run is
    not `_pairing_threshold_s` behind the straight line to its deadline (so nothing is paired with
    on-demand). A spot replica held then bills while it trains nothing; when spot has room for a
    world again, every replica boots at once, the ones let go beside the new one."""
    m = s.recipe.world.min_replicas
    if room is None or any(not q.offer.spot for q in held):
        return None
    spot = sum(1 for q in held if q.offer.spot)
    if spot + room >= m or _pairing_behind(s):
        return None
    return (f"spot has room for {spot + room} replica(s), fewer than world.min_replicas ({m}), and the run is "
            f"not {_pairing_threshold_s(s) / 3600:.1f} h behind its deadline's straight line: no spot VM is held "
            f"until spot has room for a world")


def _pairing_behind(s: Snapshot) -> bool:
    """The run is more than `_pairing_threshold_s` behind the straight line to budget.max_hours:
    the pairing rule rents (`_pairs`) where otherwise a lone spot replica is let go
    (`_waits_for_world`)."""
    return _ahead_s(s) < -_pairing_threshold_s(s)


def _pairing_threshold_s(s: Snapshot) -> float:
    """How far behind its line (seconds of the line's pace) the run must be for the pairing rule to
    rent: `PAIR_BEHIND_S` plus `PAIR_BEHIND_SHARE` of the time left to budget.max_hours (8.2 h at
    the start of a 72 h run, 2.2 h with 12 h left). A world of world.min_replicas spot replicas
    trains faster than the line (twice its pace on the real V100 traces), so far from the deadline
    spot that comes back a share of the time left catches up on its own; near it, little can."""
    if s.recipe.budget.max_hours is None:
        return PAIR_BEHIND_S
    return PAIR_BEHIND_S + PAIR_BEHIND_SHARE * max(0.0, _left_s(s))


def _left_s(s: Snapshot) -> float:
    """Seconds left to budget.max_hours from the run's start (negative past it; set by the caller)."""
    return s.recipe.budget.max_hours * 3600 - (s.time_s - s.started_s)


def _ahead_s(s: Snapshot) -> float:
    """How far the run is ahead of the straight line to budget.max_hours, in seconds of the line's
    pace (negative: behind; -inf without budget.max_hours)."""
    r = s.recipe
    if r.budget.max_hours is None:
        return -math.inf
    return (s.progress.tokens - _line_tokens(s, s.time_s)) / run_tokens(r) * r.budget.max_hours * 3600


def _line_tokens(s: Snapshot, at_s: float) -> float:
    """The straight line from the start to budget.max_hours: tokens trained by `at_s` at an even pace."""
    r = s.recipe
    return min(1.0, (at_s - s.started_s) / (r.budget.max_hours * 3600)) * run_tokens(r)


def _pending_quote(s: Snapshot, offer: Offer) -> Quote:
    """A launch under way, as the planner counts it (the market's quote when it still offers it)."""
    return next((q for q in s.quotes + s.on_demand_quotes if q.key == offer_key(offer) and q.offer.spot == offer.spot),
                Quote(offer, 0.0, "prior"))


def _top_up(s: Snapshot, quotes: list[Quote], held: list[Quote], wanted: int,
            need: OnDemandNeed | None = None) -> list[Action]:
    """Rent `wanted` more where the planner says, each within the budget (`need`: the deadline
    rule's reading when it let on-demand offers in: an on-demand launch carries it). When the timing
    rule (`_rent_at_s`) times launches for a later step boundary, every one is held instead: one
    `timing` hold, with `rent_at_s` when launches would be made, without when none could be now."""
    out: list[Action] = []
    held = list(held)
    spent, rate = s.spent_usd, usd_per_hour_held(s)
    for _ in range(wanted):
        if not quotes:
            out.append(HoldBack(HoldReason.RESTING, held=len(held)))
            break
        q = choose_launch(quotes, s.recipe, held, s.progress)
        if q is None:
            out.append(HoldBack(HoldReason.CAPACITY, held=len(held)))
            break
        why = _spreads_dear(s, held, q) if need is None else None
        if why:
            out.append(HoldBack(HoldReason.SPREAD, held=len(held), message=why))
            break
        if not launch_fits_budget(spent, rate, q.offer, s.recipe, horizon_s=s.budget_horizon_s):
            # It gives up only when nothing is on its way (launches under way, or rented just now).
            on_way = bool(s.pending) or any(isinstance(a, Rent) for a in out)
            out.append(HoldBack(HoldReason.BUDGET, held=len(held), usd_per_hour=q.offer.usd_per_hour,
                                gives_up=not on_way and len(_in_world(s)) < s.recipe.world.min_replicas))
            break
        out.append(Rent(q, deadline=need if need is not None and not q.offer.spot else None))
        held.append(q)
        rate += q.offer.usd_per_hour
    at = _rent_at_s(s) if wanted else s.time_s
    if at > s.time_s:   # the timing rule: these launches are made later, for the boundary they join at
        rents = sum(1 for a in out if isinstance(a, Rent))
        if not rents:   # none could be made now anyway: held all the same, nothing to say of timing
            return [HoldBack(HoldReason.TIMING, held=len(held))]
        boundary = at + s.recipe.planner.recovery_s + JOIN_MARGIN * s.step_s
        return [HoldBack(HoldReason.TIMING, held=len(held) - rents, rent_at_s=at,
                         message=f"{rents} launch(es) held {at - s.time_s:.0f} s: a VM rented now would wait, "
                                 f"billed, after its boot for the outer-step boundary it joins at "
                                 f"({boundary - s.time_s:.0f} s away)")]
    return out


def _timed(actions: list[Action]) -> bool:
    """`_top_up` held its launches for a later step boundary (the timing rule) and did nothing else."""
    return len(actions) == 1 and isinstance(actions[0], HoldBack) and actions[0].reason == HoldReason.TIMING


def _rent_at_s(s: Snapshot) -> float:
    """When a launch wanted now is made (the timing rule): a replica joins the world only at an
    outer-step boundary, so while a world of at least world.min_replicas trains, a VM rented now
    would wait, billed, from its boot's end (planner.recovery_s) to the first boundary after it.
    It is rented instead `JOIN_MARGIN` of a step before that boundary less its boot, and joins at
    the same boundary. Now when no world trains (the VM joins as soon as it is up), when the step's
    timing is unknown, and within `QUIET_AFTER_LOSS_S` of a loss of a training replica: spot
    losses come in storms, and a replacement rented at once is what the world restarts on if the
    storm takes the rest (timing those too cost 4.6 % on the synthetic scarce markets and 5.8 % on
    the spiky ones, 20 seeds; with the quiet hour no synthetic market is dearer and the 8-GPU V100
    trace $787.04 → $780.64, docs/benchmarks.md)."""
    if s.step_end_s is None or s.step_s <= 0 or s.time_s - s.member_lost_at_s < QUIET_AFTER_LOSS_S:
        return s.time_s
    if sum(1 for n in s.nodes if n.ready and not n.leaving) < s.recipe.world.min_replicas:
        return s.time_s
    lead = s.recipe.planner.recovery_s + JOIN_MARGIN * s.step_s
    boundary, earliest = s.step_end_s, s.time_s + lead - RENT_TICK_S   # a tick early still joins it
    if boundary < earliest:
        boundary += math.ceil((earliest - boundary) / s.step_s) * s.step_s
    at = boundary - lead
    return at if at > s.time_s + RENT_TICK_S else s.time_s


def _spreads_dear(s: Snapshot, held: list[Quote], q: Quote) -> str | None:
    """The spread rule: why renting `q` beside `held` (the world and its launches under way) waits,
    or None where it does not. It waits with budget.max_hours set, at least world.min_replicas
    held, `q` adding a site the sync then waits on (`sync_penalty_s` grows), its marginal USD per
    useful token (the world's price and tokens with it, less without it) above `SPREAD_TOLERANCE`
    × the world's, and the world held finishing the rest, one boot included, within `SPREAD_PACE`
    of `hours_left` (budget.max_hours less planner.deadline_slack)."""
    r = s.recipe
    if r.budget.max_hours is None or len(held) < r.world.min_replicas:
        return None
    now, spread = evaluate(held, r), evaluate(held + [q], r)
    if spread.sync_penalty_s <= now.sync_penalty_s + 1e-9:
        return None
    gained = spread.useful_tokens_per_s - now.useful_tokens_per_s
    marginal = (spread.usd_per_hour - now.usd_per_hour) / (gained * 3600) * 1e6 if gained > 0 else math.inf
    if marginal <= SPREAD_TOLERANCE * now.usd_per_mtok:
        return None
    finish_h = r.planner.recovery_s / 3600 + hours_to_finish(now, r, s.progress)
    left_h = hours_left(r, s.progress)
    if left_h is None or finish_h > SPREAD_PACE * left_h:
        return None
    return (f"a replica in {q.offer.zone} would spread the world to {site(q.offer)} (its outer syncs "
            f"{spread.sync_penalty_s - now.sync_penalty_s:.0f} s longer): its tokens would cost "
            f"{marginal / now.usd_per_mtok:.2f}x the world's, and the {len(held)} replica(s) held finish "
            f"in {finish_h:.1f} h of the {left_h:.1f} h left")


def spread_waits(recipe, quotes: list[Quote]) -> tuple[int, str] | None:
    """For `elastic plan`: renting the placement's `quotes` in their order at the run's start, the
    first the spread rule holds back (`_spreads_dear`): how many are rented before it, and why;
    None where the rule holds none back."""
    s = Snapshot(recipe, 0.0)
    for k, q in enumerate(quotes):
        why = _spreads_dear(s, list(quotes[:k]), q)
        if why:
            return k, why
    return None


def _moves(s: Snapshot, quotes: list[Quote], in_world: list[Node]) -> list[Action]:
    """Move the replicas a clearly cheaper offer beats (most expensive first), each within the
    budget. The old replica leaves at once when it trains dearer than its replacement will
    (`planner.leaves_at_once`; at least world.min_replicas keep training) and the new offer's
    capacity is known (a trace's, `local.capacity`), else once the new one trains. Where capacity
    is unknown (AWS and GCP say none) the launch may be refused: an old replica let go at once
    was then lost for nothing, and the top-up after the refusal rented its like again. On the real
    V100 traces with capacity hidden from the policy, on-demand deadline worlds did that at every
    re-plan and missed their deadlines (docs/benchmarks.md, session 42). Old and new are then both
    held for a boot's length, so a move may pass world.max_replicas for that long (capping the
    moves at the room left cost about 5 % per token on bench/traces/volatile.csv, where whole
    worlds move at once)."""
    held = [(n.instance_id, n.quote) for n in in_world if n.ready]
    staying = len(in_world)
    hours_left = _hours_left(s, [q for _, q in held])
    out: list[Action] = []
    rate = usd_per_hour_held(s)
    for move in replan_all(quotes, held, s.recipe, progress=s.progress):
        old = next(q for iid, q in held if iid == move.drain)
        at_once = (staying > s.recipe.world.min_replicas and move.add.capacity is not None
                   and leaves_at_once(old, move.add, s.recipe, hours_left))
        if not launch_fits_budget(s.spent_usd, rate, move.add.offer, s.recipe, horizon_s=s.budget_horizon_s):
            break
        if at_once:
            out += [Release(move.drain, move), Rent(move.add)]
            staying -= 1   # still billed until it leaves: its price stays in `rate`
        else:
            out.append(Rent(move.add, move=move))
        rate += move.add.offer.usd_per_hour
    return out


def _hours_left(s: Snapshot, held: list[Quote]) -> float | None:
    """Hours the held world needs to finish at its expected pace (None: unknown)."""
    if not held:
        return None
    left = hours_to_finish(evaluate(held, s.recipe), s.recipe, s.progress)
    return left if 0 < left < float("inf") else None
