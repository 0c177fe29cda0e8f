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
from contextlib import contextmanager

from rich.markup import escape
from datetime import datetime, timezone
from pathlib import Path

from elastic.errors import UserError, described, first_line
from elastic.recipe.model import Recipe, dump_recipe
from elastic.record.events import (ControllerStarted, Error, Event, NodeLaunched, OuterStep, Role, RunEnded, RunPlanned,
                                   RunStarted, RunStatus)
from elastic.record.ledger import Ledger
from elastic.run import stop

log = logging.getLogger(__name__)

EXIT = {RunStatus.COMPLETED: 0, RunStatus.FAILED: 1, RunStatus.BUDGET_EXHAUSTED: 3, RunStatus.INSUFFICIENT_CAPACITY: 4,
        RunStatus.INTERRUPTED: 130}


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


STACKS = "driver-stacks.txt"   # `kill -USR1 <driver pid>` appends every thread's stack here


@contextmanager
def _stacks_on_sigusr1(path: Path):
    """While the run lasts, SIGUSR1 appends the stack of every thread of the driver to `path`
    (Python's faulthandler: written from the signal handler, so it works while the driver is stuck
    in a blocking call); the run goes on. For a run that seems to hang. The file is left only when
    something was written to it."""
    import faulthandler

    with open(path, "a", encoding="utf-8") as out:
        faulthandler.register(signal.SIGUSR1, file=out, all_threads=True)
        try:
            yield
        finally:
            faulthandler.unregister(signal.SIGUSR1)
    if path.stat().st_size == 0:
        path.unlink()


@contextmanager
def _signals_ignored():
    """Cleanup must finish: a second Ctrl-C must not leave nodes behind."""
    old = {s: signal.signal(s, signal.SIG_IGN) for s in stop.SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


BUDGET_WARN_FRACTION = 0.8   # one line when the run has spent this share of budget.max_usd


def story_line(console, text: str, style: str = "") -> None:
    """One timestamped line of the run's story (above the live panel while it shows)."""
    from datetime import datetime

    stamp = datetime.now().strftime("%H:%M:%S")
    body = f"[{style}]{escape(text)}[/{style}]" if style else escape(text)
    console.print(f"[dim]{stamp}[/dim] {body}", highlight=False, soft_wrap=True)


def story_listener(console):
    """A ledger listener printing the story line (`Event.story`) of each event that tells one."""
    def on_event(e: Event) -> None:
        text = e.story()
        if text is not None:
            story_line(console, text, e.story_style())

    return on_event


class _View:
    """Live terminal view while training: a rich panel when attached to a terminal (it stays on
    screen at the end), else one plain line per outer step; above it, one line per event that tells
    the story (`Event.story`) and a budget warning."""

    def __init__(self, console, recipe: Recipe, total_outer: int):
        self._console = console
        self._recipe = recipe
        self._total = total_outer
        self._live = None
        self._rows: dict[str, str] = {"phase": "starting"}
        self._budget_warned = False

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

    def line(self, text: str, style: str = "") -> None:
        """One line above the panel (or in the plain output)."""
        story_line(self._console, text, style)

    def phase(self, text: str) -> None:
        if text == self._rows.get("phase"):
            return   # plain output: each change once, not every tick
        self._rows["phase"] = text
        if self._live is not None:
            self._live.update(self._render())
        else:
            self._console.print(f"[dim]{escape(text)}[/dim]", highlight=False, soft_wrap=True)

    def validation(self, outer_step: int, loss: float, perplexity: float) -> None:
        """A validation result: a row of the live table, or a line."""
        self._rows["val loss"] = f"{loss:.4f} (ppl {perplexity:,.2f}) at outer {outer_step}"
        if self._live is not None:
            self._live.update(self._render())
        else:
            self._console.print(f"validation at outer {outer_step}: loss {loss:.4f}  perplexity {perplexity:,.2f}",
                                highlight=False)

    def warn(self, text: str) -> None:
        """Something the user must see (a replica lost, a sync that failed): one line, kept."""
        self._console.print(f"[yellow]{escape(text)}[/yellow]", highlight=False, soft_wrap=True)

    def step(self, res, world, tokens_per_s: float, usd: float) -> None:  # noqa: D102
        h = self._recipe.train.inner_steps
        loss = sum(res.losses) / len(res.losses) if res.losses else float("nan")
        previous = self._rows
        max_usd = self._recipe.budget.max_usd
        if max_usd and usd >= BUDGET_WARN_FRACTION * max_usd and not self._budget_warned:
            self._budget_warned = True
            self.line(f"budget: ${usd:.4f} spent, {100 * usd / max_usd:.0f}% of budget.max_usd ${max_usd:g}", "yellow")
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
        if "val loss" in previous:
            self._rows["val loss"] = previous["val loss"]
        if self._live is not None:
            self._live.update(self._render())
        else:
            self._console.print(
                f"outer {res.outer_step}/{self._total}  inner {world.inner_step}  loss {loss:.4f}  "
                f"tok/s {tokens_per_s:,.0f}  world {len(res.replicas)}×{self._recipe.world.ranks_per_replica}  "
                f"${usd:.4f}", highlight=False, soft_wrap=True)


def uses_controller(recipe: Recipe, address: str | None) -> bool:
    """A cloud run with `resources.head: controller` (and no --address): the head and the driver
    run on a small on-demand VM, not here."""
    return (address is None and recipe.resources.head == "controller"
            and any(c != "local" for c in recipe.resources.clouds))


def launch_controller(recipe: Recipe, run_dir: Path, console, follow: bool = True, run: str | None = None) -> int:
    """Start the run's controller VM, which runs the Ray head and the driver (`elastic launch`
    with `head: local` there). This machine records the controller in its run directory and in
    the run's record beside its checkpoints (elastic.record.remote), which the driver on the
    controller continues; then it follows the run's log from the record until the run ends, or
    returns at once without `follow`. Ctrl-C detaches: the run goes on. `elastic down RUN` stops
    everything the run holds, the controller included.

    Args:
        run: the run's name when it is not the run directory's (`--resume RUN`: a new controller
            for run RUN, which continues its record and restores its latest complete checkpoint).
    """
    from rich.markup import escape

    from elastic.record import remote
    from providers import build

    run = run or run_dir.name
    cloud = next(c for c in recipe.resources.clouds if c != "local")
    prepare_run_dir(run_dir)
    text = dump_recipe(recipe)
    (run_dir / "recipe.yaml").write_text(text, encoding="utf-8")
    provider = build(cloud, recipe, None, run)
    ledger = Ledger(run_dir / "events.jsonl")
    # The driver runs on the controller, not in this process: no pid, so `elastic status` never
    # takes this run for a dead one.
    ledger.append(RunStarted(run=run, recipe=recipe.name, recipe_digest=recipe.digest(), pid=None,
                             host=socket.gethostname(), target_replicas=recipe.world.replicas,
                             ranks_per_replica=recipe.world.ranks_per_replica, head="controller"))
    # In the record before the controller boots: its driver finds the run there and continues it.
    record = remote.open_record(recipe.checkpoint.uri, run, create=True)
    record.write_whole("recipe.yaml", text.encode())
    stream = remote.RecordStream(record, run_dir)
    stream.flush()
    remote.remember_uri(recipe.checkpoint.uri)
    try:
        inst = provider.launch_controller(run, text)
    except BaseException:
        ledger.append(RunEnded(status=RunStatus.FAILED))
        ledger.close()
        stream.flush()
        raise
    ledger.append(NodeLaunched.of(inst.offer, instance_id=inst.instance_id, ray_node_id=None, role=Role.CONTROLLER,
                                  launched_at=inst.launched_at, joined=False))
    ledger.append(ControllerStarted(instance_id=inst.instance_id, cloud=cloud, region=inst.offer.region))
    ledger.close()
    stream.flush()
    name = escape(run)
    console.print(f"[bold]elastic[/bold] run [cyan]{name}[/cyan]: controller {inst.instance_id} "
                  f"({inst.offer.instance_type}, on-demand, {inst.offer.region}) runs the Ray head and the driver; "
                  f"its record: {escape(record.where)}.\n"
                  f"Follow it: elastic logs {name} --follow · status: elastic status {name}\n"
                  f"Stop the run and release every VM it holds: elastic down {name} --yes",
                  highlight=False, soft_wrap=True)
    if not follow:
        return 0
    return follow_run(record, console)


def follow_run(record, console) -> int:
    """Print the run's driver log from its record until the run ends (its exit code), or until
    Ctrl-C, which detaches (0): the run goes on."""
    from rich.markup import escape

    from elastic.views.runs import RemoteRun, follow_logs

    console.print("[dim]following the driver's log (Ctrl-C detaches; the run goes on)[/dim]", highlight=False)
    try:
        end = follow_logs(RemoteRun(record), console, follow=True)
    except KeyboardInterrupt:
        console.print(f"detached; the run goes on. Re-attach: elastic logs {escape(record.run)} --follow",
                      highlight=False, soft_wrap=True)
        return 0
    status = RunStatus(end["status"]) if end and end.get("status") in set(RunStatus) else RunStatus.FAILED
    console.print(f"run {escape(record.run)} ended: {status}; report: elastic report {escape(record.run)}",
                  highlight=False, soft_wrap=True)
    return EXIT[status]


def earlier_record(recipe: Recipe, run: str) -> tuple[bytes, bytes] | None:
    """The ledger and metrics already in run `run`'s record at the recipe's checkpoint.uri (a
    controller that restarted, or a new one `elastic launch --resume RUN` started, continues
    them), or None when the run has no record yet. UserError for a run that already ended."""
    from elastic.record import remote

    if not remote.streams_record(recipe):
        return None
    try:
        record = remote.open_record(recipe.checkpoint.uri, run)
        events, _ = record.read("events")
    except UserError:
        return None   # no bucket or directory yet: a new run
    if not events:
        return None
    if any(e.get("type") == RunEnded.TYPE for e in remote.records_of(events)):
        raise UserError(f"run {run} already ended (its record at {record.where}); give this run another "
                        f"--run-dir, or `elastic report {run}`")
    return events, record.read("metrics")[0]


def _start_record(recipe: Recipe, run_dir: Path, earlier: tuple[bytes, bytes] | None):
    """Stream the run directory's record into storage (elastic.record.remote), after putting the
    earlier part of a continued run's ledger and metrics in place; None when the run keeps its
    record in its run directory only."""
    from elastic.record import remote

    if not remote.streams_record(recipe):
        return None
    skip = {}
    if earlier is not None:
        for stream, data in zip(("events", "metrics"), earlier):
            (run_dir / remote.STREAMS[stream][0]).write_bytes(data)
            skip[stream] = len(data)
    try:
        record = remote.open_record(recipe.checkpoint.uri, run_dir.name, create=True)
        stream = remote.RecordStream(record, run_dir, skip).start()
    except Exception as exc:   # the run goes on with its record on this disk only
        log.warning("record: not streamed to %s: %s", remote.record_prefix(recipe.checkpoint.uri), first_line(exc, 300))
        return None
    remote.remember_uri(recipe.checkpoint.uri)
    return stream


def _close_lost_part(recipe: Recipe, ledger: Ledger, earlier: list[dict]) -> None:
    """A continued run whose earlier driver is gone (its controller lost, or stopped): record the
    VMs that driver left held as released when their watchers' autodown ended them (estimated from
    its last event), and the loss (`driver_lost`: the report prices it)."""
    from elastic.record import remote
    from elastic.record.events import DriverLost, NodeReleased

    if not remote.earlier_part(earlier):
        return
    # A controller's boot script names the VM it runs on: one that booted again continues the run
    # it holds, and is not one of the VMs its lost driver left.
    lost = remote.lost_vms(earlier, time.time(), recipe.resources.autodown_after_s,
                           this_vm=os.environ.get("ELASTIC_INSTANCE_ID") or None)
    for vm_id, at in lost:
        ledger.append(NodeReleased(instance_id=vm_id, released_at=round(at, 6)))
    step = max((e.get("outer_step") or 0 for e in earlier if e.get("type") == OuterStep.TYPE), default=0)
    ledger.append(DriverLost(last_seen_at=remote.last_seen(earlier), instance_ids=[vm_id for vm_id, _ in lost],
                             outer_step=step))


def launch(recipe: Recipe, run_dir: Path, address: str | None = None, console=None, resume: bool = False,
           earlier: tuple[bytes, bytes] | None = None) -> int:
    """Run a recipe end to end; returns the process exit code. What it prints is written by a
    thread of its own (`elastic.views.termout`): a terminal that stops reading never holds the training.
    `earlier`: the ledger and metrics bytes of the run's record this run continues (`earlier_record`)."""
    from rich.console import Console

    from elastic.views.termout import detached

    console = console or Console()
    with detached(console):
        return _launch(recipe, run_dir, address, console, resume, earlier)


def _launch(recipe: Recipe, run_dir: Path, address: str | None, console, resume: bool,
            earlier: tuple[bytes, bytes] | None) -> int:
    prepare_run_dir(run_dir)
    (run_dir / "recipe.yaml").write_text(dump_recipe(recipe), encoding="utf-8")
    stream = _start_record(recipe, run_dir, earlier)
    held: list = []   # the driver, once made: its controller VM goes last
    try:
        return _launch_recorded(recipe, run_dir, address, console, resume, earlier, held)
    finally:
        # The end of a run on a controller: the record complete in storage, then the VM let go.
        if stream is not None:
            stream.close()
        for driver in held:
            driver.release_controller()


def _launch_recorded(recipe: Recipe, run_dir: Path, address: str | None, console, resume: bool,
                     earlier: tuple[bytes, bytes] | None, held: list) -> int:
    from elastic.run.logs import run_logging
    from elastic.views.report import summary_table
    from elastic.views.report_html import write_report

    run = run_dir.name
    with run_logging(run_dir / "driver.log", console), _stacks_on_sigusr1(run_dir / STACKS):
        ledger = Ledger(run_dir / "events.jsonl")
        ledger.append(RunStarted(run=run, recipe=recipe.name, recipe_digest=recipe.digest(), pid=os.getpid(),
                                 host=socket.gethostname(), target_replicas=recipe.world.replicas,
                                 ranks_per_replica=recipe.world.ranks_per_replica))
        _record_plan(recipe, ledger)
        # Every event of the story gets its line, also those of the start and of the teardown.
        ledger.listeners.append(story_listener(console))
        if earlier is not None:
            from elastic.record.remote import records_of
            _close_lost_part(recipe, ledger, records_of(earlier[0]))
        status, message = RunStatus.FAILED, None
        driver = None
        t_start = time.monotonic()
        try:
            with stop.raise_interrupt():   # Ctrl-C, SIGTERM, SIGHUP: KeyboardInterrupt, never lost
                console.print(f"[bold]elastic[/bold] run [cyan]{escape(run)}[/cyan] → {escape(str(run_dir))}",
                              highlight=False, soft_wrap=True)
                from elastic.run.driver import Driver

                driver = Driver(recipe, run_dir, ledger, resume=resume)
                held.append(driver)
                with console.status("starting Ray cluster…"):
                    driver.start_cluster(address)
                with _View(console, recipe, driver.world.total_outer_steps) as view:
                    status = driver.run(view)
                message = driver.end_message
        except KeyboardInterrupt:
            status, message = RunStatus.INTERRUPTED, "interrupted by signal"
            log.warning("run interrupted")
        except UserError as exc:
            status, message = RunStatus.FAILED, "; ".join(exc.lines)
            log.error("run failed: %s", message, exc_info=True)
        except Exception as exc:  # the run fails; the user gets one line, the log the traceback
            status, message = RunStatus.FAILED, described(exc, 10_000)
            log.error("run failed: %s", message, exc_info=True)
        finally:
            with _signals_ignored():
                if message:
                    ledger.append(Error(message=message))
                if driver is not None:
                    driver.release_all()
                ledger.append(RunEnded(status=status, wall_s=round(time.monotonic() - t_start, 3)))
                ledger.close()
                _save_throughput(recipe, ledger.events)
                report = write_report(run_dir)
                log.info("run ended: %s; report %s", status, run_dir / "report.html")
    from elastic.views.termout import plain_console
    plain_console(console).print(summary_table(report))
    if message:
        console.print(f"[red]error:[/red] {escape(message)}" if status == RunStatus.FAILED
                      else f"[yellow]{escape(message)}[/yellow]", highlight=False, soft_wrap=True)
    console.print(f"report: {run_dir / 'report.json'}, {run_dir / 'report.html'}", highlight=False, soft_wrap=True)
    return EXIT[status]


def _record_plan(recipe: Recipe, ledger: Ledger) -> None:
    """Record what `elastic plan` would say now (`run_planned`), for the report's plan-against-actual;
    a plan that cannot be made (no offer yet, a cloud not answering) is logged, not fatal."""
    from elastic.run.fleet import plan_now

    try:
        placement = plan_now(recipe)
    except Exception as exc:
        log.warning("no plan recorded: %s", first_line(exc, 10_000),
                    exc_info=True)
        return
    if placement is None:
        return
    doc = placement.to_dict(recipe)
    ledger.append(RunPlanned(replicas=doc["replicas"], useful_tokens_per_s=doc["useful_tokens_per_s"],
                             tokens_per_s_source=doc["tokens_per_s_source"], usd_per_hour=doc["usd_per_hour"],
                             expected_hours=doc["expected_hours"], expected_usd=doc["expected_usd"],
                             tokens_needed=doc["tokens_needed"], quality=doc["quality"]))


def _save_throughput(recipe: Recipe, events: list[dict]) -> None:
    """Add what this run measured (tokens/s per instance type) to the history `elastic plan` reads."""
    from elastic.policy.market import measure_throughput, save_throughput, workload_key

    try:
        measured = measure_throughput(events, recipe.train.batch_size * recipe.train.seq_len)
        if measured:
            save_throughput(measured, workload_key(recipe))
            log.info("measured throughput saved: %s", {f"{c}:{t}": round(n / s, 1) for (c, t), (n, s) in measured.items()})
    except Exception:
        log.exception("saving the measured throughput")
