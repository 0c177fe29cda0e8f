"""Every policy on every trace, real and synthetic, over several seeds: did it finish by the deadline,
what it paid, and its ratio to the clairvoyant bound.

    python bench/real_markets.py [--seeds 5] [--traces A.csv ...] [--recipe R.yaml] [--set FIELD=VALUE ...]
                                 [--start-hours H ...] [--zone-pairs] [--policies NAME ...] [--hide-capacity]
                                 [--json FILE]

Traces and recipes: `bench/traces/real/*.csv` (AWS p3.2xlarge and p3.16xlarge markets measured for
Can't Be Late, NSDI'24; `bench/traces/convert_real.py`) with `bench/recipes/real-v100.yaml` (3 B
tokens within 72 h on 2-8 one-V100 replicas) or, for the 8-GPU VMs, `bench/recipes/real-v100x8.yaml`
(12 B tokens within 72 h on 1-4 replicas of 8 V100s), and `bench/traces/*.csv` (the synthetic
8-GPU markets of `bench/traces/make_traces.py`) with `recipes/multi-cloud.yaml`. `--traces` runs
other traces, each with the recipe of its folder (real/ or not; in real/, by the trace's GPUs per
VM) unless `--recipe` names one for all; `--set` overrides
recipe fields as `elastic simulate --set` does (e.g. world.capacity_timeout_s=259200).
`--start-hours H` runs each trace from H hours in instead of its start (every zone as it stood
then, time counted from there; several H: one window each, named `NAME@Hh`): windows of the real
traces that no policy was tuned on. `--zone-pairs` runs, instead of each trace, every market of two of
its zones in one region (each zone's rows as they are, the other zones left out): from
aws-v100-9zones, ten two-zone markets of one V100 VM per zone, the shape of aws-v100-2zones-2022
that no rule was tuned on. `--policies` runs only those of the registry (e.g. `elastic` alone, for
a sweep: a fifth of the time). `--hide-capacity` shows the policies no capacity, as AWS's and GCP's
offers carry none (the trace still refuses launches by it, and the bounds still know it): what a
real run on those clouds would learn only from refused launches.

Per trace and policy, over seeds 0..N-1 (the preemption draws): how many runs completed (the whole
token budget within budget.max_hours and budget.max_usd), how the others ended (status, at which
simulated hour), and medians of USD, USD per 1M tokens and the ratio to the bound
(`elastic.sim.simulate.bound_usd_per_mtok`: the least any policy could pay on the trace, every price
known in advance; "none" when no policy can finish in time), and the ratio to the bound that holds
to world.min_replicas (`min_replicas_bound_usd_per_mtok`: the least a policy pays that trains only
in worlds of world.min_replicas replicas, boots and preemptions priced, or the floor of whole worlds
without boots if higher; `elastic.sim.bound`). USD per 1M tokens and the ratio are
of the completed runs only: a run that stopped early paid for fewer tokens, and its ratio would say
nothing about the deadline it missed. USD here is the bill before the clouds' refunds (`list_usd`:
AWS bills nothing for a spot VM EC2 interrupts in its first hour, `elastic.record.billing.free`),
the bill the bounds price: with the refund in, a policy that knew when a zone would drop could run
every VM in the hour before and pay almost nothing (docs/benchmarks.md, session 39), so a bound of
that bill would say nothing of a policy that does not. The last column is the refunds (median):
the invoice is USD less them. Uses `elastic.sim.simulate`'s public `simulate` and
`bound_usd_per_mtok` only.
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elastic.policy.registry import POLICIES  # noqa: E402
from elastic.recipe.model import load_recipe  # noqa: E402
from elastic.sim.simulate import bound_usd_per_mtok, min_replicas_bound_usd_per_mtok, simulate  # noqa: E402

REAL_RECIPE = ROOT / "bench" / "recipes" / "real-v100.yaml"
REAL_RECIPE_8 = ROOT / "bench" / "recipes" / "real-v100x8.yaml"
SYNTHETIC_RECIPE = ROOT / "recipes" / "multi-cloud.yaml"


def default_traces() -> list[Path]:
    """The real traces, then the synthetic ones."""
    traces = ROOT / "bench" / "traces"
    return sorted((traces / "real").glob("*.csv")) + sorted(traces.glob("*.csv"))


def recipe_for(trace: Path) -> Path:
    """The recipe a trace is run with: for real/, the one-V100 recipe, or the 8 x V100 one where the
    trace's VMs have 8 GPUs; the 8-GPU multi-cloud one otherwise."""
    if trace.resolve().parent.name != "real":
        return SYNTHETIC_RECIPE
    with open(trace, newline="", encoding="utf-8") as f:
        first = next(csv.DictReader(f), None)
    return REAL_RECIPE_8 if first is not None and int(first["gpus"]) == 8 else REAL_RECIPE


def run_trace(recipe_path: Path, trace: Path, seeds: int, overrides: list[str],
              policies: list[str] | None = None, capacity_seen: bool = True) -> dict:
    """{"recipe", "trace", "bound_usd_per_mtok", "runs": {policy: [result per seed]}} (`policies`:
    the registry's names to run; None: every one; `capacity_seen`: `simulate`'s)."""
    recipe = load_recipe(recipe_path, overrides)
    runs: dict[str, list[dict]] = collections.defaultdict(list)
    for seed in range(seeds):
        for r in simulate(recipe, str(trace), policies, seed, capacity_seen=capacity_seen):
            runs[r["policy"]].append(r)
    return {"recipe": str(recipe_path.relative_to(ROOT)) if recipe_path.is_relative_to(ROOT) else str(recipe_path),
            "trace": str(trace), "bound_usd_per_mtok": bound_usd_per_mtok(recipe, str(trace)),
            "min_replicas_bound_usd_per_mtok": min_replicas_bound_usd_per_mtok(recipe, str(trace)), "runs": dict(runs)}


def window(trace: Path, start_h: float, folder: Path) -> Path:
    """The trace from `start_h` hours in, written into `folder/<the trace's folder name>/` (so
    `recipe_for` still tells real from synthetic): each zone's row in effect then at 0, every later
    row `start_h` hours earlier."""
    with open(trace, newline="", encoding="utf-8") as f:
        rows_in = list(csv.DictReader(f))
    start_s = start_h * 3600
    in_effect: dict[tuple[str, str], dict] = {}
    later = []
    for r in rows_in:
        if float(r["timestamp_s"]) <= start_s:
            in_effect[(r["zone"], r["instance_type"])] = r
        else:
            later.append(r)
    out_rows = [{**r, "timestamp_s": "0"} for r in in_effect.values()] + \
               [{**r, "timestamp_s": f"{float(r['timestamp_s']) - start_s:g}"} for r in later]
    out_rows.sort(key=lambda r: (float(r["timestamp_s"]), r["zone"], r["instance_type"]))
    return _write(folder / trace.resolve().parent.name / f"{trace.stem}@{start_h:g}h.csv", out_rows)


def zone_pairs(trace: Path, folder: Path) -> list[Path]:
    """Every market of two zones of `trace` in one region, written into `folder/<the trace's folder
    name>/` as `<trace>-<zone>+<zone>.csv`: the rows of those two zones, unchanged."""
    with open(trace, newline="", encoding="utf-8") as f:
        rows_in = list(csv.DictReader(f))
    zones = sorted({(r["region"], r["zone"]) for r in rows_in})
    out = []
    for i, (region, a) in enumerate(zones):
        for other_region, b in zones[i + 1:]:
            if other_region != region:
                continue
            out.append(_write(folder / trace.resolve().parent.name / f"{trace.stem}-{a}+{b}.csv",
                              [r for r in rows_in if r["zone"] in (a, b)]))
    return out


def _write(path: Path, rows: list[dict]) -> Path:
    """A trace CSV of `rows` (dicts of the trace's columns, in order) at `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, list(rows[0]), lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    return path


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def rows(result: dict) -> list[str]:
    """Markdown rows of one trace's table (one per policy)."""
    bound, floor = result["bound_usd_per_mtok"], result["min_replicas_bound_usd_per_mtok"]
    out = []
    for policy in [p for p in POLICIES if p in result["runs"]]:
        rs = result["runs"][policy]
        done = [r for r in rs if r["status"] == "completed"]
        ended = collections.Counter(r["status"] for r in rs if r["status"] != "completed")
        other = ", ".join(
            f"{status} ×{n} (at {statistics.median(r['wall_h'] for r in rs if r['status'] == status):.1f} h)"
            for status, n in sorted(ended.items()))
        usd = _median([r["list_usd"] for r in rs])
        per_mtok = _median([r["list_usd_per_mtok"] for r in done])
        ratio = _median([r["list_usd_per_mtok"] / bound for r in done]) if bound else None
        worst = max((r["list_usd_per_mtok"] / bound for r in done), default=None) if bound else None
        to_floor = _median([r["list_usd_per_mtok"] / floor for r in done]) if floor else None
        wall = _median([r["wall_h"] for r in done])
        refunded = _median([r["list_usd"] - r["cost_usd"] for r in rs])
        out.append(f"| {Path(result['trace']).name} | {policy} | {len(done)}/{len(rs)} | {other or '-'} | {usd:.2f} | "
                   f"{_fmt(per_mtok, 4)} | {_fmt(ratio, 2)} | {_fmt(worst, 2)} | {_fmt(to_floor, 2)} | {_fmt(wall, 1)} "
                   f"| {refunded:.2f} |")
    return out


def _fmt(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1 of the preemption draws")
    ap.add_argument("--traces", nargs="+", type=Path,
                    help="trace CSVs (default: bench/traces/real/*.csv, bench/traces/*.csv)")
    ap.add_argument("--recipe", type=Path, help="one recipe for every trace (default: by the trace's folder)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD.PATH=VALUE",
                    help="override a recipe field (repeatable)")
    ap.add_argument("--start-hours", type=float, nargs="+", default=[0.0], metavar="H",
                    help="run each trace from H hours in (one window per H; default: its start)")
    ap.add_argument("--zone-pairs", action="store_true",
                    help="run every two-zone market of each trace's zones in one region instead of the trace")
    ap.add_argument("--policies", nargs="+", choices=list(POLICIES), metavar="NAME",
                    help=f"run only these policies (of {', '.join(POLICIES)}; default: every one)")
    ap.add_argument("--hide-capacity", action="store_true",
                    help="do not show the policies the traces' capacity, as AWS and GCP show none (the bounds "
                         "still know it)")
    ap.add_argument("--json", type=Path, help="also write every run's figures here")
    args = ap.parse_args()
    print("| trace | policy | completed | other ends (median hour) | USD, median | USD / 1M tok (completed) "
          "| ratio to bound, median | worst | ratio to the min_replicas bound, median | hours (completed) "
          "| refunded USD, median |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    results = []
    with tempfile.TemporaryDirectory(prefix="real-markets-") as windows:
        traces = args.traces or default_traces()
        if args.zone_pairs:
            traces = [pair for t in traces for pair in zone_pairs(t, Path(windows) / "pairs")]
        for trace in traces:
            for start_h in args.start_hours:
                run = window(trace, start_h, Path(windows)) if start_h else trace
                result = run_trace((args.recipe or recipe_for(trace)).resolve(), run, args.seeds, args.overrides,
                                   args.policies, capacity_seen=not args.hide_capacity)
                results.append(result)
                print("\n".join(rows(result)), flush=True)
    for result in results:
        bound = result["bound_usd_per_mtok"]
        floor = result["min_replicas_bound_usd_per_mtok"]
        print(f"bound, {Path(result['trace']).name} ({result['recipe']}): "
              + ("none (no policy can finish in time)" if bound is None else f"{bound:.4f} USD / 1M tok")
              + ("" if floor is None else f"; with world.min_replicas, {floor:.4f}"))
    if args.json:
        doc = {"seeds": args.seeds, "overrides": args.overrides, "capacity_seen": not args.hide_capacity,
               "results": results}
        args.json.write_text(json.dumps(doc, indent=1))


def run_cli(main) -> None:
    """Run a bench script's `main`: a trace or recipe it cannot read is said in one line on stderr
    (exit 2), as the CLI says it, not as a traceback."""
    from elastic.errors import UserError, first_line
    from providers.simmarket import TraceError

    try:
        sys.exit(main())
    except (UserError, TraceError, OSError) as exc:
        print(f"error: {first_line(exc)}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    run_cli(main)
