"""A prototype, not the project's policy: the bound's shape played online, on the simulator.

    python bench/threshold_policy.py [--seeds 5] [--quantile-factor 2] [--traces A.csv B.csv] [--bounds F.json]

On the volatile traces the bound (`elastic.bound`) is bang-bang: it holds world.max_replicas VMs
through the cheapest one-to-four-hour spells of the market and nothing in between
(docs/benchmarks.md). This prototype does the same with only the past in hand:

- the market's price now is the planner's world of world.max_replicas (`planner.plan`), its USD
  per 1M useful tokens; one sample per 5 minutes is kept (the price history);
- the share of the time left the run must train is `need` = (tokens left at that world's pace, plus
  one boot) / (hours left to budget.max_hours), times `--quantile-factor` (slack for preemptions,
  dear spells that last, and a history that is not the future);
- it trains while the price now is at most the `need`-quantile θ of the history (1.3 θ once
  training: hysteresis), and always once `need` reaches 0.95; else it pauses: every VM leaves at its
  next step boundary (the driver would checkpoint there and resume from it);
- while it trains it is `policy.decide` sized at world.max_replicas, and a replica whose price per
  token passed 1.3 θ leaves at once when a launch is 25 % cheaper (boot spread over its life,
  `planner.launch_usd_per_mtok`); the world tops up where the planner says.

It keeps its history in the object (the pure policy has no such field) and reuses `policy.Release`
for a pause, so the simulator counts each VM it lets go as a move. What it would take in the
driver: a deliberate pause (a checkpoint, every VM released, not counted against
world.capacity_timeout_s) and the price history in the snapshot. Ratios are to the same bound as
`bench/policies.py`, against `elastic` (today's policy) in the same run; `--bounds` keeps them in a
JSON file between runs (a bound takes minutes).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import elastic.simulate as simulate_module  # noqa: E402
from elastic import policy  # noqa: E402
from elastic.bound import lower_bound_usd_per_mtok  # noqa: E402
from elastic.planner import Move, launch_usd_per_mtok, plan, run_tokens, usd_per_mtok  # noqa: E402
from elastic.recipe import load_recipe  # noqa: E402
from elastic.simulate import TraceMarket, simulate  # noqa: E402
from providers.simmarket import read_trace_rows  # noqa: E402

SAMPLE_S = 300.0       # one price sample per trace row
HYSTERESIS = 1.3       # once training, it goes on up to 1.3 θ
SAVING = 0.25          # a dear replica leaves when a launch is this much cheaper per token
MIN_SAMPLES = 12       # an hour of history before it ever pauses


class Threshold:
    """The prototype's state over one run: the price history and whether it trains."""

    def __init__(self, quantile_factor: float):
        self.factor = quantile_factor
        self.history: list[tuple[float, float]] = []
        self.training = True

    def decide(self, s: policy.Snapshot) -> list:
        r = s.recipe
        big = r.model_copy(update={"world": r.world.model_copy(update={"replicas": r.world.max_replicas})})
        quotes = [q for q in s.quotes if not policy.resting(s, q.key)]
        sized = dataclasses.replace(s, recipe=big, target_replicas=max(s.target_replicas, r.world.max_replicas))
        if not quotes:
            return policy.decide(sized)
        world = plan(quotes, big, n=r.world.max_replicas)
        if not self.history or s.time_s - self.history[-1][0] >= SAMPLE_S:
            self.history.append((s.time_s, world.usd_per_mtok))
        need_h = (max(0, run_tokens(r) - s.progress.tokens) / max(world.useful_tokens_per_s, 1e-9) / 3600
                  + r.planner.recovery_s / 3600)
        left_h = r.budget.max_hours - (s.time_s - s.started_s) / 3600
        need = min(1.0, self.factor * need_h / max(left_h, 1e-9))
        prices = sorted(p for _, p in self.history)
        theta = prices[min(len(prices) - 1, int(need * len(prices)))] if len(prices) >= MIN_SAMPLES else math.inf
        self.training = need >= 0.95 or world.usd_per_mtok <= theta * (HYSTERESIS if self.training else 1.0)
        live = [n for n in s.nodes if not n.leaving]
        if not self.training:
            return [policy.Release(n.instance_id, Move(n.quote, n.instance_id, 0.0, 0.0)) for n in live]
        cheapest = min(launch_usd_per_mtok(q, r) for q in world.quotes) if world.quotes else math.inf
        dear = [n for n in live if n.ready and need < 0.95 and usd_per_mtok(n.quote, r) > theta * HYSTERESIS
                and cheapest < usd_per_mtok(n.quote, r) * (1 - SAVING)]
        if dear:
            return [policy.Release(n.instance_id, Move(n.quote, n.instance_id, 0.0, 0.0)) for n in dear]
        return policy.decide(sized)


@contextlib.contextmanager
def threshold_policy(quantile_factor: float):
    """The simulator's `elastic` policy replaced by a fresh `Threshold` for the duration."""
    proto = Threshold(quantile_factor)
    saved = simulate_module.decide
    simulate_module.decide = proto.decide
    try:
        yield proto
    finally:
        simulate_module.decide = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default=str(ROOT / "recipes/multi-cloud.yaml"))
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--quantile-factor", type=float, default=2.0)
    ap.add_argument("--traces", nargs="+", type=Path, help="trace CSVs (default: bench/traces/*.csv)")
    ap.add_argument("--bounds", type=Path, help="JSON file of bounds by trace and recipe, read and extended")
    args = ap.parse_args()
    bounds = json.loads(args.bounds.read_text()) if args.bounds and args.bounds.exists() else {}
    # A deliberate pause has no replica: the simulator must not call it a capacity shortage.
    recipe = load_recipe(args.recipe, ["world.capacity_timeout_s=1e9"])
    print("| trace | bound | elastic: median (worst) | prototype: median (worst) | prototype wall h (max) | "
          "prototype USD (max) | completed |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for trace in args.traces or sorted((ROOT / "bench/traces").glob("*.csv")):
        key = f"{trace.resolve()}|{Path(args.recipe).resolve()}"
        if key not in bounds:
            bounds[key] = lower_bound_usd_per_mtok(recipe, TraceMarket(read_trace_rows(trace), recipe))
            if args.bounds:
                args.bounds.write_text(json.dumps(bounds, indent=1))
        bound = bounds[key]
        base, proto = [], []
        for seed in range(args.seeds):
            base.append(simulate(recipe, str(trace), ["elastic"], seed=seed)[0])
            with threshold_policy(args.quantile_factor):
                proto.append(simulate(recipe, str(trace), ["elastic"], seed=seed)[0])
        ratio = [[x["usd_per_mtok"] / bound if x["usd_per_mtok"] else math.inf for x in runs] for runs in (base, proto)]
        done = sum(x["status"] == "completed" for x in proto)
        print(f"| {trace.name} | {bound:.4f} | {statistics.median(ratio[0]):.3f} ({max(ratio[0]):.3f}) | "
              f"{statistics.median(ratio[1]):.3f} ({max(ratio[1]):.3f}) | "
              f"{statistics.median(x['wall_h'] for x in proto):.1f} ({max(x['wall_h'] for x in proto):.1f}) | "
              f"{statistics.median(x['cost_usd'] for x in proto):,.0f} ({max(x['cost_usd'] for x in proto):,.0f}) | "
              f"{done}/{len(proto)} |", flush=True)


if __name__ == "__main__":
    main()
