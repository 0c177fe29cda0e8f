"""`elastic prices`, `elastic plan` and `elastic down`: what the clouds offer now, where a recipe
would rent now, and terminating what runs left behind. Generic over `providers.PROVIDERS`; no cloud
SDK is imported here."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from elastic.errors import UserError
from elastic.policy.market import Market, load_history, load_throughput, workload_key
from elastic.policy.planner import Placement, plan
from elastic.recipe.model import Recipe, format_errors
from elastic.views.termout import plain_console
from providers.base import Offer


def cloud_names() -> list[str]:
    """Every registered cloud provider whose module is present (not `local`)."""
    from providers import PROVIDERS, available

    return [n for n in PROVIDERS if n != "local" and available(n)]


def _configured(name: str) -> str | None:
    from providers import provider_class

    return provider_class(name).configured()


def _pseudo_recipe(name: str, clouds: list[str], **resources) -> Recipe:
    """A recipe that only says what to rent, for commands that do not train."""
    try:
        return Recipe.model_validate({"name": name, "resources": {"clouds": clouds, **resources}})
    except Exception as exc:  # pydantic's message, first line per problem
        from pydantic import ValidationError

        if isinstance(exc, ValidationError):
            raise UserError(format_errors("arguments", exc)) from None
        raise


def price_rows(cloud: str | None, accelerator: str, regions: list[str], on_demand: bool = False) -> list[dict]:
    """Offers of every cloud asked (or configured), as dicts with `usd_per_gpu_hour`, cheapest per
    GPU-hour first."""
    from providers import build

    if cloud is not None:
        names = [cloud]
    else:
        names = [n for n in cloud_names() if _configured(n) is None]
        if not names:
            why = "; ".join(f"{n}: {_configured(n)}" for n in cloud_names())
            raise UserError(f"no cloud is configured ({why}); or pass --cloud local for the simulated market")
    rows = []
    gpus = int(accelerator.partition(":")[2]) if accelerator.partition(":")[2].isdigit() else 1
    for name in names:
        try:
            recipe = _pseudo_recipe("prices", [name], accelerators=accelerator, regions=regions, spot=not on_demand)
            provider = build(name, recipe, None, "prices")
            try:
                offers = provider.offers(recipe.resources)
            finally:
                provider.close()
        except UserError as exc:   # said of the flags given, not of a recipe's fields
            raise UserError([_as_flags(line) for line in exc.lines]) from None
        for o in offers:
            if o.gpus < gpus:   # the local market's CPU nodes stand in for GPU VMs in runs, not here
                continue
            row = o.to_dict()
            row["usd_per_gpu_hour"] = round(o.usd_per_hour / max(1, o.gpus), 6)
            rows.append(row)
    return sorted(rows, key=lambda r: (r["usd_per_gpu_hour"], r["usd_per_hour"], r["region"], r["zone"]))


def _as_flags(line: str) -> str:
    """A problem with `prices`' pseudo-recipe, named by the flag that set the field."""
    line = line.removeprefix("arguments: ")
    return line.replace("resources.accelerators", "--accelerator").replace("resources.regions", "--region")


def prices(args, out) -> int:
    from providers import cloud as cloud_common

    if args.refresh:
        cloud_common.set_refresh(True)
    rows = price_rows(args.cloud, args.accelerator, args.region, on_demand=args.on_demand)
    if args.json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return 0
    if not rows:
        local = " (local nodes have GPUs only where local.instance_types gives them gpus)" if args.cloud == "local" else ""
        raise UserError(f"no offer for {args.accelerator} in "
                        f"{', '.join(args.region) if args.region else 'any region'}{local}")
    from datetime import datetime, timezone

    from rich.table import Table

    read = min(r["read_at"] for r in rows)
    when = datetime.fromtimestamp(read, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    kind = "on-demand" if args.on_demand else "spot"
    t = Table(title=f"{args.accelerator} {kind} offers, cheapest per GPU-hour first (prices read {when})",
              title_justify="left")
    for col in ("cloud", "region", "zone", "instance type", "GPUs", "vCPUs", "$/h", "$/GPU-h", "on-demand $/h"):
        t.add_column(col, justify="right" if col in ("vCPUs",) or "$" in col else "left", no_wrap=True)
    for r in rows:
        t.add_row(r["cloud"], r["region"], r["zone"], r["instance_type"], f"{r['gpus']}×{r['gpu']}" if r["gpus"] else "-",
                  str(r["cpus"]), _usd(r["usd_per_hour"]), _usd(r["usd_per_gpu_hour"]), _usd(r["on_demand_usd_per_hour"]))
    plain_console(out).print(t)
    return 0


def _usd(x: float) -> str:
    return f"{x:.4f}" if x >= 0.01 or x == 0 else f"{x:.6f}"


# -- elastic plan -----------------------------------------------------------------------------------

def live_offers(recipe: Recipe) -> list[Offer]:
    """Offers of every cloud the recipe enables, read now (no cluster needed)."""
    from providers import build

    out: list[Offer] = []
    for name in recipe.resources.clouds:
        provider = build(name, recipe, None, recipe.name)
        try:
            out.extend(provider.offers(recipe.resources))
        finally:
            provider.close()
    return out


def plan_now(recipe: Recipe) -> Placement | None:
    """The placement `elastic plan` shows: live offers, risk from the preemption history, speed
    from the throughput history of this workload. None when no offer matches."""
    offers = live_offers(recipe)
    if not offers:
        return None
    t = recipe.train
    market = Market(recipe.planner, load_history(), tokens_per_inner_step=t.batch_size * t.seq_len,
                    measured_before=load_throughput(workload_key(recipe)))
    return plan(market.quotes(offers, time.time()), recipe)


def budget_shortfall(recipe: Recipe) -> str | None:
    """Why `elastic launch` refuses `recipe`, in one line: the plan `elastic plan` shows (the
    cheapest world that meets the deadline) is expected to cost more than `budget.max_usd`, or to
    take longer than `budget.max_hours`, to train the recipe's tokens. None when it fits, when
    neither limit is set, or when no plan can be made now (no offer; a cloud not answering: the
    run's start says so)."""
    b = recipe.budget
    if b.max_usd is None and b.max_hours is None:
        return None
    try:
        placement = plan_now(recipe)
    except Exception:   # the launch goes on; `_record_plan` logs why no plan was made
        return None
    if placement is None or not placement.quotes:
        return None
    ask = ("; raise it, train fewer tokens (train.outer_steps, train.token_budget), or pass --allow-partial "
           "to train until the budget runs out")
    if b.max_usd is not None and placement.expected_usd > b.max_usd:
        return (f"budget.max_usd (${b.max_usd:,.2f}) covers {_share(b.max_usd / placement.expected_usd)} of the "
                f"${placement.expected_usd:,.2f} `elastic plan` expects the recipe's "
                f"{placement.tokens_needed:,} tokens to cost{ask}")
    if b.max_hours is not None and placement.expected_hours > b.max_hours:
        return (f"budget.max_hours ({b.max_hours:g} h) covers {_share(b.max_hours / placement.expected_hours)} of the "
                f"{placement.expected_hours:,.1f} h `elastic plan` expects the recipe's "
                f"{placement.tokens_needed:,} tokens to take{ask}")
    return None


def _share(fraction: float) -> str:
    """A fraction below 1 as a percentage that never reads as 0 % or 100 %."""
    if fraction < 0.01:
        return "less than 1 %"
    return f"about {min(99, round(100 * fraction))} %"


def on_demand_fallback(recipe: Recipe) -> Placement | None:
    """What the deadline rule falls back on if spot stays out (`policy.on_demand_need`): the
    cheapest on-demand world of world.max_replicas on the live offers, for a spot recipe with
    budget.max_hours; None otherwise, or when no on-demand offer matches."""
    if not recipe.resources.spot or recipe.budget.max_hours is None:
        return None
    od = recipe.model_copy(update={"resources": recipe.resources.model_copy(update={"spot": False})})
    offers = live_offers(od)
    if not offers:
        return None
    world = plan(Market(recipe.planner).quotes(offers, time.time()), od, n=recipe.world.max_replicas)
    return world if world.quotes else None


# -- elastic down -----------------------------------------------------------------------------------

RUNS = Path("runs")   # where `elastic launch` makes run directories by default


def _run_target(run: str) -> tuple[str, list[str] | None, list[str]]:
    """(run name, its clouds and regions when RUN is a run directory with a recipe.yaml, or the
    name of one under ./runs/, else (name, None, []))."""
    p = Path(run)
    if not (p / "recipe.yaml").is_file() and os.sep not in run and (RUNS / run / "recipe.yaml").is_file():
        p = RUNS / run   # a run's name: its directory where `elastic launch` puts it by default
    if (p / "recipe.yaml").is_file():
        import yaml
        doc = yaml.safe_load((p / "recipe.yaml").read_text(encoding="utf-8")) or {}
        resources = doc.get("resources") or {}
        clouds = [c for c in resources.get("clouds", []) if c != "local"]
        return p.resolve().name, clouds, list(resources.get("regions") or [])
    if os.sep in run or not run:
        raise UserError(f"{run}: not a run directory (no recipe.yaml) and not a run name")
    return run, None, []


SCOPE_WAIT_S = 180.0     # how long `down` waits for terminated VMs to let go of their run's network group
HEARTBEAT_TAG_S = 60.0   # real seconds between two heartbeats the driver writes on its run's VMs in the cloud


def live_runs(instances, now_s: float, stale_after_s: float) -> set[str]:
    """Runs alive by the heartbeat their driver writes on their VMs in the cloud: the newest
    heartbeat on any of its VMs (a VM that never got one counts from its launch, so a run just
    starting is alive) is younger than `stale_after_s`.

    Args:
        instances: the VMs found in the clouds (`Instance.heartbeat_at`, `launched_at`).
        now_s: unix time now.
        stale_after_s: seconds without a heartbeat after which a run is dead.
    """
    newest: dict[str, float] = {}
    for i in instances:
        at = i.heartbeat_at if i.heartbeat_at is not None else i.launched_at
        newest[i.run] = max(newest.get(i.run, at), at)
    return {run for run, at in newest.items() if now_s - at < stale_after_s}


def down(args, out, err) -> int:
    """Terminate every VM tagged with a run (or, with --orphans, every elastic VM of a run whose
    newest heartbeat in the cloud is older than --stale-after-s) in every region of every cloud."""
    from rich.table import Table

    from providers import build

    if args.orphans == bool(args.run):
        raise UserError("elastic down: give a RUN (name or run directory) or --orphans, not both")
    if not args.stale_after_s >= 2 * HEARTBEAT_TAG_S:   # NaN too; shorter would end runs between two beats
        raise UserError(f"elastic down: --stale-after-s must be at least {2 * HEARTBEAT_TAG_S:g} s (drivers "
                        f"write their heartbeat every {HEARTBEAT_TAG_S:g} s), not {args.stale_after_s:g}")
    if args.orphans:
        run, clouds, regions = None, None, []
        from providers import PROVIDERS, available, provider_class
        if removed := [r for n in PROVIDERS if available(n) for r in provider_class(n).clean_orphans_here()]:
            out.print(f"removed what dead runs left on this machine: {', '.join(removed)}", highlight=False)
    else:
        run, clouds, regions = _run_target(args.run)
        if clouds == []:
            out.print(f"run {run} rented only local nodes: nothing to terminate", highlight=False)
            return 0
    names = clouds if clouds is not None else [n for n in cloud_names() if _configured(n) is None]
    if not names:
        why = "no cloud is configured: " + "; ".join(f"{n}: {_configured(n)}" for n in cloud_names())
        if args.orphans:   # this machine's leftovers are swept; no VM to look for is no error
            out.print(f"no VMs looked for: {why}", highlight=False)
            return 0
        where = f"{args.run}: no run directory here or under {RUNS}/, and " if run else ""
        raise UserError(f"elastic down: {where}{why}")
    found = []   # (provider, instance)
    built = []
    for name in names:
        recipe = _pseudo_recipe(run or "orphans", [name], regions=regions)
        provider = build(name, recipe, None, run or "orphans")
        built.append(provider)
        for inst in (provider.list_instances(run) if run else provider.find_instances(None)):
            found.append((provider, inst))
    if args.orphans:
        live = live_runs([i for _, i in found], time.time(), args.stale_after_s)
        found = [(p, i) for p, i in found if i.run not in live]
    what = f"run {run}" if run else "orphaned runs"
    if not found:
        out.print(f"nothing to terminate for {what} in {', '.join(names)}", highlight=False)
        if run:   # a run whose VMs are gone may still own a token, a role, a network group
            _remove_run_resources([(p, run) for p in built], out)
        return 0
    t = Table(title=f"instances of {what}", title_justify="left")
    for col in ("cloud", "region", "instance", "type", "run", "role", "launched (UTC)"):
        t.add_column(col)
    from datetime import datetime, timezone
    for p, i in found:
        t.add_row(i.offer.cloud, i.offer.region, i.instance_id, i.offer.instance_type, i.run, i.role,
                  datetime.fromtimestamp(i.launched_at, timezone.utc).strftime("%Y-%m-%d %H:%M:%S"))
    out.print(t)
    if not args.yes:
        if not sys.stdin.isatty():
            raise UserError(f"{len(found)} instance(s) found; pass --yes to terminate them")
        answer = input(f"terminate {len(found)} instance(s)? [y/N] ").strip().lower()
        if answer not in ("y", "yes"):
            out.print("nothing terminated")
            return 1
    for p, i in found:
        p.terminate(i.instance_id)
    out.print(f"terminated {len(found)} instance(s)", highlight=False)
    _remove_run_resources(list(dict.fromkeys((p, i.run) for p, i in found)), out)
    return 0


def _remove_run_resources(pairs, out) -> None:
    """What runs owned besides VMs (tokens, roles, network groups), removed once their VMs are."""
    for provider, run in pairs:
        for line in provider.remove_run_resources(run, wait_s=SCOPE_WAIT_S):
            out.print(f"left {line}; run `elastic down {run}` again later", highlight=False)
