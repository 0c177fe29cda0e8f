"""Goodput under churn: tokens/s of a run whose nodes are preempted, against what its surviving
capacity gives without churn, measured in the same run.

    python bench/churn.py [--outer-steps 60] [--preempt-per-hour 2.0]

1. Churn run: recipes/local-preemptible.yaml (3 replicas, simulated market at the stated rate per
   node-hour of simulated time, 60× compression, half with a 2-minute notice). From the ledger: trained
   tokens over the wall time from the first step's start to the last step's end, and how long the
   world trained with 1, 2, 3 replicas.
2. Baselines: the same model without churn at 1, 2 and 3 replicas, tokens/s each.
3. goodput = churn tokens/s ÷ Σ_k (share of time at k replicas × baseline tokens/s at k).
Goal ≥ 0.9. Prints figures; passes or fails nothing.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def run(recipe, cluster):
    from elastic.record.events import OuterStep
    from elastic.run.driver import run_attached
    from elastic.views.report import build_report

    with tempfile.TemporaryDirectory() as tmp:
        _, events = run_attached(recipe, cluster, Path(tmp) / "run", run_name="bench-churn")
    steps = [e for e in events if e["type"] == OuterStep.TYPE]
    start = steps[0]["t"] - steps[0]["inner_s"] - steps[0]["sync_s"]
    wall = steps[-1]["t"] - start
    tokens = sum(e["tokens"] for e in steps)
    at = {}
    prev = start
    for e in steps:
        at[len(e["replicas"])] = at.get(len(e["replicas"]), 0.0) + (e["t"] - prev)
        prev = e["t"]
    return tokens / wall, at, build_report(events)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--outer-steps", type=int, default=60)
    ap.add_argument("--baseline-steps", type=int, default=12)
    ap.add_argument("--preempt-per-hour", type=float, default=2.0)
    args = ap.parse_args()

    from elastic.recipe.model import load_recipe
    from elastic.run.cluster import LocalCluster

    base = REPO / "recipes/local-preemptible.yaml"
    cluster = LocalCluster()
    try:
        churn = load_recipe(base, [f"train.outer_steps={args.outer_steps}", "checkpoint.every_outer_steps=0",
                                   f"local.market.preempt_per_hour={args.preempt_per_hour}"])
        tps, at, report = run(churn, cluster)
        baseline = {}
        for k in sorted(at):
            calm = load_recipe(base, [f"train.outer_steps={args.baseline_steps}", "checkpoint.every_outer_steps=0",
                                      "local.market.preempt_per_hour=0", f"world.replicas={k}",
                                      "world.min_replicas=1", f"world.max_replicas={max(k, 1)}"])
            baseline[k] = run(calm, cluster)[0]
    finally:
        cluster.shutdown()
    total = sum(at.values())
    expected = sum(at[k] / total * baseline[k] for k in at)
    print(f"churn: {report['preemptions']} preemptions ({report['preemptions_with_notice']} with notice) at "
          f"{args.preempt_per_hour}/node-hour simulated (60× compressed), {report['joins']} joins, "
          f"{args.outer_steps} outer steps, H={churn.train.inner_steps}")
    print("time at world size: " + ", ".join(f"{k} replica(s) {at[k] / total:.0%}" for k in sorted(at)))
    print("baseline tokens/s without churn: " + ", ".join(f"{k}: {baseline[k]:,.0f}" for k in sorted(baseline)))
    print(f"churn tokens/s {tps:,.0f} vs surviving capacity without churn {expected:,.0f}")
    print(f"goodput: {tps / expected:.3f}   (goal ≥ 0.9)   effective_training_time {report['effective_training_time']}")


if __name__ == "__main__":
    main()
