"""How much of `elastic`'s distance from the bound that keeps world.min_replicas is that bound's own
slack: the same linear program with a world's members tied together within a row.

    python bench/tied_bound.py [--traces A.csv ...] [--seeds 5] [--start-hours H ...]

`elastic.sim.bound.bound_program(..., keep_min_replicas=True)` (the bound `bench/real_markets.py`
holds `elastic` to) credits each member of a world its own seconds in a row: an on-demand member a
whole row beside a spot partner reclaimed in its first minute, a member kept while its partner
boots. Its constraints are per offer, so nothing ties the members' seconds together. This program
keeps everything else of it (the VMs kept and booted per row and offer, their survival from row to
row, the bills, capacities, world.max_replicas) and replaces its world variables with the
distribution of the VMs present at each row's start: z[t,S], the probability that the row starts
with composition S (how many VMs of each group of offers were kept from the row before and how
many were booted at its start), whose means are the VMs kept and booted. A composition is
credited what its VMs train while at least world.min_replicas of them are ready (a kept VM from
the row's start, a booted one from `planner.recovery_s`, each until its preemption at the row's
rate): for each VM, its tokens/s times ∫ P(it is ready and at least world.min_replicas − 1 others
are), which is nonincreasing on [0, boot) and on [boot, row), so its left Riemann sum (`Q` points
a piece) is an upper bound. Each group's credit is also held to its own VMs' tokens (the per-offer
constraint of the bound, which the sum only approaches).

Groups: offers of unlimited capacity alike in tokens/s, preemption rate and price are one group
(any of them does what another does); an offer of limited capacity is a group of its own, at most
its capacity of VMs in every composition. Where a row would have more than `LIMIT` compositions,
offers of limited capacity alike in all three are merged (their capacities added), and failing
that all of limited capacity make one group and all of unlimited another, and failing that every
offer one group, each credited at its members' lowest rate and highest tokens/s. Every step only widens what a composition may be
credited, so the program stays a relaxation of any policy whose decisions it can express.

Why it is a diagnostic and not the yardstick: its policies decide at row starts, as the bound's
do; a policy of the simulator also acts inside a row (`elastic` rents a partner the moment one is
lost), and the bound's per-offer credit happens to cover what such a partner trains, where this
program's tied credit does not. So this is a lower bound for row-start policies only, and reported
as how much of the gap the bound's own slack makes (docs/benchmarks.md, "Session 33"). The script
counts the runs of `elastic` that came in under it: none on the real traces so far. Since `elastic`
rents a pairing's on-demand partner two minutes into the spot VM's boot (session 41), one run of a
small market where the spot VM is reclaimed 3 an hour does (tests/elastic/sim/test_tied_bound.py):
no row-start policy can overlap the two boots so.

A bound that ties the members and holds every policy, on markets of two one-VM zones, is
`bench/tied_dp.py` (session 44): on aws-v100-2zones-2022 it is $101.96 at 30-second steps and
$102.56 at 15 against this program's $104.34, so about 2 % of this program's figure there is its
row starts.

Per trace (with its recipe, as `bench/real_markets.py` picks it): the bound that keeps
world.min_replicas (USD), this program's (USD), their ratio, `elastic`'s median USD over the seeds
and its ratio to each.
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from elastic.policy.planner import run_tokens  # noqa: E402
from elastic.sim import bound as B  # noqa: E402

Q = 48          # Riemann points on each piece of a row (before and after a boot ends)
LIMIT = 3000    # compositions a row may have before its offers are merged


def credit_s(rates_per_h: list[float], comp: list[tuple[int, int]], min_replicas: int, row_s: float,
             boot_s: float) -> np.ndarray:
    """Per group, an upper bound on the seconds its VMs train in a row that starts with `comp`
    ((kept, booted) VMs per group, each group preempted at `rates_per_h`): a VM trains while it
    is ready and at least `min_replicas` VMs are."""
    out = np.zeros(len(rates_per_h))
    edge = min(boot_s, row_s)
    for lo, hi in ((0.0, edge), (edge, row_s)):
        if hi <= lo:
            continue
        tau = lo + (hi - lo) * np.arange(Q) / Q
        kinds = []   # (group, P(a VM of this kind is ready at tau), how many)
        for g, (kept, booted) in enumerate(comp):
            alive = np.exp(-rates_per_h[g] / 3600 * tau)
            if kept:
                kinds.append((g, alive, kept))
            if booted:
                kinds.append((g, alive * (tau >= boot_s), booted))
        for j, (g, ready, count) in enumerate(kinds):
            # P(at least min_replicas - 1 of the others are ready): their count's distribution,
            # truncated at min_replicas - 1 (its last cell: that many or more).
            top = min_replicas - 1
            pmf = np.zeros((top + 1, Q))
            pmf[0] = 1.0
            for i, (_, p, c) in enumerate(kinds):
                for _ in range(c - (i == j)):
                    nxt = pmf * (1 - p)
                    nxt[1:] += pmf[:-1] * p
                    nxt[-1] += pmf[-1] * p
                    pmf = nxt
            out[g] += count * float((ready * pmf[top]).sum()) * (hi - lo) / Q
    return out


def _groups(t: int, usd, cap, rate, tps, slots: int, how: str) -> tuple[list[list[int]], list]:
    """Row t's groups of offers (see the module's doc; `how`: "own", "alike", "two" or "one") and their
    compositions, None where there would be more than LIMIT."""
    keys: dict = {}
    for o in range(usd.shape[1]):
        if not np.isfinite(usd[t, o]) or cap[t, o] < 1:
            continue
        unlimited = cap[t, o] >= B.UNLIMITED
        if how == "one":
            key = 0
        elif how == "two":
            key = unlimited
        elif unlimited or how == "alike":
            key = (tps[o], rate[t, o], usd[t, o], unlimited)
        else:
            key = ("own", o)
        keys.setdefault(key, []).append(o)
    groups = list(keys.values())
    choices = []
    for members in groups:
        most = int(min(slots, sum(cap[t, o] for o in members)))
        choices.append([(k, b) for k in range(most + 1) for b in range(most + 1 - k)])
    if math.prod(len(c) for c in choices) > 50 * LIMIT:
        return groups, None
    comps = [c for c in itertools.product(*choices) if 0 < sum(k + b for k, b in c) <= slots]
    return groups, comps if len(comps) <= LIMIT else None


class _Entries:
    """A sparse matrix's entries, gathered row by row."""

    def __init__(self):
        self.rows, self.cols, self.values = [], [], []

    def add(self, row: int, col: int, value: float) -> None:
        self.rows.append(row)
        self.cols.append(col)
        self.values.append(value)

    def matrix(self, rows: int, cols: int):
        from scipy import sparse

        return sparse.csr_matrix((self.values, (self.rows, self.cols)), shape=(rows, cols))


def tied_program(recipe, market, finish_h: float | None = None):
    """The program (cost, A_ub, b_ub, A_eq, b_eq, bounds) whose least cost is the tied bound in
    USD; None where the market has no row before `finish_h`. Variables: the bound's k and b (VMs
    kept and booted per row and offer), then every row's compositions z."""
    from scipy import sparse

    usd, cap, rate, row_s, tps, terms = B._arrays(recipe, market, finish_h)
    short = B._short_usd(usd, rate, row_s, terms)
    od_usd, od_tps = B._fallback_on_demand(recipe, market, len(row_s))
    usd = np.concatenate([usd, od_usd], axis=1)
    cap = np.concatenate([cap, np.full(od_usd.shape, B.UNLIMITED)], axis=1)
    rate = np.concatenate([rate, np.zeros(od_usd.shape)], axis=1)
    short = np.concatenate([short, np.zeros(od_usd.shape)], axis=1)
    tps = np.concatenate([tps, od_tps])
    slots, m = recipe.world.max_replicas, recipe.world.min_replicas
    boot_s, needed = recipe.planner.recovery_s, run_tokens(recipe)
    base = B._slots_program(usd, cap, rate, row_s, tps, short, slots, boot_s, needed, 1)
    if base is None:
        return None
    n, offers = usd.shape
    nm = n * offers
    there = B._expected_min(rate, row_s[:, None])
    kept_share = tps * there / needed
    boot_share = np.maximum(tps * there - tps * B._expected_min(rate, boot_s), 0.0) / needed   # as bound.py's
    eq, caps = _Entries(), _Entries()   # equalities (z's means are k and b), credit caps
    tokens, rows_z = [], []
    n_eq = n_caps = nz = 0
    memo: dict = {}
    for t in range(n):
        for how in ("own", "alike", "two", "one"):
            groups, comps = _groups(t, usd, cap, rate, tps, slots, how)
            if comps is not None:
                break
        else:
            raise ValueError(f"world.max_replicas ({slots}) gives a row more than {LIMIT} compositions even "
                             "with every offer in one group")
        g_rate = [min(rate[t, o] for o in members) for members in groups]
        g_tps = [max(tps[o] for o in members) for members in groups]
        for g, members in enumerate(groups):
            for which, share in ((0, kept_share), (1, boot_share)):
                # Σ_S z[t,S]·(VMs of group g kept / booted in S) = Σ_{o in g} k[t,o] / b[t,o]
                for o in members:
                    eq.add(n_eq, which * nm + t * offers + o, -1.0)
                for i, c in enumerate(comps):
                    if c[g][which]:
                        eq.add(n_eq, 2 * nm + nz + i, float(c[g][which]))
                n_eq += 1
                # the group's credit is at most its own VMs' tokens
                for o in members:
                    caps.add(n_caps + g, which * nm + t * offers + o, -share[t, o])
        for i, c in enumerate(comps):
            key = (tuple(g_rate), tuple(g_tps), c, row_s[t])
            if key not in memo:
                memo[key] = credit_s(g_rate, list(c), m, row_s[t], boot_s) * np.array(g_tps) / needed
            for g, share in enumerate(memo[key]):
                if share > 0:
                    caps.add(n_caps + g, 2 * nm + nz + i, share)
            tokens.append(memo[key].sum())
            rows_z.append(t)
        n_caps += len(groups)
        nz += len(comps)
    size = 2 * nm + nz
    z = 2 * nm + np.arange(nz)
    a_eq = eq.matrix(n_eq, size)
    one = sparse.csr_matrix((np.ones(nz), (rows_z, z)), shape=(n, size))                   # Σ_S z[t,S] ≤ 1
    capped = caps.matrix(n_caps, size)
    earned = sparse.csr_matrix((-np.array(tokens), (np.zeros(nz, int), z)), shape=(1, size))  # Σ credit ≥ 1
    kept_rows = base.a_ub                     # the bound's, its token count too (each boot's debt whole, as bound.py's)
    a_ub = sparse.vstack([sparse.hstack([kept_rows, sparse.csr_matrix((kept_rows.shape[0], nz))]), one, capped, earned],
                         format="csr")
    b_ub = np.concatenate([base.b_ub, np.ones(n), np.zeros(n_caps), [-1.0]])
    cost = np.concatenate([base.cost, np.zeros(nz)])
    bounds = np.vstack([base.bounds, np.stack([np.zeros(nz), np.ones(nz)], axis=1)])
    return cost, a_ub, b_ub, a_eq, np.zeros(n_eq), bounds


def tied_bound_usd(recipe, market, finish_h: float | None = None) -> float:
    """The tied program's least cost in USD (inf: no schedule trains the run's tokens in time)."""
    program = tied_program(recipe, market, finish_h)
    if program is None:
        return math.inf
    cost, a_ub, b_ub, a_eq, b_eq, bounds = program
    return B.least_cost(cost, a_ub, b_ub, bounds, a_eq, b_eq)


def main(argv: list[str] | None = None) -> int:
    import real_markets

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", nargs="+", type=Path, default=sorted((ROOT / "bench" / "traces" / "real").glob("*.csv")))
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--start-hours", nargs="+", type=float, default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tied-") as folder:
        traces = [real_markets.window(t, h, Path(folder)) for t in args.traces for h in args.start_hours] \
            if args.start_hours else list(args.traces)
        return _table(traces, args.seeds)


def _table(traces: list[Path], seeds: int) -> int:
    """Print the table (see the module's doc) for `traces`, `elastic` over seeds 0..seeds-1."""
    import real_markets

    from elastic.recipe.model import load_recipe
    from elastic.sim.simulate import _market, min_replicas_bound_usd_per_mtok, simulate

    print("| trace | bound keeping world.min_replicas | tied bound | tied / bound | elastic, median USD "
          "| elastic / bound | elastic / tied |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    under = 0
    for trace in traces:
        recipe = load_recipe(real_markets.recipe_for(trace))
        market = _market(recipe, str(trace))
        kept = min_replicas_bound_usd_per_mtok(recipe, str(trace)) * run_tokens(recipe) / 1e6
        tied = tied_bound_usd(recipe, market)
        paid = [r["list_usd"] for seed in range(seeds)
                for r in simulate(recipe, str(trace), ["elastic"], seed=seed, market=market) if r["status"] == "completed"]
        usd = statistics.median(paid) if paid else math.nan
        under += sum(p < tied for p in paid)
        print(f"| {trace.stem} | ${kept:,.2f} | ${tied:,.2f} | {tied / kept:.3f} | ${usd:,.2f} | {usd / kept:.2f} "
              f"| {usd / tied:.2f} |", flush=True)
    print(f"\nruns of elastic under the tied bound: {under}")
    return 0


if __name__ == "__main__":
    import real_markets

    real_markets.run_cli(main)
