"""The simulator over the shipped traces: USD per 1M tokens and finish time of each policy.

    python bench/policies.py [--recipe recipes/multi-cloud.yaml] [--seeds 5]

Goals (issue 7): `elastic` ≤ 0.33 × `on-demand` and ≤ 0.8 × `skypilot-like` in USD per 1M tokens,
finishing no later than `skypilot-like`. Each trace is run with seeds 0..N-1 (the preemption draws);
the table shows medians, the ratios are of the medians, and the per-seed ratios' worst is shown too.

Next to the policies: the bound no policy can beat on that trace, every replica on the cheapest
spot capacity per token at every moment, with nothing lost to preemption, boots or syncs. The
control traces (`bench/traces/control/`) are reported the same way, apart from the goals.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elastic.market import recipe_tokens_per_s  # noqa: E402
from elastic.recipe import load_recipe  # noqa: E402
from elastic.simulate import POLICIES, TraceMarket, simulate  # noqa: E402
from providers.simmarket import read_trace_rows  # noqa: E402


def lower_bound_usd_per_mtok(recipe, trace: Path) -> float:
    """Time-averaged USD per 1M tokens of `world.replicas` replicas always on the cheapest spot
    capacity per token (each offer up to its capacity), with no work ever lost."""
    market = TraceMarket(read_trace_rows(trace), recipe)
    n = min(recipe.world.replicas, recipe.world.max_replicas)
    times = sorted({r.t for r in read_trace_rows(trace)})
    total = 0.0
    for t in times:
        per_tok = sorted((o.usd_per_hour / recipe_tokens_per_s(o, recipe.planner), o.capacity)
                         for o in market.offers(t, spot=True))
        need, usd = n, 0.0
        for price, cap in per_tok:
            take = need if cap is None else min(cap, need)
            usd, need = usd + take * price, need - take
            if not need:
                break
        # A moment with fewer than n places to rent counts at the dearest price rented then.
        total += (usd + need * (per_tok[-1][0] if per_tok else 0.0)) / n
    return total / len(times) / 3600 * 1e6


def report(recipe, trace: Path, seeds: int, goals: bool) -> None:
    runs = [{r["policy"]: r for r in simulate(recipe, str(trace), seed=s)} for s in range(seeds)]
    print(f"\n{trace.relative_to(ROOT / 'bench/traces')} ({seeds} seeds, medians)")
    print("| policy | USD/1M tok | wall h | USD | preemptions | moves | effective | completed |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    med = {}
    for p in POLICIES:
        rs = [run[p] for run in runs]
        m = {k: statistics.median(r[k] for r in rs) for k in ("usd_per_mtok", "wall_h", "cost_usd", "preemptions",
                                                               "moves", "effective_training_time")}
        med[p] = m
        done = sum(r["status"] == "completed" for r in rs)
        print(f"| {p} | {m['usd_per_mtok']:.4f} | {m['wall_h']:.1f} | {m['cost_usd']:,.0f} | {m['preemptions']:g} | "
              f"{m['moves']:g} | {m['effective_training_time']:.3f} | {done}/{len(rs)} |")
    bound = lower_bound_usd_per_mtok(recipe, trace)
    sky = med["skypilot-like"]["usd_per_mtok"]
    print(f"| (bound: cheapest capacity, nothing lost) | {bound:.4f} | | | | | | |")
    od = med["elastic"]["usd_per_mtok"] / med["on-demand"]["usd_per_mtok"]
    vs_sky = med["elastic"]["usd_per_mtok"] / sky
    worst_od = max(run["elastic"]["usd_per_mtok"] / run["on-demand"]["usd_per_mtok"] for run in runs)
    worst_sky = max(run["elastic"]["usd_per_mtok"] / run["skypilot-like"]["usd_per_mtok"] for run in runs)
    later = sum(run["elastic"]["wall_h"] > run["skypilot-like"]["wall_h"] for run in runs)
    goal = "; goal <= {}" if goals else "{}"
    print(f"elastic / on-demand: {od:.3f} (worst seed {worst_od:.3f}{goal.format(0.33) if goals else ''})")
    print(f"elastic / skypilot-like: {vs_sky:.3f} (worst seed {worst_sky:.3f}{goal.format(0.8) if goals else ''})")
    print(f"bound / skypilot-like: {bound / sky:.3f} (the least any policy could reach)")
    print(f"elastic finished later than skypilot-like in {later} of {len(runs)} seeds "
          f"(median {med['elastic']['wall_h']:.1f} h vs {med['skypilot-like']['wall_h']:.1f} h)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default=str(ROOT / "recipes/multi-cloud.yaml"))
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    recipe = load_recipe(args.recipe, args.overrides)
    print("# shipped traces (goals apply)")
    for trace in sorted((ROOT / "bench/traces").glob("*.csv")):
        if trace.name != "catalog-snapshot.csv":
            report(recipe, trace, args.seeds, goals=True)
    print("\n# control traces (no goal: see bench/traces/make_traces.py)")
    for trace in sorted((ROOT / "bench/traces/control").glob("*.csv")):
        report(recipe, trace, args.seeds, goals=False)


if __name__ == "__main__":
    main()
