"""What not knowing the future costs, at least: the least ratio to the bound that keeps
world.min_replicas (the yardstick of `bench/real_markets.py`) which one online schedule can hold on
a trace and on every variant of it that a policy cannot tell from it until the variant parts, in
`elastic/sim/bound.py`'s own relaxed model.

    python bench/hedge_bound.py [--trace T.csv] [--recipe R.yaml] [--start-hours H]
                                [--extend-h 12] [--min-outage-h 1] [--drops] [--onsets]
                                [--onset-every-h 0] [--split 1] [--schedule]

Variants, each the trace until it parts and again `--extend-h` hours later:
- an outage of a zone (capacity 0 for at least `--min-outage-h` hours) that ends before
  budget.max_hours lasts `--extend-h` hours longer;
- with `--drops`, the tick of a drop (a rise of a zone's preemption hazard while it still has
  capacity) is calm: the zone stays as it was before it;
- with `--onsets`, a calm zone (capacity, no hazard, at the row and the one before) drops at the row
  (the trace's own hazard of a drop, the capacity kept, for as long as its own drop ticks last, the
  median of them) and is at 0 after, as the converter writes an outage (`--onset-every-h`: at most
  one a zone that often).
Outages in the real data last up to 86 h (aws-v100-3zones-4node's us-east-2a; 80 h in
aws-v100-9zones), so `--extend-h 72`, a zone out until a 72-hour deadline, is a market the same probe
recorded.

Each scenario is priced by `elastic.sim.bound.bound_program(..., keep_min_replicas=True)`, and one
program holds them all, tied by non-anticipation: every variable of a row before the scenario parts
(expected VMs kept, booted, a world's members, tokens credited, the chance a world trains) equals
the trace's own. A policy's expected schedule up to the row a variant parts is the same on both (the
draws and what it has seen are), so it meets the ties. A drop, or its absence, shows only by what it
takes within its row, and a policy may act on that within the row: such a parting (`unforeseen`)
also shares the VMs kept into its row (present at its start, so decided before it) and nothing
else of it. The program's least t such that every scenario's cost is at most t × its yardstick (the
higher of that bound and `min_replicas_floor_usd_per_mtok`, as `min_replicas_bound_usd_per_mtok`
takes) is then at most the worst of any policy's ratios (of expected costs) over the scenarios, for
every policy that finishes on all of them and whose expected schedule the program can express.

What that takes: the program decides at its rows' starts, and a VM booted there is ready a boot
later. A policy that launches within a row (a partner the moment one is lost) has a VM ready at
another time, which no mix of row-start boots credits row by row; so t above 1.10 proves the goal
out of reach only for policies that act at the rows' starts. `--split N` restates every row as N
(the same market, decisions at N times as many points): how far t moves with it says how much the
proof leans on that. On aws-v100-2zones-2022 it leans enough to lose it (docs/benchmarks.md,
"Session 38": 1.1013 at the trace's rows, 1.0988 with `--split 2`).

All scenarios are put on one grid of rows (every row start of the trace, every end of an extension
and, with `--split`, every cut, each zone restated at each), so their programs have the same
variables; without `--split` the bound on the grid is the trace's own (a zone restated in a row it
did not change in changes nothing). Figures and what they show: docs/benchmarks.md, "Real spot
markets", sessions 28 and 38.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.real_markets import recipe_for, run_cli, window  # noqa: E402
from elastic.policy.planner import run_tokens  # noqa: E402
from elastic.recipe.model import load_recipe  # noqa: E402
from elastic.sim.bound import bound_program, min_replicas_floor_usd_per_mtok, solve  # noqa: E402
from elastic.sim.simulate import TraceMarket  # noqa: E402
from providers.simmarket import MarketState, read_trace_rows  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Variant:
    """The trace with `key`'s state in effect just before `parts_s` held `extend_s` longer from
    `parts_s` on; for an onset, `first` for its first `tick_s` (a drop's tick) and `held` after it.
    `unforeseen`: the parting row looks the same at its start on both (one of the two is the tick
    of a drop, known only by what it takes), so the VMs kept into it are shared."""

    key: tuple[str, str]
    parts_s: float
    extend_s: float
    what: str
    unforeseen: bool = False
    first: MarketState | None = None
    held: MarketState | None = None
    tick_s: float = 0.0


def drop_tick_s(market: TraceMarket, key: tuple[str, str], times: list[float]) -> float:
    """How long the zone's drop ticks (a hazard with the capacity kept) last in the trace, the
    median of them (0: it has none)."""
    spans, began = [], None
    for t in times:
        st = market.state(*key, t)
        dropping = st.preempt_per_hour > 0 and (st.capacity or 0) > 0
        if dropping and began is None:
            began = t
        elif not dropping and began is not None:
            spans.append(t - began)
            began = None
    return float(statistics.median(spans)) if spans else 0.0


def variants(market: TraceMarket, times: list[float], limit_s: float, min_s: float, extend_s: float,
             drops: bool, onsets: bool = False, onset_every_s: float = 0.0) -> list[Variant]:
    """An outage (capacity 0 for at least `min_s` seconds) that ends before `limit_s` held
    `extend_s` longer; with `drops`, each rise of a zone's preemption hazard while it still has
    capacity (the tick of a drop) replaced by the calm before it for `extend_s`; with `onsets`, at
    each calm row of a zone whose trace has drops (at most one a zone every `onset_every_s`), a drop
    and `extend_s` at 0."""
    out = []
    for key in [(o.zone, o.instance_type) for o in market.offers(0.0, True)]:
        hazard = max(market.state(*key, t).preempt_per_hour for t in times)   # the converter's drop
        tick_s = drop_tick_s(market, key, times)
        began, before, next_onset = None, None, 0.0
        for t in times:
            if t >= limit_s:
                break
            st = market.state(*key, t)
            if st.capacity == 0:
                began = t if began is None else began
            else:
                if began is not None and t - began >= min_s:
                    out.append(Variant(key, t, extend_s, f"out {(t - began) / 3600:.1f} h to {t / 3600:.2f} h"))
                began = None
                if (drops and before is not None and before.capacity and st.preempt_per_hour > before.preempt_per_hour):
                    out.append(Variant(key, t, extend_s, f"no drop at {t / 3600:.2f} h", unforeseen=True))
                calm = before is not None and before.capacity and not before.preempt_per_hour
                if onsets and hazard > 0 and calm and not st.preempt_per_hour and t >= next_onset:
                    next_onset = t + onset_every_s
                    out.append(Variant(key, t, extend_s, f"a drop at {t / 3600:.2f} h", unforeseen=True,
                                       first=dataclasses.replace(st, preempt_per_hour=hazard),
                                       held=dataclasses.replace(st, preempt_per_hour=hazard, capacity=0),
                                       tick_s=tick_s))
            before = st
    return sorted(out, key=lambda v: v.parts_s)


def scenario_market(market: TraceMarket, rows, grid: list[float], recipe, variant: Variant | None) -> TraceMarket:
    """The trace (or `variant` of it) restated at every time of `grid` for every zone."""
    first = {(r.zone, r.instance_type): r for r in rows}
    out = []
    for key, row in first.items():
        held = parting = None
        if variant is not None and key == variant.key:
            held = variant.held or market.state(*key, variant.parts_s - 1e-6)
            parting = variant.first or held
        for t in grid:
            extended = held is not None and variant.parts_s <= t < variant.parts_s + variant.extend_s
            if extended:
                state = parting if t == variant.parts_s or t < variant.parts_s + variant.tick_s else held
            else:
                state = market.state(*key, t)
            out.append(dataclasses.replace(row, t=t, state=state))
    return TraceMarket(out, recipe)


def tied(program, parts_row: int, unforeseen: bool) -> np.ndarray:
    """The variables a scenario parting at `parts_row` shares with the trace: every one of the
    rows before, and where the parting is `unforeseen` the VMs kept into it. (Not its boots, a
    world's members or the chance one trains: a policy may rent or pair within the row, on what the
    drop takes, and those count in the row's variables.)"""
    return (program.row < parts_row) | (unforeseen & (program.row == parts_row) & (program.kind == "k"))


class Minimax(NamedTuple):
    """The scenarios' program at its optimum."""

    t: float                  # the least worst ratio
    yardsticks: list[float]   # each scenario's yardstick, USD
    ratios: list[float]       # each one's ratio at the optimum
    schedule: np.ndarray      # the trace's variables
    weights: list[float]      # each one's weight in the worst case (the ratio constraints' duals, summing to 1)


def minimax(programs, ties: list[np.ndarray], yardsticks: list[float] | None = None) -> Minimax:
    """The least t with every scenario's cost at most t × its yardstick (default: its program's own
    least cost), scenario s's variables where `ties[s]` equal to the trace's (scenario 0)."""
    from scipy import sparse
    from scipy.optimize import linprog

    bounds_usd = yardsticks or [solve(p) for p in programs]
    nv, count = len(programs[0].cost), len(programs)
    a = sparse.block_diag([p.a_ub for p in programs], format="csr")
    a = sparse.hstack([a, sparse.csr_matrix((a.shape[0], 1))], format="csr")
    ratio = sparse.lil_matrix((count, count * nv + 1))
    for s, (p, b) in enumerate(zip(programs, bounds_usd)):
        ratio[s, s * nv:(s + 1) * nv] = p.cost
        ratio[s, count * nv] = -b
    a_ub = sparse.vstack([a, ratio.tocsr()], format="csr")
    b_ub = np.concatenate([p.b_ub for p in programs] + [np.zeros(count)])
    ties_r, ties_c, ties_v, k = [], [], [], 0
    for s in range(1, count):
        same = np.flatnonzero(ties[s])
        ties_r += [np.arange(k, k + len(same))] * 2
        ties_c += [same, s * nv + same]
        ties_v += [np.ones(len(same)), -np.ones(len(same))]
        k += len(same)
    a_eq = sparse.csr_matrix((np.concatenate(ties_v), (np.concatenate(ties_r), np.concatenate(ties_c))),
                             shape=(k, count * nv + 1)) if k else None
    bounds = np.vstack([p.bounds for p in programs] + [np.array([[0.0, np.inf]])])
    cost = np.zeros(count * nv + 1)
    cost[-1] = 1.0
    res = linprog(cost, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=np.zeros(k) if k else None, bounds=bounds,
                  method="highs")
    if res.status != 0:
        raise SystemExit(f"the scenarios' program did not solve: {res.message}")
    x = res.x
    ratios = [float(p.cost @ x[s * nv:(s + 1) * nv]) / b for s, (p, b) in enumerate(zip(programs, bounds_usd))]
    # t's column is 1 in the objective and −yardstick in each ratio row, so the rows' duals times the
    # yardsticks sum to 1: how much each scenario weighs in the worst case
    weights = [float(-y * b) for y, b in zip(res.ineqlin.marginals[-count:], bounds_usd)]
    return Minimax(float(x[-1]), bounds_usd, ratios, x[:nv], weights)


def print_schedule(program, x: np.ndarray, grid: list[float], offers: list[str]) -> None:
    """The trace's schedule at the optimum, hour by hour: expected VMs per offer (kept and booted),
    chance that a world trains."""
    n = int(program.row.max()) + 1
    present = (x[program.kind == "k"] + x[program.kind == "b"]).reshape(n, -1)
    y = x[program.kind == "y"]
    hours = np.array(grid[:n]) // 3600
    print("hour  " + "  ".join(f"{o:>22}" for o in offers) + "  P(world)")
    for h in np.unique(hours):
        sel = hours == h
        print(f"{int(h):4d}  " + "  ".join(f"{v:22.2f}" for v in present[sel].mean(0)) + f"  {y[sel].mean():8.2f}")


def split_times(times: list[float], limit_s: float, parts: int) -> set[float]:
    """Each row of `times` before `limit_s` cut into `parts` rows of equal length."""
    return {t + (nxt - t) * j / parts for t, nxt in zip(times, times[1:]) if t < limit_s for j in range(1, parts)}


def scenarios(recipe, rows, extend_h: float, min_outage_h: float, drops: bool, onsets: bool = False,
              onset_every_h: float = 0.0, split: int = 1):
    """(variants, programs of the trace and each variant, their ties to the trace, the common grid,
    each scenario's yardstick in USD: `min_replicas_bound_usd_per_mtok`'s, the higher of its
    program's least cost and `min_replicas_floor_usd_per_mtok`)."""
    market, limit_s = TraceMarket(rows, recipe), recipe.budget.max_hours * 3600
    varied = variants(market, market.times(), limit_s, min_outage_h * 3600, extend_h * 3600, drops, onsets,
                      onset_every_h * 3600)
    grid = sorted(set(market.times()) | {v.parts_s + v.extend_s for v in varied}
                  | {v.parts_s + v.tick_s for v in varied if v.tick_s} | split_times(market.times(), limit_s, split))
    markets = [scenario_market(market, rows, grid, recipe, v) for v in [None, *varied]]
    programs = [bound_program(recipe, m, keep_min_replicas=True) for m in markets]
    ties = [np.zeros(len(programs[0].cost), bool)] + [tied(p, grid.index(v.parts_s), v.unforeseen)
                                                      for p, v in zip(programs[1:], varied)]
    mtok = run_tokens(recipe) / 1e6
    yardsticks = [max(solve(p), min_replicas_floor_usd_per_mtok(recipe, m) * mtok)
                  for p, m in zip(programs, markets)]
    return varied, programs, ties, grid, yardsticks


def read_window(trace: Path, start_hours: float) -> list:
    """The trace's rows from `start_hours` in (`bench/real_markets.py`'s window; 0: all of them)."""
    with tempfile.TemporaryDirectory() as tmp:
        return read_trace_rows(window(trace, start_hours, Path(tmp)) if start_hours else trace)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=ROOT / "bench" / "traces" / "real" / "aws-v100-2zones-2022.csv")
    ap.add_argument("--recipe", type=Path, default=None, help="default: the trace's (bench/real_markets.py)")
    ap.add_argument("--start-hours", type=float, default=0.0, help="the trace from H hours in")
    ap.add_argument("--extend-h", type=float, default=12.0, help="hours each variant holds an outage longer")
    ap.add_argument("--min-outage-h", type=float, default=1.0, help="outages shorter than this are not varied")
    ap.add_argument("--drops", action="store_true",
                    help="also variants in which a tick of a drop is calm (the drop unforeseen)")
    ap.add_argument("--onsets", action="store_true",
                    help="also variants in which a calm zone drops at a row and is out after (the drop unforeseen)")
    ap.add_argument("--onset-every-h", type=float, default=0.0,
                    help="at most one onset a zone every this many hours (0: at every calm row)")
    ap.add_argument("--split", type=int, default=1,
                    help="restate every row of the trace as this many (decisions within its rows)")
    ap.add_argument("--schedule", action="store_true", help="print the trace's schedule at the optimum")
    args = ap.parse_args()

    recipe = load_recipe(args.recipe or recipe_for(args.trace))
    started = time.monotonic()
    rows = read_window(args.trace, args.start_hours)
    market = TraceMarket(rows, recipe)
    varied, programs, ties, grid, yardsticks = scenarios(recipe, rows, args.extend_h, args.min_outage_h, args.drops,
                                                         args.onsets, args.onset_every_h, args.split)
    t, bounds_usd, ratios, x, _ = minimax(programs, ties, yardsticks)
    per_mtok = 1e6 / run_tokens(recipe)
    name = f"{args.trace.stem}" + (f"@{args.start_hours:g}h" if args.start_hours else "")
    kinds = (", drops unforeseen" * args.drops + f", onsets of {args.extend_h:g} h" * args.onsets
             + f", rows split in {args.split}" * (args.split > 1))
    print(f"{name}: {len(varied)} variants (outages of at least {args.min_outage_h:g} h held {args.extend_h:g} h "
          f"longer{kinds}), {time.monotonic() - started:.0f} s")
    print(f"  the trace: yardstick {bounds_usd[0] * per_mtok:.5f} USD/1M tokens (${bounds_usd[0]:.2f}), "
          f"ratio at the optimum {ratios[0]:.4f}")
    for v, b, r in zip(varied, bounds_usd[1:], ratios[1:]):
        print(f"  {v.key[0]} {v.what}, for {v.extend_s / 3600:g} h: yardstick {b * per_mtok:.5f} (${b:.2f}), "
              f"ratio {r:.4f}")
    print(f"least worst ratio any online schedule can hold over these scenarios: {t:.4f}")
    if t > 1.10:
        print("so no policy that finishes on all of them and decides at these rows' starts has an expected cost "
              "within 1.10x of the yardstick on every one")
    if args.schedule:
        zones = [o.zone for o in market.offers(0.0, True)]
        print_schedule(programs[0], x, grid, [f"{z} spot" for z in zones] + [f"{z} on-demand" for z in zones])


if __name__ == "__main__":
    run_cli(main)
