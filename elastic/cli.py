"""The `elastic` command line. Imports stay lazy so `elastic --help` answers at once."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    from providers import PROVIDERS   # the registry only: no provider module, no cloud SDK

    p = argparse.ArgumentParser(
        prog="elastic",
        description="Train on cheap preemptible GPU VMs across clouds with elastic DiLoCo on Ray.")
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    def recipe_args(sp):
        sp.add_argument("recipe", help="recipe YAML file")
        sp.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD.PATH=VALUE",
                        help="override a recipe field (repeatable), e.g. --set train.outer_steps=5")

    def offline_arg(sp):
        sp.add_argument("--offline", action="store_true",
                        help="skip the preflight calls to the clouds (credentials, regions, quota, checkpoint bucket)")

    sp = sub.add_parser("launch", help="run a recipe: rent nodes, train, checkpoint, report")
    recipe_args(sp)
    sp.add_argument("--run-dir", type=Path, help="where the run writes (default runs/<name>-<UTC time>/)")
    sp.add_argument("--resume", nargs="?", const=True, default=False, metavar="RUN",
                    help="continue from the latest complete checkpoint at the recipe's checkpoint.uri "
                         "(any world shape: replicas and ranks per replica may differ); with RUN, continue that "
                         "run itself: its name, its record beside the checkpoints (and, with a controller, a new "
                         "controller VM), one report for all its parts")
    sp.add_argument("--detach", action="store_true",
                    help="with resources.head: controller, return once the controller is started instead of "
                         "following the run's log (Ctrl-C while following detaches too)")
    sp.add_argument("--address", help="HOST:PORT of a running Ray head on this machine to add the local nodes to (default: start a local cluster)")
    sp.add_argument("--allow-partial", action="store_true",
                    help="launch even when `elastic plan` expects budget.max_usd or budget.max_hours to run out "
                         "before the recipe's tokens are trained (train until the budget runs out)")
    offline_arg(sp)

    sp = sub.add_parser("rehearse", help="run an aws/gcp recipe end to end on this machine: local fakes of the "
                        "clouds' APIs, every VM a machine here running its real boot script (needs root)")
    recipe_args(sp)
    sp.add_argument("--run-dir", type=Path, help="where the run writes (default runs/<name>-<UTC time>/)")

    sp = sub.add_parser("validate", help="check a recipe and what its clouds need (credentials, project, regions, "
                                          "quota, checkpoint bucket); print every problem, one line each")
    recipe_args(sp)
    offline_arg(sp)

    run_help = ("the run: its name (./runs/RUN, else the records at the known URIs), its run directory, or the "
                "URI of its record (default: the run under runs/ whose ledger changed last)")

    def uri_arg(sp):
        sp.add_argument("--uri", action="append", default=[], metavar="URI",
                        help="also look for runs' records under this checkpoint URI (repeatable; besides "
                             "$ELASTIC_RUNS_URIS and the URIs `elastic launch` remembered)")

    sp = sub.add_parser("runs", help="list runs, here and in the records at the known URIs: status, world, "
                                     "tokens, USD so far, age")
    uri_arg(sp)

    sp = sub.add_parser("report", help="rebuild report.json and report.html of a run from its ledger and print the summary")
    sp.add_argument("run_dir", metavar="RUN", nargs="?", help=run_help)
    sp.add_argument("--compare", metavar="OTHER_RUN", help="also read another run's ledger and print both side by side")
    sp.add_argument("--to", type=Path, metavar="DIR",
                    help="a run read from storage: where to write report.json and report.html (default reports/RUN)")
    uri_arg(sp)

    sp = sub.add_parser("status", help="live view of a run from its ledger: world, step, loss, tokens/s, USD")
    sp.add_argument("run_dir", metavar="RUN", nargs="?", help=run_help)
    sp.add_argument("--once", action="store_true", help="print one snapshot and exit (default: refresh until the run ends)")
    uri_arg(sp)

    sp = sub.add_parser("logs", help="the driver's log of a run (from its run directory or its record in storage)")
    sp.add_argument("run_dir", metavar="RUN", nargs="?", help=run_help)
    sp.add_argument("--follow", "-f", action="store_true", help="keep printing new lines until the run ends")
    uri_arg(sp)

    sp = sub.add_parser("checkpoints", help="list or verify the checkpoints at a URI")
    ck = sp.add_subparsers(dest="action", metavar="ACTION", required=True)
    cl = ck.add_parser("list", help="table: step, time, size, complete or not")
    cl.add_argument("uri", help="checkpoint URI (s3://, gs://, file:// or a path)")
    cv = ck.add_parser("verify", help="re-hash every file against the manifest; non-zero exit names the bad file")
    cv.add_argument("uri", help="checkpoint URI (s3://, gs://, file:// or a path)")
    cv.add_argument("--step", type=int, help="the checkpoint to verify (default: the newest complete one)")
    cv.add_argument("--runs-dir", type=Path,
                    help="file:// checkpoints: the directory holding the run directories, whose checkpoint.key "
                         "files authenticate the manifests (default: two levels above the checkpoints, as "
                         "`elastic launch` lays a run out: RUNS/RUN/checkpoints, and ./runs; the key of the run "
                         "directory holding the checkpoints is tried too); s3:// and gs:// keys are in "
                         "the cloud's secret store")

    sp = sub.add_parser("plan", help="where the recipe would rent now: placement, USD/h, expected USD per 1M tokens and hours")
    recipe_args(sp)
    sp.add_argument("--json", action="store_true", help="print the placement as JSON")
    sp.add_argument("--refresh", action="store_true", help="read prices now, bypassing the on-disk cache")

    sp = sub.add_parser("simulate", help="compare rental policies on a price/preemption trace, in simulated time")
    recipe_args(sp)
    sp.add_argument("--trace", required=True, metavar="TRACE.csv",
                    help="trace CSV: timestamp_s,cloud,region,zone,instance_type,gpu,gpus,spot_usd_per_hour,"
                         "on_demand_usd_per_hour,preempt_per_hour,capacity")
    sp.add_argument("--policy", action="append", metavar="NAME",
                    help="a rental policy of the registry, elastic.policy.registry (repeatable; default: every one; an "
                         "unknown name lists them)")
    sp.add_argument("--seed", type=int, default=0, help="seed of the preemption draws (default 0)")
    sp.add_argument("--hide-capacity", action="store_true",
                    help="do not show the policies the trace's capacity (AWS and GCP publish none: a full zone is "
                         "learnt from a refused launch); launches are still refused by it")
    sp.add_argument("--json", action="store_true",
                    help="print the figures as JSON, with the clairvoyant bound (bound_usd_per_mtok) and each "
                         "policy's ratio_to_bound")

    sp = sub.add_parser("prices", help="live offers for an accelerator, cheapest per GPU-hour first")
    sp.add_argument("--cloud", choices=sorted(PROVIDERS),
                    help="one cloud (default: every cloud whose credentials are configured)")
    sp.add_argument("--accelerator", required=True, metavar="MODEL[:N]",
                    help="GPU model and optional count per VM, e.g. A10G, A100:8")
    sp.add_argument("--region", action="append", default=[], metavar="R",
                    help="only this region (repeatable; default: every region)")
    sp.add_argument("--on-demand", action="store_true", help="on-demand offers instead of spot")
    sp.add_argument("--json", action="store_true", help="the offers as JSON")
    sp.add_argument("--refresh", action="store_true", help="read prices now, bypassing the on-disk cache (AWS: 5 min, GCP: gcp.price_cache_ttl_s)")

    sp = sub.add_parser("down", help="terminate every VM of a run, or of runs no longer alive (--orphans)")
    sp.add_argument("run", nargs="?", help="run name, run directory, or the URI of its record")
    sp.add_argument("--orphans", action="store_true",
                    help="instances tagged by elastic whose run's driver heartbeat (a tag / label on its VMs) is stale")
    sp.add_argument("--stale-after-s", type=float, default=600.0, metavar="S",
                    help="with --orphans: a run whose newest heartbeat is older than this is dead (default 600, at least 120)")
    sp.add_argument("--yes", action="store_true", help="terminate without asking")

    sp = sub.add_parser("prepare-data", help="tokenize text/JSONL/Parquet files into token shards at a URI (for data.uri)")
    sp.add_argument("inputs", type=Path, nargs="+", metavar="INPUT",
                    help="text files (one document each), .jsonl or .parquet files, directories of them, "
                         "or a saved datasets dataset")
    sp.add_argument("--tokenizer", required=True, help="Hugging Face tokenizer: a local directory or a hub name")
    sp.add_argument("--to", required=True, metavar="URI", help="s3://, gs://, file:// or a path")
    sp.add_argument("--val-fraction", type=float, default=0.01,
                    help="share of documents held out for validation (default 0.01)")
    sp.add_argument("--shard-tokens", type=int, default=1 << 24, help="tokens per shard (default 16,777,216)")
    sp.add_argument("--text-field", default="text", help="field of a JSONL/Parquet row holding the text (default text)")

    sp = sub.add_parser("export", help="write a run's final θ_outer as a model other tools load "
                                       "(save_pretrained for model.hf, else safetensors; needs the hf extra)")
    sp.add_argument("run_dir", type=Path, help="the run directory")
    sp.add_argument("--to", type=Path, required=True, metavar="DIR", help="directory to write (new, or empty)")
    sp.add_argument("--step", type=int, help="the checkpoint to export (default: the newest one that verifies "
                                             "and loads, as --resume picks)")

    sp = sub.add_parser("cache", help="what elastic keeps between runs ($ELASTIC_CACHE, else ~/.cache/elastic)")
    ca = sp.add_subparsers(dest="action", metavar="ACTION", required=True)
    cc = ca.add_parser("clear", help="forget cached cloud answers (prices, catalogs, regions)")
    cc.add_argument("--all", action="store_true",
                    help="also forget what runs measured (preemption rates, tokens/s) that plans learn from")

    sp = sub.add_parser("schema", help="print the recipe's JSON schema (for editors) or its reference")
    sp.add_argument("--markdown", action="store_true", help="the recipe reference as Markdown")
    return p


def _hours(h: float) -> str:
    """A duration for people: `2.5 h`, or minutes below an hour (a tiny run is not `0.0 h`)."""
    return f"{h:.1f} h" if h >= 1 else f"{max(1, round(h * 60))} min"


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
    from elastic.views.termout import plain_console

    # A model.factory module next to the recipe resolves as with `python -m`; Ray workers get the
    # driver's working directory on their path too.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    err = plain_console(Console(stderr=True))
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


def _print_warnings(out, warnings: list[str]) -> None:
    """One yellow `warning:` line each (what the recipe may get wrong, the command goes on)."""
    from rich.markup import escape

    for w in warnings:
        out.print(f"[yellow]warning:[/yellow] {escape(w)}", highlight=False, soft_wrap=True)


def _dispatch(args, err) -> int:
    from rich.console import Console

    from elastic.views.termout import plain_console

    out = plain_console(Console())   # piped: whole table rows, one line per message
    if args.command == "validate":
        from rich.markup import escape

        from elastic.errors import UserError
        from elastic.recipe.model import launch_problems, launch_warnings, load_recipe
        recipe = load_recipe(args.recipe, args.overrides)
        if problems := launch_problems(recipe, args.recipe):
            raise UserError(problems)
        _print_warnings(out, launch_warnings(recipe))
        if not args.offline:
            from elastic.run.preflight import check
            check(recipe)
        out.print(f"{escape(args.recipe)}: ok ({recipe.name}: {recipe.world.replicas} replica(s) × "
                  f"{recipe.world.ranks_per_replica} rank(s), H={recipe.train.inner_steps})", highlight=False)
        return 0
    if args.command == "launch":
        from elastic.errors import UserError
        from elastic.run.launch import default_run_dir, earlier_record, launch, uses_controller
        earlier = None
        from elastic.recipe.model import load_recipe
        if args.address is not None and not _is_host_port(args.address):
            raise UserError(f"--address {args.address!r}: expected HOST:PORT of a running Ray head")
        recipe = load_recipe(args.recipe, args.overrides)
        from elastic.recipe.model import launch_problems, launch_warnings
        if problems := launch_problems(recipe, args.recipe):
            raise UserError(problems)
        _print_warnings(out, launch_warnings(recipe))
        from providers import provider_class
        for cloud in recipe.resources.clouds:   # e.g. this machine cannot build local.network's lab
            if problem := provider_class(cloud).network_problem(recipe):
                raise UserError(problem)
        if not args.offline:   # before a run directory or Ray: a cloud mistake costs a second
            from elastic.run.preflight import check
            check(recipe)
        run_name = args.resume if isinstance(args.resume, str) else None
        controller = uses_controller(recipe, args.address)
        if controller and run_name is None and args.resume:
            raise UserError("--resume with resources.head: controller: name the run, --resume RUN")
        if run_name is not None or (args.run_dir is not None and not controller):
            # The run's record may hold an earlier part (a controller that restarted, or a new one that
            # `--resume RUN` started): continue it, from its latest complete checkpoint if it has one.
            if args.run_dir is None and not controller:
                args.run_dir = Path("runs") / run_name
            found = earlier_record(recipe, run_name or args.run_dir.name)
            if run_name is not None and found is None:
                raise UserError(f"--resume {run_name}: no record of that run at "
                                f"{recipe.checkpoint.uri or 'the recipe (checkpoint.uri is not set)'}")
            if found is not None:
                from elastic.storage import checkpoint as ckpt
                from elastic.storage.stores import open_storage
                args.resume = bool(ckpt.complete_steps(open_storage(recipe.checkpoint.uri)))
            earlier = None if controller else found   # a new controller's driver reads it there
        if args.resume:
            from elastic.storage import checkpoint as ckpt
            if not recipe.checkpoint.uri:
                raise UserError("--resume: set checkpoint.uri to where the checkpoints are "
                                "(a run's default <run dir>/checkpoints is not shared with a new run)")
            from elastic.storage.stores import open_storage
            try:
                store = open_storage(recipe.checkpoint.uri)
            except UserError as exc:
                raise UserError(f"--resume: no complete checkpoint ({exc})") from None
            if not ckpt.complete_steps(store):
                raise UserError(f"--resume: no complete checkpoint at {recipe.checkpoint.uri}")
        if not (args.allow_partial or args.resume):   # before renting: a run that cannot finish is refused
            from elastic.run.fleet import budget_shortfall
            if short := budget_shortfall(recipe):
                raise UserError(short)
        from elastic.storage import checkpoint as ckpt
        run_dir = args.run_dir or default_run_dir(recipe)
        ckpt.check_destination(recipe.checkpoint.uri, args.resume, ckpt.model_digest(recipe), run_dir)
        from elastic.run.launch import launch_controller
        if uses_controller(recipe, args.address):
            if run_name is not None and args.run_dir is None:
                run_dir = default_run_dir(recipe).with_name(f"{run_name}-resumed-{run_dir.name.rpartition('-')[2]}")
            return launch_controller(recipe, run_dir, out, follow=not args.detach, run=run_name)
        return launch(recipe, run_dir, address=args.address, console=out, resume=bool(args.resume), earlier=earlier)
    if args.command == "rehearse":   # `launch` as written, its driver a child, against the lab's clouds
        from providers.lab.rehearse import rehearse
        return rehearse(args.recipe, args.overrides, args.run_dir, out)
    if args.command == "report":
        from elastic.errors import UserError
        from elastic.views.report import build_report, compare_table, summary_table
        from elastic.views.report_html import write_report_of
        from elastic.views.runs import LocalRun, resolve
        src = resolve(args.run_dir, args.uri)
        events = src.events()
        if not events:
            raise UserError(f"{src.where}: no events (not a run's ledger)")
        to = src.run_dir if isinstance(src, LocalRun) else (args.to or Path("reports") / src.name)
        report = write_report_of(events, to, src.ledger)
        if args.compare is None:
            out.print(summary_table(report))
        else:
            other = resolve(args.compare, args.uri)
            out.print(compare_table(report, build_report(other.events()), src.name, other.name))
        out.print(f"report: {to / 'report.json'}, {to / 'report.html'}", highlight=False, soft_wrap=True)
        return 0
    if args.command == "status":
        from elastic.views.runs import resolve
        from elastic.views.status import watch
        return watch(resolve(args.run_dir, args.uri), out, once=args.once)
    if args.command == "logs":
        from elastic.views.runs import follow_logs, resolve
        try:
            follow_logs(resolve(args.run_dir, args.uri), out, follow=args.follow)
        except KeyboardInterrupt:
            pass   # stops following; the run goes on
        return 0
    if args.command == "runs":
        import time

        from elastic.views.runs import all_runs, runs_table
        out.print(runs_table(all_runs(args.uri), time.time()))
        return 0
    if args.command == "checkpoints":
        return _checkpoints(args, out, err)
    if args.command == "plan":
        return _plan(args, out)
    if args.command == "simulate":
        return _simulate(args, out)
    if args.command == "prices":
        from elastic.run.fleet import prices
        return prices(args, out)
    if args.command == "down":
        import shutil

        from elastic.run.fleet import down
        made = None
        if args.run:
            args.run, made = _run_for_down(args.run)
        try:
            return down(args, out, err)
        finally:
            if made is not None:   # the recipe copied out of storage: down has read it
                shutil.rmtree(made, ignore_errors=True)
    if args.command == "prepare-data":
        return _prepare_data(args, out)
    if args.command == "export":
        from elastic.train.export import export
        done = export(args.run_dir, args.to, args.step)
        _print_warnings(out, [f"checkpoint passed over: {line}" for line in done["skipped"]])
        out.print(f"exported step {done['step']} of {args.run_dir} ({done['params']:,} parameters) to "
                  f"{done['to']} ({done['format']})", highlight=False)
        return 0
    if args.command == "cache":
        return _cache_clear(args, out)
    if args.command == "schema":
        from elastic.recipe.schema import json_schema, markdown_reference
        sys.stdout.write(markdown_reference() if args.markdown else json_schema())
        return 0
    raise AssertionError(args.command)


def _run_for_down(arg: str) -> tuple[str, Path | None]:
    """What `elastic down` terminates by: a run directory or name as given, or, for a run known only
    by its record in storage (a URI, or a name not under ./runs), a directory holding its recipe
    (its clouds and regions), named as the run; with the temporary directory made for it, if any."""
    import tempfile

    if "://" not in arg and (Path(arg) / "recipe.yaml").is_file() or (Path("runs") / arg / "recipe.yaml").is_file():
        return arg, None
    from elastic.views.runs import RemoteRun, resolve
    try:
        src = resolve(arg)
    except Exception:
        if "://" in arg:
            raise
        return arg, None   # a name only: down looks for its VMs in every configured cloud
    text = src.recipe_text() if isinstance(src, RemoteRun) else None
    if text is None:
        return (arg if "://" not in arg else src.name), None
    made = Path(tempfile.mkdtemp(prefix="elastic-down-"))
    (made / src.name).mkdir()
    (made / src.name / "recipe.yaml").write_text(text, encoding="utf-8")
    return str(made / src.name), made


def _cache_clear(args, out) -> int:
    import shutil

    from elastic.cache import cache_dir
    from elastic.policy.market import history_path, throughput_path
    from providers.cloud import price_cache_dir

    gone = []
    if price_cache_dir().is_dir():
        gone.append(f"{sum(1 for _ in price_cache_dir().iterdir())} cached cloud answer(s)")
        shutil.rmtree(price_cache_dir())
    if args.all:
        for path in (history_path(), throughput_path()):
            if path.exists():
                path.unlink()
                gone.append(path.name)
    out.print(f"cleared {', '.join(gone) if gone else 'nothing'} in {cache_dir()}", highlight=False, soft_wrap=True)
    return 0


def _checkpoints(args, out, err) -> int:
    from datetime import datetime, timezone

    from rich.table import Table

    from elastic.storage import checkpoint as ckpt
    from elastic.storage.stores import FileStorage, LocalKeys, open_keys, open_storage

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
    if isinstance(root, FileStorage):
        # A run's key is RUNS/RUN/checkpoint.key: in --runs-dir, else beside the run directory
        # holding the checkpoints (RUNS/RUN/checkpoints, as `elastic launch` lays a run out) and in
        # ./runs (where it puts runs: those of a resumed run too); and that run directory's own key
        # (renamed or copied, it keeps its key, not its name).
        roots = [args.runs_dir] if args.runs_dir else [root.root.parent.parent, Path("runs")]
        keys = LocalKeys(list(dict.fromkeys(roots)), home=root.root.parent)
    else:
        keys = open_keys(args.uri, Path.cwd() / "verify")
    step, problems = ckpt.verify(root, args.step, keys)
    for line in problems:
        _err(err, line)
    if problems:
        return 1
    out.print(f"step {step}: the manifest is authenticated by its run's key and every file matches it", highlight=False)
    return 0


def _prepare_data(args, out) -> int:
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn
    from rich.table import Table

    from elastic.train.prepare import prepare

    total = sum(f.stat().st_size for p in args.inputs if p.exists()
                for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file())
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TimeRemainingColumn(), console=out, transient=True) as bar:
        task = bar.add_task("tokenizing", total=total or None)
        s = prepare(args.inputs, args.tokenizer, args.to, args.val_fraction, args.shard_tokens, args.text_field,
                    progress=lambda n: bar.advance(task, n))
    table = Table(title=f"token shards at {args.to}", title_justify="left")
    for col in ("split", "documents", "tokens", "shards", "bytes"):
        table.add_column(col, justify="left" if col == "split" else "right")
    for split in s.tokens:
        table.add_row(split, f"{s.documents.get(split, 0):,}", f"{s.tokens[split]:,}", str(s.shards.get(split, 0)),
                      f"{s.bytes.get(split, 0):,}")
    out.print(table)
    out.print("already prepared: inputs and settings unchanged, nothing uploaded" if s.skipped
              else f"uploaded {len(s.uploaded)} shard(s)", highlight=False)
    return 0


def _plan(args, out) -> int:
    import json

    from rich.table import Table

    from elastic.errors import UserError
    from elastic.policy.rules import spread_waits
    from elastic.recipe.model import load_recipe
    from elastic.run.fleet import on_demand_fallback, plan_now
    from elastic.train.quality import describe as describe_quality

    recipe = load_recipe(args.recipe, args.overrides)
    if args.refresh:
        from providers import cloud as cloud_common
        cloud_common.set_refresh(True)
    placement = plan_now(recipe)
    if placement is None:
        raise UserError("resources: no offer matches resources.clouds / regions / accelerators / max_usd_per_hour")
    doc = placement.to_dict(recipe)
    fallback = on_demand_fallback(recipe)
    doc["on_demand_fallback"] = None if fallback is None else {
        "replicas": len(fallback.quotes), "usd_per_hour": round(fallback.usd_per_hour, 4),
        "expected_hours": round(fallback.expected_hours, 4), "expected_usd": round(fallback.expected_usd, 2)}
    spread = spread_waits(recipe, placement.quotes)
    doc["spread_waits"] = None if spread is None else {"replicas": spread[0], "why": spread[1]}
    if args.json:
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        table = Table(title=f"plan for {recipe.name}", title_justify="left")
        numeric = ("n", "USD/h", "risk/h", "capacity", "tok/s", "USD/1M tok")
        for col in ("n", "cloud:zone", "instance type", "GPUs", "ranks", "USD/h", "risk/h", "capacity", "tok/s",
                    "USD/1M tok"):
            table.add_column(col, justify="right" if col in numeric else "left", no_wrap=True)
        for s in doc["placement"]:
            table.add_row(str(s["replicas"]), f"{s['cloud']}:{s['zone']}", s["instance_type"],
                          f"{s['gpus']}×{s['gpu']}" if s["gpus"] else "-",
                          f"{s['ranks']}×{'GPU' if s['gpus'] else 'CPU'}", f"{s['usd_per_hour']:.2f}",
                          f"{s['preempt_per_hour']:.2f} {s['risk_source']}",
                          "?" if s["capacity"] is None else str(s["capacity"]),
                          f"{s['tokens_per_s']:,.0f} {s['tokens_per_s_source']}", f"{s['usd_per_mtok']:.4f}")
        out.print(table)
        if doc["usd_per_mtok"] is not None:
            out.print(f"world: {doc['replicas']} replica(s), ${doc['usd_per_hour']:.2f}/h, "
                      f"{doc['useful_tokens_per_s']:,.0f} useful tokens/s ({doc['tokens_per_s_source']}), "
                      f"${doc['usd_per_mtok']:.4f} per 1M tokens; "
                      f"{doc['tokens_needed']:,} tokens in about {_hours(doc['expected_hours'])} for "
                      f"${doc['expected_usd']:,.2f}", highlight=False)
        if (fb := doc["on_demand_fallback"]) is not None:
            out.print(f"on-demand fallback (budget.max_hours): if spot stays out, the run waits while the deadline "
                      f"allows, then {fb['replicas']} on-demand replica(s) at ${fb['usd_per_hour']:.2f}/h train the "
                      f"whole run in about {_hours(fb['expected_hours'])} for ${fb['expected_usd']:,.2f}",
                      highlight=False)
        if (sw := doc["spread_waits"]) is not None:
            out.print(f"spread rule (budget.max_hours): the run starts with {sw['replicas']} of these "
                      f"{doc['replicas']} replicas and the rest wait while the deadline allows: {sw['why']}",
                      highlight=False)
        out.print(describe_quality(doc["quality"]), highlight=False)
        _print_warnings(out, doc["warnings"])
    return 0 if placement.feasible else 4


def _simulate(args, out) -> int:
    import json

    from rich.table import Table

    from elastic.errors import UserError
    from elastic.recipe.model import load_recipe
    from elastic.sim.simulate import bound_usd_per_mtok, simulate, why_nothing_trained

    recipe = load_recipe(args.recipe, args.overrides)
    results = simulate(recipe, args.trace, args.policy, seed=args.seed, capacity_seen=not args.hide_capacity)
    if not any(r["tokens"] for r in results):   # a table of zeros says nothing: say why
        raise UserError(why_nothing_trained(recipe, args.trace))
    if args.json:
        # The yardstick: what any policy could at best pay per token on this trace (elastic.sim.bound).
        bound = bound_usd_per_mtok(recipe, args.trace)
        for r in results:
            # The bound prices the bill before the clouds' refunds (`list_usd_per_mtok`): see elastic.sim.bound.
            r["ratio_to_bound"] = round(r["list_usd_per_mtok"] / bound, 4) if bound and r["list_usd_per_mtok"] else None
        doc = {"recipe": recipe.name, "trace": args.trace, "seed": args.seed,
               "budget_usd": recipe.budget.max_usd, "bound_usd_per_mtok": round(bound, 6) if bound else None,
               "policies": {r["policy"]: r for r in results}}
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return 0
    table = Table(title=f"{recipe.name} on {args.trace} (seed {args.seed})", title_justify="left")
    for col in ("policy", "status", "USD", "refunded USD", "tokens", "USD/1M tok", "wall h", "preemptions", "moves",
                "effective"):
        table.add_column(col, justify="left" if col in ("policy", "status") else "right")
    for r in results:
        table.add_row(r["policy"], r["status"], f"{r['cost_usd']:,.2f}", f"{r['list_usd'] - r['cost_usd']:,.2f}",
                      f"{r['tokens']:,}",
                      f"{r['usd_per_mtok']:.4f}" if r["usd_per_mtok"] is not None else "-", f"{r['wall_h']:.2f}",
                      str(r["preemptions"]), str(r["moves"]),
                      f"{r['effective_training_time']:.3f}" if r["effective_training_time"] is not None else "-")
    out.print(table)
    return 0
