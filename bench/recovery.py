"""Recovery time after hard kills on the local cluster.

    python bench/recovery.py [--kills 8] [--replicas 3]

Runs the real driver on a local Ray cluster and hard-kills one replica's node (raylet and every
process on it, no notice) every few outer steps, during the inner phase. `recovery_s` is, for each
loss, the seconds from the kill to the next outer step the re-formed world completes (from the
ledger, as report.json computes it). Prints median and worst. Goal: median < 5 s.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=8)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--every", type=int, default=4, help="outer steps between kills")
    args = ap.parse_args()

    from elastic.recipe.model import load_recipe
    from elastic.run.cluster import LocalCluster
    from elastic.run.driver import run_attached
    from elastic.views.report import build_report

    recipe = load_recipe(REPO / "recipes/local-tiny.yaml", [
        f"world.replicas={args.replicas}", f"world.max_replicas={args.replicas}", "world.min_replicas=1",
        f"train.outer_steps={args.kills * args.every + 6}", "train.inner_steps=10", "checkpoint.every_outer_steps=0",
        "world.sync_timeout_s=5"])
    rng = random.Random(0)
    kills = []

    def faults(driver, phase, members):
        step = driver.world.outer_step + 1
        if phase == "inner" and step % args.every == 0 and len(kills) < args.kills and len(members) > 1:
            victim = driver.world.replicas[rng.choice(members)].instance_id
            kills.append(step)
            driver.provider.preempt(victim, notice=False)

    cluster = LocalCluster()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            status, events = run_attached(recipe, cluster, Path(tmp) / "run", on_phase=faults,
                                          run_name="bench-recovery")
    finally:
        cluster.shutdown()
    report = build_report(events)
    rec = report["recovery_s"]
    print(f"{len(kills)} hard kills ({args.replicas} replicas, H=10, local-tiny model); status {status}")
    print(f"recovery_s: median {statistics.median(rec):.2f} s, worst {max(rec):.2f} s   (goal: median < 5 s)")
    print(f"all: {rec}")


if __name__ == "__main__":
    main()
