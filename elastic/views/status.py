"""`elastic status [RUN]`: a live view of a run from its ledger, from any terminal.

It reads `events.jsonl` (and the outer-step target from `recipe.yaml`), in the run directory or in
the run's record in storage (elastic/views/runs.py), and never talks to the driver, so it works
while the run goes, after it ended, and after its driver died.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from elastic.errors import UserError
from elastic.record import billing
from elastic.record.events import (NodeLaunched, NodeNotice, NodePreempted, NodeReleased, OnDemandStarted, OuterStep,
                            RunEnded, RunStarted, UnknownEvent, WorldPaused, WorldUnpaused, read)
from elastic.record.ledger import LedgerError, SHAPE_ERRORS

REFRESH_S = 1.0     # how often the live view re-reads the ledger
REMOTE_REFRESH_S = 2.0   # ... a record in storage (a listing and the new parts each time)
RECENT_STEPS = 5    # tokens/s and step time over the last outer steps


def latest_run_dir(root: Path = Path("runs")) -> Path:
    """The run under `root` whose ledger changed last."""
    ledgers = sorted(root.glob("*/events.jsonl"), key=lambda p: p.stat().st_mtime) if root.is_dir() else []
    if not ledgers:
        raise UserError(f"no run under {root}/ (no */events.jsonl); pass RUN_DIR")
    return ledgers[-1].parent


def target_outer_steps(recipe_text: str | None) -> int | None:
    """`train.outer_steps` of a run's recipe.yaml text (None without one, or unreadable)."""
    import yaml

    if recipe_text is None:
        return None
    try:
        return int(yaml.safe_load(recipe_text)["train"]["outer_steps"])
    except (yaml.YAMLError, KeyError, TypeError, ValueError, AttributeError):
        return None


def driver_alive(pid, host) -> bool:
    """Whether the driver that wrote the ledger still runs (unknown, or on another host: assume so)."""
    import socket

    if not isinstance(pid, int) or (host is not None and host != socket.gethostname()):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def snapshot(records: list[dict], now: float, target_outer_steps: int | None = None) -> dict:
    """The live figures of a ledger's records at unix time `now` (the end of the run once it ended)."""
    events = read(records)
    start = next((e for e in events if isinstance(e, RunStarted)), None)
    end = next((e for e in reversed(events) if isinstance(e, RunEnded)), None)
    if end is not None:
        now = end.t
    steps = [e for e in events if isinstance(e, OuterStep)]
    recent = steps[-RECENT_STEPS:]
    busy_s = sum(s.inner_s + s.sync_s for s in recent)
    vms = billing.holds(events, now)
    spent = sum(h.usd() for h in vms.values())
    burn = sum(h.segments[-1][1] for h in vms.values() if h.end_s is None) if end is None else 0.0
    done = steps[-1].outer_step if steps else 0
    first = steps[0].outer_step if steps else 0
    projected = None
    if end is not None:
        projected = spent
    elif target_outer_steps and len(steps) >= 2:
        # Wall time per outer step so far (joins, waits and checkpoints included), at today's burn.
        per_step_s = (steps[-1].t - steps[0].t) / (done - first) if done > first else 0.0
        projected = spent + burn * max(0, target_outer_steps - done) * per_step_s / 3600
    # The driver writing now is the last to start (a controller restarted, a run resumed).
    latest = next((e for e in reversed(events) if isinstance(e, RunStarted)), None)
    alive = end is not None or latest is None or driver_alive(latest.pid, latest.host)
    pause = next((e for e in reversed(events) if isinstance(e, (WorldPaused, WorldUnpaused))), None)
    paused = end is None and isinstance(pause, WorldPaused)
    running = ("paused: the market is dear, no replica VM held (planner.pauses)" if paused else "running")
    last = events[-1] if events else None
    on_demand = [h for h in vms.values() if not h.vm.spot]
    why = next((e for e in reversed(events) if isinstance(e, OnDemandStarted)), None)
    return {
        "run": start.run if start else None,
        "status": end.status if end else (running if alive else "driver gone (no run_ended)"),
        "ended": end is not None or not alive,
        "elapsed_s": round(now - start.t, 1) if start else 0.0,
        "outer_step": done,
        "target_outer_steps": target_outer_steps,
        # Replicas training now: none once the run ended or while it is paused (the last step's
        # count is `world_last`).
        "world": 0 if end is not None or paused else (len(steps[-1].replicas) if steps else 0),
        "world_last": len(steps[-1].replicas) if steps else 0,
        "vms_held": sum(1 for e in events if isinstance(e, NodeLaunched))
        - len({e.instance_id for e in events if isinstance(e, (NodeReleased, NodePreempted))}),
        "loss": (sum(steps[-1].losses) / len(steps[-1].losses)) if steps and steps[-1].losses else None,
        "tokens": steps[-1].tokens_total if steps else 0,
        "tokens_per_s": sum(s.tokens for s in recent) / busy_s if busy_s > 0 else None,
        "usd_so_far": spent,
        "burn_usd_per_hour": burn,
        "projected_usd": projected,
        "preemptions": len({e.instance_id for e in events if isinstance(e, (NodePreempted, NodeNotice))}),
        # On-demand VMs a spot run rented for its deadline (`on_demand_started`): how long, how much, why.
        "on_demand": None if why is None else {
            "held": sum(1 for h in on_demand if h.end_s is None),
            "vm_hours": sum(h.stop_s - h.start_s for h in on_demand) / 3600,
            "usd": sum(h.usd() for h in on_demand), "why": why.story()},
        "last_event": (last.type if isinstance(last, UnknownEvent) else last.TYPE) if last else None,
    }


def status_table(snap: dict, name: str):
    from rich.table import Table

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    t = Table(title=f"elastic status · {snap['run'] or name}", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column(justify="right")
    target = f"/{snap['target_outer_steps']}" if snap["target_outer_steps"] else ""
    for k, v in [
        ("status", snap["status"]),
        ("elapsed", f"{snap['elapsed_s']:.0f} s"),
        ("outer step", f"{snap['outer_step']}{target}"),
        ("world", f"{snap['world']} replica(s), {snap['vms_held']} VM(s) held"
                  + (f" (run over; {snap['world_last']} in its last outer step)" if snap["ended"] else "")),
        ("loss", fmt(snap["loss"], ".4f")),
        ("tokens", f"{snap['tokens']:,}"),
        ("tokens/s (recent)", fmt(snap["tokens_per_s"], ",.0f")),
        ("USD so far", f"${snap['usd_so_far']:.4f}"),
        ("burn rate", f"${snap['burn_usd_per_hour']:.4f}/h"),
        ("projected total", "-" if snap["projected_usd"] is None else f"${snap['projected_usd']:.4f}"),
        ("preemptions", str(snap["preemptions"])),
        *([("on-demand", f"{od['held']} held; {od['vm_hours']:.2f} VM-hours, ${od['usd']:.4f} so far ({od['why']})")]
          if (od := snap.get("on_demand")) else []),
        ("last event", snap["last_event"] or "-"),
    ]:
        t.add_row(k, v)
    return t


def _line(snap: dict) -> str:
    target = f"/{snap['target_outer_steps']}" if snap["target_outer_steps"] else ""
    loss = "-" if snap["loss"] is None else f"{snap['loss']:.4f}"
    projected = "-" if snap["projected_usd"] is None else f"${snap['projected_usd']:.4f}"
    return (f"{snap['status']}  outer {snap['outer_step']}{target}  world {snap['world']}  loss {loss}  "
            f"${snap['usd_so_far']:.4f} so far  ${snap['burn_usd_per_hour']:.4f}/h  projected {projected}")


def watch(src, console, once: bool = False) -> int:
    """Show the status of run `src` (elastic.views.runs: a run directory or a record in storage);
    refresh until it ends unless `once`. On a terminal the table redraws in place; piped, one line
    per outer step, then the table at the end."""
    target = target_outer_steps(src.recipe_text())
    refresh_s = src.refresh_s

    def render():
        events = src.events()
        if not events:
            raise UserError(f"{src.where}: no events (not a run's record)")
        try:
            snap = snapshot(events, time.time(), target)
        except SHAPE_ERRORS as exc:
            raise LedgerError(f"{src.ledger}: an event is not of the shape elastic writes "
                              f"({type(exc).__name__}: {str(exc)[:80]})") from None
        return snap, status_table(snap, src.name)

    snap, table = render()
    if once or snap["ended"]:
        console.print(table)
        return 0
    if not console.is_terminal:
        shown = None
        while not snap["ended"]:
            if (snap["outer_step"], snap["status"]) != shown:
                shown = (snap["outer_step"], snap["status"])
                console.print(_line(snap), highlight=False)
                console.file.flush()
            time.sleep(refresh_s)
            snap, table = render()
        console.print(table)
        return 0
    from rich.live import Live

    with Live(table, console=console, refresh_per_second=4) as live:
        while not snap["ended"]:
            time.sleep(refresh_s)
            snap, table = render()
            live.update(table)
    return 0
