"""The one bill: what a held VM costs. Pure functions of data (no I/O, no clock).

A VM bills per billing increment of its cloud from its launch, at the price in effect in each
interval (a spot price moves while the VM is held: its price is a series of `(from_s, usd_per_hour)`
segments), and, once it is gone, at least its cloud's minimum (the seconds short of the minimum, or
of the last whole increment, bill at its last price). A spot VM its cloud interrupted within the
cloud's free window of its launch (`BillingTerms.interrupted_free_s`; AWS: the first hour, for
Linux, "Billing for interrupted Spot Instances" in the EC2 User Guide) bills nothing at all, where
one the run released, or one lost for another reason, bills its seconds; a ledger says which by a
`node_preempted` after a notice or with `reclaimed` (the cloud's word that it took the VM back),
any other `node_preempted`, or `node_released`. A VM still held bills the seconds so far, with no minimum yet (nor the refund
it may yet earn). The driver's running spend, the budget checks of the policy, the simulator's bill,
the clairvoyant bound, `elastic plan`'s estimate, `elastic status`, report.json and report.html all
price VMs here, so the ledger's cost and the report's cost are one number.

A ledger is priced in two steps: `holds(events, now)` (each VM's hold: its price segments, when it
ended and how), then the holds' figures: `Hold.usd`, `cost_so_far`, `burn_usd_per_hour`,
`cumulative` (the curve report.html draws) and `wasted` (USD that bought no kept progress, by cause).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

from elastic.record.events import (CapacityWaitEnded, CheckpointSaved, DriverLost, Event, NodeJoinTimeout, NodeLaunched,
                            NodeLeftToCloud, NodePreempted, NodePrice, NodeReleased, OuterStep, ReplicaJoined,
                            ReplicaLost, read)
from providers import billing_terms
from providers.base import BillingTerms

DEFAULT_TERMS = BillingTerms(minimum_s=60.0, increment_s=1.0)   # a cloud not registered (a trace may name any)


def terms(cloud: str) -> BillingTerms:
    """The billing terms of `cloud`: its `providers/<cloud>/facts.py` (AWS and GCP: per second with
    a one-minute minimum; the local market per second), `DEFAULT_TERMS` for a cloud not registered."""
    return billing_terms(cloud) or DEFAULT_TERMS


def billed_s(cloud: str, held_s: float, ended: bool) -> float:
    """Seconds billed for a VM held `held_s` seconds by its cloud's terms: as held while it runs;
    once `ended`, rounded up to the cloud's increment and raised to its minimum (a VM never held
    bills nothing). A refund (`free`) is `vm_usd`'s: these seconds stay its time."""
    if not ended or held_s <= 0:
        return max(0.0, held_s)
    t = terms(cloud)
    # 1e-9: a float sum of whole seconds must not round up a whole increment.
    rounded = math.ceil(held_s / t.increment_s - 1e-9) * t.increment_s if t.increment_s > 0 else held_s
    return max(rounded, t.minimum_s, held_s)


def usd_between(segments, stop_s: float, t0: float, t1: float) -> float:
    """USD a VM accrued over [t0, t1] at the prices in effect, no minimum.

    Args:
        segments: [(from_s, usd_per_hour)] in time order, the first at the VM's launch.
        stop_s: when the VM stopped billing (released, preempted, or now while held).
        t0, t1: the span asked for, seconds (same clock as `segments`).
    """
    t0, t1 = max(t0, segments[0][0]), min(t1, stop_s)
    usd = 0.0
    for i, (since, usd_per_hour) in enumerate(segments):
        until = segments[i + 1][0] if i + 1 < len(segments) else stop_s
        lo, hi = max(since, t0), min(until, t1)
        if hi > lo:
            usd += (hi - lo) * usd_per_hour / 3600
    return usd


def free(cloud: str, held_s: float, interrupted: bool) -> bool:
    """A spot VM its cloud `interrupted` after `held_s` seconds bills nothing: within the cloud's
    `interrupted_free_s` of its launch (AWS: the first hour). The caller says it was spot."""
    return interrupted and held_s < terms(cloud).interrupted_free_s


def vm_usd(cloud: str, segments, stop_s: float, ended: bool, until: float | None = None,
           interrupted: bool = False) -> float:
    """USD billed for one VM up to `until` (default: the whole hold), its minimum included once it
    has ended and `until` reaches its end.

    Args:
        cloud: the VM's cloud (its billing terms).
        segments: [(from_s, usd_per_hour)] from launch, in time order.
        stop_s: end of the hold (release or preemption; now while held).
        ended: the VM is gone (the minimum and the increment apply).
        until: bill up to this time only (what accrued: a free VM's refund comes at its end).
        interrupted: a spot VM its cloud took (`free` within the cloud's window).
    """
    until = stop_s if until is None else until
    if ended and until >= stop_s and free(cloud, stop_s - segments[0][0], interrupted):
        return 0.0
    usd = usd_between(segments, stop_s, segments[0][0], until)
    if until >= stop_s:
        held = stop_s - segments[0][0]
        usd += (billed_s(cloud, held, ended) - max(0.0, held)) * segments[-1][1] / 3600
    return usd


def vm_on_demand_usd(cloud: str, start_s: float, stop_s: float, ended: bool, on_demand_usd_per_hour: float,
                     until: float | None = None) -> float:
    """USD the same hold would have billed on demand (same billed seconds, the on-demand price)."""
    until = stop_s if until is None else until
    held = max(0.0, min(until, stop_s) - start_s)
    if until >= stop_s:
        held = billed_s(cloud, stop_s - start_s, ended)
    return held * on_demand_usd_per_hour / 3600


def launch_span_s(cloud: str, override_s: float | None = None) -> float:
    """Seconds a new VM is certain to bill once launched (what a launch commits the budget to):
    `planner.billing_increment_s` when the recipe sets it, else the cloud's minimum (at least one
    increment)."""
    if override_s:
        return override_s
    t = terms(cloud)
    return max(t.minimum_s, t.increment_s)


class Ended(StrEnum):
    """How a VM's hold ended (report.json's `instances[].ended`)."""

    HELD = "held"              # still held when the ledger ends
    RELEASED = "released"
    PREEMPTED = "preempted"


@dataclass
class Hold:
    """One VM the run held, as its ledger tells it.

    Args:
        vm: its `node_launched` event (the offer it was rented from).
        start_s: unix seconds it bills from (`launched_at`, else the event's time).
        segments: [(from_s, usd_per_hour)] the prices in effect, the first at `start_s`.
        end_s: unix seconds it was released or preempted; None while held.
        ended: how the hold ended.
        reclaimed: it ended in a `node_preempted` that says its cloud took it back itself (after a
            notice, or by the cloud's word): the VM a cloud may not bill (`free`).
        joined: it joined the Ray cluster (False: all its cost is waste).
        stop_s: `end_s`, or the time the ledger is priced at while held.
    """

    vm: NodeLaunched
    start_s: float
    segments: list[tuple[float, float]]
    end_s: float | None = None
    ended: Ended = Ended.HELD
    reclaimed: bool = False
    joined: bool = True
    stop_s: float = field(default=0.0)

    @property
    def interrupted(self) -> bool:
        """A spot VM its cloud took back itself (`reclaimed`), not one the run let go or one lost
        for another reason."""
        return self.vm.spot and self.ended == Ended.PREEMPTED and self.reclaimed

    @property
    def free(self) -> bool:
        """Its cloud bills it nothing: interrupted within the cloud's free window (`free`)."""
        return free(self.vm.cloud, self.stop_s - self.start_s, self.interrupted)

    def billed_s(self) -> float:
        """Seconds billed by the cloud's terms: held seconds, rounded and raised to its minimum once
        it is gone; for a `free` one, the seconds it would have billed (its `usd` carries the
        refund, so VM-hours and the on-demand equivalent still count its time)."""
        return billed_s(self.vm.cloud, self.stop_s - self.start_s, self.end_s is not None)

    def usd(self, until: float | None = None) -> float:
        """USD billed up to `until` (default: the whole hold), the minimum included at its end
        (and a `free` one's refund: nothing in all; before its end, what it accrued, as the
        running cost counts it). `usd_between`, the waste's measure, is 0 for a `free` one."""
        return vm_usd(self.vm.cloud, self.segments, self.stop_s, self.end_s is not None, until, self.interrupted)

    def on_demand_usd(self, until: float | None = None) -> float:
        """USD the same hold would have cost on demand (an on-demand VM is never interrupted, so a
        `free` one's seconds are billed here)."""
        return vm_on_demand_usd(self.vm.cloud, self.start_s, self.stop_s, self.end_s is not None,
                                self.vm.on_demand_usd_per_hour, until)

    def usd_between(self, t0: float, t1: float) -> float:
        """USD accrued over [t0, t1] at the prices in effect (no minimum; none for a `free` one)."""
        return 0.0 if self.free else usd_between(self.segments, self.stop_s, t0, t1)


_HOLD_TYPES = frozenset(c.TYPE for c in (NodeLaunched, NodePrice, NodeReleased, NodePreempted, NodeJoinTimeout,
                                         NodeLeftToCloud))


def holds(events: list[Event], now: float) -> dict[str, Hold]:
    """Every VM a ledger's typed events (`events.read`) say the run held, by instance id, priced
    as of unix time `now` while still held. A VM left to its cloud after a notice
    (`node_left_to_cloud`) and then taken ends at the notice's deadline, when the cloud took it,
    where the `node_preempted` that says so came when a poll saw it gone (up to
    `providers.cloud.STATE_POLL_S` later)."""
    out: dict[str, Hold] = {}
    left: dict[str, float] = {}   # instance id -> deadline of the notice it was left to its cloud on
    for e in events:
        if isinstance(e, NodeLeftToCloud):
            left[e.instance_id] = e.deadline
            continue
        if isinstance(e, NodeLaunched):
            left.pop(e.instance_id, None)   # a deadline of an earlier VM of this id is not this one's
            if e.instance_id in out and out[e.instance_id].end_s is not None:
                # An id used again after its VM went (a local run continued by a new driver numbers its
                # VMs from 1 again): the earlier hold stays billed, under a key of its own.
                earlier = out.pop(e.instance_id)
                out[f"{e.instance_id}@{earlier.start_s:.6f}"] = earlier
            start = e.launched_at or e.t
            out[e.instance_id] = Hold(vm=e, start_s=start, segments=[(start, e.usd_per_hour)],
                                      joined=e.joined is not False)
            continue
        if not isinstance(e, (NodePrice, NodeReleased, NodePreempted, NodeJoinTimeout)) or e.instance_id not in out:
            continue
        hold = out[e.instance_id]
        if isinstance(e, NodePrice) and hold.end_s is None:
            hold.segments.append((max(e.t, hold.start_s), e.usd_per_hour))
        elif isinstance(e, (NodeReleased, NodePreempted)) and hold.end_s is None:
            end = e.released_at if isinstance(e, NodeReleased) and e.released_at is not None else e.t
            if isinstance(e, NodePreempted) and e.instance_id in left:
                end = min(end, left.pop(e.instance_id))
            hold.end_s = max(end, hold.start_s)
            hold.ended = Ended.RELEASED if isinstance(e, NodeReleased) else Ended.PREEMPTED
            hold.reclaimed = isinstance(e, NodePreempted) and (e.with_notice or e.reclaimed)
        elif isinstance(e, NodeJoinTimeout):
            hold.joined = False
    for hold in out.values():
        hold.stop_s = hold.end_s if hold.end_s is not None else max(now, hold.start_s)
    return out


def _vm_records(records: list[dict]) -> list:
    """The records `holds` reads, typed: the driver prices its ledger every second, so the rest of
    it (outer steps, checkpoints, metrics-like events) is not typed each time."""
    return read([r for r in records if r["type"] in _HOLD_TYPES])


def cost_so_far(records: list[dict], now: float) -> float:
    """USD accrued by every VM a ledger's records (`Ledger.events`) say the run held, up to `now`."""
    return sum(h.usd() for h in holds(_vm_records(records), now).values())


def burn_usd_per_hour(records: list[dict]) -> float:
    """USD per hour of the VMs held at the end of a ledger's records, at their current prices."""
    return sum(h.segments[-1][1] for h in holds(_vm_records(records), 0.0).values() if h.end_s is None)


def cumulative(vms: dict[str, Hold], t0: float, end: float) -> tuple[list, list]:
    """Cumulative billed and on-demand USD, as [(seconds since `t0`, USD)] at every change of the
    total rate up to `end`: one sweep over the holds' price segments (plus each one's rounding and
    minimum, due when it goes, or a free one's refund of what it accrued). Its last point is what `Hold.usd` and `Hold.on_demand_usd` sum to."""
    steps: dict[float, list[float]] = {}   # t -> [Δ USD/s billed, Δ USD/s on demand, lump billed, lump on demand]

    def at(t):
        return steps.setdefault(min(max(t, t0), end), [0.0, 0.0, 0.0, 0.0])

    for h in vms.values():
        for i, (since, price) in enumerate(h.segments):
            until = h.segments[i + 1][0] if i + 1 < len(h.segments) else h.stop_s
            if until > since:
                at(since)[0] += price / 3600
                at(until)[0] -= price / 3600
        held = h.stop_s - h.start_s
        if held > 0:
            at(h.start_s)[1] += h.vm.on_demand_usd_per_hour / 3600
            at(h.stop_s)[1] -= h.vm.on_demand_usd_per_hour / 3600
            # At its end: its rounding and minimum, or a free one's refund of all it accrued.
            at(h.stop_s)[2] += h.usd() - usd_between(h.segments, h.stop_s, h.start_s, h.stop_s)
            extra_s = billed_s(h.vm.cloud, held, h.end_s is not None) - held
            at(h.stop_s)[3] += extra_s * h.vm.on_demand_usd_per_hour / 3600
    usd, od = [], []
    total = total_od = rate = rate_od = 0.0
    last = t0
    for t in sorted(steps):
        d_rate, d_od, lump, lump_od = steps[t]
        total += rate * (t - last)
        total_od += rate_od * (t - last)
        if lump or lump_od:   # a step at t: the curve before it, then after (a refund steps down)
            usd.append((t - t0, total))
            od.append((t - t0, total_od))
        total += lump
        total_od += lump_od
        rate, rate_od, last = rate + d_rate, rate_od + d_od, t
        usd.append((t - t0, total))
        od.append((t - t0, total_od))
    if steps and last < end:
        usd.append((end - t0, total + rate * (end - last)))
        od.append((end - t0, total_od + rate_od * (end - last)))
    return usd, od


WASTE_CAUSES = ("preemption", "capacity_wait", "checkpoint_stalls", "never_joined", "setup_failed",
                "driver_lost")


def driver_lost_usd(e: DriverLost, vms: dict[str, Hold]) -> float:
    """USD the VMs a lost driver left held accrued with no driver: from its last event to their
    release (the autodown time `node_released` records), no minimum. (A VM of the same id the next
    driver rented, after this event, accrued nothing before it.)"""
    ids = set(e.instance_ids)
    return sum(h.usd_between(e.last_seen_at, e.t) for h in vms.values() if h.vm.instance_id in ids)


def wasted(events: list[Event], vms: dict[str, Hold]) -> dict:
    """USD spent on VM time that produced no kept progress, by cause (`WASTE_CAUSES`, rounded to
    the microdollar, and their `total`; see docs/report.md)."""
    waste = dict.fromkeys(WASTE_CAUSES, 0.0)
    joined_at: dict[int, float] = {}
    last_step_t = None

    def joined_usd(t0: float, t1: float) -> float:   # a VM that never joined is all waste already
        return sum(h.usd_between(t0, t1) for h in vms.values() if h.joined)

    for e in events:
        if isinstance(e, ReplicaJoined):
            joined_at[e.replica] = e.t
        elif isinstance(e, OuterStep):
            last_step_t = e.t
        elif isinstance(e, ReplicaLost) and e.instance_id in vms and (
                e.reason.startswith("preempted") or e.reason == "notice while joining"):
            vm = vms[e.instance_id]
            if e.phase in ("inner", "sync"):
                # The work of the outer step under way: from its start (or the replica's admission).
                since = max(last_step_t or vm.start_s, joined_at.get(e.replica, vm.start_s))
            elif e.phase == "setup":
                since = vm.start_s   # renting and setting up a replica that never trained
            else:
                continue
            waste["preemption"] += vm.usd_between(since, e.t)
        elif isinstance(e, ReplicaLost) and e.instance_id in vms and e.phase == "setup":
            # Its setup failed, timed out or stalled: the VM, rented for it alone, never trained.
            waste["setup_failed"] += vms[e.instance_id].usd()
        elif isinstance(e, CapacityWaitEnded):
            waste["capacity_wait"] += joined_usd(e.t - (e.waited_s or 0), e.t)
        elif isinstance(e, CheckpointSaved):
            waste["checkpoint_stalls"] += joined_usd(e.t - e.stall_s, e.t)
        elif isinstance(e, DriverLost):
            waste["driver_lost"] += driver_lost_usd(e, vms)
    for vm in vms.values():
        if not vm.joined:
            waste["never_joined"] += vm.usd()
    out = {k: round(v, 6) for k, v in waste.items()}
    out["total"] = round(sum(waste.values()), 6)
    return out
