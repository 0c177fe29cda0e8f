"""The `elastic` command line. Imports stay lazy so `elastic --help` answers at once."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="elastic",
        description="Train on cheap preemptible GPU VMs across clouds with elastic DiLoCo on Ray.")
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    def recipe_args(sp):
        sp.add_argument("recipe", help="recipe YAML file")
        sp.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD.PATH=VALUE",
                        help="override a recipe field (repeatable), e.g. --set train.outer_steps=5")

    sp = sub.add_parser("launch", help="run a recipe: rent nodes, train, checkpoint, report")
    recipe_args(sp)
    sp.add_argument("--run-dir", type=Path, help="where the run writes (default runs/<name>-<UTC time>/)")
    sp.add_argument("--resume", action="store_true",
                    help="continue from the latest complete checkpoint at the recipe's checkpoint.uri "
                         "(any world shape: replicas and ranks per replica may differ)")
    sp.add_argument("--address", help="HOST:PORT of a running Ray head on this machine to add the local nodes to (default: start a local cluster)")

    sp = sub.add_parser("validate", help="check a recipe; print every problem, one line each")
    recipe_args(sp)

    sp = sub.add_parser("report", help="rebuild report.json and report.html of a run from its ledger and print the summary")
    sp.add_argument("run_dir", type=Path)
    sp.add_argument("--compare", type=Path, metavar="OTHER_RUN_DIR",
                    help="also read another run's ledger and print both side by side")

    sp = sub.add_parser("status", help="live view of a run from its ledger: world, step, loss, tokens/s, USD")
    sp.add_argument("run_dir", type=Path, nargs="?",
                    help="the run directory (default: the run under runs/ whose ledger changed last)")
    sp.add_argument("--once", action="store_true", help="print one snapshot and exit (default: refresh until the run ends)")

    sp = sub.add_parser("checkpoints", help="list or verify the checkpoints at a URI")
    ck = sp.add_subparsers(dest="action", metavar="ACTION", required=True)
    cl = ck.add_parser("list", help="table: step, time, size, complete or not")
    cl.add_argument("uri", help="checkpoint URI (s3://, gs://, file:// or a path)")
    cv = ck.add_parser("verify", help="re-hash every file against the manifest; non-zero exit names the bad file")
    cv.add_argument("uri", help="checkpoint URI (s3://, gs://, file:// or a path)")
    cv.add_argument("--step", type=int, help="the checkpoint to verify (default: the newest complete one)")

    sp = sub.add_parser("plan", help="where the recipe would rent now: placement, USD/h, expected USD per 1M tokens and hours")
    recipe_args(sp)
    sp.add_argument("--json", action="store_true", help="print the placement as JSON")

    sp = sub.add_parser("simulate", help="compare rental policies on a price/preemption trace, in simulated time")
    recipe_args(sp)
    sp.add_argument("--trace", required=True, metavar="TRACE.csv",
                    help="trace CSV: timestamp_s,cloud,region,zone,instance_type,gpu,gpus,spot_usd_per_hour,"
                         "on_demand_usd_per_hour,preempt_per_hour,capacity")
    sp.add_argument("--policy", action="append", metavar="NAME",
                    help="elastic, on-demand, spot-static or skypilot-like (repeatable; default: all)")
    sp.add_argument("--seed", type=int, default=0, help="seed of the preemption draws (default 0)")
    sp.add_argument("--json", action="store_true", help="print the figures as JSON")

    sp = sub.add_parser("prices", help="live offers for an accelerator, cheapest per GPU-hour first")
    sp.add_argument("--cloud", choices=["aws", "gcp", "local"],
                    help="one cloud (default: every cloud whose credentials are configured)")
    sp.add_argument("--accelerator", required=True, metavar="MODEL[:N]",
                    help="GPU model and optional count per VM, e.g. A10G, A100:8")
    sp.add_argument("--region", action="append", default=[], metavar="R",
                    help="only this region (repeatable; default: every region)")
    sp.add_argument("--on-demand", action="store_true", help="on-demand offers instead of spot")
    sp.add_argument("--json", action="store_true", help="the offers as JSON")
    sp.add_argument("--refresh", action="store_true", help="read prices now, bypassing the on-disk cache (AWS: 5 min, GCP: gcp.price_cache_ttl_s)")

    sp = sub.add_parser("down", help="terminate every VM of a run, or of runs no longer alive (--orphans)")
    sp.add_argument("run", nargs="?", help="run name or run directory")
    sp.add_argument("--orphans", action="store_true",
                    help="instances tagged by elastic whose run's driver heartbeat (a tag / label on its VMs) is stale")
    sp.add_argument("--stale-after-s", type=float, default=600.0, metavar="S",
                    help="with --orphans: a run whose newest heartbeat is older than this is dead (default 600, at least 120)")
    sp.add_argument("--yes", action="store_true", help="terminate without asking")

    sp = sub.add_parser("schema", help="print the recipe's JSON schema (for editors) or its reference")
    sp.add_argument("--markdown", action="store_true", help="the recipe reference as Markdown")
    return p


def _is_host_port(address: str) -> bool:
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def _err(console, line: str) -> None:
    from rich.markup import escape

    # The line holds user text (paths, values); escape it so "[/x]" is printed, not parsed as markup.
    console.print(f"[red]error:[/red] {escape(line)}", highlight=False, soft_wrap=True)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.version:
        from elastic import __version__
        print(__version__)
        return 0
    if args.command is None:
        _parser().print_help()
        return 2

    import os

    from rich.console import Console

    from elastic.errors import UserError

    # A model.factory module next to the recipe resolves as with `python -m`; Ray workers get the
    # driver's working directory on their path too.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    err = Console(stderr=True)
    try:
        return _dispatch(args, err)
    except UserError as exc:
        for line in exc.lines:
            _err(err, line)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # never a traceback at the user; ELASTIC_DEBUG=1 shows it
        import os
        if os.environ.get("ELASTIC_DEBUG"):
            raise
        _err(err, f"internal error: {type(exc).__name__}: {exc} (set ELASTIC_DEBUG=1 for the traceback)")
        return 1


def _dispatch(args, err) -> int:
    from rich.console import Console

    out = Console()
    if args.command == "validate":
        from rich.markup import escape

        from elastic.errors import UserError
        from elastic.recipe import launch_problems, load_recipe
        recipe = load_recipe(args.recipe, args.overrides)
        if problems := launch_problems(recipe, args.recipe):
            raise UserError(problems)
        out.print(f"{escape(args.recipe)}: ok ({recipe.name}: {recipe.world.replicas} replica(s) × "
                  f"{recipe.world.ranks_per_replica} rank(s), H={recipe.train.inner_steps})", highlight=False)
        return 0
    if args.command == "launch":
        from elastic.errors import UserError
        from elastic.launch import default_run_dir, launch
        from elastic.recipe import load_recipe
        if args.address is not None and not _is_host_port(args.address):
            raise UserError(f"--address {args.address!r}: expected HOST:PORT of a running Ray head")
        recipe = load_recipe(args.recipe, args.overrides)
        from elastic.recipe import launch_problems
        if problems := launch_problems(recipe, args.recipe):
            raise UserError(problems)
        from elastic import checkpoint as ckpt
        ckpt.check_destination(recipe.checkpoint.uri, args.resume, ckpt.model_digest(recipe))
        from elastic.launch import launch_controller, uses_controller
        if uses_controller(recipe, args.address):
            if args.resume:
                raise UserError("--resume with resources.head: controller: not supported yet; use head: local")
            return launch_controller(recipe, args.run_dir or default_run_dir(recipe), out)
        return launch(recipe, args.run_dir or default_run_dir(recipe), address=args.address, console=out,
                      resume=args.resume)
    if args.command == "report":
        from elastic.errors import UserError
        from elastic.ledger import read_events
        from elastic.report import build_report, compare_table, summary_table, write_report
        for d in filter(None, [args.run_dir, args.compare]):
            if not (d / "events.jsonl").is_file():
                raise UserError(f"{d}: no events.jsonl (not a run directory)")
        report = write_report(args.run_dir)
        if args.compare is None:
            out.print(summary_table(report))
        else:
            other = build_report(read_events(args.compare / "events.jsonl"))
            out.print(compare_table(report, other, args.run_dir.name, args.compare.name))
        out.print(f"report: {args.run_dir / 'report.json'}, {args.run_dir / 'report.html'}", highlight=False)
        return 0
    if args.command == "status":
        from elastic.status import latest_run_dir, watch
        return watch(args.run_dir or latest_run_dir(), out, once=args.once)
    if args.command == "checkpoints":
        return _checkpoints(args, out, err)
    if args.command == "plan":
        return _plan(args, out)
    if args.command == "simulate":
        return _simulate(args, out)
    if args.command == "prices":
        from elastic.fleet import prices
        return prices(args, out)
    if args.command == "down":
        from elastic.fleet import down
        return down(args, out, err)
    if args.command == "schema":
        from elastic.schema import json_schema, markdown_reference
        sys.stdout.write(markdown_reference() if args.markdown else json_schema())
        return 0
    raise AssertionError(args.command)


def _checkpoints(args, out, err) -> int:
    from datetime import datetime, timezone

    from rich.table import Table

    from elastic import checkpoint as ckpt
    from elastic.storage import open_storage

    root = open_storage(args.uri)
    if args.action == "list":
        table = Table(title=f"checkpoints at {args.uri}", title_justify="left")
        for col in ("step", "saved (UTC)", "size", "complete"):
            table.add_column(col, justify="right" if col in ("step", "size") else "left")
        for c in ckpt.listing(root):
            when = (datetime.fromtimestamp(c["saved_at"], timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
                    if c["saved_at"] else "-")
            table.add_row(str(c["step"]), when, f"{c['bytes'] / 1e6:.1f} MB", "yes" if c["complete"] else "no (partial)")
        out.print(table)
        return 0
    step, problems = ckpt.verify(root, args.step)
    for line in problems:
        _err(err, line)
    if problems:
        return 1
    out.print(f"step {step}: every file matches its manifest", highlight=False)
    return 0


def _plan(args, out) -> int:
    import json
    import time

    from rich.table import Table

    from elastic.errors import UserError
    from elastic.market import Market, live_offers, load_history
    from elastic.planner import plan
    from elastic.recipe import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    offers = live_offers(recipe)
    if not offers:
        raise UserError("resources: no offer matches resources.clouds / regions / accelerators / max_usd_per_hour")
    quotes = Market(recipe.planner, load_history()).quotes(offers, time.time())
    placement = plan(quotes, recipe)
    doc = placement.to_dict(recipe)
    if args.json:
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        table = Table(title=f"plan for {recipe.name}", title_justify="left")
        numeric = ("n", "USD/h", "risk/h", "capacity", "USD/1M tok")
        for col in ("n", "cloud:zone", "instance type", "GPUs", "USD/h", "risk/h", "capacity", "USD/1M tok"):
            table.add_column(col, justify="right" if col in numeric else "left", no_wrap=col != "cloud:zone",
                             overflow="fold")
        for s in doc["placement"]:
            table.add_row(str(s["replicas"]), f"{s['cloud']}:{s['zone']}", s["instance_type"],
                          f"{s['gpus']}×{s['gpu']}" if s["gpus"] else "-", f"{s['usd_per_hour']:.2f}",
                          f"{s['preempt_per_hour']:.2f} {s['risk_source']}",
                          "?" if s["capacity"] is None else str(s["capacity"]), f"{s['usd_per_mtok']:.4f}")
        out.print(table)
        if doc["usd_per_mtok"] is not None:
            out.print(f"world: {doc['replicas']} replica(s), ${doc['usd_per_hour']:.2f}/h, "
                      f"{doc['useful_tokens_per_s']:,.0f} useful tokens/s, ${doc['usd_per_mtok']:.4f} per 1M tokens; "
                      f"{doc['tokens_needed']:,} tokens in about {doc['expected_hours']:.1f} h for "
                      f"${doc['expected_usd']:,.2f}", highlight=False)
        for w in doc["warnings"]:
            out.print(f"[yellow]warning:[/yellow] {w}", highlight=False)
    return 0 if placement.feasible else 4


def _simulate(args, out) -> int:
    import json

    from rich.table import Table

    from elastic.recipe import load_recipe
    from elastic.simulate import simulate

    recipe = load_recipe(args.recipe, args.overrides)
    results = simulate(recipe, args.trace, args.policy, seed=args.seed)
    if args.json:
        doc = {"recipe": recipe.name, "trace": args.trace, "seed": args.seed,
               "budget_usd": recipe.budget.max_usd, "policies": {r["policy"]: r for r in results}}
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return 0
    table = Table(title=f"{recipe.name} on {args.trace} (seed {args.seed})", title_justify="left")
    for col in ("policy", "status", "USD", "tokens", "USD/1M tok", "wall h", "preemptions", "moves", "effective"):
        table.add_column(col, justify="left" if col in ("policy", "status") else "right")
    for r in results:
        table.add_row(r["policy"], r["status"], f"{r['cost_usd']:,.2f}", f"{r['tokens']:,}",
                      f"{r['usd_per_mtok']:.4f}" if r["usd_per_mtok"] is not None else "-", f"{r['wall_h']:.2f}",
                      str(r["preemptions"]), str(r["moves"]),
                      f"{r['effective_training_time']:.3f}" if r["effective_training_time"] is not None else "-")
    out.print(table)
    return 0
