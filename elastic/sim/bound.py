"""The least any rental policy could pay per token on a trace, in the simulator's own model: the
yardstick `bench/policies.py` holds the policies against.

`lower_bound_usd_per_mtok` bounds the expected USD per 1M tokens of any policy that trains the run's
tokens on the trace by a given time, billed before the clouds' refunds (the simulator's `list_usd`:
AWS bills nothing for a spot VM it interrupts in its first hour, `elastic.record.billing.free`, which
these programs leave out). With the refund in, the same program, its kept VMs split by the row they
were booted in, falls to $1.24 on aws-v100-3zones against $64.09 (docs/benchmarks.md, session 39):
knowing when a zone drops, a policy would run every VM in the hour before and pay next to nothing,
so a bound of the invoice says nothing of a policy that does not know. It keeps the costs the simulator charges every policy and no
policy can dodge, and drops the rest in the policy's favour:
- kept: the trace's prices, each VM billed from launch, `planner.recovery_s` of boot (paid, no
  tokens) for every VM started, preemptions at the trace's rates (a preempted VM is gone: going on
  means booting another) with what a VM preempted in its first row bills past its life by its
  cloud's terms (`elastic.record.billing.terms`: the seconds short of the minimum, then the rest of the
  increment it was preempted in), at most `world.max_replicas` VMs, each offer's capacity;
- dropped: uncertainty about prices (the whole trace is known in advance), the slowest replica
  setting the world's pace, the outer sync and its cross-region cost, work lost without a notice,
  `world.min_replicas`, decisions between the trace's rows (made at row starts), the minimum of a
  VM the policy lets go itself (rows are longer than a minimum), the rounding to increments of a VM
  the policy lets go (it may go on an increment's end) or that is preempted after its first row.

Method. Each of the `world.max_replicas` slots is a small Markov decision process over the trace's
rows: at each row start it is off or holds one VM of one offer; moving to another offer boots a new
VM; a VM present in a row is preempted with the row's probability and the slot is then off. The
run's token count and the offers' capacities couple the slots. In expectation all of it is linear:
the bound is the least expected cost of a linear program over the slots' expected VMs per row and
offer (`_slots_program`, solved exactly by scipy's HiGHS), which every policy's expected schedule
satisfies, so it is at most what any policy pays. It is the optimum of the Lagrangian relaxation
that `_slot` prices (λ per token, μ per VM of an offer in a row; `bench/foresight.py` and
`bench/online_bound.py` use `_slot` so). With no boot (`recovery_s` 0) and no preemption it is the
relaxation of choosing the cheapest world at every row with free moves. A spot recipe with
budget.max_hours also has the on-demand offers its deadline rule falls back on.

`min_replicas_floor_usd_per_mtok` is the other yardstick: it keeps world.min_replicas (every credited
step has that many members) and drops boots and preemptions instead; each is a lower bound, so the
higher of the two is one (`elastic.sim.simulate.min_replicas_bound_usd_per_mtok`).

What is not shown: that a policy deciding within rows meets the program that keeps
world.min_replicas row by row. A VM launched s seconds into a row is ready at a time no mix of
row-start boots gives it: over two rows the mix credits its tokens whole, but in the second it
credits up to s·boot/row seconds fewer than the VM trains, and a world short of members in the
first cannot take the difference there. The plain program counts tokens over the whole run and is
not touched by this. Restating aws-v100-2zones-2022's rows as two moves the bound from $99.13 to
$99.17, and no run of the simulator has come in under it (docs/benchmarks.md, session 38).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from elastic.policy.market import recipe_tokens_per_s
from elastic.policy.planner import allowed, run_tokens
from elastic.record import billing

UNLIMITED = 1e9   # capacity of an offer the trace gives none for


def row_times(market, limit_s: float, rows: int = 0) -> list[float]:
    """The rows' start times: the trace's, and where it ends before `limit_s` (its last row holds
    for ever, as `TraceMarket` replays it) more rows of its first row's length up to `limit_s`, and
    at least `rows` of them."""
    times = list(market.times())
    if times:
        gap = _row_gap(times)
        while len(times) < rows or (math.isfinite(limit_s) and times[-1] + gap < limit_s):
            times.append(times[-1] + gap)
    return times


def _row_gap(times: list[float]) -> float:
    """The length given to a row past the trace's last start: its first row's (300 s for one row)."""
    return times[1] - times[0] if len(times) > 1 else 300.0


def _arrays(recipe, market, finish_h: float | None):
    """Per row (until `finish_h`) and offer: USD/h (inf where the recipe does not allow it),
    capacity, preemptions per hour; seconds per row; tokens/s and billing terms per offer."""
    limit_s = (finish_h if finish_h is not None else recipe.budget.max_hours or math.inf) * 3600
    times = row_times(market, limit_s)
    spot = recipe.resources.spot
    keys = None
    usd, cap, rate, row_s = [], [], [], []
    for i, t in enumerate(times):
        if t >= limit_s:
            break
        end = times[i + 1] if i + 1 < len(times) else t + _row_gap(times)
        offers = market.offers(t, spot)
        keys = keys or [(o.zone, o.instance_type) for o in offers]
        by_key = {(o.zone, o.instance_type): o for o in offers}
        row = [by_key[k] for k in keys]
        row_s.append(min(end, limit_s) - t)
        usd.append([o.usd_per_hour if allowed(o, recipe.resources) else math.inf for o in row])
        cap.append([o.capacity if o.capacity is not None else UNLIMITED for o in row])
        rate.append([market.state(o.zone, o.instance_type, t).preempt_per_hour if spot else 0.0 for o in row])
    first = market.offers(0.0, spot)
    tps = [recipe_tokens_per_s(o, recipe.planner) for o in first]
    terms = [billing.terms(o.cloud) for o in first]
    return (np.array(usd), np.array(cap, float), np.array(rate), np.array(row_s), np.array(tps), terms)


def _expected_min(rate_per_h, seconds):
    """E[min(τ, seconds)] for τ exponential at `rate_per_h` per hour (seconds a VM is there)."""
    r = np.asarray(rate_per_h) / 3600
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(r > 0, -np.expm1(-r * seconds) / np.where(r > 0, r, 1), seconds)


def _mean_rounding_s(rate_per_h, increment_s):
    """E[increment − x | x < increment] for x exponential at `rate_per_h` per hour: the seconds a
    VM preempted within an increment bills past its end (increment/2 at low rates)."""
    r = np.asarray(rate_per_h) / 3600
    ri = r * increment_s
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        mean_x = 1 / r - increment_s * np.exp(-ri) / -np.expm1(-ri)
        return np.where(ri > 1e-6, increment_s - mean_x, increment_s / 2 + r * increment_s ** 2 / 12)


def _short_usd(usd, rate, row_s, terms):
    """USD a VM booted at each row and offer is expected to bill past its life when preempted in
    that row, by its cloud's `terms` (minimum m, increment i): its price × E[(billed(τ) − τ)·1{τ <
    row}]. Counted: m − τ before the minimum, and between the first whole increment from m and the
    row's last the mean rounding of an increment (the same in each: τ is memoryless); the seconds
    between m and that increment are left out, in the policy's favour."""
    minimum_s = np.array([t.minimum_s for t in terms], float)
    inc_s = np.array([t.increment_s for t in terms], float)
    first_s = np.ceil(minimum_s / inc_s - 1e-9) * inc_s                 # first increment boundary from m
    last_s = np.floor(row_s[:, None] / inc_s + 1e-9) * inc_s             # the row's last one
    r = rate / 3600
    rounded = np.maximum(0.0, np.exp(-r * first_s) - np.exp(-r * last_s)) * _mean_rounding_s(rate, inc_s)
    short_s = minimum_s - _expected_min(rate, minimum_s) + rounded
    with np.errstate(invalid="ignore"):           # inf × 0 where no price is allowed and nothing is short
        return np.where(np.isfinite(usd), usd * short_s / 3600, 0.0)


def _slot(usd, rate, row_s, tps, lam, mu, boot_s, short_usd):
    """One slot's best schedule for token price `lam` and capacity prices `mu`: its expected
    cost − lam·tokens + mu·presence, the expected presence at each offer and row, expected tokens.
    `short_usd`: what a VM booted there bills short of its minimum (`_short_usd`)."""
    n, m = usd.shape
    there = _expected_min(rate, row_s[:, None])                  # seconds a VM present at row start stays
    gone = -np.expm1(-rate * row_s[:, None] / 3600)               # P(preempted within the row)
    run = (usd * there + mu * row_s[:, None]) / 3600 - lam * tps * there
    run = np.where(np.isfinite(usd), run, math.inf)
    boot = lam * tps * _expected_min(rate, boot_s) + short_usd    # tokens a fresh VM forgoes, priced; its minimum

    stay = np.zeros((n, m), bool)
    leave = np.zeros((n, m), bool)
    move_to = np.zeros(n, np.int64)
    start_from_off = np.zeros(n, bool)
    w_on, w_off = np.zeros(m), 0.0                                # expected value from the next row on
    for t in range(n - 1, -1, -1):
        keep = run[t] + (1 - gone[t]) * w_on + gone[t] * w_off
        switch = boot[t] + keep
        a = int(switch.argmin())
        move_to[t] = a
        best_move = min(switch[a], w_off)
        stay[t] = keep <= best_move
        leave[t] = ~stay[t] & (w_off <= switch[a])
        start_from_off[t] = switch[a] < w_off
        w_on, w_off = np.minimum(keep, best_move), best_move
    value = w_off

    on, off = np.zeros(m), 1.0                                    # state distribution at row start
    presence = np.zeros((n, m))
    tokens = 0.0
    booting = tps[move_to] * _expected_min(rate[np.arange(n), move_to], boot_s)   # tokens a move forgoes, per row
    for t in range(n):
        moved = on[~stay[t] & ~leave[t]].sum() + (off if start_from_off[t] else 0.0)
        now = np.where(stay[t], on, 0.0)
        now[move_to[t]] += moved
        presence[t] = now
        tokens += (now * tps * there[t]).sum() - moved * booting[t]
        off = on[leave[t]].sum() + (0.0 if start_from_off[t] else off) + (now * gone[t]).sum()
        on = now * (1 - gone[t])
    return value, presence, tokens


def lower_bound_usd_per_mtok(recipe, market, finish_h: float | None = None,
                             keep_min_replicas: bool = False) -> float:
    """USD per 1M tokens below which no policy's expected cost can go on this market (a
    `simulate.TraceMarket`), training the run's tokens by `finish_h` (default budget.max_hours,
    else the trace's end). inf: no schedule of the offers trains them in time. With
    `keep_min_replicas`, below which no policy that trains only in worlds of world.min_replicas
    members can go (`_slots_program`'s world constraints).

    Offers: the trace's offers of the recipe's kind that it allows, and for a spot recipe with
    budget.max_hours the on-demand ones too (the deadline rule's fallback: a policy may rent them,
    so a bound without them is none where spot alone cannot finish in time)."""
    program = bound_program(recipe, market, finish_h, keep_min_replicas)
    return solve(program) / run_tokens(recipe) * 1e6 if program is not None else math.inf


def bound_program(recipe, market, finish_h: float | None = None,
                  keep_min_replicas: bool = False) -> SlotsProgram | None:
    """`lower_bound_usd_per_mtok`'s linear program (its least cost in USD; None: the market has
    no row before `finish_h`)."""
    usd, cap, rate, row_s, tps, terms = _arrays(recipe, market, finish_h)
    short_usd = _short_usd(usd, rate, row_s, terms)
    od_usd, od_tps = _fallback_on_demand(recipe, market, len(row_s))
    usd = np.concatenate([usd, od_usd], axis=1)
    cap = np.concatenate([cap, np.full(od_usd.shape, UNLIMITED)], axis=1)
    rate = np.concatenate([rate, np.zeros(od_usd.shape)], axis=1)
    short_usd = np.concatenate([short_usd, np.zeros(od_usd.shape)], axis=1)
    tps = np.concatenate([tps, od_tps])
    return _slots_program(usd, cap, rate, row_s, tps, short_usd, recipe.world.max_replicas,
                          recipe.planner.recovery_s, run_tokens(recipe),
                          recipe.world.min_replicas if keep_min_replicas else 1)


def solve(program: SlotsProgram) -> float:
    """The least cost of `program` (inf: infeasible, no schedule trains the tokens in time),
    solved exactly by scipy's HiGHS."""
    return least_cost(program.cost, program.a_ub, program.b_ub, program.bounds)


def least_cost(cost, a_ub, b_ub, bounds, a_eq=None, b_eq=None) -> float:
    """min cost·x subject to a_ub·x ≤ b_ub (and a_eq·x = b_eq) within `bounds`, by scipy's HiGHS
    (inf: infeasible)."""
    from scipy.optimize import linprog

    res = linprog(cost, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=b_eq, bounds=bounds, method="highs")
    if res.status == 2:
        return math.inf
    if res.status != 0:
        raise RuntimeError(f"the bound's linear program did not solve: {res.message}")
    return float(res.fun)


@dataclasses.dataclass(frozen=True)
class SlotsProgram:
    """`_slots_program`'s linear program: minimise cost·x subject to a_ub·x ≤ b_ub within
    `bounds`. Variable i is of the trace's row `row[i]` and of kind `kind[i]`: "k" (VMs kept from
    the row before), "b" (booted), "W" (a world's members), "y" (the chance a world trains), all
    chosen at the row's start, or "c" (tokens credited, an outcome of the row)."""

    cost: np.ndarray
    a_ub: object
    b_ub: np.ndarray
    bounds: np.ndarray
    row: np.ndarray
    kind: np.ndarray


def _slots_program(usd, cap, rate, row_s, tps, short_usd, slots: int, boot_s: float, needed: float,
                   min_replicas: int = 1) -> SlotsProgram | None:
    """The linear program whose least cost is the least expected USD of `slots` slots that train
    `needed` tokens, each slot the Markov decision process of `_slot`, coupled by the offers'
    capacities and the token count: a program over their expected occupation (None: no rows).

    Per row t and offer o: k[t,o] VMs kept from the row before, b[t,o] booted at the row start;
    present p = k + b. Kept VMs are at most the survivors of the row before, k[t,o] ≤ (1 −
    gone[t−1,o])·p[t−1,o] (none at the first row); Σ_o p[t,o] ≤ slots; p[t,o] ≤ capacity. A VM
    present bills its price over the seconds it stays in the row, E[min(τ, row)], a booted one also
    what it bills short of its cloud's minimum (`_short_usd`); it trains its tokens/s over those
    seconds, a booted one less the tokens of its boot, E[min(τ, boot)]. Any policy's expected VMs
    present per row and offer meet these constraints with at least its expected cost and at most
    its expected tokens, so the program's least cost is at most its expected bill.

    With `min_replicas` > 1 only worlds of that many members earn tokens (as the simulator
    credits only outer steps of at least world.min_replicas members). Per row t: y[t], the
    probability that a world trains in the row; W[t,o], the expected members of offer o; c[t,o],
    the tokens they are credited (as shares of `needed`). In every outcome a world that trains has
    at least min_replicas members, each a VM present in the row, at most its offer's capacity, and
    none trains without one: Σ_o W[t,o] ≥ min_replicas·y[t], W[t,o] ≤ p[t,o], W[t,o] ≤
    capacity·y[t]; a member is credited at most what a VM present trains in the row, c[t,o] ≤ the
    tokens of W[t,o] VMs kept through it and ≤ the tokens of its present VMs (k kept, b booted; a
    booted one what it trains after its boot within the row, none in a row shorter than a boot,
    and in the rows after, while still booting, it is credited as kept: in the policy's favour);
    and the present VMs' tokens, each boot's debt counted whole, are at least the run's, as in
    the program without min_replicas (so this one is never below it).
    Taking expectations keeps every inequality, so the program is still a relaxation of any policy
    that trains only in such worlds."""
    from scipy import sparse

    n, m = usd.shape
    if n == 0:
        return None
    ok = np.isfinite(usd)
    price = np.where(ok, usd, 0.0)
    there = _expected_min(rate, row_s[:, None])                  # seconds a VM present at row start stays
    stays = np.exp(-rate * row_s[:, None] / 3600)                  # P(not preempted within the row)
    run_usd = price * there / 3600
    cost = np.concatenate([run_usd.ravel(), (run_usd + np.where(ok, short_usd, 0.0)).ravel()])
    kept_tokens = tps * there
    boot_tokens = kept_tokens - tps * _expected_min(rate, boot_s)
    # Variables: k (n·m), then b (n·m), row-major by (t, o).
    nm = n * m
    idx = np.arange(nm).reshape(n, m)
    t1 = idx[1:].ravel()                                           # rows t ≥ 1
    t0 = idx[:-1].ravel()
    g = stays[:-1].ravel()
    survive = sparse.csr_matrix(
        (np.concatenate([np.ones(len(t1)), -g, -g]),
         (np.concatenate([np.arange(len(t1))] * 3), np.concatenate([t1, t0, nm + t0]))), shape=(len(t1), 2 * nm))
    present = sparse.hstack([sparse.identity(nm, format="csr"), sparse.identity(nm, format="csr")], format="csr")
    per_row = sparse.csr_matrix((np.ones(2 * nm), (np.concatenate([idx.ravel() // m] * 2), np.arange(2 * nm))),
                                shape=(n, 2 * nm))
    capped = (cap < UNLIMITED).ravel()
    upper = np.where(ok, float(slots), 0.0).ravel()
    bounds = np.stack([np.zeros(2 * nm), np.concatenate([np.where(np.arange(nm) < m, 0.0, upper), upper])], axis=1)
    b_ub = np.concatenate([np.zeros(len(t1)), np.full(n, float(slots)), np.minimum(cap.ravel()[capped], slots)])
    if min_replicas <= 1:
        tokens = sparse.csr_matrix(-np.concatenate([kept_tokens.ravel(), boot_tokens.ravel()]) / needed)
        a_ub = sparse.vstack([survive, per_row, present[capped], tokens], format="csr")
        b_ub = np.append(b_ub, -1.0)
    else:
        # Variables W (n·m), c (n·m), y (n) after k and b; c in shares of `needed` (HiGHS drops
        # coefficients under 1e-9, and 1/needed is one).
        # A row's cap on a booted VM is what it trains in that row: none in a row shorter than a
        # boot (its boot's debt would otherwise cap the row's other members below zero).
        kept_share, boot_share = (kept_tokens / needed).ravel(), (np.maximum(boot_tokens, 0.0) / needed).ravel()
        eye, rows = sparse.identity(nm, format="csr"), idx.ravel() // m
        zero = sparse.csr_matrix((nm, nm))
        row_of = sparse.csr_matrix((np.ones(nm), (np.arange(nm), rows)), shape=(nm, n))
        world = sparse.vstack([
            sparse.hstack([-eye, -eye, eye, zero, sparse.csr_matrix((nm, n))]),                     # W ≤ k + b
            sparse.hstack([zero, zero, eye, zero, -row_of.multiply(np.minimum(cap, slots).ravel()[:, None])]),  # W ≤ cap·y
            sparse.hstack([sparse.csr_matrix((n, 2 * nm)), -row_of.T, sparse.csr_matrix((n, nm)),
                           sparse.identity(n, format="csr") * float(min_replicas)]),                 # m·y ≤ Σ W
            sparse.hstack([-sparse.diags(kept_share), -sparse.diags(boot_share), zero, eye, sparse.csr_matrix((nm, n))]),
            sparse.hstack([zero, zero, -sparse.diags(kept_share), eye, sparse.csr_matrix((nm, n))]),  # c ≤ W's tokens
            sparse.hstack([sparse.csr_matrix((1, 3 * nm)), sparse.csr_matrix(-np.ones((1, nm))),
                           sparse.csr_matrix((1, n))]),                                               # Σ c ≥ 1
        ], format="csr")
        # And the plain program's count, which charges each boot's debt whole to the run: a VM
        # trains at most its life less its boot, however the rows cut them.
        tokens = sparse.csr_matrix(-np.concatenate([kept_tokens.ravel(), boot_tokens.ravel()]) / needed)
        pad = sparse.csr_matrix((len(t1) + n + int(capped.sum()) + 1, 2 * nm + n))
        a_ub = sparse.vstack([sparse.hstack([sparse.vstack([survive, per_row, present[capped], tokens]), pad]), world],
                             format="csr")
        b_ub = np.concatenate([b_ub, [-1.0], np.zeros(4 * nm + n), [-1.0]])
        cost = np.concatenate([cost, np.zeros(2 * nm + n)])
        bounds = np.vstack([bounds, np.stack([np.zeros(2 * nm + n),
                                              np.concatenate([upper, np.full(nm, np.inf), np.ones(n)])], axis=1)])
    rows = idx.ravel() // m
    kinds = "kbWcy" if min_replicas > 1 else "kb"
    row = np.concatenate([rows, rows] + ([rows, rows, np.arange(n)] if min_replicas > 1 else []))
    kind = np.concatenate([np.full(n if k == "y" else nm, k) for k in kinds])
    return SlotsProgram(cost, a_ub, b_ub, bounds, row, kind)


def min_replicas_floor_usd_per_mtok(recipe, market, finish_h: float | None = None) -> float:
    """USD per 1M tokens below which no policy can go that trains only in worlds of at least
    world.min_replicas replicas, as the simulator's does (a phase starts with that many ready
    members), training the run's tokens by `finish_h` (default budget.max_hours, else the trace's
    end); inf: no such schedule trains them in time. Reported beside `lower_bound_usd_per_mtok`,
    which drops world.min_replicas: where spot rarely offers world.min_replicas VMs at once, the
    world trains on-demand or not at all, and this floor is the higher of the two.

    Offers: the trace's spot offers the recipe allows, at their capacity, and (for an on-demand
    recipe, or a spot one with budget.max_hours, whose deadline rule falls back on them) its
    on-demand offers, unlimited.

    Why it is a lower bound. Every token the simulator credits is credited in an outer step whose
    members M (world.min_replicas ≤ |M| ≤ world.max_replicas, each billed over the whole step at
    its row's price) each train at most their own tokens/s over the step: the step lasts at least
    the slowest member's inner phase, and a step a notice ends early credits each member the same
    share of it, the noticed one too. So a run's credited steps are a schedule of worlds W
    over the rows, each W held for some seconds x_W ≤ its rows' length, earning at most
    tokens(W)/s and costing at least usd(W)/h, and the run pays at least Σ x_W·usd(W) over such
    a schedule with Σ x_W·tokens(W) ≥ the tokens it needs. For any token price λ ≥ 0,
    Σ x_W·usd(W) ≥ λ·need − Σ x_W·(λ·tokens(W) − usd(W)) ≥ λ·need − Σ_rows row_h·max(0, best_W
    (λ·tokens(W) − usd(W))) (weak duality of that linear program); the floor is the best λ found,
    valid whichever it is. Dropped, in the policy's favour: boots, preemptions and the work they
    lose, billing minimums and increments, decisions between rows, the sync's own cost.

    Outside the model (said, not bounded): a VM kept where its offer's capacity fell below what is
    held (the simulator lets it go through the trace's hazard; a fall to 0 in
    bench/traces/convert_real.py's traces leaves it a chance of e^-10 per fall), and the survivors
    of a loss without a notice, credited their step though fewer than world.min_replicas remain
    (the simulator's path for a cloud whose notice is at most twice the sync; AWS's 120 s notice
    takes the notice path)."""
    usd, cap, _, row_s, tps, _ = _arrays(recipe, market, finish_h)
    od_usd, od_tps = _fallback_on_demand(recipe, market, len(row_s))
    m, most, needed = recipe.world.min_replicas, recipe.world.max_replicas, run_tokens(recipe)

    # Each offer's VMs that could be held in a row: spot up to its capacity, on-demand unlimited
    # (world.max_replicas at most, either way); their USD/h and tokens/h.
    price = np.concatenate([usd, od_usd], axis=1)
    count = np.concatenate([np.where(np.isfinite(usd), np.minimum(cap, most), 0.0),
                            np.full(od_usd.shape, float(most))], axis=1)
    tokens_h = np.concatenate([tps, od_tps]) * 3600
    price = np.where(count > 0, price, 0.0)
    enough = count.sum(axis=1) >= m
    hours = row_s / 3600

    def rows_gain(lam: float) -> tuple[float, float]:
        """Σ_rows row_h·max(0, best world's λ·tokens − usd) (USD), and the tokens those worlds
        train. A row's best world: its VMs of most gain, every one that gains (at most
        world.max_replicas), at least world.min_replicas."""
        gain = np.where(count > 0, lam * tokens_h - price, -np.inf)
        order = np.argsort(-gain, axis=1)
        g = np.take_along_axis(gain, order, 1)
        c = np.take_along_axis(count, order, 1)
        x = tokens_h[order]
        before = np.cumsum(c, axis=1) - c
        k = np.clip(np.where(g > 0, c, 0.0).sum(axis=1), m, most)[:, None]
        take = np.clip(k - before, 0.0, c)
        with np.errstate(invalid="ignore"):
            row_gain = np.where(take > 0, take * g, 0.0).sum(axis=1)
        use = enough & (row_gain > 0)
        return (float((row_gain * hours)[use].sum()),
                float(((take * x).sum(axis=1) * hours)[use].sum()))

    lo, hi = 0.0, 1e-9
    while rows_gain(hi)[1] < needed:
        hi *= 2
        if hi > 1:                 # $1M per 1M tokens and still short: no such schedule trains them
            return math.inf
    for _ in range(40):            # the least λ whose best worlds train what the run needs
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if rows_gain(mid)[1] >= needed else (mid, hi)
    return max(0.0, hi * needed - rows_gain(hi)[0]) / needed * 1e6


def _fallback_on_demand(recipe, market, rows: int):
    """The on-demand offers a spot recipe with budget.max_hours falls back on (its deadline rule's),
    that the recipe allows: USD/h per row (the first `rows` of the trace) and offer, and tokens/s per
    offer; none for any other recipe (an on-demand recipe's offers are `_arrays`' already)."""
    if not (recipe.resources.spot and recipe.budget.max_hours is not None):
        return np.zeros((rows, 0)), np.zeros(0)
    offers = [o for o in market.offers(0.0, False) if allowed(o, recipe.resources)]
    times = row_times(market, math.inf, rows)
    usd = np.array([[market.state(o.zone, o.instance_type, t).on_demand_usd_per_hour for o in offers]
                    for t in times[:rows]]).reshape(rows, len(offers))
    return usd, np.array([recipe_tokens_per_s(o, recipe.planner) for o in offers], float)
