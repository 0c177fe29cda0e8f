"""`elastic launch`: rent nodes, build the world, train, checkpoint, release, report.

Whatever happens (completion, a failure, Ctrl-C or SIGTERM), every node the run rented is released,
the ledger records the end, and report.json and report.html are written. Exit codes: 0 completed, 1 failed,
3 budget exhausted (stopped at `budget.max_usd` / `budget.max_hours` after a final checkpoint),
4 insufficient capacity (fewer than `world.min_replicas` for `world.capacity_timeout_s`),
130 interrupted. (2 is bad input, from the CLI.)
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
import traceback
from contextlib import contextmanager

from rich.markup import escape
from datetime import datetime, timezone
from pathlib import Path

from elastic.errors import UserError
from elastic.ledger import Ledger
from elastic.recipe import Recipe, dump_recipe

log = logging.getLogger(__name__)

EXIT = {"completed": 0, "failed": 1, "budget_exhausted": 3, "insufficient_capacity": 4, "interrupted": 130}


def default_run_dir(recipe: Recipe) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return Path("runs") / f"{recipe.name}-{stamp}"


def prepare_run_dir(run_dir: Path) -> None:
    """Refuse a directory that already holds a run, or anything else: nothing already written gets
    overwritten. Its last part names the run (VM tags, staging), so `.` or `..` are refused too."""
    if (run_dir / "events.jsonl").exists():
        raise UserError(f"{run_dir}: already holds a run (events.jsonl); choose another --run-dir")
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"{run_dir}: exists and is not a directory")
    if run_dir.name in ("", ".", ".."):
        raise UserError(f"--run-dir {run_dir}: name a new directory (its name becomes the run's name)")
    if run_dir.is_dir() and any(run_dir.iterdir()):
        raise UserError(f"{run_dir}: exists and is not empty; choose a new --run-dir")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{run_dir}: cannot create run directory: {exc.strerror}") from None


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextmanager
def _signals_raise_interrupt():
    """SIGTERM behaves like Ctrl-C inside the block (KeyboardInterrupt in the main thread).
    LocalCluster keeps Ray from replacing this handler (see elastic.cluster)."""
    old = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextmanager
def _signals_ignored():
    """Cleanup must finish: a second Ctrl-C must not leave nodes behind."""
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


class _View:
    """Live terminal view while training: a rich table when attached to a terminal, else one
    plain line per outer step."""

    def __init__(self, console, recipe: Recipe, total_outer: int):
        self._console = console
        self._recipe = recipe
        self._total = total_outer
        self._live = None
        self._rows: dict[str, str] = {"phase": "starting"}

    def __enter__(self):
        if self._console.is_terminal:
            from rich.live import Live
            self._live = Live(self._render(), console=self._console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc):
        if self._live is not None:
            self._live.__exit__(*exc)

    def _render(self):
        from rich.table import Table
        t = Table(title=f"elastic · {self._recipe.name}", show_header=False, title_justify="left")
        t.add_column(style="bold")
        t.add_column(justify="right")
        for k, v in self._rows.items():
            t.add_row(k, v)
        return t

    def phase(self, text: str) -> None:
        if text == self._rows.get("phase"):
            return   # plain output: each change once, not every tick
        self._rows["phase"] = text
        if self._live is not None:
            self._live.update(self._render())
        else:
            self._console.print(f"[dim]{escape(text)}[/dim]", highlight=False)

    def step(self, res, world, tokens_per_s: float, usd: float) -> None:  # noqa: D102
        h = self._recipe.train.inner_steps
        loss = sum(res.losses) / len(res.losses) if res.losses else float("nan")
        self._rows = {
            "phase": "training",
            "outer step": f"{res.outer_step}/{self._total}",
            "inner step": f"{world.inner_step} (H={h})",
            "loss": f"{loss:.4f}",
            "tokens/s": f"{tokens_per_s:,.0f}",
            "tokens": f"{world.tokens:,}",
            "world": f"{len(res.replicas)} replica(s) × {self._recipe.world.ranks_per_replica} rank(s)",
            "$ so far": f"${usd:.4f}",
        }
        if self._live is not None:
            self._live.update(self._render())
        else:
            self._console.print(
                f"outer {res.outer_step}/{self._total}  inner {world.inner_step}  loss {loss:.4f}  "
                f"tok/s {tokens_per_s:,.0f}  world {len(res.replicas)}×{self._recipe.world.ranks_per_replica}  "
                f"${usd:.4f}", highlight=False)


def uses_controller(recipe: Recipe, address: str | None) -> bool:
    """A cloud run with `resources.head: controller` (and no --address): the head and the driver
    run on a small on-demand VM, not here."""
    return (address is None and recipe.resources.head == "controller"
            and any(c != "local" for c in recipe.resources.clouds))


def launch_controller(recipe: Recipe, run_dir: Path, console) -> int:
    """Start the run's controller VM, which runs the Ray head and the driver (`elastic launch`
    with `head: local` there). This machine records the controller in its run directory and is
    done; `elastic down RUN` stops everything the run holds, the controller included."""
    from rich.markup import escape

    from providers import build

    cloud = next(c for c in recipe.resources.clouds if c != "local")
    prepare_run_dir(run_dir)
    text = dump_recipe(recipe)
    (run_dir / "recipe.yaml").write_text(text, encoding="utf-8")
    provider = build(cloud, recipe, None, run_dir.name)
    start = getattr(provider, "launch_controller", None)
    if start is None:
        raise UserError(f"resources.head: controller is not available on {cloud} yet; set resources.head: local")
    ledger = Ledger(run_dir / "events.jsonl")
    # The driver runs on the controller, not in this process: no pid, so `elastic status` never
    # takes this run for a dead one.
    ledger.append("run_started", run=run_dir.name, recipe=recipe.name, recipe_digest=recipe.digest(), pid=None,
                  host=socket.gethostname(), target_replicas=recipe.world.replicas,
                  ranks_per_replica=recipe.world.ranks_per_replica, head="controller")
    try:
        inst = start(run_dir.name, text)
    except BaseException:
        ledger.append("run_ended", status="failed")
        ledger.close()
        raise
    ledger.append("node_launched", instance_id=inst.instance_id, ray_node_id=None, role="controller",
                  launched_at=inst.launched_at, joined=False,
                  **inst.offer.vm_fields())
    ledger.append("controller_started", instance_id=inst.instance_id, cloud=cloud, region=inst.offer.region)
    ledger.close()
    console.print(f"[bold]elastic[/bold] run [cyan]{escape(run_dir.name)}[/cyan]: controller {inst.instance_id} "
                  f"({inst.offer.instance_type}, on-demand, {inst.offer.region}) runs the Ray head and the driver.\n"
                  f"Stop the run and release every VM it holds: elastic down {escape(run_dir.name)} --yes",
                  highlight=False, soft_wrap=True)
    return 0


def launch(recipe: Recipe, run_dir: Path, address: str | None = None, console=None, resume: bool = False) -> int:
    """Run a recipe end to end; returns the process exit code."""
    from rich.console import Console

    from rich.markup import escape

    from elastic.report import summary_table, write_report

    console = console or Console()
    prepare_run_dir(run_dir)
    (run_dir / "recipe.yaml").write_text(dump_recipe(recipe), encoding="utf-8")
    handler = logging.FileHandler(run_dir / "driver.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger("elastic").addHandler(handler)
    logging.getLogger("elastic").setLevel(logging.INFO)
    logging.getLogger("providers").addHandler(handler)

    run = run_dir.name
    ledger = Ledger(run_dir / "events.jsonl")
    ledger.append("run_started", run=run, recipe=recipe.name, recipe_digest=recipe.digest(), pid=os.getpid(),
                  host=socket.gethostname(),
                  target_replicas=recipe.world.replicas, ranks_per_replica=recipe.world.ranks_per_replica)
    status, message = "failed", None
    driver = None
    t_start = time.monotonic()
    try:
        with _signals_raise_interrupt():
            console.print(f"[bold]elastic[/bold] run [cyan]{escape(run)}[/cyan] → {escape(str(run_dir))}",
                          highlight=False)
            from elastic.driver import Driver

            driver = Driver(recipe, run_dir, ledger, resume=resume)
            with console.status("starting Ray cluster…"):
                driver.start_cluster(address)
            with _View(console, recipe, driver.world.total_outer_steps) as view:
                status = driver.run(view)
            message = driver.end_message
    except KeyboardInterrupt:
        status, message = "interrupted", "interrupted by signal"
    except UserError as exc:
        status, message = "failed", "; ".join(exc.lines)
    except Exception as exc:  # the run fails; the user gets one line, the log the traceback
        status, message = "failed", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        log.error("run failed\n%s", traceback.format_exc())
    finally:
        with _signals_ignored():
            if message:
                ledger.append("error", message=message)
            if driver is not None:
                driver.release_all()
            ledger.append("run_ended", status=status, wall_s=round(time.monotonic() - t_start, 3))
            ledger.close()
            report = write_report(run_dir)
            logging.getLogger("elastic").removeHandler(handler)
            logging.getLogger("providers").removeHandler(handler)
            handler.close()
    console.print(summary_table(report))
    if message:
        console.print(f"[red]error:[/red] {escape(message)}" if status == "failed"
                      else f"[yellow]{escape(message)}[/yellow]", highlight=False, soft_wrap=True)
    console.print(f"report: {run_dir / 'report.json'}, {run_dir / 'report.html'}", highlight=False)
    return EXIT[status]
