"""The simulator over the shipped traces: USD per 1M tokens and finish time of each policy.

    python bench/policies.py [--recipe recipes/multi-cloud.yaml] [--seeds 5]

Goals (issue 7): `elastic` ≤ 0.33 × `on-demand` and ≤ 0.8 × `skypilot-like` in USD per 1M tokens,
finishing no later than `skypilot-like`. Each trace is run with seeds 0..N-1 (the preemption draws);
the table shows medians, the ratios are of the medians, and the per-seed ratios' worst is shown too.

Next to the policies: ours again with budget.max_hours set to skypilot-like's median finish (the
planner then buys speed: faster GPUs or more replicas); and two bounds no policy can beat on that
trace, every replica on the cheapest spot capacity per token at every moment with nothing lost to
preemption, boots or syncs, and the same for a world fast enough to finish by skypilot-like's time.
The control traces (`bench/traces/control/`) are reported the same way, apart from the goals.
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


def lower_bound_usd_per_mtok(recipe, trace: Path, finish_h: float | None = None) -> float:
    """Time-averaged USD per 1M tokens of a world always on the cheapest spot capacity per token
    (each offer up to its capacity), with no work ever lost: `world.replicas` replicas of any mix;
    with `finish_h`, the cheapest world of world.replicas..max_replicas replicas of one GPU speed
    (a world moves at its slowest replica's pace) that trains the run's tokens at a steady rate
    within `finish_h` hours (a moment when none can takes the fastest world then). No policy can
    pay less on that trace (with `finish_h`: and finish by then at a steady pace)."""
    from elastic.planner import tokens_per_phase

    rows = read_trace_rows(trace)
    market = TraceMarket(rows, recipe)
    w, p = recipe.world, recipe.planner
    n = min(w.replicas, w.max_replicas)
    tokens = recipe.train.token_budget or recipe.train.outer_steps * n * tokens_per_phase(recipe)
    rate = tokens / (finish_h * 3600) if finish_h else None
    total, times = 0.0, sorted({r.t for r in rows})
    for t in times:
        offers = sorted((o.usd_per_hour / recipe_tokens_per_s(o, p), o.usd_per_hour, recipe_tokens_per_s(o, p),
                         o.capacity) for o in market.offers(t, spot=True))
        if rate is None:
            need, usd = n, 0.0
            for per_tok, _, _, cap in offers:
                take = need if cap is None else min(cap, need)
                usd, need = usd + take * per_tok, need - take
                if not need:
                    break
            total += (usd + need * (offers[-1][0] if offers else 0.0)) / n
            continue
        best, fastest = None, None
        for speed in {o[2] for o in offers}:
            slots = [usd for _, usd, tps, cap in offers if tps == speed for _ in range(cap if cap is not None else w.max_replicas)]
            for k in range(n, min(w.max_replicas, len(slots)) + 1):
                per_tok = sum(slots[:k]) / (k * speed)
                if k * speed >= rate and (best is None or per_tok < best):
                    best = per_tok
                if fastest is None or k * speed > fastest[0]:
                    fastest = (k * speed, per_tok)
        total += best if best is not None else (fastest[1] if fastest else 0.0)
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
    timed = lower_bound_usd_per_mtok(recipe, trace, finish_h=med["skypilot-like"]["wall_h"])
    # Ours again, told to finish by skypilot-like's median finish (the planner buys speed for it).
    deadline_h = med["skypilot-like"]["wall_h"]
    timely = recipe.model_copy(update={"budget": recipe.budget.model_copy(update={"max_hours": deadline_h})})
    rs = [simulate(timely, str(trace), ["elastic"], seed=s)[0] for s in range(seeds)]
    med["elastic, deadline"] = m = {k: statistics.median(r[k] for r in rs) for k in ("usd_per_mtok", "wall_h", "cost_usd")}
    done = sum(r["status"] == "completed" for r in rs)
    print(f"| elastic, budget.max_hours {deadline_h:.1f} | {m['usd_per_mtok']:.4f} | {m['wall_h']:.1f} | "
          f"{m['cost_usd']:,.0f} | {statistics.median(r['preemptions'] for r in rs):g} | "
          f"{statistics.median(r['moves'] for r in rs):g} | "
          f"{statistics.median(r['effective_training_time'] for r in rs):.3f} | {done}/{len(rs)} |")
    print(f"| (bound: cheapest capacity, nothing lost) | {bound:.4f} | | | | | | |")
    print(f"| (bound, finishing by skypilot-like's {med['skypilot-like']['wall_h']:.1f} h) | {timed:.4f} | | | | | | |")
    od = med["elastic"]["usd_per_mtok"] / med["on-demand"]["usd_per_mtok"]
    vs_sky = med["elastic"]["usd_per_mtok"] / sky
    worst_od = max(run["elastic"]["usd_per_mtok"] / run["on-demand"]["usd_per_mtok"] for run in runs)
    worst_sky = max(run["elastic"]["usd_per_mtok"] / run["skypilot-like"]["usd_per_mtok"] for run in runs)
    later = sum(run["elastic"]["wall_h"] > run["skypilot-like"]["wall_h"] for run in runs)
    goal = "; goal <= {}" if goals else "{}"
    print(f"elastic / on-demand: {od:.3f} (worst seed {worst_od:.3f}{goal.format(0.33) if goals else ''})")
    print(f"elastic / skypilot-like: {vs_sky:.3f} (worst seed {worst_sky:.3f}{goal.format(0.8) if goals else ''})")
    print(f"bound / skypilot-like: {bound / sky:.3f} (the least any policy could reach); "
          f"finishing no later: {timed / sky:.3f}")
    print(f"elastic finished later than skypilot-like in {later} of {len(runs)} seeds "
          f"(median {med['elastic']['wall_h']:.1f} h vs {med['skypilot-like']['wall_h']:.1f} h)")
    d = med["elastic, deadline"]
    print(f"elastic with budget.max_hours {deadline_h:.1f}: {d['usd_per_mtok'] / sky:.3f} of skypilot-like's USD per "
          f"1M tokens, done in {d['wall_h']:.1f} h")


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
