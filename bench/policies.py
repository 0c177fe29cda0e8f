"""The simulator over the shipped traces: USD per 1M tokens and finish time of each policy.

    python bench/policies.py [--recipe recipes/multi-cloud.yaml] [--seeds 5]

Goals (issue 7): `elastic` ≤ 0.33 × `on-demand` and ≤ 0.8 × `skypilot-like` in USD per 1M tokens,
finishing no later than `skypilot-like`. Each trace is run with seeds 0..N-1 (the preemption draws);
the table shows medians, the ratios are of the medians, and the per-seed ratios' worst is shown too.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elastic.recipe import load_recipe  # noqa: E402
from elastic.simulate import POLICIES, simulate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default=str(ROOT / "recipes/multi-cloud.yaml"))
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    recipe = load_recipe(args.recipe, args.overrides)
    for trace in sorted((ROOT / "bench/traces").glob("*.csv")):
        runs = [{r["policy"]: r for r in simulate(recipe, str(trace), seed=s)} for s in range(args.seeds)]
        print(f"\n{trace.name} ({args.seeds} seeds, medians)")
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
        od = med["elastic"]["usd_per_mtok"] / med["on-demand"]["usd_per_mtok"]
        sky = med["elastic"]["usd_per_mtok"] / med["skypilot-like"]["usd_per_mtok"]
        worst_od = max(run["elastic"]["usd_per_mtok"] / run["on-demand"]["usd_per_mtok"] for run in runs)
        worst_sky = max(run["elastic"]["usd_per_mtok"] / run["skypilot-like"]["usd_per_mtok"] for run in runs)
        later = sum(run["elastic"]["wall_h"] > run["skypilot-like"]["wall_h"] for run in runs)
        print(f"elastic / on-demand: {od:.3f} (worst seed {worst_od:.3f}; goal <= 0.33)")
        print(f"elastic / skypilot-like: {sky:.3f} (worst seed {worst_sky:.3f}; goal <= 0.8)")
        print(f"elastic finished later than skypilot-like in {later} of {len(runs)} seeds "
              f"(median {med['elastic']['wall_h']:.1f} h vs {med['skypilot-like']['wall_h']:.1f} h)")


if __name__ == "__main__":
    main()
