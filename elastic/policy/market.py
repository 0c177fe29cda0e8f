"""The market: one view of what can be rented now, with an interruption-risk estimate per offer.

Offers come from the enabled providers (or, in `elastic simulate`, from a trace). Risk is a
preemption rate per node-hour, estimated per (cloud, region, zone, instance type) from the recipe's
prior blended with what was observed: preemptions over node-hours held in this run's ledger, and in
earlier runs through a small history file. Regions whose preemptions spike cool down for a while;
for a run that can fall back on on-demand, an offer whose spot VM was reclaimed within
`RECLAIMED_EARLY_S` of its launch rests `planner.capacity_cooldown_s` (`EARLY_AGAIN_REST` times
that after two in a row), as one that refused a launch does, and counts no preemption in its
risk; once this run's relaunches (`Market.relaunches`) show that a zone which took back an older
VM takes back the next one too, any reclaim rests its offer as long. Throughput per instance type
is what the run's replicas measured (each outer step's `inner_s_by_replica`), else the recipe's
figure. A spot offer that shows no capacity (AWS's, GCP's) is believed to hold what this run held
there when a launch was refused (`Market.capacity_learned`). The market reads ledger-shaped events
only, so the driver (real ledger) and the simulator (events it writes in simulated time) share
this code.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Mapping
from pathlib import Path

from elastic.cache import cache_dir, write_json_atomic
from elastic.record.events import (CapacityRefused, LinkMeasured, NodeLaunched, NodeNotice, NodePreempted, NodeReleased,
                                   OuterStep, ReplicaStarting, read)
from providers.base import Offer

Key = tuple[str, str, str, str]   # cloud, region, zone, instance type

RECLAIMED_EARLY_S = 120.0
"""A spot VM reclaimed (or noticed) this soon after its launch was granted as its zone ran out:
its offer rests `planner.capacity_cooldown_s` (`Market.quotes` leaves it out for a run whose
deadline rule can fall back on on-demand). On the real V100
traces four of five such reclaims come in the tick of a drop, and renting again at once buys
another VM that lives a minute and bills its minimum (docs/benchmarks.md, "Real spot markets",
session 22). Two minutes is AWS's interruption notice; a preemption rate that reclaims a VM this
soon by chance (under 2 % of VMs below 0.5 per hour) is no reason to rest. Such a reclaim is the
zone's refusal, not a hazard of the VMs that live there: it counts no preemption in the offer's
risk (`Market.risk`); its minutes count as node time. Counted, a run that met a zone's drops saw
5-8 preemptions per hour where VMs past their first minutes lived an hour, and its on-demand world
never moved back to spot there (aws-v100x8-2zones-2022: $800.60 → $795.30)."""

EARLY_AGAIN_REST = 2.0
"""An offer whose VMs were reclaimed within `RECLAIMED_EARLY_S` twice or more in a row (none living
past it between) rests this many times `planner.capacity_cooldown_s` from the last. On the real
8-GPU trace a zone's drops come every 10-30 minutes for hours, and a launch at each tick that still
reads capacity lived a minute and billed it: 107 of a run's 150 spot launches, $19.60
(aws-v100x8-2zones-2022 $795.30 → $783.15, each of its windows at 72-336 h $0-10 less; the
two-zone V100 trace $0.63 more). The synthetic traces never reclaim two in a row that early."""


CAPACITY_MEMORY_S = 3600.0
"""How long a spot offer's capacity learnt from a refusal (`Quote.capacity_learned`: the VMs this run
held there when a launch was refused) is believed. AWS and GCP show no spot capacity; a refusal
while the run holds n VMs of an offer says it held n then. Capacity moves, so the belief lapses and
the offer is tried again as one of unknown capacity."""


def offer_key(o) -> Key:
    """The market key of an Offer (or of a `node_launched` event)."""
    return (o.cloud, o.region, o.zone, o.instance_type)


def recipe_tokens_per_s(o, planner) -> float:
    """The recipe's training throughput of one replica on the VM of an Offer (or of a
    `node_launched` event, or a dict of its instance type), tokens/s: `planner.tokens_per_s` by instance type, else by GPU
    model times the GPU count."""
    if isinstance(o, dict):
        instance_type, gpu, gpus = o["instance_type"], o.get("gpu", ""), o.get("gpus", 0)
    else:
        instance_type, gpu, gpus = o.instance_type, o.gpu, o.gpus
    by = planner.tokens_per_s
    if instance_type in by:
        return by[instance_type]
    return by.get(gpu, planner.default_tokens_per_s) * max(1, gpus)


@dataclass(frozen=True)
class Quote:
    """One offer in the market view.

    Args:
        offer: the provider's offer (price and when it was read).
        preempt_per_hour: estimated preemptions per node-hour (0 for on-demand).
        risk_source: `prior`, `observed` (this run or earlier ones) or `on-demand`.
        capacity: VMs of this offer that can be held at once, when known (the offer's); None: unknown.
        tokens_per_s: one replica's throughput on this VM, tokens/s, as this run measured it (or
            earlier runs of the same workload, or the recipe's figure rescaled by the measurements
            of other types); None: the recipe's figure.
        speed_source: `measured` (this run or an earlier run of the same workload on this instance
            type) or `estimate` (the recipe's figure, rescaled or not).
        links: seconds an outer sync spends between two sites ({`cloud/region`, `cloud/region`}),
            as this run measured them (`planner.measured_links`); the same for every quote.
        capacity_learned: for a spot offer that shows no capacity, the VMs this run held there (or
            was launching) when a launch was last refused for capacity, at least one, within
            `CAPACITY_MEMORY_S` of that refusal; None: nothing learnt, a launch there granted
            beyond it since (it had more room), or the zone out now (refused with none held, or
            it took a VM back) until a launch there is granted.
    """

    offer: Offer
    preempt_per_hour: float
    risk_source: str
    capacity: int | None = None
    tokens_per_s: float | None = None
    speed_source: str = "estimate"
    links: Mapping[frozenset, float] = field(default_factory=dict, compare=False, hash=False)
    capacity_learned: int | None = None

    @property
    def key(self) -> Key:
        return offer_key(self.offer)


def link_sync_s(rtt_ms: float, mbit_s: float, sync_bytes: int) -> float:
    """Seconds one outer sync spends crossing a link of `rtt_ms` round trip and `mbit_s`: a ring
    all-reduce sends about twice the pseudo-gradient over each link (reduce-scatter, then
    all-gather), and waits a round trip in each half."""
    return 2 * sync_bytes * 8 / (max(mbit_s, 1e-6) * 1e6) + 2 * rtt_ms / 1000


def measured_links(links: list[LinkMeasured], sync_bytes: int | None) -> dict[frozenset, float]:
    """Sync seconds per pair of sites from `link_measured` events (the newest measurement of a pair
    wins; a pair inside one site is not a cross-region cost), given the bytes one rank sends per
    outer sync (None: no sync yet, so no cost can be derived and the planner keeps its guess)."""
    if not sync_bytes:
        return {}
    out: dict[frozenset, float] = {}
    for e in links:
        pair = frozenset((e.site, e.peer_site))
        if len(pair) == 2:
            out[pair] = link_sync_s(e.rtt_ms, e.mbit_s, sync_bytes)
    return out



class Market:
    """Args:
        planner: the recipe's `planner` section (prior, region cool-downs).
        history: {key: (node_hours, preemptions)} observed by earlier runs (see `load_history`).
    """

    def __init__(self, planner, history: dict[Key, tuple[float, int]] | None = None,
                 tokens_per_inner_step: int | None = None,
                 measured_before: dict[tuple[str, str], float] | None = None):
        self._p = planner
        # (cloud, type) -> tokens/s earlier runs of this workload measured (see `load_throughput`).
        self._before = dict(measured_before or {})
        self._tokens_per_inner_step = tokens_per_inner_step
        self._history = dict(history or {})
        self._hours: dict[Key, float] = defaultdict(float)       # closed node-hours this run
        self._preempted: dict[Key, int] = defaultdict(int)
        self._open: dict[str, tuple[Key, float]] = {}            # instance id -> (key, held since)
        self._counted: set[str] = set()                           # instances whose preemption counted
        self._region_hits: dict[str, list[float]] = defaultdict(list)
        self._cool_region: dict[str, float] = {}                  # region -> until
        self._reclaimed_at: dict[Key, float] = {}                 # offer -> its last early reclaim
        self._early_in_row: dict[Key, int] = defaultdict(int)     # offer -> early reclaims since a VM lived
        self._late_at: dict[Key, float] = {}                      # offer -> its last reclaim of an older VM
        self._relaunched: set[str] = set()                        # spot VMs rented soon after such a reclaim
        self._relaunch_fates = [0, 0]                             # of those: reclaimed early, lived past it
        self._vm_type: dict[str, tuple[str, str]] = {}           # instance id -> (cloud, instance type)
        self._recipe_tps: dict[tuple[str, str], float] = {}      # (cloud, type) -> the recipe's tokens/s
        self._replica_vm: dict[int, str] = {}                     # replica id -> instance id
        self._trained: dict[tuple[str, str], list] = {}          # (cloud, type) -> [tokens, seconds]
        self._measured: dict[tuple[str, str], float] = {}        # (cloud, type) -> tokens/s, from _trained
        self._recipe_scale: float | None = None                  # measured / recipe, geometric mean
        self._links: list[LinkMeasured] = []                              # link_measured events
        self._sync_bytes: int | None = None                      # bytes one rank sent in the last sync
        self._links_cost: dict[frozenset, float] = {}            # site pair -> sync seconds (measured)
        self._learned: dict[tuple[str, str], tuple[int, float]] = {}   # (zone, type) -> (VMs at a refusal, when)
        self._out: set[tuple[str, str]] = set()     # (zone, type) out now (refused with none, or took a VM back)
        self._seen = 0

    # -- what happened --------------------------------------------------------------------------

    def observe(self, records: list[dict]) -> None:
        """Take in the ledger records appended since the last call (read back typed)."""
        for e in read(records[self._seen:]):
            t = e.t
            if isinstance(e, NodeLaunched):
                typ = (e.cloud, e.instance_type)
                self._vm_type[e.instance_id] = typ
                self._recipe_tps[typ] = recipe_tokens_per_s(e, self._p)
                if e.spot is not False:
                    key = offer_key(e)
                    self._open[e.instance_id] = (key, e.launched_at if e.launched_at is not None else t)
                    late = self._late_at.get(key)
                    if late is not None and t - late <= self._p.capacity_cooldown_s + RECLAIMED_EARLY_S:
                        self._relaunched.add(e.instance_id)
                    zt = (e.zone, e.instance_type)
                    self._out.discard(zt)
                    learned = self._learned.get(zt)
                    if learned is not None and (self._held(zt) > learned[0] or t - learned[1] >= CAPACITY_MEMORY_S):
                        del self._learned[zt]   # it had room for more (or the belief lapsed): unknown again
            elif isinstance(e, CapacityRefused):
                if e.spot:
                    self._refused(e, t)
            elif isinstance(e, ReplicaStarting):
                self._replica_vm[int(e.replica)] = e.instance_id
            elif isinstance(e, OuterStep):
                if e.bytes_sent:
                    self._sync_bytes = int(e.bytes_sent)
                    self._links_cost = measured_links(self._links, self._sync_bytes)
                if self._tokens_per_inner_step:
                    self._measure(e)
            elif isinstance(e, LinkMeasured):
                self._links.append(e)
                self._links_cost = measured_links(self._links, self._sync_bytes)
            elif isinstance(e, (NodeNotice, NodePreempted)):
                iid = e.instance_id
                if iid in self._open and iid not in self._counted:
                    self._counted.add(iid)
                    key, since = self._open[iid]
                    self._hit_region(key[1], t)
                    self._out.add((key[2], key[3]))   # it took a VM back: its room now is unknown
                    early = t - since < RECLAIMED_EARLY_S
                    if iid in self._relaunched:
                        self._relaunched.discard(iid)
                        self._relaunch_fates[0 if early else 1] += 1
                    if early:
                        self._reclaimed_at[key] = t
                        self._early_in_row[key] += 1
                    else:
                        self._preempted[key] += 1
                        self._early_in_row[key] = 0
                        self._late_at[key] = t
                if isinstance(e, NodePreempted):
                    self._close(iid, t)
            elif isinstance(e, NodeReleased):
                held = self._open.get(e.instance_id)
                if held is not None and t - held[1] >= RECLAIMED_EARLY_S:
                    self._early_in_row[held[0]] = 0
                    if e.instance_id in self._relaunched:
                        self._relaunch_fates[1] += 1
                self._relaunched.discard(e.instance_id)   # let go young, it says nothing of the zone
                self._close(e.instance_id, t)
        self._seen = len(records)

    def _measure(self, step: OuterStep) -> None:
        """Credit each replica's inner phase of an outer step to its VM's instance type."""
        steps_done = {int(r): n for r, n in (step.steps_done or {}).items()}
        for rid, seconds in (step.inner_s_by_replica or {}).items():
            typ = self._vm_type.get(self._replica_vm.get(int(rid), ""))
            n = steps_done.get(int(rid), 0)
            if typ is not None and n and seconds > 0:
                acc = self._trained.setdefault(typ, [0, 0.0])
                acc[0] += n * self._tokens_per_inner_step
                acc[1] += seconds
        if self._trained:
            self._measured = {typ: tokens / seconds for typ, (tokens, seconds) in self._trained.items()}
            logs = [math.log(tps / self._recipe_tps[typ]) for typ, tps in self._measured.items()]
            self._recipe_scale = math.exp(sum(logs) / len(logs))

    def measured_tokens_per_s(self) -> dict[tuple[str, str], float]:
        """{(cloud, instance type): tokens/s one replica trained} over this run's outer steps."""
        return dict(self._measured)

    def tokens_per_s(self, offer: Offer) -> float | None:
        """A replica's throughput on this offer's VM: measured for its type; for a type not run yet,
        the recipe's figure times how far measured types came from their own (geometric mean);
        None before any measurement (the planner takes the recipe's figure)."""
        typ = (offer.cloud, offer.instance_type)
        mine = self._measured.get(typ, self._before.get(typ))
        if mine is not None:
            return mine
        scale = self._recipe_scale
        if scale is None and self._before:   # no measurement yet in this run: earlier runs' types
            logs = [math.log(tps / recipe_tokens_per_s({"cloud": c, "instance_type": t}, self._p))
                    for (c, t), tps in self._before.items()]
            scale = math.exp(sum(logs) / len(logs))
        return None if scale is None else recipe_tokens_per_s(offer, self._p) * scale

    def speed_source(self, offer: Offer) -> str:
        """`measured` when this run or an earlier one of the same workload trained on this type."""
        typ = (offer.cloud, offer.instance_type)
        return "measured" if typ in self._measured or typ in self._before else "estimate"

    def _held(self, zone_type: tuple[str, str]) -> int:
        """Spot VMs of a (zone, instance type) held now (launched, neither preempted nor released)."""
        return sum(1 for k, _ in self._open.values() if (k[2], k[3]) == zone_type)

    def _refused(self, e: CapacityRefused, t: float) -> None:
        """A spot launch refused for capacity: where this run held VMs of that offer (or had launches
        of it under way, `in_flight`), the offer held that many then (`capacity_learned`). One
        refused with none says the zone is out now, not how many it holds when it is not: the
        belief stands, unused until a launch there is granted again."""
        zt = (e.zone, e.instance_type)
        held = self._held(zt) + e.in_flight
        if held:
            self._learned[zt] = (held, t)
            self._out.discard(zt)
        else:
            self._out.add(zt)

    def capacity_learned(self, offer: Offer, now: float) -> int | None:
        """`Quote.capacity_learned` of `offer`: None for an on-demand offer or one that shows its
        capacity."""
        zt = (offer.zone, offer.instance_type)
        if not offer.spot or offer.capacity is not None or zt in self._out:
            return None
        held, at = self._learned.get(zt, (None, -math.inf))
        return held if now - at < CAPACITY_MEMORY_S else None

    def _close(self, instance_id: str, t: float) -> None:
        held = self._open.pop(instance_id, None)
        if held is not None:
            self._hours[held[0]] += max(0.0, t - held[1]) / 3600

    def _hit_region(self, region: str, t: float) -> None:
        hits = [h for h in self._region_hits[region] if h > t - self._p.region_cooldown_window_s] + [t]
        self._region_hits[region] = hits
        if len(hits) >= self._p.region_cooldown_preemptions:
            self._cool_region[region] = t + self._p.region_cooldown_s
            self._region_hits[region] = []

    # -- the view -------------------------------------------------------------------------------

    def risk(self, offer: Offer, now: float) -> tuple[float, str]:
        """(preemptions per node-hour, where the figure comes from) for an offer."""
        if not offer.spot:
            return 0.0, "on-demand"
        key = offer_key(offer)
        h_hours, h_n = self._history.get(key, (0.0, 0))
        hours = h_hours + self._hours.get(key, 0.0) + sum(
            max(0.0, now - since) / 3600 for k, since in self._open.values() if k == key)
        n = h_n + self._preempted.get(key, 0)
        w = self._p.prior_weight_hours
        rate = (self._p.preempt_per_hour_prior * w + n) / (w + hours)
        return rate, ("observed" if hours or n else "prior")

    def cooled_regions(self, now: float) -> set[str]:
        """Regions resting after a spike of preemptions."""
        return {r for r, until in self._cool_region.items() if until > now}

    def relaunches(self) -> tuple[int, int]:
        """(reclaimed early, lived past it) of this run's relaunches: spot VMs rented in an offer
        within `planner.capacity_cooldown_s` + `RECLAIMED_EARLY_S` of a reclaim there of a VM that
        had lived past `RECLAIMED_EARLY_S`; one let go younger than that counts in neither."""
        return self._relaunch_fates[0], self._relaunch_fates[1]

    def resting_after_reclaim(self, offer: Offer, now: float) -> bool:
        """A spot offer whose VM was reclaimed within `RECLAIMED_EARLY_S` of its launch, less than
        `planner.capacity_cooldown_s` ago (`EARLY_AGAIN_REST` times that after two or more such
        reclaims in a row, none of its VMs living past `RECLAIMED_EARLY_S` between them); or whose
        older VM was reclaimed less than `planner.capacity_cooldown_s` ago, once more of this run's
        relaunches were reclaimed early than lived (`relaunches`)."""
        if not offer.spot:
            return False
        key = offer_key(offer)
        at = self._reclaimed_at.get(key)
        rest_s = self._p.capacity_cooldown_s * (EARLY_AGAIN_REST if self._early_in_row[key] >= 2 else 1)
        if at is not None and now - at < rest_s:
            return True
        # An older VM's reclaim rests its offer only once this run's relaunches were taken young: on
        # the real V100 markets a drop takes every VM of a zone over its tick, and a replacement rented
        # there at once lived a minute (aws-v100-2zones-2022 $114.74 → $113.47, aws-v100x8-2zones-2022
        # $780.64 → $769.04); on the synthetic markets a preemption is a hazard of the VM, relaunches
        # live, and resting after every reclaim made them 1-4 % dearer (docs/benchmarks.md, session
        # 40). Counting launches up to two minutes past the rest lets a run whose zones recover unlearn it.
        early, lived = self._relaunch_fates
        late = self._late_at.get(key)
        return early > lived and late is not None and now - late < self._p.capacity_cooldown_s

    def quote(self, offer: Offer, now: float) -> Quote:
        rate, source = self.risk(offer, now)
        return Quote(offer, rate, source, offer.capacity, self.tokens_per_s(offer), self.speed_source(offer),
                     self._links_cost, self.capacity_learned(offer, now))

    def quotes(self, offers: list[Offer], now: float, rest_reclaimed: bool = False) -> list[Quote]:
        """Every offer with its risk, speed and capacity (when known). With `rest_reclaimed` (a run
        whose deadline rule can fall back on on-demand, so it can wait out a zone that is running
        out), an offer resting after an early reclaim (`resting_after_reclaim`) is left out; a run
        without that fallback keeps renting where it can (waiting, it could end for capacity).
        Regions whose preemptions spiked are left out while any other region has an offer (the
        next region first; a cooled region is still better than none). An offer resting after a
        capacity error is the policy's to leave out (`elastic.policy.rules.resting`)."""
        if rest_reclaimed:
            offers = [o for o in offers if not self.resting_after_reclaim(o, now)]
        cooled = self.cooled_regions(now)
        elsewhere = [o for o in offers if o.region not in cooled]
        return [self.quote(o, now) for o in (elsewhere or offers)]

    def stats(self, now: float) -> dict[Key, tuple[float, int]]:
        """This run's observations: {key: (node_hours, preemptions)} (open VMs counted up to now)."""
        out: dict[Key, list] = {k: [h, 0] for k, h in self._hours.items()}
        for key, since in self._open.values():
            out.setdefault(key, [0.0, 0])[0] += max(0.0, now - since) / 3600
        for key, n in self._preempted.items():
            out.setdefault(key, [0.0, 0])[1] += n
        return {k: (h, n) for k, (h, n) in out.items()}


# -- history of earlier runs ----------------------------------------------------------------------

def history_path() -> Path:
    """Where observed preemption rates of earlier runs are kept ($ELASTIC_CACHE or ~/.cache/elastic)."""
    return cache_dir() / "preemptions.json"


def load_history(path: Path | None = None) -> dict[Key, tuple[float, int]]:
    """{key: (node_hours, preemptions)} of earlier runs; empty when missing or unreadable."""
    path = path or history_path()
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
        return {tuple(r["key"]): (float(r["node_hours"]), int(r["preemptions"])) for r in rows}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def save_history(stats: dict[Key, tuple[float, int]], path: Path | None = None) -> None:
    """Add a run's observations to the history (written to a temp file, then renamed)."""
    path = path or history_path()
    merged = load_history(path)
    for key, (hours, n) in stats.items():
        h0, n0 = merged.get(key, (0.0, 0))
        merged[key] = (h0 + hours, n0 + n)
    rows = [{"key": list(k), "node_hours": round(h, 6), "preemptions": n} for k, (h, n) in sorted(merged.items())]
    write_json_atomic(path, rows, indent=1)


# -- measured throughput of earlier runs ----------------------------------------------------------

def throughput_path() -> Path:
    """Where measured tokens/s of earlier runs are kept ($ELASTIC_CACHE or ~/.cache/elastic)."""
    return cache_dir() / "throughput.json"


def workload_key(recipe) -> str:
    """What a throughput figure holds for: the model's size and what one replica trains per step
    (a figure measured for another model or batch says little about this one)."""
    import hashlib

    t = recipe.train
    model = hashlib.sha256(json.dumps(recipe.model.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()
    return f"model-{model[:12]}/b{t.batch_size}x{t.seq_len}/r{recipe.world.ranks_per_replica}"


def measure_throughput(events: list[dict], tokens_per_inner_step: int) -> dict[tuple[str, str], tuple[int, float]]:
    """{(cloud, instance type): (tokens, seconds)} one replica trained on that type over a run's
    outer steps. A replica's seconds are the whole phase (its inner steps and the outer sync all
    replicas wait for), so the figures sum to the run's training tokens/s."""
    vm_type: dict[str, tuple[str, str]] = {}
    replica_vm: dict[int, str] = {}
    out: dict[tuple[str, str], list] = {}
    for e in events:
        if e["type"] == NodeLaunched.TYPE:
            vm_type[e["instance_id"]] = (e["cloud"], e["instance_type"])
        elif e["type"] == ReplicaStarting.TYPE:
            replica_vm[int(e["replica"])] = e["instance_id"]
        elif e["type"] == OuterStep.TYPE:
            phase_s = e.get("inner_s", 0.0) + e.get("sync_s", 0.0)
            for rid, n in (e.get("steps_done") or {}).items():
                typ = vm_type.get(replica_vm.get(int(rid), ""))
                if typ is not None and n and phase_s > 0:
                    acc = out.setdefault(typ, [0, 0.0])
                    acc[0] += n * tokens_per_inner_step
                    acc[1] += phase_s
    return {typ: (tokens, seconds) for typ, (tokens, seconds) in out.items()}


def load_throughput(workload: str, path: Path | None = None) -> dict[tuple[str, str], float]:
    """{(cloud, instance type): tokens/s} earlier runs of `workload` measured; empty when none."""
    path = path or throughput_path()
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
        return {(r["cloud"], r["instance_type"]): r["tokens"] / r["seconds"] for r in rows
                if r["workload"] == workload and r["seconds"] > 0}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def save_throughput(measured: dict[tuple[str, str], tuple[int, float]], workload: str,
                    path: Path | None = None) -> None:
    """Add a run's measured (tokens, seconds) per instance type to the throughput history."""
    path = path or throughput_path()
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
        merged = {(r["cloud"], r["instance_type"], r["workload"]): [int(r["tokens"]), float(r["seconds"])]
                  for r in rows}
    except (OSError, ValueError, KeyError, TypeError):
        merged = {}
    for (cloud, itype), (tokens, seconds) in measured.items():
        acc = merged.setdefault((cloud, itype, workload), [0, 0.0])
        acc[0] += tokens
        acc[1] += seconds
    rows = [{"cloud": c, "instance_type": t, "workload": w, "tokens": n, "seconds": round(sec, 3)}
            for (c, t, w), (n, sec) in sorted(merged.items())]
    write_json_atomic(path, rows, indent=1)
