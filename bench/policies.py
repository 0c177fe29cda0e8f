"""The simulator over the shipped traces: USD per 1M tokens and finish time of each policy.

    python bench/policies.py [--recipe recipes/multi-cloud.yaml] [--seeds 20] [--traces A.csv B.csv] [--ratios-only]
                             [--explain] [--bounds FILE]

Each trace's table ends with every policy's ratio to the bound (median and worst over the seeds,
and ours seed by seed), ours also with its pause rule switched (`planner.pauses`; off by default, a
steady world of world.replicas): issue 16 asks `elastic` for at most 1.15 on every trace, which no
policy that does not see the future can promise (`bench/foresight.py`). `--ratios-only`
leaves out the deadline variant and the extra bounds (a bound takes about a minute per trace);
`--traces` runs other traces than bench/traces/*.csv (`bench/traces/make_traces.py --storms-seed N
--out DIR` writes unseen ones). `--explain` adds, per trace, where `elastic`'s excess over the bound
goes (`explain`); `--foresight-h H` adds the same policy told each offer's mean price over the next H
hours (`Foresight`: what price information alone would buy it).

Goals (issue 7): `elastic` ≤ 0.33 × `on-demand` and ≤ 0.8 × `skypilot-like` in USD per 1M tokens,
finishing no later than `skypilot-like`. Each trace is run with seeds 0..N-1 (the preemption draws);
the table shows medians, the ratios are of the medians, and the per-seed ratios' worst is shown too.

Next to the policies: ours again with budget.max_hours set to skypilot-like's median finish (the
planner then buys speed: faster GPUs or more replicas); and the least any policy could pay on that
trace (`elastic.sim.bound.lower_bound_usd_per_mtok`: every price known in advance, but every VM's boot
and the trace's preemptions paid), within the recipe's budget.max_hours and by skypilot-like's
finish, and the first again with boots free (planner.recovery_s 0), to show what they cost.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elastic.policy.market import recipe_tokens_per_s  # noqa: E402
from elastic.policy.planner import allowed  # noqa: E402
from elastic.policy.registry import POLICIES  # noqa: E402
from elastic.recipe.model import load_recipe  # noqa: E402
from elastic.record import billing  # noqa: E402
from elastic.record.events import NodeLaunched, NodePreempted, NodeReleased  # noqa: E402
from elastic.sim.bound import lower_bound_usd_per_mtok  # noqa: E402
from elastic.sim.simulate import TraceMarket, simulate  # noqa: E402
from providers.simmarket import read_trace_rows  # noqa: E402


def ratios(runs: list[dict], bound: float) -> None:
    """Each policy's USD per 1M tokens over the bound: median and worst seed (a run that trained
    nothing counts as inf); ours seed by seed. `runs` may hold more policies than POLICIES
    (`variant`: ours with the pause rule switched)."""
    def ratio(r):
        return r["list_usd_per_mtok"] / bound if r["list_usd_per_mtok"] and bound else math.inf

    print("| policy | ratio to bound, median | worst seed | within 1.15× | completed |")
    print("| --- | --- | --- | --- | --- |")
    for p in list(POLICIES) + [p for p in runs[0] if p not in POLICIES]:
        rs = [ratio(run[p]) for run in runs]
        done = sum(run[p]["status"] == "completed" for run in runs)
        print(f"| {p} | {statistics.median(rs):.3f} | {max(rs):.3f} | {sum(x <= 1.15 for x in rs)}/{len(rs)} | "
              f"{done}/{len(rs)} |")
    print("elastic / bound by seed: " + " ".join(f"{ratio(run['elastic']):.3f}" for run in runs))


def _floor_usd_per_token(recipe, market: TraceMarket, t: float, n: int) -> float:
    """USD per nominal token of the n cheapest VMs per token the trace offers at `t` (capacity
    kept, risk and boots ignored): what tracking the market's cheapest offers would pay then."""
    offers = sorted(((o.usd_per_hour / recipe_tokens_per_s(o, recipe.planner), o)
                     for o in market.offers(t, recipe.resources.spot) if allowed(o, recipe.resources)),
                    key=lambda x: x[0])
    usd = tps = 0.0
    for _, o in offers:
        k = min(n, o.capacity if o.capacity is not None else n)
        usd, tps, n = usd + k * o.usd_per_hour, tps + k * recipe_tokens_per_s(o, recipe.planner), n - k
        if n <= 0:
            break
    return usd / 3600 / tps if tps else math.inf


def explain(recipe, market: TraceMarket, result: dict, events: list[dict], kept: list, bound: float) -> dict:
    """Where one `elastic` run's USD per token goes, as factors whose product is its ratio to the
    bound: `waste` = spend / spend on kept outer steps (of the spend: `boot` on VMs booting and
    joining, `lost` on the rest: work a preemption took, waiting for a world, draining);
    `pace` = nominal tokens of the kept steps (each member at its own speed for the whole step) /
    tokens credited (slowest member sets the pace, outer syncs); `choice` = USD per nominal token
    paid in the kept steps / what the same number of the cheapest VMs then would pay (`_floor_...`);
    `timing` = that floor / the bound (training when the market is dear, where the bound, knowing
    every price, trains in its dips)."""
    boot_s = recipe.planner.recovery_s
    ends = {e["instance_id"]: e["t"] for e in events if e["type"] in (NodePreempted.TYPE, NodeReleased.TYPE)}
    boot_usd = 0.0
    for e in events:
        if e["type"] == NodeLaunched.TYPE:
            o = SimpleNamespace(zone=e["zone"], instance_type=e["instance_type"], spot=e["spot"])
            t0 = e["launched_at"]
            stop = ends.get(e["instance_id"], result["wall_h"] * 3600)
            boot_usd += billing.usd_between(market.segments(o, t0, stop), stop, t0, t0 + boot_s)
    kept_usd = nominal = floor_usd = 0.0
    for start, end, offers, _ in kept:
        row = 300.0
        for o in offers:
            kept_usd += billing.usd_between(market.segments(o, start, end), end, start, end)
        step_tps = sum(recipe_tokens_per_s(o, recipe.planner) for o in offers)
        nominal += step_tps * (end - start)
        t = start
        while t < end:   # the floor row by row (the trace's rows are 5 minutes)
            until = min(end, (t // row + 1) * row)
            floor_usd += _floor_usd_per_token(recipe, market, t, len(offers)) * step_tps * (until - t)
            t = until
    cost, tokens = result["list_usd"], result["tokens"]
    return {"ratio": cost / tokens * 1e6 / bound, "boot": boot_usd / cost, "lost": (cost - kept_usd - boot_usd) / cost,
            "waste": cost / kept_usd, "pace": nominal / tokens, "choice": kept_usd / floor_usd,
            "timing": floor_usd / nominal * 1e6 / bound}


class Foresight(TraceMarket):
    """The trace as a market whose spot prices, as the policy reads them, are each offer's mean price
    over the next `horizon_s` (clairvoyant quotes); VMs still bill the trace's prices (`segments`).
    What knowing the next hours' prices would buy the same policy."""

    def __init__(self, rows, recipe, horizon_s: float):
        super().__init__(rows, recipe)
        self.horizon_s = horizon_s

    def state(self, zone: str, instance_type: str, t: float):
        st = super().state(zone, instance_type, t)
        segments = self.segments(SimpleNamespace(zone=zone, instance_type=instance_type, spot=True), t,
                                 t + self.horizon_s)
        usd = billing.usd_between(segments, t + self.horizon_s, t, t + self.horizon_s) * 3600 / self.horizon_s
        return dataclasses.replace(st, spot_usd_per_hour=usd)


def explain_table(recipe, trace: Path, seeds: int, bound: float, foresight_h: float | None = None) -> None:
    """`explain` for `elastic` seed by seed, medians printed; with `foresight_h`, the same policy
    quoted the next hours' mean prices (`Foresight`)."""
    rows_in = read_trace_rows(trace)
    views = [("", TraceMarket(rows_in, recipe))]
    if foresight_h:
        views.append((f", quoted the mean price of the next {foresight_h:g} h", Foresight(rows_in, recipe, foresight_h * 3600)))
    for label, market in views:
        rows = []
        for s in range(seeds):
            ledgers, kept = {}, {}
            r = simulate(recipe, str(trace), ["elastic"], seed=s, ledgers=ledgers, kept=kept, market=market)[0]
            rows.append(explain(recipe, views[0][1], r, ledgers["elastic"], kept["elastic"], bound))   # true prices
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(f"elastic{label}: ratio = waste × pace × choice × timing (medians over seeds): "
              f"{med['ratio']:.3f} (worst {max(r['ratio'] for r in rows):.3f}) = waste {med['waste']:.3f} "
              f"(boot {med['boot']:.1%}, lost/idle {med['lost']:.1%} of spend) × pace {med['pace']:.3f} × "
              f"choice {med['choice']:.3f} × timing {med['timing']:.3f}")


def variant(recipe):
    """Ours with the pause rule switched (`planner.pauses`), as (name, recipe); None without
    budget.max_hours (the rule needs a deadline)."""
    if recipe.budget.max_hours is None:
        return None
    on = not recipe.planner.pauses
    return (f"elastic, planner.pauses {str(on).lower()}",
            recipe.model_copy(update={"planner": recipe.planner.model_copy(update={"pauses": on})}))


def report(recipe, trace: Path, seeds: int, ratios_only: bool = False, explain_too: bool = False,
           foresight_h: float | None = None, bounds: dict | None = None) -> None:
    runs = [{r["policy"]: r for r in simulate(recipe, str(trace), seed=s)} for s in range(seeds)]
    other = variant(recipe)
    if other is not None:
        for s, run in enumerate(runs):
            run[other[0]] = simulate(other[1], str(trace), ["elastic"], seed=s)[0]
    name = trace.relative_to(ROOT / "bench/traces") if trace.is_relative_to(ROOT / "bench/traces") else trace
    print(f"\n{name} ({seeds} seeds, medians)")
    print("| policy | USD/1M tok | wall h | USD | preemptions | moves | effective | completed |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    med = {}
    for p in POLICIES:
        rs = [run[p] for run in runs]
        m = {k: statistics.median(r[k] for r in rs) for k in ("list_usd_per_mtok", "wall_h", "list_usd", "preemptions",
                                                               "moves", "effective_training_time")}
        med[p] = m
        done = sum(r["status"] == "completed" for r in rs)
        print(f"| {p} | {m['list_usd_per_mtok']:.4f} | {m['wall_h']:.1f} | {m['list_usd']:,.0f} | {m['preemptions']:g} | "
              f"{m['moves']:g} | {m['effective_training_time']:.3f} | {done}/{len(rs)} |")
    market = TraceMarket(read_trace_rows(trace), recipe)
    key = f"{trace}|{recipe.model_dump_json()}"
    bound = (bounds or {}).get(key)
    if bound is None:
        bound = lower_bound_usd_per_mtok(recipe, market)
        if bounds is not None:
            bounds[key] = bound
    if ratios_only:
        print(f"| (bound: prices foreseen, boots and preemptions paid) | {bound:.4f} | | | | | | |")
        ratios(runs, bound)
        if explain_too:
            explain_table(recipe, trace, seeds, bound, foresight_h)
        return
    sky = med["skypilot-like"]["list_usd_per_mtok"]
    timed = lower_bound_usd_per_mtok(recipe, market, finish_h=med["skypilot-like"]["wall_h"])
    free_boots = recipe.model_copy(update={"planner": recipe.planner.model_copy(update={"recovery_s": 0.0})})
    loose = lower_bound_usd_per_mtok(free_boots, market)
    # Ours again, told to finish by skypilot-like's median finish (the planner buys speed for it).
    deadline_h = med["skypilot-like"]["wall_h"]
    timely = recipe.model_copy(update={"budget": recipe.budget.model_copy(update={"max_hours": deadline_h})})
    rs = [simulate(timely, str(trace), ["elastic"], seed=s)[0] for s in range(seeds)]
    med["elastic, deadline"] = m = {k: statistics.median(r[k] for r in rs) for k in ("list_usd_per_mtok", "wall_h", "list_usd")}
    done = sum(r["status"] == "completed" for r in rs)
    print(f"| elastic, budget.max_hours {deadline_h:.1f} | {m['list_usd_per_mtok']:.4f} | {m['wall_h']:.1f} | "
          f"{m['list_usd']:,.0f} | {statistics.median(r['preemptions'] for r in rs):g} | "
          f"{statistics.median(r['moves'] for r in rs):g} | "
          f"{statistics.median(r['effective_training_time'] for r in rs):.3f} | {done}/{len(rs)} |")
    print(f"| (bound: prices foreseen, boots and preemptions paid) | {bound:.4f} | | | | | | |")
    print(f"| (bound, finishing by skypilot-like's {med['skypilot-like']['wall_h']:.1f} h) | {timed:.4f} | | | | | | |")
    od = med["elastic"]["list_usd_per_mtok"] / med["on-demand"]["list_usd_per_mtok"]
    vs_sky = med["elastic"]["list_usd_per_mtok"] / sky
    worst_od = max(run["elastic"]["list_usd_per_mtok"] / run["on-demand"]["list_usd_per_mtok"] for run in runs)
    worst_sky = max(run["elastic"]["list_usd_per_mtok"] / run["skypilot-like"]["list_usd_per_mtok"] for run in runs)
    later = sum(run["elastic"]["wall_h"] > run["skypilot-like"]["wall_h"] for run in runs)
    print(f"elastic / on-demand: {od:.3f} (worst seed {worst_od:.3f}; goal <= 0.33)")
    print(f"elastic / skypilot-like: {vs_sky:.3f} (worst seed {worst_sky:.3f}; goal <= 0.8)")
    print(f"bound / skypilot-like: {bound / sky:.3f} (the least any policy could reach); "
          f"finishing no later: {timed / sky:.3f}; with free boots: {loose / sky:.3f}")
    print(f"elastic finished later than skypilot-like in {later} of {len(runs)} seeds "
          f"(median {med['elastic']['wall_h']:.1f} h vs {med['skypilot-like']['wall_h']:.1f} h)")
    d = med["elastic, deadline"]
    print(f"elastic with budget.max_hours {deadline_h:.1f}: {d['list_usd_per_mtok'] / sky:.3f} of skypilot-like's USD per "
          f"1M tokens, done in {d['wall_h']:.1f} h")
    ratios(runs, bound)
    if explain_too:
        explain_table(recipe, trace, seeds, bound, foresight_h)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default=str(ROOT / "recipes/multi-cloud.yaml"))
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--traces", nargs="+", type=Path, help="trace CSVs (default: bench/traces/*.csv)")
    ap.add_argument("--ratios-only", action="store_true", help="only the policies and their ratios to the bound")
    ap.add_argument("--explain", action="store_true", help="where elastic's excess over the bound goes, per trace")
    ap.add_argument("--foresight-h", type=float, help="with --explain: also elastic quoted the next H hours' mean prices")
    ap.add_argument("--bounds", type=Path, help="JSON file keeping each trace's bound between runs (a bound takes "
                                                "about a minute; the key is the trace and the whole recipe)")
    args = ap.parse_args()
    recipe = load_recipe(args.recipe, args.overrides)
    bounds = json.loads(args.bounds.read_text()) if args.bounds and args.bounds.exists() else {}
    for trace in args.traces or sorted((ROOT / "bench/traces").glob("*.csv")):
        report(recipe, trace.resolve(), args.seeds, args.ratios_only, args.explain, args.foresight_h, bounds)
        if args.bounds:
            args.bounds.write_text(json.dumps(bounds, indent=1))

if __name__ == "__main__":
    main()
