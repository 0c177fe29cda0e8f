"""A simulated spot market for the local provider.

Per (zone, instance type): a spot price over time, a capacity (how many VMs can be had; 0 is a
stock-out) and a preemption hazard. Generated from a seed (mean-reverting log-price walk,
Poisson stock-outs) or replayed from a trace CSV. Time is simulated: `compression` simulated
seconds pass per real second, so an hour of market fits in a minute of test.

Preemptions are drawn per VM, not per tick: the n-th VM a run rents gets a unit-exponential hazard
budget seeded by (seed, n) (`hazard_budget`) and is preempted once the hazard it has run through,
∫ preempt_per_hour dt over the trace rows it lived through, reaches it (`preempted_at_s`). The
simulator (`elastic.sim.simulate`) draws its preemptions with the same two functions, so a seeded run
loses the same VMs at the same trace times on both sides, whatever the clocks' jitter.
"""

from __future__ import annotations

import bisect
import csv
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

TRACE_COLUMNS = ["timestamp_s", "cloud", "region", "zone", "instance_type", "gpu", "gpus", "spot_usd_per_hour",
                 "on_demand_usd_per_hour", "preempt_per_hour", "capacity"]


@dataclass
class MarketState:
    """The market for one (zone, instance type) at one moment.

    Args:
        spot_usd_per_hour: spot price.
        on_demand_usd_per_hour: on-demand price.
        preempt_per_hour: preemption hazard per node-hour (simulated time).
        capacity: VMs that can be held at once (None: no limit; 0: stock-out).
    """

    spot_usd_per_hour: float
    on_demand_usd_per_hour: float
    preempt_per_hour: float
    capacity: int | None


class TraceError(ValueError):
    """A trace file that cannot be replayed (one line: file, row, what is wrong)."""


@dataclass(frozen=True)
class TraceRow:
    """One row of a trace: what one (zone, instance type) offers from `t` (simulated seconds) on."""

    t: float
    cloud: str
    region: str
    zone: str
    instance_type: str
    gpu: str
    gpus: int
    state: MarketState


def read_trace_rows(path: str | Path) -> list[TraceRow]:
    """Every row of a trace, checked (sorted by time). Raises TraceError naming the file and row."""
    rows: list[TraceRow] = []
    seen: dict[tuple[str, str], tuple] = {}
    try:
        f = open(path, newline="", encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror or exc}") from None
    with f:
        reader = csv.DictReader(f)
        try:
            missing = [c for c in TRACE_COLUMNS if c not in (reader.fieldnames or [])]
        except (UnicodeDecodeError, csv.Error) as exc:
            raise TraceError(f"{path}: not a CSV trace: {exc}") from None
        if missing:
            raise TraceError(f"{path}: missing columns: {', '.join(missing)}")
        n = 1
        try:
            for n, row in enumerate(reader, start=2):
                rows.append(_parse_row(row, n, seen))
        except (UnicodeDecodeError, csv.Error) as exc:
            raise TraceError(f"{path}: row {n}: {exc}") from None
        except ValueError as exc:
            raise TraceError(f"{path}: {exc}") from None
    if not rows:
        raise TraceError(f"{path}: no rows")
    rows.sort(key=lambda r: r.t)
    return rows


# Beyond these a row is a mistake, and replaying it would not end: 60 preemptions per hour leave no
# VM time to join, a simulated clock past 10 years or a capacity of millions only loop longer.
TRACE_MAX = {"timestamp_s": 10 * 365 * 86400.0, "spot_usd_per_hour": 10_000.0, "on_demand_usd_per_hour": 10_000.0,
             "preempt_per_hour": 60.0, "capacity": 100_000, "gpus": 64}


def _parse_row(row: dict, n: int, seen: dict) -> TraceRow:
    if None in row or any(row[c] is None for c in TRACE_COLUMNS):
        raise ValueError(f"row {n}: expected {len(TRACE_COLUMNS)} columns")
    try:
        t = float(row["timestamp_s"])
        spot, od = float(row["spot_usd_per_hour"]), float(row["on_demand_usd_per_hour"])
        rate, cap, gpus = float(row["preempt_per_hour"]), int(row["capacity"]), int(row["gpus"])
    except ValueError as exc:
        raise ValueError(f"row {n}: {exc}") from None
    for name, v in (("timestamp_s", t), ("spot_usd_per_hour", spot), ("on_demand_usd_per_hour", od),
                    ("preempt_per_hour", rate), ("capacity", cap), ("gpus", gpus)):
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"row {n}: {name} must be a finite number >= 0, got {row[name]!r}")
        if v > TRACE_MAX[name]:
            raise ValueError(f"row {n}: {name} {row[name]} is beyond any real market (at most {TRACE_MAX[name]:g})")
    if spot > od:   # no cloud asks more for a VM it may take back; the bound and the baselines assume it
        raise ValueError(f"row {n}: spot_usd_per_hour {row['spot_usd_per_hour']} is above on_demand_usd_per_hour "
                         f"{row['on_demand_usd_per_hour']} (spot never costs more than on-demand)")
    if not row["zone"] or not row["instance_type"] or not row["region"] or not row["cloud"]:
        raise ValueError(f"row {n}: cloud, region, zone and instance_type must not be empty")
    key, desc = (row["zone"], row["instance_type"]), (row["cloud"], row["region"], row["gpu"], gpus)
    if seen.setdefault(key, desc) != desc:
        raise ValueError(f"row {n}: {key[1]} in {key[0]} changes cloud/region/gpu/gpus from an earlier row")
    return TraceRow(t, row["cloud"], row["region"], row["zone"], row["instance_type"], row["gpu"], gpus,
                    MarketState(spot, od, rate, cap))


def read_trace(path: str | Path) -> dict[tuple[str, str], list[tuple[float, MarketState]]]:
    """Rows per (zone, instance_type), sorted by time."""
    out: dict[tuple[str, str], list[tuple[float, MarketState]]] = {}
    for r in read_trace_rows(path):
        out.setdefault((r.zone, r.instance_type), []).append((r.t, r.state))
    return out


def hazard_budget(seed: int, launch: int) -> float:
    """The hazard (unit-exponential, dimensionless) the `launch`-th VM (1, 2, …) of a run seeded
    `seed` can run through before it is preempted. Its own generator per VM: the draw does not
    depend on what else the run did, nor on how often a clock ticked."""
    return random.Random(f"{seed}:{launch}").expovariate(1.0)


def preempted_at_s(times_s: Sequence[float], rates_per_hour: Sequence[float], from_s: float, budget: float) -> float:
    """When (simulated seconds) a VM whose hazard starts accruing at `from_s` has run through
    `budget` (`hazard_budget`): ∫ rate dt / 3600 from `from_s` reaches it. `times_s`, sorted, and
    `rates_per_hour`: the preemption hazard each row sets from its time on (the first row's also
    holds before it; the last one for ever). inf: never (the hazard ends too low)."""
    left = budget
    i = max(0, bisect.bisect_right(times_s, from_s) - 1)
    t = from_s
    while True:
        rate = rates_per_hour[i]
        end = times_s[i + 1] if i + 1 < len(times_s) else math.inf
        if rate > 0:
            need_s = left * 3600 / rate
            if t + need_s <= end:
                return t + need_s
            left -= rate * (end - t) / 3600
        if end == math.inf:
            return math.inf
        t, i = end, i + 1


class SimMarket:
    """Args:
        section: the recipe's `local.market` section.
        instance_types: the recipe's `local.instance_types` (base prices, zones).
        capacity: default capacity per instance type (None: unlimited).
    """

    def __init__(self, section, instance_types, capacity: int | None = None):
        self._s = section
        self._types = {(it.zone, it.name): it for it in instance_types}
        self._capacity = capacity
        self._rng = random.Random(section.seed)
        self._trace = read_trace(section.trace) if section.trace else None
        self._log_dev = {k: 0.0 for k in self._types}          # log(price / base)
        self._stockout_until = {k: -1.0 for k in self._types}  # simulated seconds
        self._sim_t = 0.0

    @property
    def sim_time_s(self) -> float:
        return self._sim_t

    def real_s(self, sim_s: float) -> float:
        """Real seconds for a span of simulated seconds."""
        return sim_s / self._s.time_compression

    def state(self, zone: str, instance_type: str) -> MarketState:
        """The market for this zone and instance type now."""
        key = (zone, instance_type)
        it = self._types[key]
        if self._trace is not None:
            rows = self._trace.get(key)
            if not rows:
                return MarketState(it.spot_usd_per_hour, it.on_demand_usd_per_hour, 0.0, self._capacity)
            current = rows[0][1]
            for t, st in rows:
                if t > self._sim_t:
                    break
                current = st
            return current
        cap = 0 if self._sim_t < self._stockout_until[key] else self._capacity
        price = it.spot_usd_per_hour * math.exp(self._log_dev[key])
        return MarketState(round(price, 6), it.on_demand_usd_per_hour, self._s.preempt_per_hour, cap)

    def advance(self, real_dt_s: float) -> None:
        """Move the market `real_dt_s` real seconds forward (prices walk, stock-outs start)."""
        dt = real_dt_s * self._s.time_compression
        self._sim_t += dt
        if self._trace is not None:
            return
        hours = dt / 3600
        for key in self._types:
            if self._s.volatility:
                # Ornstein-Uhlenbeck on log-price, reverting to the base over ~1 simulated hour.
                d = self._log_dev[key]
                self._log_dev[key] = d - d * min(1.0, hours) + self._s.volatility * math.sqrt(hours) * self._rng.gauss(0, 1)
            if self._s.stockout_per_hour and self._rng.random() < 1 - math.exp(-self._s.stockout_per_hour * hours):
                self._stockout_until[key] = self._sim_t + self._s.stockout_s

    def preemption(self, zone: str, instance_type: str, launch: int, launched_sim_s: float) -> tuple[float, bool]:
        """When the `launch`-th spot VM of the run (1, 2, …), of this kind, rented at
        `launched_sim_s`, is preempted: (simulated seconds, inf for never; whether a notice comes
        `notice_s` ahead, else a hard kill). Its hazard accrues from `first_preemption_after_s`
        after its launch, at the trace's rate (the section's for a generated market)."""
        from_s = launched_sim_s + self._s.first_preemption_after_s
        if self._trace is None:
            times, rates = [0.0], [self._s.preempt_per_hour]
        else:
            rows = self._trace.get((zone, instance_type)) or [(0.0, MarketState(0, 0, 0.0, None))]
            times, rates = [t for t, _ in rows], [st.preempt_per_hour for _, st in rows]
        at_s = preempted_at_s(times, rates, from_s, hazard_budget(self._s.seed, launch))
        return at_s, random.Random(f"{self._s.seed}:{launch}:notice").random() < self._s.notice_fraction

    @property
    def notice_real_s(self) -> float:
        return self.real_s(self._s.notice_s)
