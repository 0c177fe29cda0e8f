"""The one bill: what a held VM costs. Pure functions of data (no I/O, no clock).

A VM bills per billing increment of its cloud from its launch, at the price in effect in each
interval (a spot price moves while the VM is held: its price is a series of `(from_s, usd_per_hour)`
segments), and, once it is gone, at least its cloud's minimum (the seconds short of the minimum, or
of the last whole increment, bill at its last price). A VM still held bills the seconds so far, with
no minimum yet. The driver's running spend, the budget checks of the policy, the simulator's bill,
the clairvoyant bound, `elastic plan`'s estimate and the run report all price VMs here, so the
ledger's cost and the report's cost are one number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Terms:
    """How a cloud bills a VM.

    Args:
        minimum_s: seconds billed at least once the VM is gone.
        increment_s: billed time is rounded up to whole increments of this many seconds.
    """

    minimum_s: float
    increment_s: float


DEFAULT_TERMS = Terms(minimum_s=60.0, increment_s=1.0)   # a cloud not registered (a trace may name any)


def terms(cloud: str) -> Terms:
    """The billing terms of `cloud`: its provider's `billing_minimum_s` and `billing_increment_s`
    (AWS and GCP: per second with a one-minute minimum; the local market per second)."""
    from providers import PROVIDERS, provider_class

    if cloud not in PROVIDERS:
        return DEFAULT_TERMS
    cls = provider_class(cloud)
    return Terms(minimum_s=cls.billing_minimum_s, increment_s=cls.billing_increment_s)


def billed_s(cloud: str, held_s: float, ended: bool) -> float:
    """Seconds billed for a VM held `held_s` seconds: as held while it runs; once `ended`, rounded
    up to the cloud's increment and raised to its minimum (a VM never held bills nothing)."""
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


def vm_usd(cloud: str, segments, stop_s: float, ended: bool, until: float | None = None) -> float:
    """USD billed for one VM up to `until` (default: the whole hold), its minimum included once it
    has ended and `until` reaches its end.

    Args:
        cloud: the VM's cloud (its billing terms).
        segments: [(from_s, usd_per_hour)] from launch, in time order.
        stop_s: end of the hold (release or preemption; now while held).
        ended: the VM is gone (the minimum and the increment apply).
        until: bill up to this time only.
    """
    until = stop_s if until is None else until
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
