"""A bound that ties a world's members, sound for policies that act at any moment, on markets of two
spot zones of one VM each (aws-v100-2zones-2022 and its kind): dynamic programming over the run's
VMs, their boots and the world's phase.

    python bench/tied_dp.py [--traces A.csv ...] [--step-s 30] [--seeds 5] [--zone-pairs] [--start-hours H ...]

`elastic.sim.bound`'s program that keeps world.min_replicas (the yardstick of `bench/real_markets.py`)
credits each VM its own seconds: a member of a world while its partner boots, a member beside one
already gone. `bench/tied_bound.py` ties the members, but decides only at the trace's rows, so a
policy that rents a partner the moment one is lost can pay less than it. This program ties them
and admits every policy, at the price of the market's size: per zone the VM there (none, booting
with its age, ready), the on-demand VMs held, and the world's phase clock; a time grid of
`--step-s`; the run's tokens priced by a Lagrange multiplier (one value function per price: any
price gives a lower bound, the best of a search is reported).

The simulator's model (`elastic.sim.simulate`, the elastic world) and what this program grants
beside it, each in the policy's favour, so its least expected cost is at most any policy's
(bill before refunds, as the yardstick's):
- a spot VM launched at s counts from the first grid point t ≥ s (billed from there, not from s),
  a step of its boot already done: it is ready at t + (⌊boot/step⌋ − 1)·step ≤ s + boot. One
  launched and lost or let go before t never counts. A zone may take a VM at t if it had room at
  any moment of (t − step, t] (after the VM it held went, if one did); preemptions at the lowest
  hazard of each step (from t, not from s);
- a VM present over a step bills that step only if it is kept at the next grid point (its last,
  partial step is free: a VM let go or lost within a step bills less than the step), at the
  step's lowest price; the billing minimum is left out;
- an on-demand VM (never preempted) is ready the moment it counts, its boot billed up front
  short of a step (at the lowest on-demand price of that boot's steps): one launched at s is
  ready at s + boot, so it counts from the last grid point t ≤ s + boot, billed (boot − step)
  before t, at most what it billed. The step is at most a boot (planner.recovery_s);
- tokens: every ready VM present trains, at its tokens/s, while the world trains: through a step
  whose start has world.min_replicas ready VMs (a VM lost in it, until its loss). In the
  simulator a member lost with a notice longer than twice the outer sync (AWS's 120 s) ends the
  phase at once, every member credited its part; one lost without such a notice (GCP's 30 s
  against a cross-region sync) leaves the survivors training to the phase's end ("DiLoCo
  survivors keep training through a preemption"), a lone one too. On such a market the world
  here also trains on after a step with enough members, while a VM is ready, for as long as a
  phase lasts (⌈phase/step⌉ + 1 steps; the slowest VM's phase and the most spread world's sync),
  whatever ended the step. A lost VM's partial phase is not lost here, VMs join at once, the
  outer sync takes no time, a run that loses every replica loses nothing, and the recipe's price
  cap (resources.max_usd_per_hour) is left out;
- tokens counted in expectation (E[tokens] by budget.max_hours ≥ the run's, not on every draw), so
  a schedule may be played with a probability: a long one played sometimes spreads its boots
  over more tokens than a policy that must finish every time can; up to world.max_replicas
  on-demand VMs beside the two spot ones, every one of them training.
The value function over those states is exact for the relaxed model (backward induction over the
grid), and each token price gives a lower bound on its least cost; the search keeps the best it
finds. A finer grid gives less of the first three away (the bound rises as the step falls).

Per trace (with its recipe, as `bench/real_markets.py` picks it): the bound that keeps
world.min_replicas, this bound, `elastic`'s median bill before refunds over the seeds and its ratio
to each, and how many runs of any registered policy came in under this bound (in expectation none
can; a run may by its draws).
"""

from __future__ import annotations

import argparse
import bisect
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from elastic.errors import UserError  # noqa: E402
from elastic.policy.market import Quote, recipe_tokens_per_s  # noqa: E402
from elastic.policy.planner import allowed, run_tokens, sync_penalty_s, tokens_per_phase  # noqa: E402
from providers import notice_s  # noqa: E402

BIG = 1e15          # the value of a state no policy can be in
SEARCH = (10, 6)    # multipliers tried per round, rounds (each narrows the search to two of its gaps)


class Market2:
    """The grid's view of a two-zone market: per step and zone the lowest hazard (per s) and spot
    price (USD/h), whether a launch may count at the step's start, the cheapest on-demand price."""

    def __init__(self, recipe, market, step_s: float):
        if step_s > recipe.planner.recovery_s:
            raise UserError(f"tied_dp needs a step no longer than a boot (planner.recovery_s, "
                            f"{recipe.planner.recovery_s:g} s): {step_s:g} s")
        uncapped = recipe.resources.model_copy(update={"max_usd_per_hour": None})   # the price cap left out
        spot = [o for o in market.offers(0.0, True) if allowed(o, uncapped)]
        od = [o for o in market.offers(0.0, False) if allowed(o, uncapped)]
        if len(spot) != 2 or not od:
            raise UserError(f"tied_dp prices markets of two spot zones with an on-demand fallback "
                             f"(this one: {len(spot)} spot, {len(od)} on-demand)")
        keys = [(o.zone, o.instance_type) for o in spot]
        times = market.times()
        for z, it in keys:
            if any((market.state(z, it, t).capacity or 0) > 1 for t in times):
                raise UserError(f"tied_dp prices zones of one VM; {z} holds more")
        self.steps = int(math.ceil(recipe.budget.max_hours * 3600 / step_s - 1e-9))
        grid = np.arange(self.steps) * step_s
        self.rate = np.zeros((2, self.steps))
        self.usd = np.zeros((2, self.steps))
        self.room = np.zeros((2, self.steps), bool)
        self.tps = np.array([recipe_tokens_per_s(o, recipe.planner) for o in spot])

        def rows_in(lo: float, hi: float) -> list[float]:   # row starts u with lo < u < hi
            return times[bisect.bisect_right(times, lo):bisect.bisect_left(times, hi)]

        for z, key in enumerate(keys):
            for i, t in enumerate(grid):
                during = [market.state(*key, u) for u in [t] + rows_in(t, t + step_s)]
                self.rate[z, i] = min(st.preempt_per_hour for st in during) / 3600
                self.usd[z, i] = min(st.spot_usd_per_hour for st in during)
                # a launch at any s in (t - step, t] counts at t
                lo = t - step_s
                before = [max(lo + 1e-6, 0.0)] + rows_in(lo, t) + [t]
                self.room[z, i] = max(market.state(*key, u).capacity or 0 for u in before) >= 1
        self.od_usd = np.array([min(market.state(o.zone, o.instance_type, u).on_demand_usd_per_hour
                                    for o in od for u in [t] + rows_in(t, t + step_s)) for t in grid])
        self.od_tps = max(recipe_tokens_per_s(o, recipe.planner) for o in od)
        # the longest phase a world here can have: the slowest VM's inner phase and the outer sync
        # of the most spread world (the planner's own figure, as the simulator times a phase)
        sync = sync_penalty_s([Quote(o, 0.0, "trace") for o in spot + od], recipe.planner)
        self.phase_s = max(tokens_per_phase(recipe) / t for t in list(self.tps) + [self.od_tps]) + sync
        # A member lost with a notice longer than twice the sync ends the phase at once, every
        # member credited its part (AWS: 120 s); without, the survivors train to the phase's end.
        self.survivors_train_on = any(notice_s(o.cloud) <= max(0.5, 2 * sync) for o in spot)


def dual(m2: Market2, recipe, step_s: float, prices: np.ndarray) -> np.ndarray:
    """min over policies of E[bill − price × tokens] + price × the run's tokens, for each of `prices`
    (USD per token; each is a lower bound on any policy's expected bill)."""
    shape = states(m2, recipe, step_s)
    V = backward(m2, recipe, step_s, np.zeros((len(prices), 1) + shape), m2.steps, 0,
                 lambda i: (np.ones((len(prices), 1)), -prices[:, None]))
    return V[:, 0, 0, 0, 0, 0] + prices * run_tokens(recipe)


def states(m2: Market2, recipe, step_s: float) -> tuple[int, int, int, int]:
    """The shape of a value function's states: each zone's class (0 none, 1..K−1 booting, K ready),
    the on-demand VMs held (0..world.max_replicas), the phase clock (0 none, 1..L−1 the survivors'
    window, where a loss does not end the phase)."""
    K = max(1, int(math.floor(recipe.planner.recovery_s / step_s + 1e-9)))
    L = math.ceil(m2.phase_s / step_s - 1e-9) + 1 if m2.survivors_train_on else 1
    return (K + 1, K + 1, recipe.world.max_replicas + 1, L)


def backward(m2: Market2, recipe, step_s: float, V: np.ndarray, hi: int, lo: int, weights,
             at: dict | None = None) -> np.ndarray:
    """Backward induction from grid point `hi` down to `lo`: `V` is the value at `hi`, of shape
    (P, S) + `states`: P problems, each with S slots. Slot 0 is the value minimised; the others are
    carried along the policy that minimises it (its expected bill or tokens to go, say).
    `weights(i)` gives, for step i, each slot's weight on the step's bill and on its tokens (two
    (P, S) arrays). `at` maps a grid point to a function of the value there (before the step
    back from it), which may replace it."""
    w = recipe.world
    boot = recipe.planner.recovery_s
    C, _, R1, L = states(m2, recipe, step_s)
    K = C - 1
    m = w.min_replicas
    cls = np.arange(C)
    age = np.where(cls == 0, 0, np.minimum(cls + 1, K))
    present = cls > 0
    ready = cls == K
    rr = np.arange(R1)
    ph = np.arange(L)
    n_ready = ready[:, None, None].astype(int) + ready[None, :, None].astype(int) + rr[None, None, :]
    n4 = n_ready[..., None]
    trains = (n4 >= m) | ((n4 >= 1) & (ph >= 1))
    clock = np.where(n4 >= m, 1, np.where((n4 >= 1) & (ph >= 1) & (ph + 1 <= L - 1), ph + 1, 0))
    clock = np.broadcast_to(clock, (C, C, R1, L)).copy() if L > 1 else np.zeros((C, C, R1, L), int)
    ri = rr[None, None, :, None]
    A, B = age[:, None, None, None], age[None, :, None, None]
    at = at or {}
    for i in range(hi - 1, lo - 1, -1):
        on_usd, on_tok = (x[:, :, None, None, None, None] for x in weights(i))
        la, lb = m2.rate[0, i], m2.rate[1, i]
        qa, qb = math.exp(-la * step_s), math.exp(-lb * step_s)
        ia = -math.expm1(-la * step_s) / la if la > 0 else step_s     # E[seconds alive] in the step
        ib = -math.expm1(-lb * step_s) / lb if lb > 0 else step_s
        vm_tokens = ((rr * step_s * m2.od_tps)[None, None, :] + np.where(ready, ia * m2.tps[0], 0.0)[:, None, None]
                     + np.where(ready, ib * m2.tps[1], 0.0)[None, :, None])
        tokens = np.where(trains, vm_tokens[..., None], 0.0)
        sa = np.where(present, qa, 1.0)[:, None, None, None]
        sb = np.where(present, qb, 1.0)[None, :, None, None]
        da = np.where(present, 1 - qa, 0.0)[:, None, None, None]
        db = np.where(present, 1 - qb, 0.0)[None, :, None, None]
        later = (sa * sb * V[:, :, A, B, ri, clock] + sa * db * V[:, :, A, 0, ri, clock]
                 + da * sb * V[:, :, 0, B, ri, clock] + da * db * V[:, :, 0, 0, ri, clock])
        after = later + on_tok * tokens          # post-decision value
        keep_a = m2.usd[0, i - 1] * step_s / 3600 if i > 0 else 0.0
        keep_b = m2.usd[1, i - 1] * step_s / 3600 if i > 0 else 0.0
        keep_o = m2.od_usd[i - 1] * step_s / 3600 if i > 0 else 0.0
        add_o = np.min(m2.od_usd[max(0, i - K):i + 1]) * max(0.0, boot - step_s) / 3600
        # On-demand VMs held r → r': r kept (each billed the step it lived) and r' − r counted ready
        # with their boots billed up front, or r' < r kept. Both minima by running minima along r.
        grow = _running_min(after + on_usd * (rr * add_o)[:, None], reverse=True)    # min over r' ≥ r
        grow = grow + on_usd * (rr * (keep_o - add_o))[:, None]
        shrink = _running_min(after + on_usd * (rr * keep_o)[:, None])               # min over r' ≤ r ...
        none = np.zeros_like(shrink[..., :1, :])
        none[:, 0] = BIG
        shrink = np.concatenate([none, shrink[..., :-1, :]], axis=4)                 # ... r' < r
        best_od = _least(grow, shrink)
        new = np.zeros_like(after)
        new[:, 0] = BIG
        # per zone: keep its VM (billed the step it lived), let it go, or count a fresh one (a launch in
        # the step before, after the old one went) where the zone had room
        for how_a in ("keep", "drop", "fresh"):
            for how_b in ("keep", "drop", "fresh"):
                ta, ca = _zone_choice(how_a, cls, present, m2.room[0, i], keep_a)
                tb, cb = _zone_choice(how_b, cls, present, m2.room[1, i], keep_b)
                if ta is None or tb is None:
                    continue
                bill = (ca[:, None, None, None] + cb[None, :, None, None])
                new = _least(new, best_od[:, :, ta][:, :, :, tb] + on_usd * bill)
        V = new
        if i in at:
            V = at[i](V)
    return V


def _least(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Per state and problem, the slots of whichever of `x` and `y` has the lower value (slot 0)."""
    return np.where(x[:, :1] <= y[:, :1], x, y)


def _running_min(x: np.ndarray, reverse: bool = False) -> np.ndarray:
    """Along the on-demand axis, the slots of the least value up to each r (`reverse`: from each r on)."""
    out = x.copy()
    n = x.shape[4]
    for r in (range(n - 2, -1, -1) if reverse else range(1, n)):
        near = out[..., r + 1, :] if reverse else out[..., r - 1, :]
        out[..., r, :] = _least(out[..., r, :], near)
    return out


def _zone_choice(how: str, cls, present, room: bool, keep_usd: float):
    """A zone's class after the choice `how` from each class before it, and its cost (None: not
    possible now)."""
    if how == "keep":
        return np.where(present, cls, 0), np.where(present, keep_usd, 0.0)
    if how == "drop":
        return np.zeros_like(cls), np.zeros(len(cls))
    return (np.ones_like(cls), np.zeros(len(cls))) if room else (None, None)


def tied_dp_usd(recipe, market, step_s: float = 30.0) -> float:
    """The least expected bill (USD, before refunds) of any policy that trains the run's tokens by
    budget.max_hours on a market of two one-VM spot zones: the best of a search over the
    token's price (`dual`)."""
    m2 = Market2(recipe, market, step_s)
    top = 2 * float(np.max(m2.od_usd)) / 3600 / m2.od_tps
    lo, hi, best = 0.0, top, -math.inf
    for _ in range(SEARCH[1]):
        prices = np.linspace(lo, hi, SEARCH[0])
        values = dual(m2, recipe, step_s, prices)
        j = int(np.argmax(values))
        best = max(best, float(values[j]))
        width = (hi - lo) / (SEARCH[0] - 1)
        lo, hi = max(0.0, prices[j] - width), prices[j] + width
    return best


def main(argv: list[str] | None = None) -> int:
    import real_markets

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", nargs="+", type=Path,
                    default=[ROOT / "bench" / "traces" / "real" / "aws-v100-2zones-2022.csv"])
    ap.add_argument("--step-s", nargs="+", type=float, default=[30.0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--start-hours", nargs="+", type=float, default=None)
    ap.add_argument("--zone-pairs", action="store_true",
                    help="every two-zone market of each trace's zones in one region instead of the trace "
                         "(as bench/real_markets.py --zone-pairs)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tied-dp-") as folder:
        traces = list(args.traces)
        if args.zone_pairs:
            traces = [pair for t in traces for pair in real_markets.zone_pairs(t, Path(folder) / "pairs")]
        if args.start_hours:
            traces = [real_markets.window(t, h, Path(folder)) if h else t for t in traces for h in args.start_hours]
        return _table(traces, args.step_s, args.seeds)


def _table(traces: list[Path], steps: list[float], seeds: int) -> int:
    import real_markets

    from elastic.policy.registry import POLICIES
    from elastic.recipe.model import load_recipe
    from elastic.sim.simulate import _market, min_replicas_bound_usd_per_mtok, simulate

    heads = " | ".join(f"tied DP, {s:g} s" for s in steps)
    print(f"| trace | bound keeping world.min_replicas | {heads} | elastic, median USD | elastic / bound "
          f"| elastic / tied DP ({steps[-1]:g} s) | runs under the tied DP |")
    print("| --- | --- | " + " | ".join("---" for _ in steps) + " | --- | --- | --- | --- |")
    for trace in traces:
        recipe = load_recipe(real_markets.recipe_for(trace))
        market = _market(recipe, str(trace))
        kept = min_replicas_bound_usd_per_mtok(recipe, str(trace)) * run_tokens(recipe) / 1e6
        t0 = time.time()
        tied = [tied_dp_usd(recipe, market, s) for s in steps]
        seconds = time.time() - t0
        runs = [r for seed in range(seeds)
                for r in simulate(recipe, str(trace), list(POLICIES), seed=seed, market=market)]
        runs = [r for r in runs if r["status"] == "completed"]
        paid = [r["list_usd"] for r in runs if r["policy"] == "elastic"]
        usd = statistics.median(paid) if paid else math.nan
        under = sum(r["list_usd"] < tied[-1] for r in runs)
        cells = " | ".join(f"${t:,.2f}" for t in tied)
        print(f"| {trace.stem} | ${kept:,.2f} | {cells} | ${usd:,.2f} | {usd / kept:.3f} | {usd / tied[-1]:.3f} "
              f"| {under} of {len(runs)} |", flush=True)
        print(f"  ({seconds:.0f} s for the tied DP)", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    import real_markets

    real_markets.run_cli(main)
