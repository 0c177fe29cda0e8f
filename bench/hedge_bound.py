"""What not knowing when an outage ends costs, at least: the least ratio to the bound that keeps
world.min_replicas which one online schedule can hold on a trace and on every variant of it in which
one of its outages lasts longer, in `elastic/sim/bound.py`'s own relaxed model.

    python bench/hedge_bound.py [--trace T.csv] [--recipe R.yaml] [--start-hours H]
                                [--extend-h 12] [--min-outage-h 1] [--schedule]

A policy cannot tell the trace from a variant until the variant parts from it: where an outage of a
zone (capacity 0 for at least `--min-outage-h` hours) ends before budget.max_hours, the variant
keeps that zone at the outage's last row for `--extend-h` hours more (the longest outages in the
real traces last 3.4-11.8 h) and is the trace again after. Each scenario is priced by
`elastic.sim.bound.bound_program(..., keep_min_replicas=True)`, and one program holds them all,
tied by non-anticipation: every variable of a row before the scenario parts (expected VMs kept,
booted, a world's members, tokens credited, the chance a world trains) equals the trace's own. A
policy's expected schedule up to the row a variant parts is the same on both (the draws and what it
has seen are), so it meets the ties. The program's least t such that every scenario's cost is at
most t × its own bound is then at most the worst of any policy's ratios (of expectations) over the
scenarios: t above 1.10 would prove that no policy is within 1.10× of the bound on all of them.

All scenarios are put on one grid of rows (every row start of the trace and every end of an
extension, each zone restated at each), so their programs have the same variables; the bound on the
grid is the trace's own (a zone restated in a row it did not change in changes nothing).
Figures and what they show: docs/benchmarks.md, "Real spot markets", session 28.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.real_markets import recipe_for, window  # noqa: E402
from elastic.policy.planner import run_tokens  # noqa: E402
from elastic.recipe.model import load_recipe  # noqa: E402
from elastic.sim.bound import bound_program, solve  # noqa: E402
from elastic.sim.simulate import TraceMarket  # noqa: E402
from providers.simmarket import read_trace_rows  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Variant:
    """The trace with `key`'s state in effect just before `parts_s` held `extend_s` longer from
    `parts_s` on. `unforeseen`: the parting row looks the same at its start on both (the trace's
    row is the tick of a drop, known only by what it takes), so the choices made then are shared."""

    key: tuple[str, str]
    parts_s: float
    extend_s: float
    what: str
    unforeseen: bool = False


def variants(market: TraceMarket, times: list[float], limit_s: float, min_s: float, extend_s: float,
             drops: bool) -> list[Variant]:
    """An outage (capacity 0 for at least `min_s` seconds) that ends before `limit_s` held
    `extend_s` longer; with `drops`, each rise of a zone's preemption hazard while it still has
    capacity (the tick of a drop) replaced by the calm before it for `extend_s`."""
    out = []
    for key in [(o.zone, o.instance_type) for o in market.offers(0.0, True)]:
        began, before = None, None
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
            before = st
    return sorted(out, key=lambda v: v.parts_s)


def scenario_market(market: TraceMarket, rows, grid: list[float], recipe, variant: Variant | None) -> TraceMarket:
    """The trace (or `variant` of it) restated at every time of `grid` for every zone."""
    first = {(r.zone, r.instance_type): r for r in rows}
    out = []
    for key, row in first.items():
        held = None
        if variant is not None and key == variant.key:
            held = market.state(*key, variant.parts_s - 1e-6)
        for t in grid:
            extended = held is not None and variant.parts_s <= t < variant.parts_s + variant.extend_s
            out.append(dataclasses.replace(row, t=t, state=held if extended else market.state(*key, t)))
    return TraceMarket(out, recipe)


def tied(program, parts_row: int, unforeseen: bool) -> np.ndarray:
    """The variables a scenario parting at `parts_row` shares with the trace: every one of the
    rows before, and where the parting is `unforeseen` the choices made at its own start."""
    return (program.row < parts_row) | (unforeseen & (program.row == parts_row) & (program.kind != "c"))


def minimax(programs, ties: list[np.ndarray]) -> tuple[float, list[float], list[float], np.ndarray]:
    """(t, each scenario's bound in USD, each one's ratio at the optimum, the trace's schedule):
    the least t with every scenario's cost at most t × its bound, scenario s's variables where
    `ties[s]` equal to the trace's (scenario 0)."""
    from scipy import sparse
    from scipy.optimize import linprog

    bounds_usd = [solve(p) for p in programs]
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
    return float(x[-1]), bounds_usd, ratios, x[:nv]


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


def scenarios(recipe, rows, extend_h: float, min_outage_h: float, drops: bool):
    """(variants, programs of the trace and each variant, their ties to the trace, the common grid)."""
    market = TraceMarket(rows, recipe)
    varied = variants(market, market.times(), recipe.budget.max_hours * 3600, min_outage_h * 3600, extend_h * 3600,
                      drops)
    grid = sorted(set(market.times()) | {v.parts_s + v.extend_s for v in varied})
    programs = [bound_program(recipe, scenario_market(market, rows, grid, recipe, v), keep_min_replicas=True)
                for v in [None, *varied]]
    ties = [np.zeros(len(programs[0].cost), bool)] + [tied(p, grid.index(v.parts_s), v.unforeseen)
                                                      for p, v in zip(programs[1:], varied)]
    return varied, programs, ties, grid


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=ROOT / "bench" / "traces" / "real" / "aws-v100-2zones-2022.csv")
    ap.add_argument("--recipe", type=Path, default=None, help="default: the trace's (bench/real_markets.py)")
    ap.add_argument("--start-hours", type=float, default=0.0, help="the trace from H hours in")
    ap.add_argument("--extend-h", type=float, default=12.0, help="hours each variant holds an outage longer")
    ap.add_argument("--min-outage-h", type=float, default=1.0, help="outages shorter than this are not varied")
    ap.add_argument("--drops", action="store_true",
                    help="also variants in which a tick of a drop is calm (the drop unforeseen)")
    ap.add_argument("--schedule", action="store_true", help="print the trace's schedule at the optimum")
    args = ap.parse_args()

    recipe = load_recipe(args.recipe or recipe_for(args.trace))
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        trace = window(args.trace, args.start_hours, Path(tmp)) if args.start_hours else args.trace
        rows = read_trace_rows(trace)
    market = TraceMarket(rows, recipe)
    varied, programs, ties, grid = scenarios(recipe, rows, args.extend_h, args.min_outage_h, args.drops)
    t, bounds_usd, ratios, x = minimax(programs, ties)
    per_mtok = 1e6 / run_tokens(recipe)
    name = f"{args.trace.stem}" + (f"@{args.start_hours:g}h" if args.start_hours else "")
    print(f"{name}: {len(varied)} variants (outages of at least {args.min_outage_h:g} h held {args.extend_h:g} h "
          f"longer{', drops unforeseen' if args.drops else ''}), {time.monotonic() - started:.0f} s")
    print(f"  the trace: bound {bounds_usd[0] * per_mtok:.5f} USD/1M tokens (${bounds_usd[0]:.2f}), "
          f"ratio at the optimum {ratios[0]:.4f}")
    for v, b, r in zip(varied, bounds_usd[1:], ratios[1:]):
        print(f"  {v.key[0]} {v.what}, for {v.extend_s / 3600:g} h: bound {b * per_mtok:.5f} (${b:.2f}), ratio {r:.4f}")
    print(f"least worst ratio any online schedule can hold over these scenarios: {t:.4f}")
    if args.schedule:
        zones = [o.zone for o in market.offers(0.0, True)]
        print_schedule(programs[0], x, grid, [f"{z} spot" for z in zones] + [f"{z} on-demand" for z in zones])


if __name__ == "__main__":
    main()
