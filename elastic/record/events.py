"""Every event a run's ledger holds, with its fields and its story line: the one list of them.

An event is a frozen dataclass; `Ledger.append` takes one and writes it as a JSON line
`{"t": unix seconds, "type": TYPE, **fields}` (every field, None included). Constructing an event
with a field missing or one too many raises TypeError, and the ledger refuses any object that is
not a declared event: a new event is a new class here (its fields, and `story` if the terminal
tells it), never a bare string elsewhere.

Views (report, status, report.html, the live terminal, the market's estimates, the bill) read the
JSON records back through `read`: the typed events, each stamped with its `t`. Fields keep the
names the on-disk format has always had; units are in the names where a field has one (`_s`
seconds, `_usd` dollars, `usd_per_hour`); `t`, `deadline`, `launched_at` and `released_at` are unix
seconds. Field values that come from a closed set are the str enums below (the JSON holds their
strings).
"""

from __future__ import annotations

import dataclasses
from enum import StrEnum
from typing import Any, ClassVar, Iterable

from providers.base import Offer

EVENTS: dict[str, type[Event]] = {}   # TYPE -> class, every declared event


class RunStatus(StrEnum):
    """How a run ended (`run_ended.status`, report.json's `status`)."""

    COMPLETED = "completed"
    FAILED = "failed"
    BUDGET_EXHAUSTED = "budget_exhausted"
    INSUFFICIENT_CAPACITY = "insufficient_capacity"
    INTERRUPTED = "interrupted"


class Role(StrEnum):
    """What a rented VM is for (`node_launched.role`)."""

    REPLICA = "replica"
    CONTROLLER = "controller"


class HeldBack(StrEnum):
    """Why launches are held back (`launch_held_back.reason`)."""

    CAPACITY = "capacity"               # every offer at its known capacity
    BUDGET = "budget.max_usd"           # the next VM would take the spend past the budget
    SPREAD = "spread"                   # the next VM would spread the world over another site while the deadline allows
    NO_WORLD = "no_world"               # spot has no room for a world and the run is not far behind its deadline's line
    TIMING = "timing"                   # a VM rented now would wait, billed, for the step boundary it joins at: rented later


class LossRule(StrEnum):
    """Which rule removed a replica (`replica_lost.rule`, `world.Loss.rule`)."""

    ACTOR_DIED = "actor_died"         # a call of one of its ranks failed: the process or its node died
    STALLED = "stalled"               # no heartbeat, or no progress while it should move, for world.stall_timeout_s
    PREEMPTED = "preempted"           # the provider saw its node go
    NOTICE = "notice"                 # a notice came while it was joining
    SETUP_FAILED = "setup_failed"     # its setup raised
    SAFETY_BOUND = "safety_bound"     # a call ran past world.step_timeout_s
    EXPORT_FAILED = "export_failed"   # it failed while giving its state to a joiner
    PAUSE = "pause"                   # the policy paused the run


class LossPhase(StrEnum):
    """What a lost replica was doing (`replica_lost.phase`)."""

    INNER = "inner"
    SYNC = "sync"
    IDLE = "idle"
    SETUP = "setup"


class TargetReason(StrEnum):
    """Why the world's target size grew (`world_target.reason`)."""

    DEADLINE = "budget.max_hours"   # the planner needs more replicas to finish within it


class OnDemandReason(StrEnum):
    """Why a spot run rents on-demand VMs (`on_demand_started.reason`)."""

    DEADLINE = "deadline"           # the deadline rule: spot is short and the slack reached its margin


class RestoredAfter(StrEnum):
    """Why the world starts again from a checkpoint (`world_restored.after`)."""

    LOSS = "loss"      # every replica was lost
    PAUSE = "pause"    # the policy paused the run


@dataclasses.dataclass(frozen=True, kw_only=True)
class Event:
    """Base of every ledger event (not one itself).

    Args:
        t: unix seconds the ledger recorded it (set on events `read` back; None on one not yet
            appended). Not a field on disk beside the others, and not compared.
    """

    TYPE: ClassVar[str] = ""
    STYLE: ClassVar[str] = ""   # how its story line shows: "" plain, "yellow" a warning, "red" a loss

    t: float | None = dataclasses.field(default=None, compare=False)

    def record(self, t: float) -> dict:
        """The ledger's JSON record of this event at unix time `t` (seconds)."""
        return {"t": t, "type": self.TYPE,
                **{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "t"}}

    def story(self) -> str | None:
        """The terminal's one line for this event when it tells the run's story (a node rented, a
        notice, a preemption, a join, a loss, a committed checkpoint, a move, the budget); None for
        the rest (outer steps are the live panel's)."""
        return None

    def story_style(self) -> str:
        """The rich style of its story line (`STYLE`)."""
        return self.STYLE


@dataclasses.dataclass(frozen=True, kw_only=True)
class UnknownEvent(Event):
    """A record of a type this version does not declare (written by a newer one): views pass over
    it. Args: type: its `type`. fields: the rest of the record."""

    type: str
    fields: dict


def _event(type_: str):
    """Declare an event class with its on-disk `type` string."""
    def wrap(cls):
        cls = dataclasses.dataclass(frozen=True, kw_only=True)(cls)
        if type_ in EVENTS:
            raise TypeError(f"event type {type_!r} declared twice")
        cls.TYPE = type_
        EVENTS[type_] = cls
        return cls
    return wrap


def declared(event: Any) -> bool:
    """Whether `event` is an instance of a declared event class (not a subclass, not a string)."""
    return EVENTS.get(getattr(type(event), "TYPE", None)) is type(event)


def fields(cls: type[Event]) -> list[dataclasses.Field]:
    """The on-disk fields of an event class (its dataclass fields but `t`)."""
    return [f for f in dataclasses.fields(cls) if f.name != "t"]


def parse(record: dict) -> Event:
    """The typed event of a JSON record, strictly. Raises TypeError for an undeclared type or a
    missing or unknown field (tests check that what a run wrote is what this module declares)."""
    rest = {k: v for k, v in record.items() if k not in ("t", "type")}
    cls = EVENTS.get(record.get("type"))
    if cls is None:
        raise TypeError(f"undeclared event type {record.get('type')!r}")
    return cls(t=record.get("t"), **rest)


_ABSENT: dict[type, tuple[tuple[str, bool], ...]] = {}   # class -> ((field, required), ...), memo of `read`


def read(records: Iterable[dict]) -> list[Event]:
    """The typed events of ledger records (the JSON objects of `read_events` and `Ledger.events`),
    each stamped with its `t`. Leniently, as views read ledgers of other versions: a type this
    version does not declare reads as an `UnknownEvent`; a field a record lacks reads as the
    field's default, else None (a ledger written before the field was added, or by hand); a field
    the class does not declare is dropped (written by a newer version)."""
    out = []
    for r in records:
        cls = EVENTS.get(r["type"])
        if cls is None:
            out.append(UnknownEvent(t=r["t"], type=r["type"],
                                    fields={k: v for k, v in r.items() if k not in ("t", "type")}))
            continue
        names = _ABSENT.get(cls)
        if names is None:
            names = _ABSENT[cls] = tuple((f.name, f.default is dataclasses.MISSING) for f in fields(cls))
        out.append(cls(t=r["t"], **{k: r.get(k) for k, required in names if required or k in r}))
    return out


def _replica(replica: int | None) -> str:
    return f"replica {replica}" if replica is not None else "no replica"


# -- the run ---------------------------------------------------------------------------------------

@_event("run_started")
class RunStarted(Event):
    """A driver started (again, on a restart) writing this ledger.

    Args:
        run: the run's name. recipe: the recipe's name. recipe_digest: its digest.
        pid: the driver's process id on `host` (None: runs elsewhere, or in-process from code).
        host: the driver's host name.
        target_replicas: `world.replicas`. ranks_per_replica: `world.ranks_per_replica`.
        head: where the driver runs: `local` or `controller` (a cloud VM).
    """

    run: str
    recipe: str
    recipe_digest: str
    pid: int | None = None
    host: str | None = None
    target_replicas: int | None = None
    ranks_per_replica: int | None = None
    head: str = "local"


@_event("run_planned")
class RunPlanned(Event):
    """What `elastic plan` said at the start (the report's plan-against-actual).

    Args:
        replicas: planned placements (dicts of `Placement.to_dict`).
        useful_tokens_per_s: expected training tokens per second. tokens_per_s_source: where that
            figure came from. usd_per_hour: the planned world's price. expected_hours,
        expected_usd: to finish. tokens_needed: tokens the run trains.
        quality: the expected held-out loss cost against synchronous DDP of the recipe's H and sync
            (`elastic.train.quality.quality_cost`), or None when not measured.
    """

    replicas: list
    useful_tokens_per_s: float
    tokens_per_s_source: str
    usd_per_hour: float
    expected_hours: float
    expected_usd: float
    tokens_needed: int
    quality: dict | None = None


@_event("run_ended")
class RunEnded(Event):
    """The run ended. Args: status: how (`RunStatus`). wall_s: seconds the run took (None from code)."""

    status: RunStatus
    wall_s: float | None = None


@_event("error")
class Error(Event):
    """Something went wrong that the user must read. Args: message: one line."""

    message: str


@_event("network_started")
class NetworkStarted(Event):
    """The run's overlay is up: a local network lab, or on clouds the head's WireGuard interface.
    Args: tag: the lab's namespace tag, or the interface's name. head_ip: the head's overlay address."""

    tag: str
    head_ip: str


@_event("link_measured")
class LinkMeasured(Event):
    """A node that joined measured its link to one peer, over the overlay (or whatever path Ray's
    node addresses take). Args: instance_id, peer_instance_id: the two nodes. site, peer_site:
    their `cloud/region`. rtt_ms: median round trip of small messages, milliseconds. mbit_s:
    throughput of a bulk transfer from the node to its peer, Mbit/s. duration_s: how long the
    transfer ran."""

    instance_id: str
    peer_instance_id: str
    site: str
    peer_site: str
    rtt_ms: float
    mbit_s: float
    duration_s: float


@_event("cluster_started")
class ClusterStarted(Event):
    """The Ray cluster is up. Args: address: its GCS address. session_dir: Ray's session directory."""

    address: str
    session_dir: str


@_event("controller_started")
class ControllerStarted(Event):
    """The controller VM (the Ray head and the driver) was started.
    Args: instance_id: its VM. cloud, region: where."""

    instance_id: str
    cloud: str
    region: str


@_event("driver_lost")
class DriverLost(Event):
    """A driver continuing the run (`elastic launch --resume RUN`, or `--run-dir runs/RUN` whose
    record has not ended) found the driver before it gone without ending the run (its controller
    lost, or its process killed).
    What the loss cost is a view of it (`billing.driver_lost_usd`, the report's `driver_lost`).

    Args:
        last_seen_at: unix seconds of the lost driver's last event (the run had no driver since).
        instance_ids: the VMs it left held, recorded released (`node_released`) at their autodown.
        outer_step: the last outer step it recorded (the run continues from its latest complete
            checkpoint, at or before it).
    """

    STYLE = "red"

    last_seen_at: float
    instance_ids: list[str]
    outer_step: int

    def story(self) -> str:
        return (f"the run's previous driver was lost after outer step {self.outer_step}: the VMs it held are "
                f"billed until their autodown ended them; continuing from the latest complete checkpoint")


# -- nodes -----------------------------------------------------------------------------------------

@_event("node_launched")
class NodeLaunched(Event):
    """A VM was rented (billed from `launched_at`).

    Args:
        instance_id: the provider's id. ray_node_id: its Ray node (None: never joined, or a
            controller). role: what it is for. launched_at: unix seconds. joined: it joined the
            Ray cluster.
        cloud, region, zone, instance_type, gpu, gpus, cpus, spot, usd_per_hour,
        on_demand_usd_per_hour: the offer it was rented from, declared once by `Offer` (all of
            its fields but `Offer.NOT_KEPT`); `NodeLaunched.of` builds one from the offer.
    """

    instance_id: str
    ray_node_id: str | None
    role: Role
    launched_at: float
    joined: bool
    # The offer's fields, as `Offer` declares them (same names, types and order).
    __annotations__.update({f.name: f.type for f in dataclasses.fields(Offer) if f.name not in Offer.NOT_KEPT})

    @classmethod
    def of(cls, offer: Offer, *, instance_id: str, ray_node_id: str | None, role: Role, launched_at: float,
           joined: bool) -> NodeLaunched:
        """The event of a VM rented from `offer`."""
        return cls(instance_id=instance_id, ray_node_id=ray_node_id, role=role, launched_at=launched_at,
                   joined=joined, **{f.name: getattr(offer, f.name) for f in dataclasses.fields(Offer)
                                     if f.name not in Offer.NOT_KEPT})

    def story(self) -> str:
        kind = "spot" if self.spot else "on-demand"
        return (f"rented {self.instance_id}: {self.instance_type} in {self.cloud}:{self.zone} ({kind}, "
                f"${self.usd_per_hour:.4f}/h)")


@_event("node_price")
class NodePrice(Event):
    """The price in effect for a held VM changed (spot prices move).
    Args: instance_id: the VM. usd_per_hour: its price from now on."""

    instance_id: str
    usd_per_hour: float


@_event("node_rebalance")
class NodeRebalance(Event):
    """The provider warned of elevated interruption risk (no deadline; recorded only).
    Args: instance_id: the VM. replica: its replica, if any."""

    instance_id: str
    replica: int | None


@_event("node_notice")
class NodeNotice(Event):
    """A preemption notice. Args: instance_id: the VM. deadline: unix seconds it goes at.
    notice_s: seconds of notice given. replica: its replica, if any."""

    STYLE = "yellow"

    instance_id: str
    deadline: float
    notice_s: float
    replica: int | None

    def story(self) -> str:
        return (f"notice: {self.instance_id} ({_replica(self.replica)}) will be reclaimed in "
                f"{self.notice_s or 0:.0f} s")


@_event("node_preempted")
class NodePreempted(Event):
    """The provider took a VM back. Args: instance_id: the VM. with_notice: a notice came first.
    replica: its replica, if any. reclaimed: the cloud says it took the VM back itself (a spot
    interruption; with a notice it is one too): what `elastic.record.billing` bills by, where a
    cloud bills nothing for a spot VM it interrupts young. Not written by ledgers before it: their
    VMs lost without a notice are billed."""

    STYLE = "red"

    instance_id: str
    with_notice: bool
    replica: int | None
    reclaimed: bool = False

    def story(self) -> str:
        return (f"preempted: {self.instance_id} ({_replica(self.replica)}, "
                f"{'after a notice' if self.with_notice else 'no notice'})")


@_event("node_left_to_cloud")
class NodeLeftToCloud(Event):
    """A VM out of the run after a notice, left for its cloud to reclaim at the notice's deadline
    rather than terminated: its cloud bills nothing for a spot VM it interrupts this young, and
    the seconds of one the run terminates (`providers.base.BillingTerms.interrupted_free_s`; AWS:
    the first hour). A `node_preempted` follows when the cloud takes it (the run terminates it
    should it still be held a minute past the deadline). Args: instance_id: the VM. deadline: unix
    seconds it goes at. age_s: its age then (seconds from its launch). free_s: the cloud's window."""

    instance_id: str
    deadline: float
    age_s: float
    free_s: float

    def story(self) -> str:
        return (f"left to its cloud: {self.instance_id} goes at its notice's deadline, {self.age_s / 60:.0f} min "
                f"after its launch, which its cloud does not bill (within {self.free_s / 60:.0f} min); "
                f"terminated now, it would bill")


@_event("node_released")
class NodeReleased(Event):
    """The run let a VM go. Args: instance_id: the VM. released_at: unix seconds it was released,
    when not the event's time (a VM that never joined)."""

    instance_id: str
    released_at: float | None = None


@_event("node_join_timeout")
class NodeJoinTimeout(Event):
    """A rented VM never joined the cluster. Args: instance_id: the VM. timeout_s:
    `resources.join_timeout_s`. boot_log: the last lines of its serial console (its boot script's
    output) as the cloud kept it, "" when none was read. boot_failed: its boot script said it
    failed (the wait ended then, before the timeout)."""

    instance_id: str
    timeout_s: float
    boot_log: str = ""
    boot_failed: bool = False

    def story(self) -> str:
        head = f"never joined: {self.instance_id}" + (" (its boot script failed)" if self.boot_failed else "")
        if not self.boot_log:
            return head
        return f"{head}; its boot log ends:\n" + "\n".join(
            f"    {line}" for line in self.boot_log.splitlines())


@_event("capacity_error")
class CapacityRefused(Event):
    """A launch was refused for capacity (the offer rests). Args: zone, instance_type: the offer.
    message: what the provider said. spot: the launch was spot (None in ledgers written before it
    was recorded). in_flight: the run's other launches of the same offer still under way then (the
    driver launches in the background: granted, they are the offer's too)."""

    zone: str
    instance_type: str
    message: str
    spot: bool | None = None
    in_flight: int = 0

    def story(self) -> str:
        return f"no capacity: {self.instance_type} in {self.zone}"


@_event("launch_failed")
class LaunchFailed(Event):
    """A launch failed for another reason (the offer rests). Args: zone, instance_type: the offer.
    message: the error."""

    zone: str
    instance_type: str
    message: str


@_event("launch_held_back")
class LaunchHeldBack(Event):
    """Launches are held back. Args: reason: `HeldBack.CAPACITY`, `HeldBack.SPREAD`,
    `HeldBack.NO_WORLD` or `HeldBack.TIMING` (then held: VMs held or on their way, message: why, and
    for timing when the launch is made) or `HeldBack.BUDGET` (then spent_usd: USD spent,
    usd_per_hour: the next VM's price)."""

    reason: HeldBack
    held: int | None = None
    message: str | None = None
    spent_usd: float | None = None
    usd_per_hour: float | None = None

    def story(self) -> str:
        why = f": {self.message}" if self.reason in (HeldBack.SPREAD, HeldBack.NO_WORLD, HeldBack.TIMING) and self.message else ""
        return f"launches held back ({self.reason}){why}"


@_event("market_unavailable")
class MarketUnavailable(Event):
    """A cloud that answered before fails to list offers now. Args: cloud: which. message: why."""

    cloud: str
    message: str


@_event("market_available")
class MarketAvailable(Event):
    """A cloud's offers answer again. Args: cloud: which."""

    cloud: str


# -- the world -------------------------------------------------------------------------------------

@_event("replica_starting")
class ReplicaStarting(Event):
    """A replica's actors are being created on a new VM. Args: replica: its id. instance_id: the VM."""

    replica: int
    instance_id: str


@_event("replica_copying")
class ReplicaCopying(Event):
    """A joiner copies its state from a member in the background.
    Args: replica, instance_id: the joiner. donor: the member. outer_step: the world's outer steps."""

    replica: int
    instance_id: str
    donor: int
    outer_step: int


@_event("replica_joined")
class ReplicaJoined(Event):
    """A replica became a member. Args: replica, instance_id: it. outer_step: the world's outer
    steps. epoch: the membership epoch. source: where its state came from. setup_s: seconds from
    its start to joining."""

    replica: int
    instance_id: str
    outer_step: int
    epoch: int
    source: str
    setup_s: float

    def story(self) -> str:
        return (f"joined: replica {self.replica} on {self.instance_id} after outer step {self.outer_step} "
                f"(state from {self.source})")


@_event("replica_lost")
class ReplicaLost(Event):
    """The world lost a replica (see `world.Loss`). Args: replica, instance_id: it. reason: what
    happened. rule: which rule removed it. phase: `inner`, `sync`, `idle` or `setup`.
    lost_inner_steps: inner steps of work it took with it. outer_step: the world's outer steps."""

    STYLE = "red"

    replica: int
    instance_id: str
    reason: str
    rule: str
    phase: str
    lost_inner_steps: int
    outer_step: int

    def story(self) -> str:
        return (f"lost: replica {self.replica} on {self.instance_id} ({self.reason}, "
                f"{self.lost_inner_steps} inner step(s) lost)")


@_event("replica_drained")
class ReplicaDrained(Event):
    """A noticed (or moved) replica gave its last step and left. Args: replica, instance_id: it.
    outer_step: the step it contributed to last. steps_done: inner steps it took in it."""

    replica: int
    instance_id: str
    outer_step: int
    steps_done: int | None

    def story(self) -> str:
        return f"drained: replica {self.replica} on {self.instance_id} gave its last step"


@_event("replica_move")
class ReplicaMove(Event):
    """A replica moves to a cheaper offer (rented first; the old one drains once it joined).
    Args: drain_instance_id: the VM it leaves. zone, instance_type, usd_per_hour: the new offer.
    usd_per_mtok_before, usd_per_mtok_after: USD per million tokens before and after."""

    drain_instance_id: str
    zone: str
    instance_type: str
    usd_per_hour: float
    usd_per_mtok_before: float
    usd_per_mtok_after: float

    def story(self) -> str:
        return (f"moving: {self.drain_instance_id} to {self.instance_type} in {self.zone} "
                f"(${self.usd_per_mtok_before:.4f} → ${self.usd_per_mtok_after:.4f} per 1M tokens)")


@_event("world_target")
class WorldTarget(Event):
    """The world's target size grew. Args: replicas: the new target. reason: the rule
    (`budget.max_hours`). hours_to_finish: hours the planner expects with it."""

    replicas: int
    reason: str
    hours_to_finish: float

    def story(self) -> str:
        return f"world grows to {self.replicas} replicas to finish within budget.max_hours"


@_event("on_demand_started")
class OnDemandStarted(Event):
    """A spot run rents on-demand VMs: the deadline needs them (`policy.OnDemandNeed`). Args:
    reason: the rule (`deadline`). slack_s: seconds to budget.max_hours less what the on-demand
    world needs. margin_s: the slack the rule keeps. hours_needed: the on-demand world's hours to
    finish the rest. replicas: its size. usd_expected: its expected USD if spot stays out."""

    reason: str
    slack_s: float
    margin_s: float
    hours_needed: float
    replicas: int
    usd_expected: float

    def story(self) -> str:
        return (f"spot is short and the deadline is near: renting on-demand ({self.replicas} replicas finish in "
                f"{self.hours_needed:.1f} h, about ${self.usd_expected:,.2f} if spot stays out; slack "
                f"{self.slack_s / 3600:.1f} h)")


@_event("on_demand_ended")
class OnDemandEnded(Event):
    """The run holds no on-demand VM any more (spot took their place). Args: held_s: seconds since
    `on_demand_started`."""

    held_s: float

    def story(self) -> str:
        return f"back on spot only, after {self.held_s / 3600:.1f} h with on-demand replicas"


@_event("world_formed")
class WorldFormed(Event):
    """The members changed before an outer step. Args: epoch: the membership epoch. replicas:
    member ids. outer_step: the world's outer steps. params: the model's parameters."""

    epoch: int
    replicas: list
    outer_step: int
    params: int


@_event("world_restored")
class WorldRestored(Event):
    """The world had no replica (every one lost, or a pause) and starts again. Args: from_step: the
    checkpoint's step (0: the initial state). uri: the checkpoint's location (None: no checkpoint).
    after: why (`RestoredAfter`)."""

    from_step: int
    uri: str | None
    after: RestoredAfter = RestoredAfter.LOSS

    def story(self) -> str:
        start = f"checkpoint step {self.from_step}" if self.uri else "the initial state"
        if self.after == RestoredAfter.PAUSE:
            return f"pause over: the world starts again from {start}"
        return f"every replica lost: restarting from {start}"

    def story_style(self) -> str:
        return "" if self.after == RestoredAfter.PAUSE else "red"


@_event("world_paused")
class WorldPaused(Event):
    """The rental policy paused the run while prices are dear: a checkpoint, then every VM
    released. Args: outer_step: the world's outer steps. usd_per_mtok: the market's price now (a
    world of world.max_replicas, USD per 1M useful tokens). threshold_usd_per_mtok: the price it
    trains at. need: the share of the time left the run keeps for training."""

    outer_step: int
    usd_per_mtok: float
    threshold_usd_per_mtok: float
    need: float

    def story(self) -> str:
        return (f"paused at outer step {self.outer_step}: the market's ${self.usd_per_mtok:.4f} per 1M tokens is "
                f"dear (trains at ≤ ${self.threshold_usd_per_mtok:.4f}); every replica VM released")


@_event("world_unpaused")
class WorldUnpaused(Event):
    """The pause ended: the policy rents again (the world restarts from the checkpoint). Args:
    paused_s: seconds paused. usd_per_mtok, threshold_usd_per_mtok, need: as `world_paused`'s,
    now."""

    paused_s: float
    usd_per_mtok: float
    threshold_usd_per_mtok: float
    need: float

    def story(self) -> str:
        return (f"unpaused after {self.paused_s / 60:.0f} min: ${self.usd_per_mtok:.4f} per 1M tokens"
                + (" (the deadline needs the time)" if self.need >= 0.95 else ""))


@_event("resumed")
class Resumed(Event):
    """`--resume` loaded a checkpoint. Args: from_step: its step. uri: where. saved_replicas,
    saved_ranks: the world that saved it."""

    from_step: int
    uri: str
    saved_replicas: int | None
    saved_ranks: int | None


@_event("capacity_wait_started")
class CapacityWaitStarted(Event):
    """Training paused: fewer than `world.min_replicas` alive. Args: replicas: alive.
    min_replicas: the minimum."""

    replicas: int
    min_replicas: int


@_event("capacity_wait_ended")
class CapacityWaitEnded(Event):
    """The capacity wait ended. Args: waited_s: seconds waited. replicas: alive. gave_up: the wait
    timed out (or the budget could not pay): the run stops."""

    waited_s: float
    replicas: int
    gave_up: bool = False


@_event("budget_exhausted")
class BudgetExhausted(Event):
    """The run stops for its budget. Args: reason: which limit and why. outer_step: the world's
    outer steps."""

    STYLE = "red"

    reason: str
    outer_step: int

    def story(self) -> str:
        return f"budget: stopping ({self.reason})"


# -- training --------------------------------------------------------------------------------------

@_event("outer_step")
class OuterStep(Event):
    """An outer step was applied (see `world.StepResult`).

    Args:
        outer_step, inner_step: the world's counters after it. epoch: the membership epoch.
        replicas: contributing replica ids. losses: mean loss per inner step. tokens: tokens it
        trained. tokens_total: the run's. inner_s, sync_s: seconds of its phases. bytes_sent:
        pseudo-gradient bytes a rank sent (streamed fragments and the blocking sync). network_s:
        seconds the sync was under way on a rank. wait_s: of those, seconds training waited on
        the network. overlapped_s: seconds streamed fragment syncs ran beside inner steps.
        data_cursor: next unleased sample. steps_done: {replica: inner steps}.
        inner_s_by_replica: {replica: seconds of its inner phase}.
    """

    outer_step: int
    inner_step: int
    epoch: int
    replicas: list
    losses: list
    tokens: int
    tokens_total: int
    inner_s: float
    sync_s: float
    bytes_sent: int
    network_s: float
    data_cursor: int
    steps_done: dict
    inner_s_by_replica: dict
    wait_s: float = 0.0        # absent from ledgers written before streamed fragments
    overlapped_s: float = 0.0


@_event("sync_failed")
class SyncFailed(Event):
    """An outer all-reduce attempt did not complete. Args: outer_step: the step under way.
    attempt: 1-based. failures: {replica id: {"stage", "addr", "error"}}."""

    outer_step: int
    attempt: int
    failures: dict


@_event("sync_retried")
class SyncRetried(Event):
    """An outer step needed more than one all-reduce attempt. Args: outer_step: it. attempts: how many."""

    outer_step: int
    attempts: int


@_event("validation")
class Validation(Event):
    """Validation of θ_outer. Args: outer_step, tokens_total: when. loss: mean loss. perplexity:
    exp(loss). tokens: tokens evaluated. seconds: the slowest rank's time."""

    outer_step: int
    tokens_total: int
    loss: float
    perplexity: float
    tokens: int
    seconds: float


@_event("validation_failed")
class ValidationFailed(Event):
    """A validation could not run (its replica was lost). Args: outer_step: when. message: why."""

    outer_step: int
    message: str


# -- checkpoints -----------------------------------------------------------------------------------

@_event("checkpoint_saved")
class CheckpointSaved(Event):
    """Phase 1 of a checkpoint (training waits). Args: step: the outer step. stall_s: seconds
    training waited. write_s: seconds the write took. local: the staging directory. replica: the
    replica that saved it."""

    step: int
    stall_s: float
    write_s: float
    local: str
    replica: int


@_event("checkpoint_uploaded")
class CheckpointUploaded(Event):
    """Phase 2: the checkpoint is durable (manifest written). Args: step: it. uri: where.
    bytes: its size. files: its files. seconds: upload time. mb_per_s: upload rate."""

    step: int
    uri: str
    bytes: int
    files: int
    seconds: float
    mb_per_s: float

    def story(self) -> str:
        return (f"checkpoint step {self.step} committed to {self.uri} ({self.bytes / 1e6:.1f} MB in "
                f"{self.seconds:.1f} s)")


@_event("checkpoint_upload_failed")
class CheckpointUploadFailed(Event):
    """Phase 2 failed (never loaded). Args: step: it. message: why."""

    STYLE = "red"

    step: int
    message: str

    def story(self) -> str:
        return f"checkpoint step {self.step} failed: {self.message}"


@_event("checkpoint_upload_abandoned")
class CheckpointUploadAbandoned(Event):
    """The run ended during phase 2 (the last complete checkpoint stands). Args: step: it."""

    step: int


@_event("checkpoint_failed")
class CheckpointFailed(Event):
    """Phase 1 failed (the saving replica was lost). Args: step: it. message: why."""

    STYLE = "red"

    step: int
    message: str

    def story(self) -> str:
        return f"checkpoint step {self.step} failed: {self.message}"


@_event("checkpoint_skipped")
class CheckpointSkipped(Event):
    """A checkpoint that could not be loaded was passed over. Args: step: it (None: unreadable).
    message: why."""

    step: int | None
    message: str


@_event("checkpoint_deleted")
class CheckpointDeleted(Event):
    """An old checkpoint was pruned (`checkpoint.keep_last`). Args: step: it."""

    step: int
