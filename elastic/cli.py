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

    sp = sub.add_parser("report", help="rebuild report.json of a run from its ledger and print it")
    sp.add_argument("run_dir", type=Path)

    sp = sub.add_parser("checkpoints", help="list or verify the checkpoints at a URI")
    ck = sp.add_subparsers(dest="action", metavar="ACTION", required=True)
    cl = ck.add_parser("list", help="table: step, time, size, complete or not")
    cl.add_argument("uri", help="checkpoint URI (file:// or a path)")
    cv = ck.add_parser("verify", help="re-hash every file against the manifest; non-zero exit names the bad file")
    cv.add_argument("uri", help="checkpoint URI (file:// or a path)")
    cv.add_argument("--step", type=int, help="the checkpoint to verify (default: the newest complete one)")

    sp = sub.add_parser("prices", help="live offers for an accelerator, cheapest per GPU-hour first")
    sp.add_argument("--cloud", choices=["aws", "gcp", "local"],
                    help="one cloud (default: every cloud whose credentials are configured)")
    sp.add_argument("--accelerator", required=True, metavar="MODEL[:N]",
                    help="GPU model and optional count per VM, e.g. A10G, A100:8")
    sp.add_argument("--region", action="append", default=[], metavar="R",
                    help="only this region (repeatable; default: every region)")
    sp.add_argument("--on-demand", action="store_true", help="on-demand offers instead of spot")
    sp.add_argument("--json", action="store_true", help="the offers as JSON")
    sp.add_argument("--refresh", action="store_true", help="read prices now, bypassing the cache (5 min)")

    sp = sub.add_parser("down", help="terminate every VM of a run, or of runs no longer alive (--orphans)")
    sp.add_argument("run", nargs="?", help="run name or run directory")
    sp.add_argument("--orphans", action="store_true",
                    help="instances tagged by elastic whose run is no longer alive")
    sp.add_argument("--runs-dir", default="runs", help="where local runs live, for --orphans (default runs/)")
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

        from elastic.recipe import load_recipe
        recipe = load_recipe(args.recipe, args.overrides)
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
        if args.resume:
            from elastic import checkpoint as ckpt
            if not recipe.checkpoint.uri:
                raise UserError("--resume: set checkpoint.uri to where the checkpoints are "
                                "(a run's default <run dir>/checkpoints is not shared with a new run)")
            if not ckpt.complete_steps(ckpt.checkpoint_dir(recipe.checkpoint.uri, Path("."))):
                raise UserError(f"--resume: no complete checkpoint at {recipe.checkpoint.uri}")
        from elastic.launch import launch_controller, uses_controller
        if uses_controller(recipe, args.address):
            if args.resume:
                raise UserError("--resume with resources.head: controller: not supported yet; use head: local")
            return launch_controller(recipe, args.run_dir or default_run_dir(recipe), out)
        return launch(recipe, args.run_dir or default_run_dir(recipe), address=args.address, console=out,
                      resume=args.resume)
    if args.command == "report":
        from elastic.errors import UserError
        from elastic.report import summary_table, write_report
        if not (args.run_dir / "events.jsonl").is_file():
            raise UserError(f"{args.run_dir}: no events.jsonl (not a run directory)")
        out.print(summary_table(write_report(args.run_dir)))
        return 0
    if args.command == "checkpoints":
        return _checkpoints(args, out, err)
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

    root = ckpt.local_root(args.uri)
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
