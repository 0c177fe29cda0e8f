"""The run report: a view of the ledger, never a second tally.

`build_report(events)` turns `events.jsonl` (read back typed: `elastic.record.events.read`) into the
figures of `report.json`, every dollar priced by `elastic.record.billing`; `elastic.views.report_html` draws the
same ledger and writes both files (`write_report`). Nothing here reads
the clock: the report of a ledger is the same whenever it is built (the end of a running ledger is
its last event, unless the caller passes `now`).

Billing model (`elastic.record.billing`, see docs/report.md): each VM is billed from `launched_at` to its
release or preemption, at the price in effect in each interval (`node_launched.usd_per_hour`, then
every `node_price` event for it), with its cloud's increment and minimum once it is gone. The on-demand equivalent prices the
same VM-seconds at `on_demand_usd_per_hour`. Storage and egress are estimates from bytes moved.
"""

from __future__ import annotations

import statistics
from typing import TypeVar

from elastic.record import billing
from elastic.record.billing import WASTE_CAUSES
from elastic.record.events import (
    BudgetExhausted, CapacityWaitEnded, CheckpointDeleted, CheckpointSaved, CheckpointUploadFailed,
    CheckpointUploaded, DriverLost, Error, Event, NodeNotice, NodePreempted, OnDemandStarted, OuterStep, ReplicaDrained,
    ReplicaJoined, ReplicaLost, Resumed, RunEnded, RunPlanned, RunStarted, SyncRetried, Validation, WorldFormed, WorldPaused,
    WorldRestored, WorldUnpaused, read)

E = TypeVar("E", bound=Event)

# Estimate rate (list price, USD) of traffic between regions per GB. Object storage is priced by
# the provider whose URI scheme a checkpoint's is (`providers.storage_usd_per_gb_month`); local
# disks are part of the VM price.
EGRESS_USD_PER_GB = 0.02
_MONTH_S = 30 * 86400


def _instances(vms: dict[str, billing.Hold]) -> list[dict]:
    """Every VM the run held, with seconds held, seconds billed and cost."""
    out = []
    for h in vms.values():
        vm, seconds, billed, cost = h.vm, h.stop_s - h.start_s, h.billed_s(), h.usd()
        out.append({"instance_id": vm.instance_id, "cloud": vm.cloud, "region": vm.region, "zone": vm.zone,
                    "instance_type": vm.instance_type, "gpu": vm.gpu or "", "gpus": vm.gpus or 0,
                    "spot": vm.spot, "usd_per_hour": vm.usd_per_hour,
                    "on_demand_usd_per_hour": vm.on_demand_usd_per_hour,
                    "mean_usd_per_hour": round(cost / billed * 3600, 6) if billed > 0 else vm.usd_per_hour,
                    "price_changes": len(h.segments) - 1,
                    "launched_at": h.start_s, "released_at": h.end_s,
                    "seconds": round(seconds, 3), "billed_seconds": round(billed, 3),
                    "cost_usd": round(cost, 6), "on_demand_cost_usd": round(h.on_demand_usd(), 6),
                    "joined": h.joined, "ended": h.ended})
    return out


def _breakdown(instances: list[dict], key: str) -> dict:
    out: dict[str, dict] = {}
    for i in instances:
        row = out.setdefault(i[key], {"instances": 0, "seconds": 0.0, "cost_usd": 0.0,
                                      "on_demand_equivalent_usd": 0.0, "gpu_hours": 0.0})
        row["instances"] += 1
        row["seconds"] += i["billed_seconds"]
        row["cost_usd"] += i["cost_usd"]
        row["on_demand_equivalent_usd"] += i["on_demand_cost_usd"]
        row["gpu_hours"] += i["billed_seconds"] * i["gpus"] / 3600
    return {k: {f: round(v, 6) if isinstance(v, float) else v for f, v in row.items()} for k, row in sorted(out.items())}


def _of(events: list[Event], cls: type[E]) -> list[E]:
    """The events of one type, in ledger order."""
    return [e for e in events if isinstance(e, cls)]


def _estimates(events: list[Event], vms: dict[str, billing.Hold], end: float) -> dict:
    """Storage and egress: estimates from bytes moved, at the providers' storage list prices and
    the egress rate above."""
    from providers import storage_usd_per_gb_month

    storage_rates = storage_usd_per_gb_month()
    deleted = {e.step: e.t for e in _of(events, CheckpointDeleted)}
    written, storage_usd = 0, 0.0
    for e in _of(events, CheckpointUploaded):
        written += e.bytes
        rate = storage_rates.get(e.uri.partition("://")[0], 0.0)
        kept_s = max(0.0, deleted.get(e.step, end) - e.t)
        storage_usd += e.bytes / 1e9 * rate * kept_s / _MONTH_S
    ranks = _ranks(events)
    region_of: dict[int, str] = {}
    cross = 0
    for e in events:
        if isinstance(e, ReplicaJoined) and e.instance_id in vms:
            region_of[e.replica] = f"{vms[e.instance_id].vm.cloud}/{vms[e.instance_id].vm.region}"
        elif isinstance(e, OuterStep):
            regions = {region_of.get(r) for r in e.replicas} - {None}
            if len(regions) > 1:
                # A ring all-reduce crosses a region boundary once per region; each crossing carries
                # about what one rank sends.
                cross += (e.bytes_sent or 0) * ranks * len(regions)
    return {"checkpoint_bytes_written": written, "checkpoint_storage_usd": round(storage_usd, 6),
            "cross_region_sync_bytes": cross, "egress_usd": round(cross / 1e9 * EGRESS_USD_PER_GB, 6),
            "storage_usd_per_gb_month": storage_rates, "egress_usd_per_gb": EGRESS_USD_PER_GB}


def _ranks(events: list[Event]) -> int:
    """Ranks per replica (the first `run_started`'s; 1 when unknown)."""
    start = next(iter(_of(events, RunStarted)), None)
    return (start.ranks_per_replica if start else None) or 1


def _sync_traffic(events: list[Event], steps: list[OuterStep]) -> dict:
    """Outer-sync bytes per trained token, against what data-parallel training would have sent for
    the same tokens: DDP all-reduces the whole bfloat16 gradient every inner step (a ring: each of
    n replicas sends 2(n-1)/n of it)."""
    ranks = _ranks(events)
    params = next((e.params for e in reversed(_of(events, WorldFormed)) if e.params), 0)
    sent = ddp = tokens = 0
    for e in steps:
        n = len(e.replicas)
        sent += (e.bytes_sent or 0) * ranks * n
        ddp += 4 * (n - 1) * max((e.steps_done or {}).values(), default=0) * params
        tokens += e.tokens
    return {"bytes_sent": sent,
            "bytes_per_token": round(sent / tokens, 4) if tokens else None,
            "ddp_bytes_per_token": round(ddp / tokens, 4) if tokens and params else None,
            "vs_ddp": round(ddp / sent, 1) if sent and params else None,
            "network_s": round(sum(e.network_s or 0.0 for e in steps), 3),
            "wait_s": round(sum(e.wait_s for e in steps), 3),
            "overlapped_s": round(sum(e.overlapped_s for e in steps), 3)}


def _recovery_s(events: list[Event], steps: list[OuterStep]) -> list[float]:
    """For each replica lost while training: seconds from the loss to the next outer step the
    re-formed world completed."""
    out = []
    for e in _of(events, ReplicaLost):
        if e.phase == "setup":
            continue
        nxt = next((s for s in steps if s.t > e.t), None)
        if nxt is not None:
            out.append(round(nxt.t - e.t, 3))
    return out


def _effective(steps: list[OuterStep], instances: list[dict]) -> float | None:
    """Fraction of rented node-seconds that produced kept training progress: each completed outer
    step credits its duration to every replica whose pseudo-gradient it applied."""
    rented = sum(i["seconds"] for i in instances)
    if rented <= 0:
        return None
    useful = sum((s.inner_s + s.sync_s) * len(s.replicas) for s in steps)
    return round(min(1.0, useful / rented), 4)


def _mean_loss(step: OuterStep | None) -> float | None:
    """Mean loss over an outer step's inner phase (None without one)."""
    return sum(step.losses) / len(step.losses) if step is not None and step.losses else None


def build_report(records: list[dict], now: float | None = None) -> dict:
    """The report.json figures, computed from a ledger's records (`read_events`) alone."""
    events = read(records)
    start = next(iter(_of(events, RunStarted)), None)
    end = next(iter(reversed(_of(events, RunEnded))), None)
    if now is None:
        now = end.t if end else (events[-1].t if events else 0.0)
    steps = _of(events, OuterStep)
    vms = billing.holds(events, now)
    instances = _instances(vms)
    # The totals sum the unrounded per-VM figures, so the report's cost is the driver's running cost
    # (`billing.cost_so_far`) to the sixth decimal, however many VMs the run held.
    cost = sum(h.usd() for h in vms.values())
    on_demand_exact = sum(h.on_demand_usd() for h in vms.values())
    tokens = steps[-1].tokens_total if steps else 0
    # What this run trained: a run resumed from a checkpoint starts at its tokens, which an earlier
    # run trained and paid for. Tokens/s divides every token trained by the training seconds.
    kept = tokens - (steps[0].tokens_total - steps[0].tokens) if steps else 0
    trained = sum(e.tokens for e in steps)
    deleted = {e.step for e in _of(events, CheckpointDeleted)}
    uploads = _of(events, CheckpointUploaded)
    validations = _of(events, Validation)
    lost = _of(events, ReplicaLost)
    preempted, noticed = _of(events, NodePreempted), _of(events, NodeNotice)
    train_s = sum(e.inner_s + e.sync_s for e in steps)
    report = {
        "run": start.run if start else None,
        "status": end.status if end else "running",
        "recipe_digest": start.recipe_digest if start else None,
        "tokens": tokens,
        "outer_steps": steps[-1].outer_step if steps else 0,
        "inner_steps": steps[-1].inner_step if steps else 0,
        # Mean loss over the first and the last inner phase: the first and last points of the loss
        # chart, the figures of the first and last progress lines.
        "loss_first": _mean_loss(steps[0] if steps else None),
        "loss_last": _mean_loss(steps[-1] if steps else None),
        "wall_s": round(now - start.t, 3) if start else 0.0,
        "train_s": round(train_s, 3),
        "first_step_s": round(steps[0].t - steps[0].inner_s - steps[0].sync_s - start.t, 3)
        if steps and start else None,
        "tokens_this_run": kept,
        "tokens_per_s": round(trained / train_s, 1) if train_s > 0 else 0.0,
        "cost_usd": round(cost, 6),
        "refunded_usd": round(sum(billing.vm_usd(h.vm.cloud, h.segments, h.stop_s, ended=True)
                                  for h in vms.values() if h.free), 6),
        "usd_per_mtok": round(cost / kept * 1e6, 6) if kept > 0 else None,
        "on_demand_equivalent_usd": round(on_demand_exact, 6),
        "savings_pct": round(100 * (1 - cost / on_demand_exact), 2)
        if on_demand_exact > 0 else None,
        "vm_hours": round(sum(i["billed_seconds"] for i in instances) / 3600, 6),
        "gpu_hours": round(sum(i["billed_seconds"] * i["gpus"] for i in instances) / 3600, 6),
        "wasted_usd": billing.wasted(events, vms),
        "estimates": _estimates(events, vms, now),
        "sync": _sync_traffic(events, steps),
        "by_cloud": _breakdown(instances, "cloud"),
        "by_region": _breakdown(instances, "region"),
        "by_instance_type": _breakdown(instances, "instance_type"),
        "instances": instances,
        "nodes_joined": sum(1 for i in instances if i["joined"]),
        "nodes_never_joined": sum(1 for i in instances if not i["joined"]),
        # A VM the cloud reclaims counts once, whether it was killed outright or after a notice
        # (and whether or not the run released it before the deadline).
        "preemptions": len({e.instance_id for e in preempted + noticed}),
        "preemptions_with_notice": len({e.instance_id for e in noticed}),
        "preemptions_without_notice": len({e.instance_id for e in preempted if not e.with_notice}),
        "drained": len(_of(events, ReplicaDrained)),
        "joins": sum(1 for e in _of(events, ReplicaJoined) if (e.outer_step or 0) > 0),
        "joins_at_start": sum(1 for e in _of(events, ReplicaJoined) if not e.outer_step),
        "replicas_lost": len(lost),
        "recovery_s": _recovery_s(events, steps),
        "lost_inner_steps": sum(e.lost_inner_steps or 0 for e in lost),
        "sync_retries": sum(e.attempts - 1 for e in _of(events, SyncRetried)),
        "effective_training_time": _effective(steps, instances),
        # Drivers that started (a `run_started` of `elastic launch` recording a controller is none).
        "driver_restarts": max(0, sum(1 for e in _of(events, RunStarted) if e.head != "controller") - 1),
        "driver_lost": _driver_lost(events, vms),
        # VMs rented on-demand (in a spot run: the deadline rule's fallback, `on_demand_started`).
        "on_demand_vm_hours": round(sum(i["billed_seconds"] for i in instances if not i["spot"]) / 3600, 6),
        "on_demand_usd": round(sum(i["cost_usd"] for i in instances if not i["spot"]), 6),
        "on_demand_why": [e.story() for e in _of(events, OnDemandStarted)],
        "capacity_wait_s": round(sum(e.waited_s or 0 for e in _of(events, CapacityWaitEnded)), 3),
        "pauses": len(_of(events, WorldPaused)),
        "paused_s": round(_paused_s(events), 3),
        "resumed_from_step": next((e.from_step for e in _of(events, Resumed)), None),
        "restored_from_checkpoint": sum(1 for e in _of(events, WorldRestored) if e.uri),
        "max_replicas_seen": max((len(e.replicas) for e in steps), default=0),
        # Complete checkpoints still kept (retention deletes the older ones).
        "checkpoints": [f"{e.uri.rstrip('/')}/step-{e.step:08d}" for e in uploads if e.step not in deleted],
        "checkpoint_stall_s": round(sum(e.stall_s for e in _of(events, CheckpointSaved)), 3),
        "checkpoint_upload_s": round(sum(e.seconds for e in uploads), 3),
        "checkpoint_uploads_failed": len(_of(events, CheckpointUploadFailed)),
        "validation": [{"outer_step": e.outer_step, "tokens_total": e.tokens_total, "loss": e.loss,
                        "perplexity": e.perplexity} for e in validations],
        "val_loss_last": validations[-1].loss if validations else None,
        # What the plan expected DiLoCo's H and sync to cost against synchronous DDP (bench/quality.py).
        "expected_quality_cost": next((e.quality for e in _of(events, RunPlanned)), None),
        "budget_exhausted": next((e.reason for e in _of(events, BudgetExhausted)), None),
        "errors": [e.message for e in _of(events, Error)],
    }
    report["plan_vs_actual"] = _plan_vs_actual(events, report)
    return report


def _driver_lost(events: list[Event], vms: dict) -> list[dict]:
    """What each lost driver cost (`driver_lost` events): the seconds the run had no driver (from
    the lost one's last event to the next one's start), the USD its VMs accrued unused until their
    autodown, and the outer steps trained again (its last one minus the step the run continued from)."""
    out = []
    for i, e in enumerate(events):
        if not isinstance(e, DriverLost):
            continue
        resumed = next((r.from_step for r in events[i:] if isinstance(r, Resumed)), 0)
        start = next((s for s in reversed(_of(events[:i], RunStarted)) if s.head != "controller"), None)
        out.append({"down_s": round((start.t if start else e.t) - e.last_seen_at, 3),
                    "vms": len(e.instance_ids),
                    "usd_held_unused": round(billing.driver_lost_usd(e, vms), 6),
                    "outer_steps_redone": max(0, e.outer_step - resumed)})
    return out


def _paused_s(events: list[Event]) -> float:
    """Seconds the run spent paused by the pause rule: each `world_unpaused`'s `paused_s`, and a
    pause still under way when the ledger ends (a run stopped while paused) up to its last event."""
    total, since = 0.0, None
    for e in events:
        if isinstance(e, WorldPaused):
            since = e.t
        elif isinstance(e, WorldUnpaused) and since is not None:
            total, since = total + e.paused_s, None
    if since is not None and events:
        total += max(0.0, events[-1].t - since)
    return total


def _plan_vs_actual(events: list[Event], report: dict) -> dict | None:
    """What `elastic plan` predicted when the run started (`run_planned`) beside what the run did:
    tokens/s, USD and hours. None when no plan was recorded."""
    planned = next(iter(_of(events, RunPlanned)), None)
    if planned is None:
        return None
    return {"planned": {"tokens_per_s": planned.useful_tokens_per_s, "source": planned.tokens_per_s_source,
                        "usd": planned.expected_usd, "hours": planned.expected_hours,
                        "replicas": planned.replicas},
            "actual": {"tokens_per_s": report["tokens_per_s"], "usd": report["cost_usd"],
                       "hours": round(report["wall_s"] / 3600, 6), "replicas": report["max_replicas_seen"]}}


def _fmt(v, spec=""):
    return "-" if v is None else format(v, spec)


def headline_rows(report: dict) -> list[tuple[str, str]]:
    """The headline figures as (label, text): the terminal summary and the top of report.html."""
    waste = report["wasted_usd"]
    causes = ", ".join(f"{k.replace('_', ' ')} ${waste[k]:.4f}" for k in WASTE_CAUSES if waste[k])
    rows = [
        ("status", report["status"]),
        ("outer steps", _fmt(report["outer_steps"])),
        ("tokens", _fmt(report["tokens"], ",")),
        ("loss first → last", f"{_fmt(report['loss_first'], '.3f')} → {_fmt(report['loss_last'], '.3f')}"),
        ("wall time", f"{report['wall_s']:.1f} s"),
        ("tokens/s (training)", _fmt(report["tokens_per_s"], ",.0f")),
        ("cost", f"${report['cost_usd']:.4f}" + (f" (the clouds refunded ${report['refunded_usd']:.4f} of spot VMs "
                                                  "they took back young)" if report.get("refunded_usd") else "")),
        ("on-demand equivalent", f"${report['on_demand_equivalent_usd']:.4f}"),
        ("saving vs on-demand", "-" if report["savings_pct"] is None else f"{report['savings_pct']:.1f} %"),
        ("$ per 1M tokens", _fmt(report["usd_per_mtok"], ".4f")),
        ("VM-hours / GPU-hours", f"{report['vm_hours']:.3f} / {report['gpu_hours']:.3f}"),
        ("wasted", f"${waste['total']:.4f}" + (f" ({causes})" if causes else "")),
        *[("driver lost", (f"{d['down_s']:.0f} s without a driver, {d['vms']} VM(s) held unused "
                           f"${d['usd_held_unused']:.4f} until their autodown, {d['outer_steps_redone']} outer "
                           f"step(s) trained again")) for d in report.get("driver_lost") or ()],
        *([("on-demand VMs", f"{report['on_demand_vm_hours']:.2f} VM-hours, ${report['on_demand_usd']:.4f}"
            + (f" ({report['on_demand_why'][-1]})" if report["on_demand_why"] else ""))]
          if report.get("on_demand_why") else []),
        ("instances", str(len(report["instances"]))),
        # The replicas that joined at the start are said apart: the console printed their joins too.
        ("preemptions / joins", f"{report['preemptions']} / {report['joins']}"
                                + (f" (+{report['joins_at_start']} at the start)" if report.get("joins_at_start") else "")),
        ("recovery (median)", f"{statistics.median(report['recovery_s']):.1f} s" if report["recovery_s"] else "-"),
        ("effective training time", _fmt(report["effective_training_time"], ".1%")),
        ("sync bytes/token (data-parallel ÷ this)",
         f"{_fmt(report['sync']['bytes_per_token'], ',.2f')} ({_fmt(report['sync']['vs_ddp'], ',.0f')}×)"),
        ("outer sync: waited / overlapped", f"{report['sync']['wait_s']:.1f} s / {report['sync']['overlapped_s']:.1f} s"),
        ("storage + egress (estimate)",
         f"${report['estimates']['checkpoint_storage_usd'] + report['estimates']['egress_usd']:.4f}"),
        *_plan_rows(report.get("plan_vs_actual")),
    ]
    if report.get("val_loss_last") is not None:
        rows.insert(4, ("validation loss (last)", f"{report['val_loss_last']:.3f} "
                                                  f"(ppl {report['validation'][-1]['perplexity']:,.2f})"))
    return rows


def _plan_rows(pva: dict | None) -> list[tuple[str, str]]:
    if pva is None:
        return []
    p, a = pva["planned"], pva["actual"]
    usd = (lambda x: "-" if x is None else f"${x:.4f}")
    hours = (lambda x: "-" if x is None else f"{x:.3f} h")
    return [("tokens/s: plan → actual", f"{_fmt(p['tokens_per_s'], ',.0f')} ({p['source']}) → "
                                        f"{_fmt(a['tokens_per_s'], ',.0f')}"),
            ("USD: plan → actual", f"{usd(p['usd'])} → {usd(a['usd'])}"),
            ("hours: plan → actual", f"{hours(p['hours'])} → {hours(a['hours'])}")]


def summary_table(report: dict):
    """A rich table of the headline figures."""
    from rich.table import Table

    table = Table(title=f"elastic run {report['run']}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    for k, v in headline_rows(report):
        table.add_row(k, v)
    return table


def compare_table(a: dict, b: dict, name_a: str, name_b: str):
    """Two runs side by side: the headline figures of each."""
    from rich.table import Table

    table = Table(title="elastic runs compared", title_justify="left")
    table.add_column("")
    table.add_column(name_a, justify="right")
    table.add_column(name_b, justify="right")
    for (k, va), (_, vb) in zip(headline_rows(a), headline_rows(b)):
        table.add_row(k, va, vb, style="bold" if va != vb else None)
    return table
