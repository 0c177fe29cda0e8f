"""The planner: how many replicas to rent where, and when to move one. Pure and fast (no I/O).

Objective: least expected USD per useful token. A replica's raw throughput is what the run measured
on that instance type, else the recipe's figure (`planner.tokens_per_s`, scaled by how far the
measured types came from theirs; see `Market.quote`); useful throughput discounts the work
preemption is expected to cost (risk × (half an inner phase + `planner.recovery_s`)) and the outer
sync a world spread over regions or clouds pays (`planner.cross_region_sync_s`). Replicas
synchronise every inner phase, so the slowest one sets the world's pace. Constraints: regions,
`resources.max_usd_per_hour`, spot or on-demand, known capacity, world min/target/max,
`planner.spread_min` distinct zones or regions, and `budget.max_hours` through `plan` (a faster or
bigger world when the cheapest one would finish too late). What to do with a plan, and the budget
checks, are the policy's (`elastic.policy.rules`).
"""

from __future__ import annotations

import math

from collections import Counter
from dataclasses import dataclass, field

from elastic.policy.market import Quote, recipe_tokens_per_s
from elastic.record import billing
from elastic.train.quality import quality_cost


def replica_tokens_per_s(q: Quote, planner) -> float:
    """Raw training throughput of one replica on this quote's VM, tokens/s: the market's figure
    (measured in this run) where it has one, else the recipe's."""
    return q.tokens_per_s or recipe_tokens_per_s(q.offer, planner)


def tokens_per_phase(recipe) -> int:
    """Tokens one replica trains in one inner phase."""
    t = recipe.train
    return t.inner_steps * t.batch_size * t.seq_len


def run_tokens(recipe) -> int:
    """Tokens the whole run trains: train.token_budget, else outer_steps phases of world.replicas."""
    t, w = recipe.train, recipe.world
    return t.token_budget if t.token_budget is not None else \
        t.outer_steps * min(w.replicas, w.max_replicas) * tokens_per_phase(recipe)


def allowed(offer, resources) -> bool:
    """The recipe lets this offer be rented (regions, price cap, spot or on-demand; a spot recipe
    falls back on on-demand offers where the policy quotes them: `policy.on_demand_need`)."""
    return ((not resources.regions or offer.region in resources.regions)
            and (offer.spot == resources.spot or not offer.spot)
            and (resources.max_usd_per_hour is None or offer.usd_per_hour <= resources.max_usd_per_hour))


def site(offer) -> str:
    """`cloud/region`: the unit a link between replicas is measured and priced in."""
    return f"{offer.cloud}/{offer.region}"


def sync_penalty_s(quotes: list[Quote], planner) -> float:
    """Extra seconds per outer sync for a world spread over sites (`cloud/region`): the slowest
    pair of its sites sets it. A pair measured in this run (`Quote.links`, from `link_measured`)
    costs what its measurement says; one not measured costs the recipe's guess,
    `planner.cross_region_sync_s` (twice that across clouds)."""
    sites = sorted({site(q.offer) for q in quotes})
    links = next((q.links for q in quotes if q.links), {})
    worst = 0.0
    for i, a in enumerate(sites):
        for b in sites[i + 1:]:
            guess = planner.cross_region_sync_s * (2 if a.split("/")[0] != b.split("/")[0] else 1)
            worst = max(worst, links.get(frozenset((a, b)), guess))
    return worst


def _group(q: Quote, planner) -> tuple:
    o = q.offer
    return (o.cloud, o.region, o.zone) if planner.spread_over == "zone" else (o.cloud, o.region)


def _availability(q: Quote, phase_s: float, planner) -> float:
    """Share of a replica's time that ends up as kept work, given its preemption risk."""
    lost_s_per_h = q.preempt_per_hour * (phase_s / 2 + planner.recovery_s)
    return max(0.0, 1.0 - lost_s_per_h / 3600)


def usd_per_mtok(q: Quote, recipe) -> float:
    """Expected USD per million useful tokens of one replica on its own (the ranking key)."""
    p = recipe.planner
    tps = replica_tokens_per_s(q, p)
    useful = tps * _availability(q, tokens_per_phase(recipe) / tps, p)
    return q.offer.usd_per_hour / (useful * 3600) * 1e6 if useful > 0 else float("inf")


@dataclass
class Placement:
    """A world: one quote per replica, and what it is expected to cost and give.

    Args:
        quotes: one per replica.
        usd_per_hour: the world's price, USD per hour.
        useful_tokens_per_s: expected kept tokens per second of the whole world.
        usd_per_mtok: expected USD per million useful tokens.
        phase_s: seconds of one inner phase (the slowest replica's) plus the outer sync.
        sync_penalty_s: the part of `phase_s` due to spreading over regions/clouds.
        tokens_needed: tokens the run trains (train.token_budget, or outer_steps × replicas × phase tokens).
        expected_hours: hours to train `tokens_needed` at the useful rate.
        expected_usd: USD for that, as `elastic.record.billing` bills the world's VMs (`expected_vm_usd`).
        feasible: at least world.min_replicas could be placed.
        warnings: what the user should know (budget, time, capacity).
    """

    quotes: list[Quote]
    usd_per_hour: float = 0.0
    useful_tokens_per_s: float = 0.0
    usd_per_mtok: float = float("inf")
    phase_s: float = 0.0
    sync_penalty_s: float = 0.0
    tokens_needed: int = 0
    expected_hours: float = float("inf")
    expected_usd: float = float("inf")
    feasible: bool = False
    warnings: list[str] = field(default_factory=list)

    def to_dict(self, recipe) -> dict:
        slots: dict = {}
        for q in self.quotes:
            o = q.offer
            s = slots.setdefault(q.key, {"cloud": o.cloud, "region": o.region, "zone": o.zone,
                                         "instance_type": o.instance_type, "gpu": o.gpu, "gpus": o.gpus,
                                         "ranks": recipe.world.ranks_per_replica, "spot": o.spot, "replicas": 0, "usd_per_hour": round(o.usd_per_hour, 6),
                                         "on_demand_usd_per_hour": round(o.on_demand_usd_per_hour, 6),
                                         "preempt_per_hour": round(q.preempt_per_hour, 4),
                                         "risk_source": q.risk_source, "capacity": q.capacity,
                                         "tokens_per_s": round(replica_tokens_per_s(q, recipe.planner), 1),
                                         "tokens_per_s_source": q.speed_source,
                                         "usd_per_mtok": round(usd_per_mtok(q, recipe), 4),
                                         "read_at": o.read_at})
            s["replicas"] += 1
        fin = (lambda x: round(x, 4) if x != float("inf") else None)
        return {"feasible": self.feasible, "replicas": len(self.quotes), "ranks_per_replica": recipe.world.ranks_per_replica,
                "placement": list(slots.values()),
                "regions": sorted({q.offer.region for q in self.quotes}),
                "zones": sorted({q.offer.zone for q in self.quotes}),
                "usd_per_hour": round(self.usd_per_hour, 4), "useful_tokens_per_s": round(self.useful_tokens_per_s, 1),
                "tokens_per_s_source": speed_source(self.quotes),
                "usd_per_mtok": fin(self.usd_per_mtok), "phase_s": round(self.phase_s, 3),
                "sync_penalty_s": self.sync_penalty_s, "tokens_needed": self.tokens_needed,
                "expected_hours": fin(self.expected_hours), "expected_usd": fin(self.expected_usd),
                "quality": quality_cost(recipe, len(self.quotes)),
                "warnings": self.warnings}


def speed_source(quotes: list[Quote]) -> str:
    """`measured`, `estimate`, or `partly measured` for a world's throughput figure."""
    kinds = {q.speed_source for q in quotes}
    return kinds.pop() if len(kinds) == 1 else ("partly measured" if kinds else "estimate")


def evaluate(quotes: list[Quote], recipe) -> Placement:
    """What a world on these quotes is expected to cost and give."""
    p, t = recipe.planner, recipe.train
    pl = Placement(list(quotes), feasible=len(quotes) >= recipe.world.min_replicas)
    if not quotes:
        return pl
    tpp = tokens_per_phase(recipe)
    inner_s = max(tpp / replica_tokens_per_s(q, p) for q in quotes)
    pl.sync_penalty_s = sync_penalty_s(quotes, p)
    pl.phase_s = inner_s + pl.sync_penalty_s
    pl.usd_per_hour = sum(q.offer.usd_per_hour for q in quotes)
    pl.useful_tokens_per_s = tpp / pl.phase_s * sum(_availability(q, inner_s, p) for q in quotes)
    pl.tokens_needed = t.token_budget if t.token_budget is not None else t.outer_steps * len(quotes) * tpp
    if pl.useful_tokens_per_s > 0:
        pl.usd_per_mtok = pl.usd_per_hour / (pl.useful_tokens_per_s * 3600) * 1e6
        pl.expected_hours = pl.tokens_needed / pl.useful_tokens_per_s / 3600
        pl.expected_usd = sum(expected_vm_usd(q, pl.expected_hours) for q in quotes)
    return pl


def expected_vm_usd(q: Quote, hours: float) -> float:
    """USD one replica's place in the world bills over `hours` (`elastic.record.billing`): a VM of `q`,
    replaced after each of its expected preemptions, each VM billed its expected share of the time
    but at least its cloud's minimum (VMs preempted within a minute each bill a whole one), less what
    the cloud does not bill of the spot VMs it takes young (`billing.free`; AWS: the first hour).

    That refund: the lives that end in a preemption span the place's hours less its last life
    (censored by the run's end: E[min(Exp(r), hours)] = (1 − e^{−r·hours})/r), and of the time in
    lives each Exp(r) long, the share in lives shorter than the free window F is
    r·E[τ·1{τ < F}] = 1 − e^{−rF}(1 + rF) (the renewal share; an estimate, as the rest). The
    minimums of the refunded VMs are not taken off: above the invoice where VMs last under a
    minute."""
    r = q.preempt_per_hour
    vms = 1 + r * hours
    billed_s = billing.billed_s(q.offer.cloud, hours * 3600 / vms, ended=True)
    usd = vms * billed_s * q.offer.usd_per_hour / 3600
    free_h = billing.terms(q.offer.cloud).interrupted_free_s / 3600
    if q.offer.spot and free_h > 0 and r > 0 and hours > 0:
        ended_h = hours + math.expm1(-r * hours) / r
        refunded_h = ended_h * (1 - math.exp(-r * free_h) * (1 + r * free_h))
        usd = max(0.0, usd - refunded_h * q.offer.usd_per_hour)
    return usd


def _fill(ranked: list[Quote], held: list[Quote], n: int, k: int, planner) -> list[Quote]:
    """Greedy: the best quote of each of the first k distinct groups (spread), then the best quotes
    in order, each up to its known capacity."""
    chosen = list(held)
    used = Counter((q.key, q.offer.spot) for q in held)   # on-demand VMs take no spot capacity
    groups = {_group(q, planner) for q in held}

    def room(q):
        return q.capacity is None or used[(q.key, q.offer.spot)] < q.capacity

    if len(groups) < k:
        for q in ranked:
            if len(chosen) >= n or len(groups) >= k:
                break
            g = _group(q, planner)
            if g not in groups and room(q):
                chosen.append(q)
                used[(q.key, q.offer.spot)] += 1
                groups.add(g)
    for q in ranked:
        if len(chosen) >= n:
            break
        while len(chosen) < n and room(q):
            chosen.append(q)
            used[(q.key, q.offer.spot)] += 1
    return chosen


class _Ranked:
    """Quotes the recipe allows, best first by USD per useful token, and grouped by throughput
    class (GPU model and count; by speed for CPU-only VMs) and by region (computed once per
    decision; `_best` is called for several world sizes)."""

    def __init__(self, quotes: list[Quote], recipe):
        p = recipe.planner
        self.all = sorted((q for q in quotes if allowed(q.offer, recipe.resources)), key=lambda q: usd_per_mtok(q, recipe))
        self.by_speed: dict = {}
        self.by_region: dict = {}
        for q in self.all:
            # Measured speeds of two VMs with the same GPUs differ a little: still one class.
            speed_class = (q.offer.gpu, q.offer.gpus) if q.offer.gpu else replica_tokens_per_s(q, p)
            self.by_speed.setdefault(speed_class, []).append(q)
            self.by_region.setdefault((q.offer.cloud, q.offer.region), []).append(q)


def _candidates(ranked: _Ranked, recipe, held: list[Quote], n: int) -> list[Placement]:
    """Worlds of n replicas (held ones kept) worth comparing: the plain ranking filled greedily;
    each throughput class alone (no replica waits on a slower GPU); and, when no spread is asked
    for, each region alone (no cross-region sync)."""
    k = min(recipe.planner.spread_min, n)
    subsets = [ranked.all] + (list(ranked.by_speed.values()) if len(ranked.by_speed) > 1 else [])
    if k <= 1 and len(ranked.by_region) > 1:
        held_regions = {(q.offer.cloud, q.offer.region) for q in held}
        subsets += [qs for r, qs in ranked.by_region.items() if held_regions <= {r}]
    return [evaluate(_fill(qs, held, n, k, recipe.planner), recipe) for qs in subsets]


def _best(ranked: _Ranked, recipe, held: list[Quote], n: int) -> Placement:
    """The most replicas (up to n) that can be placed, cheapest per useful token among those."""
    best = None
    for pl in _candidates(ranked, recipe, held, n):
        if best is None or (len(pl.quotes), -pl.usd_per_mtok) > (len(best.quotes), -best.usd_per_mtok):
            best = pl
    return best


@dataclass(frozen=True)
class Progress:
    """How far a run has come, for planning the rest of it against budget.max_hours.

    Args:
        tokens: tokens trained so far.
        outer_steps: outer steps done so far.
        hours: hours since the run started.
    """

    tokens: int = 0
    outer_steps: int = 0
    hours: float = 0.0


def hours_to_finish(pl: Placement, recipe, progress: Progress = Progress()) -> float:
    """Expected hours for the world `pl` to train what is left of the run."""
    t = recipe.train
    if t.token_budget is not None:
        tokens = max(0, t.token_budget - progress.tokens)
    else:
        tokens = max(0, t.outer_steps - progress.outer_steps) * len(pl.quotes) * tokens_per_phase(recipe)
    if not tokens:
        return 0.0
    return tokens / pl.useful_tokens_per_s / 3600 if pl.useful_tokens_per_s > 0 else float("inf")


def hours_left(recipe, progress: Progress = Progress()) -> float | None:
    """Hours the planner may plan the rest of the run into: what budget.max_hours leaves, less
    `planner.deadline_slack` of that (preemptions make the finish uncertain); None without a
    limit."""
    b = recipe.budget
    if b.max_hours is None:
        return None
    return max(0.0, b.max_hours - progress.hours) * (1 - recipe.planner.deadline_slack)


def _finish_h(pl: Placement, recipe, held: list[Quote], progress: Progress) -> float:
    """Hours until `pl` has trained the rest of the run, its new VMs' boot (`planner.recovery_s`)
    included."""
    boot_h = recipe.planner.recovery_s / 3600 if len(pl.quotes) > len(held) else 0.0
    return boot_h + hours_to_finish(pl, recipe, progress)


def _for_deadline(ranked: _Ranked, recipe, held: list[Quote], progress: Progress) -> Placement:
    """The cheapest world, from world.replicas up to world.max_replicas replicas and over the
    throughput classes and regions `_best` weighs, that finishes within `hours_left`; when none
    does, the one that finishes first. A bigger world must be more than 1 % cheaper per token to
    win over a smaller one (the recipe's world.replicas is the size asked for)."""
    w = recipe.world
    target = min(w.replicas, w.max_replicas)
    limit = hours_left(recipe, progress)
    first = _best(ranked, recipe, held, max(target, len(held)))
    if limit is None or (len(first.quotes) >= target and _finish_h(first, recipe, held, progress) <= limit):
        return first
    fits, fastest = None, None
    for n in range(max(target, len(held)), w.max_replicas + 1):
        for pl in _candidates(ranked, recipe, held, n):
            if len(pl.quotes) < n:
                continue
            finish_h = _finish_h(pl, recipe, held, progress)
            if finish_h <= limit:
                bar = fits.usd_per_mtok * (0.99 if n > len(fits.quotes) else 1.0) if fits else float("inf")
                if pl.usd_per_mtok < bar:
                    fits = pl
            if fastest is None or (finish_h, pl.usd_per_mtok, n) < fastest[0]:
                fastest = ((finish_h, pl.usd_per_mtok, n), pl)
    return fits or (fastest[1] if fastest else first)


def plan(quotes: list[Quote], recipe, held: list[Quote] = (), n: int | None = None,
         progress: Progress = Progress()) -> Placement:
    """The placement for the whole world (`held`: replicas already running, kept in place;
    `progress`: how far the run is).

    Without `n`: the cheapest world per useful token of world.replicas replicas; when that would not
    finish within budget.max_hours (less `planner.deadline_slack`), the cheapest that does, with
    faster GPUs or more replicas (up to world.max_replicas); when none does, the fastest."""
    return _plan(_Ranked(quotes, recipe), recipe, list(held), n, progress)


def _plan(ranked: _Ranked, recipe, held: list[Quote], n: int | None, progress: Progress) -> Placement:
    w, b = recipe.world, recipe.budget
    if n is not None:
        best = _best(ranked, recipe, held, n)
    else:
        best = _for_deadline(ranked, recipe, held, progress)
        n = max(len(best.quotes), min(w.replicas, w.max_replicas))
    if len(best.quotes) < n:
        best.warnings.append(f"only {len(best.quotes)} of {n} replica(s) can be placed on the offers now")
    if not best.feasible:
        best.warnings.append(f"fewer than world.min_replicas ({w.min_replicas}) can be placed")
    if best.quotes and b.max_usd is not None and best.expected_usd > b.max_usd:
        best.warnings.append(f"budget.max_usd (${b.max_usd:,.2f}) covers about "
                             f"{b.max_usd / best.expected_usd:.0%} of the expected ${best.expected_usd:,.2f}")
    finish_h = _finish_h(best, recipe, held, progress) if best.quotes else 0.0
    if best.quotes and b.max_hours is not None and progress.hours + finish_h > b.max_hours:
        best.warnings.append(f"budget.max_hours ({b.max_hours} h) is shorter than the expected "
                             f"{progress.hours + finish_h:.1f} h")
    return best


def choose_launch(quotes: list[Quote], recipe, held: list[Quote], progress: Progress = Progress()) -> Quote | None:
    """The offer the next replica should be rented from, given the replicas held (or on their way):
    the first one the plan for the whole world (`plan`) adds to them, else the best one more."""
    ranked = _Ranked(quotes, recipe)
    pl = _plan(ranked, recipe, list(held), None, progress)
    if len(pl.quotes) <= len(held):
        pl = _best(ranked, recipe, list(held), len(held) + 1)
    return pl.quotes[len(held)] if len(pl.quotes) > len(held) else None


def lifetime_h(q: Quote, hours_left: float | None = None) -> float:
    """Hours a VM rented from `q` is expected to train before a preemption takes it (1 / its
    learnt rate), at most `hours_left` (what the run still needs)."""
    life = 1 / q.preempt_per_hour if q.preempt_per_hour > 0 else float("inf")
    return min(life, hours_left) if hours_left is not None and hours_left > 0 else life


def launch_usd_per_mtok(q: Quote, recipe, hours_left: float | None = None) -> float:
    """Expected USD per million useful tokens of a VM rented now from `q`, its boot and join
    (`planner.recovery_s`, billed, no tokens) spread over its expected lifetime (`lifetime_h`): a
    cheap offer that is reclaimed within the hour is dear once its boot is paid."""
    boot_h = recipe.planner.recovery_s / 3600
    life = lifetime_h(q, hours_left)
    return usd_per_mtok(q, recipe) * (1 + boot_h / life) if life > 0 else float("inf")


def leaves_at_once(old: Quote, new: Quote, recipe, hours_left: float | None = None) -> bool:
    """Whether a moved replica should leave the moment its replacement is rented, not once the
    replacement trains: its tokens while the new VM boots cost more than the new VM's will, boot
    included, so they are cheaper trained later (the world goes on, one replica short, meanwhile).
    A price spike is the usual case: holding the old VM through the boot is the dearest part of
    the move."""
    return usd_per_mtok(old, recipe) > launch_usd_per_mtok(new, recipe, hours_left)


@dataclass(frozen=True)
class Move:
    """Rent `add` first; once its replica has joined, drain the replica on `drain` (an instance id).

    Args:
        add: the offer to rent.
        drain: instance id of the replica to drain once the new one trains.
        usd_per_mtok_before: the world's expected USD per 1M useful tokens now.
        usd_per_mtok_after: the same after the move.
    """

    add: Quote
    drain: str
    usd_per_mtok_before: float
    usd_per_mtok_after: float


def replan(quotes: list[Quote], held: list[tuple[str, Quote]], recipe, remaining_hours: float = 1.0,
           progress: Progress = Progress()) -> Move | None:
    """Whether to move the world's most expensive replica (held: (instance id, its quote at today's
    price and risk)). The new offer is the planner's choice for that place (`choose_launch`, so the
    world still finishes within budget.max_hours from `progress` on when it can); its expected USD
    per useful token must be `planner.min_saving` below that replica's (hysteresis), the world must
    come out cheaper per useful token, and the saving over `remaining_hours` must pay for the
    replacement while it boots and joins."""
    if not held or not quotes:
        return None
    p = recipe.planner
    now = evaluate([q for _, q in held], recipe)
    worst = max(range(len(held)), key=lambda i: usd_per_mtok(held[i][1], recipe))
    rest = [q for i, (_, q) in enumerate(held) if i != worst]
    add = choose_launch(quotes, recipe, rest, progress)
    if add is None or add.key == held[worst][1].key:
        return None
    if usd_per_mtok(add, recipe) > usd_per_mtok(held[worst][1], recipe) * (1 - p.min_saving):
        return None
    after = evaluate(rest + [add], recipe)
    if after.usd_per_mtok >= now.usd_per_mtok:
        return None
    saving_usd_per_h = (now.usd_per_mtok - after.usd_per_mtok) * after.useful_tokens_per_s * 3600 / 1e6
    migration_usd = add.offer.usd_per_hour * p.recovery_s / 3600
    if saving_usd_per_h * remaining_hours <= migration_usd:
        return None
    return Move(add, held[worst][0], now.usd_per_mtok, after.usd_per_mtok)


def replan_all(quotes: list[Quote], held: list[tuple[str, Quote]], recipe, remaining_hours: float | None = None,
               progress: Progress = Progress()) -> list[Move]:
    """Every move worth making now, most expensive replica first (each move's new replica counts
    as held, in its new place, for the next decision). `remaining_hours`: the payback horizon;
    default, the rest of the run at the held world's expected pace from `progress`."""
    if remaining_hours is None:   # what is left of the run at the held world's pace
        left_h = hours_to_finish(evaluate([q for _, q in held], recipe), recipe, progress) if held else 0.0
        remaining_hours = left_h if 0 < left_h < float("inf") else 1.0
    moves: list[Move] = []
    start = list(held)
    for _ in range(len(held)):
        move = replan(quotes, held, recipe, remaining_hours, progress)
        if move is None:
            break
        moves.append(move)
        held = [(iid, q) for iid, q in held if iid != move.drain] + [(f"<for {move.drain}>", move.add)]
    # A held region missing from the quotes rests after a spike of preemptions (`Market.quotes`):
    # a wave is under way there, so the world leaves it whole, ahead of the rest of the wave.
    offered = {q.offer.region for q in quotes}
    if moves or all(q.offer.region in offered for _, q in start):
        return moves
    return _move_world(quotes, start, recipe, remaining_hours, progress)


def _move_world(quotes: list[Quote], held: list[tuple[str, Quote]], recipe, remaining_hours: float,
                progress: Progress) -> list[Move]:
    """The whole world moved at once, for a world whose region is hit by a wave of preemptions
    (`replan_all` asks only then): one replica at a time cannot leave a region or a throughput
    class (the rest would sync across regions or wait on it), so replacements went on being rented
    into the wave. It moves when the plan for a fresh world (`plan`: budget.max_hours kept) has the
    same size, is `planner.min_saving` cheaper per useful token (the wave's learnt risk counts) and
    the saving over `remaining_hours` pays every new VM's boot and join. Asked on every re-plan
    instead, it chased price noise: 5-10 % dearer on bench/traces/make_traces.py's storms traces."""
    if not held or not quotes:
        return []
    p = recipe.planner
    now = evaluate([q for _, q in held], recipe)
    fresh = plan(quotes, recipe, progress=progress)   # within budget.max_hours, as any plan
    if len(fresh.quotes) != len(held) or fresh.usd_per_mtok > now.usd_per_mtok * (1 - p.min_saving):
        return []
    saving_usd_per_h = (now.usd_per_mtok - fresh.usd_per_mtok) * fresh.useful_tokens_per_s * 3600 / 1e6
    if saving_usd_per_h * remaining_hours <= fresh.usd_per_hour * p.recovery_s / 3600:
        return []
    # Most expensive first, each paired with a place of the fresh world (held places kept).
    order = sorted(held, key=lambda h: -usd_per_mtok(h[1], recipe))
    places = sorted(fresh.quotes, key=lambda q: usd_per_mtok(q, recipe))
    kept = Counter(q.key for _, q in held)
    moves = []
    for iid, q in order:
        if kept[q.key] and any(f.key == q.key for f in places):
            kept[q.key] -= 1
            places.remove(next(f for f in places if f.key == q.key))
            continue
        moves.append(Move(places.pop(0), iid, now.usd_per_mtok, fresh.usd_per_mtok))
    return moves
