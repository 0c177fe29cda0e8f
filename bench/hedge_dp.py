"""What not knowing the future costs, with a world's members tied and a policy free to act at any
moment: the least worst ratio to the yardstick (the bound that keeps world.min_replicas, as
`bench/real_markets.py` and `bench/hedge_bound.py` take it) that one online policy can hold over a
two-zone trace and the variants of it that it cannot tell apart until they part.

    python bench/hedge_dp.py [--trace T.csv] [--start-hours H] [--extend-h 72] [--min-outage-h 1]
                             [--drops] [--onsets] [--step-s 60] [--eval-step-s S ...] [--top 8]
                             [--iterations 60]

`bench/hedge_bound.py` holds one schedule over the trace and its variants (an outage held longer, a
drop that does not come, a drop where none came), but in `elastic.sim.bound`'s relaxed program: a
world's members credited apart, decisions at the rows' starts. So its 1.1013 on
aws-v100-2zones-2022 proved nothing: restating each row as two gave 1.0988. This program puts the
same scenarios into `bench/tied_dp.py`'s model instead (members tied, a VM counted on a grid of
`--step-s`, each simplification in the policy's favour; that module's docstring lists them) and
ties the scenarios by what a policy can know:

- the scenarios are the trace and the variants on which `hedge_bound.py`'s own minimax puts weight
  (the duals of its ratio constraints), the `--top` heaviest (a subset: fewer scenarios to hold
  can only lower the least worst ratio, so it stays a lower bound for the whole family). Each is
  also priced alone (`tied_dp_usd`, the policy told which it is from the start): where the least
  worst ratio is above every one of those, what it adds is the price of not knowing;
- a variant parts at the first grid step whose data (a zone's hazard, price or room, the
  on-demand price) differ from the trace's, and no later than the first moment any row of theirs
  differs (those summaries can hide a difference). Up to there a policy sees the same market and
  draws on both, so its decisions there are the same: one value function (the trunk) holds every
  scenario not yet parted. From there on the variant is its own, known to the policy at once (in
  its favour: a real policy learns it later, if at all within the step);
- a minimax over scenarios is a game: nature weighs the scenarios (w, summing to 1), the policy
  finishes on every one. For any weights and any token prices μ ≥ 0,
      g(w, μ) = min over policies of Σ_k w_k E[bill_k] / yardstick_k − μ_k (E[tokens_k] − run's tokens)
  is at most the least worst ratio (weak duality), and the dynamic program computes it exactly for
  its model: backward over each variant's steps after it parts, then over the trunk, each step's
  bill weighted by the scenarios still in it. The program also carries each scenario's expected
  bill and tokens along the minimising policy, a supergradient of g; a cutting-plane search
  (Kelley's, in a box about the best point that shrinks when a step fails and grows when one
  succeeds) looks for the weights and prices with the highest g.

The figure reported is g at the best point found, evaluated exactly: a lower bound whatever the
search's quality. `--eval-step-s` evaluates that same point on finer grids (a finer grid gives the
policy less, so g rises). Above 1.10, it proves that no policy of the simulator that finishes on
every scenario has an expected bill within 1.10× of the yardstick on every one of them (in
expectation over the draws; the goal's median of five seeds is another statistic). Figures:
docs/benchmarks.md, "Real spot markets", session 45.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench.hedge_bound import minimax, read_window, scenario_market, scenarios  # noqa: E402
from bench.real_markets import recipe_for, run_cli  # noqa: E402
from bench.tied_dp import Market2, backward, dual, states, tied_dp_usd  # noqa: E402
from elastic.errors import UserError  # noqa: E402
from elastic.policy.planner import run_tokens  # noqa: E402
from elastic.recipe.model import load_recipe  # noqa: E402
from elastic.sim.simulate import TraceMarket  # noqa: E402

NU_MAX = 5.0        # μ_k × the run's tokens is searched in [0, this]
TOLERANCE = 1e-4    # the search stops when the cutting planes promise no more than this above the best g


def parts_at(base: Market2, other: Market2, base_market, other_market, step_s: float) -> int:
    """The grid step from which a policy may act on what sets the two markets apart: the first whose
    data (`Market2`'s hazards, prices, room, on-demand price) differ, and no later than the first
    moment any row of theirs differs (a step's decision stands for what a policy does up to its grid
    point, and those summaries can hide a difference). The steps: they never differ."""
    differs = ((base.rate != other.rate).any(0) | (base.usd != other.usd).any(0) | (base.room != other.room).any(0)
               | (base.od_usd != other.od_usd))
    at = int(np.argmax(differs)) if differs.any() else base.steps
    for t in sorted(set(base_market.times()) | set(other_market.times())):
        if t >= at * step_s:
            break
        for spot in (True, False):
            keys = {(o.zone, o.instance_type) for m in (base_market, other_market) for o in m.offers(t, spot)}
            if any(base_market.state(*k, t) != other_market.state(*k, t) for k in keys):
                return min(at, math.ceil(t / step_s - 1e-9))
    return at


class Hedge:
    """The trace (scenario 0) and its variants on one grid, with their yardsticks (USD)."""

    def __init__(self, recipe, markets: list, yardsticks: list[float], step_s: float):
        self.recipe, self.step_s = recipe, step_s
        self.m2 = [Market2(recipe, m, step_s) for m in markets]
        self.parts = [self.m2[0].steps] + [parts_at(self.m2[0], m2, markets[0], m, step_s)
                                           for m2, m in zip(self.m2[1:], markets[1:])]
        self.yardsticks = np.array(yardsticks)
        self.tokens = run_tokens(recipe)

    def g(self, w: np.ndarray, nu: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
        """(g(w, μ) for μ = ν / the run's tokens, each scenario's expected bill (USD) and tokens
        along the policy that attains it)."""
        n, shape, steps = len(self.m2), states(self.m2[0], self.recipe, self.step_s), self.m2[0].steps
        a = w / self.yardsticks
        mu = nu / self.tokens
        parted: dict[int, list[tuple[int, np.ndarray]]] = {}
        for k in range(1, n):
            # slots: the value, this scenario's bill and tokens to go
            usd, tok = np.array([[a[k], 1.0, 0.0]]), np.array([[-mu[k], 0.0, 1.0]])
            V = backward(self.m2[k], self.recipe, self.step_s, np.zeros((1, 3) + shape), steps, self.parts[k],
                         lambda i, usd=usd, tok=tok: (usd, tok))
            parted.setdefault(self.parts[k], []).append((k, V))

        def merge(i: int):
            def at(V: np.ndarray) -> np.ndarray:
                V = V.copy()
                for k, branch in parted[i]:
                    V[:, 0] += branch[:, 0]
                    V[:, 1 + 2 * k:3 + 2 * k] = branch[:, 1:3]
                return V
            return at

        parts = np.array(self.parts)

        def weights(i: int) -> tuple[np.ndarray, np.ndarray]:
            inside = parts > i                      # the scenarios not parted by step i
            usd = np.concatenate([[a[inside].sum()], np.tile([1.0, 0.0], n)])
            tok = np.concatenate([[-mu[inside].sum()], np.tile([0.0, 1.0], n)])
            return usd[None], tok[None]

        V = backward(self.m2[0], self.recipe, self.step_s, np.zeros((1, 1 + 2 * n) + shape), steps, 0, weights,
                     {i: merge(i) for i in parted})
        start = V[0, :, 0, 0, 0, 0]
        return float(start[0] + nu.sum()), start[1::2].copy(), start[2::2].copy()


def search(hedge: Hedge, w0: np.ndarray, nu0: np.ndarray, iterations: int, log=print
           ) -> tuple[float, np.ndarray, np.ndarray, float]:
    """Kelley's cutting planes for the highest g, each step in a box about the best point (halved
    after a step that gains less than a tenth of what the planes promised, doubled after one that
    gains three quarters of it or when the planes promise nothing more within it): (best g, its w,
    its ν, the most the planes promise anywhere: no point of these scenarios' g is higher)."""
    from scipy.optimize import linprog

    n, T = len(w0), hedge.tokens
    cuts: list[np.ndarray] = []          # rows over (w, ν, z): z − Σ w bill/Y + Σ ν (tokens/T − 1) ≤ 0

    def evaluate(w, nu):
        # the programs' points may sit a rounding error outside the simplex and ν ≥ 0: put them on it
        w, nu = np.maximum(w, 0.0), np.maximum(nu, 0.0)
        w = w / w.sum()
        value, bill, tokens = hedge.g(w, nu)
        cuts.append(np.concatenate([-bill / hedge.yardsticks, tokens / T - 1, [1.0]]))
        return value, w, nu

    def planes(lo, hi):
        res = linprog(np.concatenate([np.zeros(2 * n), [-1.0]]), A_ub=np.array(cuts), b_ub=np.zeros(len(cuts)),
                      A_eq=np.concatenate([np.ones(n), np.zeros(n + 1)])[None], b_eq=[1.0],
                      bounds=np.stack([lo, hi], 1), method="highs")
        if res.status != 0:
            raise UserError(f"hedge_dp: the cutting-plane program did not solve: {res.message}")
        return -res.fun, res.x

    everywhere = (np.concatenate([np.zeros(2 * n), [-np.inf]]),
                  np.concatenate([np.ones(n), np.full(n, NU_MAX), [np.inf]]))
    best, best_w, best_nu = evaluate(w0, nu0)
    box_w, box_nu = 0.5, 1.0
    for it in range(iterations):
        ceiling = planes(*everywhere)[0]
        if ceiling - best < TOLERANCE:
            break
        lo = np.concatenate([np.maximum(0, best_w - box_w), np.maximum(0, best_nu - box_nu), [-np.inf]])
        hi = np.concatenate([np.minimum(1, best_w + box_w), np.minimum(NU_MAX, best_nu + box_nu), [np.inf]])
        promised, x = planes(lo, hi)
        if promised - best < TOLERANCE:
            box_w, box_nu = min(1.0, 2 * box_w), min(NU_MAX, 2 * box_nu)
            continue
        w, nu = x[:n], x[n:2 * n]
        value, w, nu = evaluate(w, nu)
        gained = (value - best) / (promised - best)
        if gained >= 0.1:
            best, best_w, best_nu = value, w, nu
            if gained >= 0.75:
                box_w, box_nu = min(1.0, 2 * box_w), min(NU_MAX, 2 * box_nu)
        else:
            box_w, box_nu = box_w / 2, box_nu / 2
        log(f"  {it + 1:3d}: g {value:.5f}, best {best:.5f}, planes promise {promised:.5f} in the box, "
            f"{ceiling:.5f} anywhere")
    return best, best_w, best_nu, planes(*everywhere)[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=ROOT / "bench" / "traces" / "real" / "aws-v100-2zones-2022.csv")
    ap.add_argument("--start-hours", type=float, default=0.0, help="the trace from H hours in")
    ap.add_argument("--extend-h", type=float, default=72.0, help="hours each variant holds an outage longer")
    ap.add_argument("--min-outage-h", type=float, default=1.0, help="outages shorter than this are not varied")
    ap.add_argument("--drops", action="store_true", help="variants in which a tick of a drop is calm")
    ap.add_argument("--onsets", action="store_true", help="variants in which a calm zone drops at a row")
    ap.add_argument("--step-s", type=float, default=60.0, help="the grid of the search")
    ap.add_argument("--eval-step-s", type=float, nargs="*", default=[],
                    help="finer grids on which the best point is evaluated again")
    ap.add_argument("--top", type=int, default=8, help="variants kept: the heaviest in hedge_bound.py's minimax")
    ap.add_argument("--iterations", type=int, default=60)
    args = ap.parse_args(argv)

    recipe = load_recipe(recipe_for(args.trace))
    started = time.monotonic()
    rows = read_window(args.trace, args.start_hours)
    market = TraceMarket(rows, recipe)
    varied, programs, ties, grid, yardsticks = scenarios(recipe, rows, args.extend_h, args.min_outage_h, args.drops,
                                                         args.onsets)
    relaxed = minimax(programs, ties, yardsticks)
    heavy = sorted((k for k in range(1, len(programs)) if relaxed.weights[k] > 1e-6),
                   key=lambda k: -relaxed.weights[k])[:args.top]
    keep = [0] + heavy
    markets = [scenario_market(market, rows, grid, recipe, None if k == 0 else varied[k - 1]) for k in keep]
    names = ["the trace"] + [f"{varied[k - 1].key[0]} {varied[k - 1].what}" for k in heavy]
    ys = [yardsticks[k] for k in keep]
    name = args.trace.stem + (f"@{args.start_hours:g}h" if args.start_hours else "")
    print(f"{name}: {len(varied)} variants; hedge_bound.py's relaxed minimax {relaxed.t:.4f}, "
          f"its weight on {len(heavy)} (kept here) ({time.monotonic() - started:.0f} s)", flush=True)

    hedge = Hedge(recipe, markets, ys, args.step_s)
    w0 = np.array([relaxed.weights[k] for k in keep])
    w0 = w0 / w0.sum()
    # prices to start from: the trace's own best token price (tied_dp's search), for every scenario
    prices = np.linspace(0, 2 * float(np.max(hedge.m2[0].od_usd)) / 3600 / hedge.m2[0].od_tps, 41)
    rho = prices[int(np.argmax(dual(hedge.m2[0], recipe, args.step_s, prices)))]
    nu0 = np.minimum(NU_MAX, w0 * rho * hedge.tokens / hedge.yardsticks)
    for k, (label, y, m) in enumerate(zip(names, ys, markets)):
        alone = tied_dp_usd(recipe, m, args.step_s) / y
        print(f"  {label}: yardstick ${y:.2f}, parts at {hedge.parts[k] * args.step_s / 3600:.2f} h, "
              f"weight {w0[k]:.3f} in the relaxed minimax; alone, the tied DP is {alone:.4f}× its yardstick",
              flush=True)
    best, w, nu, ceiling = search(hedge, w0, nu0, args.iterations, log=lambda s: print(s, flush=True))
    print(f"least worst ratio, tied, {args.step_s:g} s grid: at least {best:.4f} "
          f"(these scenarios' g is at most {ceiling:.4f}; {time.monotonic() - started:.0f} s)")
    print("  at weights " + ", ".join(f"{x:.3f}" for x in w) + "; ν " + ", ".join(f"{x:.3f}" for x in nu))
    for step in args.eval_step_s:
        fine = Hedge(recipe, markets, ys, step)
        value, _, _ = fine.g(w, nu)
        best = max(best, value)
        print(f"least worst ratio, tied, {step:g} s grid (the same point): at least {value:.4f} "
              f"({time.monotonic() - started:.0f} s)", flush=True)
    if best > 1.10:
        print("so no policy of the simulator that finishes on all of these scenarios has an expected bill within "
              "1.10x of the yardstick on every one")
    return 0


if __name__ == "__main__":
    run_cli(main)
