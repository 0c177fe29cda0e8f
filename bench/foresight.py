"""What foresight is worth: no policy that does not see the future can be within 1.15× of
`elastic/sim/bound.py`'s bound on every trace.

    python bench/foresight.py [--recipe recipes/multi-cloud.yaml] [--at-h 24] [--factors 1.3 1.5 2]
                              [--traces still bench/traces/calm.csv ...] [--seeds 3]

The twins. Take a market (a trace) and an hour t1 (`--at-h`). The twins are that market until t1;
from t1 to the end every spot price is divided by f in one twin (`down`) and multiplied by f in the
other (`up`), never above the offer's on-demand price. A policy that does not see the future is
shown the same offers, prices and preemption draws on both until t1, so it does the same there: the
work it does before t1 (member-seconds × tokens per second, whether a phase that spans t1 is kept
or lost later) has one distribution Y on both twins. Whatever it does after t1, it
pays at least prefix(E[Y]) + suffix(N − E[Y]) on each twin, prefix(y) being the least any policy
pays for y tokens before t1 and suffix(z) the least for z tokens from t1 to the deadline on that
twin (N: the run's tokens). On the worse twin its USD per token is therefore at least
    floor × bound.py's bound,   floor = min over y in [0, N] of max over the twins of
                                        (prefix(y) + suffix_twin(N − y)) / (bound_twin × N).
If floor > 1.15, no policy is within 1.15 on both twins: "within 1.15× on every trace" cannot be
met by any online policy, deterministic or random, on a set of traces that holds such a pair.
The minimum is taken over a grid of y with each cell [y_i, y_i+1] costed at prefix(y_i) +
suffix(N − y_i+1), both sides being nondecreasing in the tokens they train: a true lower bound.

Two ways to cost prefix and suffix (columns `floor, tokens` and `floor, slots`):
- `tokens` (`token_floor`), for every policy the simulator can run: every VM-second is billed at the
  trace's price in effect (`elastic.record.billing`: a minimum only adds), spot or on-demand, a replica
  trains at most its offer's planner.tokens_per_s (a phase lasts as long as its slowest member
  needs), and at most world.max_replicas replicas train at once. So a row of the trace trains at
  most max_replicas × the fastest offer's tokens per second, each token at no less than the row's
  cheapest USD per token, spot or on-demand; cheapest rows first (a fractional knapsack, convex in
  y, so the random Y costs at least prefix(E[Y])). Boots, preemptions, capacities, syncs, the
  price cap and the billing minimum are all left out, in the policy's favour.
- `slots` (`slot_floor`): bound.py's own relaxation on each side of t1 (one Markov decision process
  per VM slot, λ per token: prefix(y) ≥ max over λ of max_replicas × V(λ) + λ·y, for any λ), with
  capacities not priced, the price cap lifted (a VM rented under it may stay when its price
  rises), no billing minimum, and after t1 no boot (a VM held across t1 is not booted again).
  Sharper where preemptions and boots matter; it keeps the rest of bound.py's model (one VM per
  slot, decisions at row starts: docs/benchmarks.md, "An online lower bound"), so it is a floor
  for policies of that shape, as bound.py is. Needs budget.max_hours within the trace.

`still` is the calmest market there is: the first prices of bench/traces/calm.csv held for 48 h,
no preemptions, capacity 24 everywhere. There the floor is (1 + f) / 2 less the boots: a policy
that trains a share x of the run before t1 pays (x + (1 − x)/f) / (1/f) = 1 + (f − 1)·x times
the bound on the down twin and x + (1 − x)·f on the up twin, and the larger is least at x = 1/2.
So f = 1.4 (up 40 % or down 29 %) that lasts is enough to deny 1.15; at f = 1.3 the hand figure
is 1.15 itself.

Next to the floors, every policy of `elastic simulate` on both twins (`--seeds` preemption draws,
mean): seed by seed its ratio on the worse twin can be no lower than the token floor (the twins
draw the same preemptions before t1 for one seed; the script says so loudly if one is: that would
be a bug in the floor). The slots floor holds in expectation only, so it is not checked per seed.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elastic.policy.market import recipe_tokens_per_s  # noqa: E402
from elastic.policy.planner import run_tokens  # noqa: E402
from elastic.policy.registry import POLICIES  # noqa: E402
from elastic.recipe.model import load_recipe  # noqa: E402
from elastic.sim.bound import _arrays, _slot, lower_bound_usd_per_mtok  # noqa: E402
from elastic.sim.simulate import TraceMarket, simulate  # noqa: E402
from providers.simmarket import read_trace_rows  # noqa: E402

CELLS = 400          # the grid of y (tokens trained before t1)
LAMBDAS = 240        # token prices tried per side (`slot_floor`)
ROW_S = 300.0        # bench/traces' rows


def moved(row, factor: float):
    """`row` with its spot price times `factor`, never above its on-demand price."""
    st = row.state
    return dataclasses.replace(row, state=dataclasses.replace(
        st, spot_usd_per_hour=min(st.spot_usd_per_hour * factor, st.on_demand_usd_per_hour)))


def twins(rows: list, at_s: float, factor: float) -> tuple[list, list]:
    """(down, up): `rows` as they are before `at_s`; from `at_s` on, every spot price divided by
    `factor` in `down` and multiplied by it in `up` (a row at `at_s` is added for each zone and
    instance type whose price in effect then was set earlier)."""
    last, starts = {}, set()
    for r in rows:
        key = (r.zone, r.instance_type)
        if r.t < at_s:
            last[key] = r
        elif r.t == at_s:
            starts.add(key)
    carried = [dataclasses.replace(r, t=at_s) for k, r in last.items() if k not in starts]
    out = []
    for factor_ in (1 / factor, factor):
        twin = [r if r.t < at_s else moved(r, factor_) for r in rows] + [moved(r, factor_) for r in carried]
        out.append(sorted(twin, key=lambda r: r.t))
    return out[0], out[1]


def still(rows: list, hours: float = 48.0) -> list:
    """The first prices of `rows` held for `hours` in rows of 5 minutes, no preemptions, capacity
    24 everywhere: the calmest market there is."""
    first = [r for r in rows if r.t == rows[0].t]
    return [dataclasses.replace(r, t=float(t), state=dataclasses.replace(r.state, preempt_per_hour=0.0, capacity=24))
            for t in np.arange(0.0, hours * 3600, ROW_S) for r in first]


def _end_s(recipe) -> float:
    return recipe.budget.max_hours * 3600 if recipe.budget.max_hours else math.inf


def _rows(recipe, market: TraceMarket, end_s: float) -> list[tuple[float, float, float]]:
    """Per row of the market until `end_s`: (start_s, least USD per token on offer, most tokens
    the world can train in it). The last row lasts until `end_s` (the trace's last prices hold)."""
    times = [t for t in market.times() if t < end_s]
    out = []
    for i, t in enumerate(times):
        until = times[i + 1] if i + 1 < len(times) else end_s
        offers = market.offers(t, recipe.resources.spot)
        tps = [recipe_tokens_per_s(o, recipe.planner) for o in offers]
        usd = min(min(o.usd_per_hour, o.on_demand_usd_per_hour) / 3600 / s for o, s in zip(offers, tps))
        out.append((t, usd, recipe.world.max_replicas * max(tps) * (until - t)))
    return out


def _knapsack(rows, tokens: float) -> float:
    """Least USD for `tokens` over `rows` (start, USD per token, most tokens), cheapest first."""
    usd = 0.0
    for _, price, most in sorted(rows, key=lambda r: r[1]):
        if tokens <= 0:
            break
        k = min(most, tokens)
        usd, tokens = usd + k * price, tokens - k
    return usd if tokens <= 0 else math.inf


def token_floor(recipe, down: TraceMarket, up: TraceMarket, at_s: float):
    """(prefix, suffix_down, suffix_up): each a function of tokens to the least USD for them
    before `at_s` / from `at_s` to the deadline, for any policy the simulator runs."""
    end = _end_s(recipe)
    rows_down, rows_up = _rows(recipe, down, end), _rows(recipe, up, end)
    pre = [r for r in rows_down if r[0] < at_s]
    post_down, post_up = [r for r in rows_down if r[0] >= at_s], [r for r in rows_up if r[0] >= at_s]
    return (lambda y: _knapsack(pre, y)), (lambda z: _knapsack(post_down, z)), (lambda z: _knapsack(post_up, z))


def slot_floor(recipe, down: TraceMarket, up: TraceMarket, at_s: float):
    """As `token_floor`, in bound.py's slot relaxation: for each side, max over a grid of token
    prices λ of max_replicas × (the slot's least expected cost − λ × its tokens) + λ × tokens."""
    if not recipe.budget.max_hours or recipe.budget.max_hours * 3600 > down.times()[-1] + ROW_S:
        raise ValueError("the slots floor needs budget.max_hours within the trace")
    slots, boot_s = recipe.world.max_replicas, recipe.planner.recovery_s
    uncapped = recipe.model_copy(update={"resources": recipe.resources.model_copy(update={"max_usd_per_hour": None})})
    sides = []
    for market, part in ((down, "pre"), (down, "post"), (up, "post")):
        usd, _, rate, row_s, tps, _ = _arrays(uncapped, market, recipe.budget.max_hours)
        start = np.concatenate([[0.0], np.cumsum(row_s)[:-1]])
        keep = start < at_s if part == "pre" else start >= at_s
        usd, rate, row_s = usd[keep], rate[keep], row_s[keep]
        short, boot = np.zeros_like(usd), (boot_s if part == "pre" else 0.0)
        per_token = usd[np.isfinite(usd)] / 3600 / np.broadcast_to(tps, usd.shape)[np.isfinite(usd)]
        lams = np.geomspace(per_token.min() / 2, per_token.max() * 4, LAMBDAS)
        values = np.array([_slot(usd, rate, row_s, tps, lam, np.zeros_like(usd), boot, short)[0] for lam in lams])

        def side(tokens, lams=lams, values=values):
            return float(np.max(slots * values + lams * tokens)) if tokens > 0 else 0.0
        sides.append(side)
    return tuple(sides)


def floor(recipe, down: TraceMarket, up: TraceMarket, at_s: float, costs, known: dict | None = None) -> dict:
    """The least ratio to bound.py's bound that any online policy can be sure of on the worse
    twin (module docstring), with `costs` = `token_floor` or `slot_floor`; and the two bounds.
    `known`: an earlier `floor` of the same twins, whose bounds are taken instead of computed again
    (about a minute on a 48 h trace)."""
    n = run_tokens(recipe)
    bound = ({"down": known["bound_down_usd"], "up": known["bound_up_usd"]} if known else
             {name: lower_bound_usd_per_mtok(recipe, m) * n / 1e6 for name, m in (("down", down), ("up", up))})
    pre, post_down, post_up = costs(recipe, down, up, at_s)
    ys = np.linspace(0.0, n, CELLS + 1)
    best, at = math.inf, 0.0
    for lo, hi in zip(ys[:-1], ys[1:]):
        p = pre(lo)
        worse = max((p + post_down(n - hi)) / bound["down"], (p + post_up(n - hi)) / bound["up"])
        if worse < best:
            best, at = worse, lo / n
    return {"floor": best, "share_before": at, "bound_down_usd": bound["down"], "bound_up_usd": bound["up"]}


def policies_on(recipe, down: TraceMarket, up: TraceMarket, bounds: dict, seeds: int) -> dict:
    """Each policy's ratio to the bound on each twin, seed by seed (inf where a run did not
    complete): {policy: {"down": [...], "up": [...]}}."""
    out = {p: {"down": [], "up": []} for p in POLICIES}
    for name, market in (("down", down), ("up", up)):
        for seed in range(seeds):
            for r in simulate(recipe, "", seed=seed, market=market):
                ok = r["status"] == "completed"
                out[r["policy"]][name].append(r["list_usd"] / bounds[f"bound_{name}_usd"] if ok else math.inf)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default=str(ROOT / "recipes/multi-cloud.yaml"))
    ap.add_argument("--at-h", type=float, default=24.0, help="the hour the twins part (default 24)")
    ap.add_argument("--factors", type=float, nargs="+", default=[1.3, 1.5, 2.0])
    ap.add_argument("--traces", nargs="+", default=["still", str(ROOT / "bench/traces/calm.csv"),
                                                     str(ROOT / "bench/traces/spikes.csv")],
                    help="markets to make twins of; `still`: the calmest (module docstring)")
    ap.add_argument("--seeds", type=int, default=3, help="preemption draws per policy and twin")
    args = ap.parse_args()
    recipe = load_recipe(args.recipe)
    at_s = args.at_h * 3600
    print(f"recipe {Path(args.recipe).name}: {run_tokens(recipe) / 1e9:g} B tokens, deadline "
          f"{recipe.budget.max_hours} h, twins part at hour {args.at_h:g}; ratios to bound.py's bound on each twin\n")
    print("| market | f | bound down, USD | bound up, USD | floor, tokens | floor, slots | share before t1 at the floor "
          "| elastic down | elastic up | best policy on its worse twin |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for trace in args.traces:
        rows = still(read_trace_rows(ROOT / "bench/traces/calm.csv")) if trace == "still" else read_trace_rows(trace)
        name = "still" if trace == "still" else Path(trace).stem
        for f in args.factors:
            down_rows, up_rows = twins(rows, at_s, f)
            down, up = TraceMarket(down_rows, recipe), TraceMarket(up_rows, recipe)
            by_tokens = floor(recipe, down, up, at_s, token_floor)
            try:
                by_slots = floor(recipe, down, up, at_s, slot_floor, known=by_tokens)["floor"]
            except ValueError:
                by_slots = math.nan
            runs = policies_on(recipe, down, up, by_tokens, args.seeds)
            mean = {p: {k: statistics.mean(v) for k, v in r.items()} for p, r in runs.items()}
            worse = {p: max(m.values()) for p, m in mean.items()}
            best = min(worse, key=worse.get)
            print(f"| {name} | {f:g} | {by_tokens['bound_down_usd']:.0f} | {by_tokens['bound_up_usd']:.0f} | "
                  f"**{by_tokens['floor']:.3f}** | {by_slots:.3f} | {by_tokens['share_before']:.2f} | "
                  f"{mean['elastic']['down']:.3f} | {mean['elastic']['up']:.3f} | {best} {worse[best]:.3f} |", flush=True)
            for p, r in runs.items():
                for seed, pair in enumerate(zip(r["down"], r["up"])):
                    if max(pair) < by_tokens["floor"] - 1e-9:
                        print(f"FLOOR VIOLATED: {p} on {name} f={f:g} seed {seed}: {max(pair):.4f} on its worse twin",
                              file=sys.stderr)


if __name__ == "__main__":
    main()
