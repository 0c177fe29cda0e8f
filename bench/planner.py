"""Planning time for a large market: `plan()` over 10,000 offers (goal < 100 ms).

    python bench/planner.py [--offers 10000] [--repeat 7]

Offers: random clouds (3), regions (40), zones (3 per region), instance types (A100/H100/L4 ×
1/4/8 GPUs), spot prices 20-50 % of on-demand, risks 0-0.5 per hour; the recipe is
recipes/multi-cloud.yaml with spread_min 2. Prints the median and best of `--repeat` runs, and,
as the baseline measured in the same run, the time to sort the same quotes by price alone. Then
the same with budget.max_hours 1, which no world meets: the planner searches every world size
from world.replicas to world.max_replicas for one that would (its slowest path).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic.policy.market import Quote  # noqa: E402
from elastic.policy.planner import plan  # noqa: E402
from elastic.recipe.model import load_recipe  # noqa: E402
from providers.base import Offer  # noqa: E402


def market(n: int, rng: random.Random) -> list[Quote]:
    gpus = {"A100": 3000.0, "H100": 7500.0, "L4": 900.0}
    out = []
    for i in range(n):
        cloud = rng.choice(["aws", "gcp", "azure"])
        region = f"{cloud}-r{rng.randrange(40)}"
        gpu, count = rng.choice(list(gpus)), rng.choice([1, 4, 8])
        od = {"A100": 4.1, "H100": 11.0, "L4": 0.9}[gpu] * count * rng.uniform(0.9, 1.2)
        o = Offer(cloud=cloud, region=region, zone=f"{region}{'abc'[rng.randrange(3)]}", instance_type=f"{gpu}x{count}-{i % 7}",
                  gpu=gpu, gpus=count, cpus=12 * count, spot=True, usd_per_hour=od * rng.uniform(0.2, 0.5),
                  on_demand_usd_per_hour=od, read_at=0.0)
        out.append(Quote(o, rng.uniform(0, 0.5), "prior", rng.choice([None, 0, 2, 8])))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--offers", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    recipe = load_recipe(Path(__file__).resolve().parents[1] / "recipes/multi-cloud.yaml",
                         ["resources.max_usd_per_hour=null", "planner.spread_min=2",
                          "planner.tokens_per_s={A100: 3000, H100: 7500, L4: 900}"])
    quotes = market(args.offers, random.Random(0))
    deadline = recipe.model_copy(update={"budget": recipe.budget.model_copy(update={"max_hours": 1.0})})
    times, base, searched = [], [], []
    for _ in range(args.repeat):
        t = time.perf_counter()
        pl = plan(quotes, recipe)
        times.append(time.perf_counter() - t)
        t = time.perf_counter()
        sorted(quotes, key=lambda q: q.offer.usd_per_hour)
        base.append(time.perf_counter() - t)
        t = time.perf_counter()
        fast = plan(quotes, deadline)
        searched.append(time.perf_counter() - t)
    print(f"offers: {args.offers}, replicas placed: {len(pl.quotes)} in {len(set(q.offer.region for q in pl.quotes))} "
          f"region(s), ${pl.usd_per_mtok:.4f} per 1M tokens")
    print(f"plan(): median {statistics.median(times) * 1e3:.1f} ms, best {min(times) * 1e3:.1f} ms (goal < 100 ms)")
    print(f"baseline, sort by price alone: median {statistics.median(base) * 1e3:.1f} ms "
          f"(plan / sort = {statistics.median(times) / statistics.median(base):.1f}×)")
    print(f"plan() with budget.max_hours 1 (every size searched; {len(fast.quotes)} replicas, "
          f"{fast.expected_hours:.1f} h): median {statistics.median(searched) * 1e3:.1f} ms, "
          f"best {min(searched) * 1e3:.1f} ms (plan / sort = {statistics.median(searched) / statistics.median(base):.1f}×)")

if __name__ == "__main__":
    main()
