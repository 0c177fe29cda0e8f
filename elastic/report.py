"""The run report: a view of the ledger, never a second tally.

`build_report(events)` turns `events.jsonl` into the figures of `report.json`; the same function
feeds the live view's "$ so far" and `elastic report RUN_DIR`.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from elastic.ledger import read_events


def _instances(events: list[dict], now: float) -> list[dict]:
    """Every VM the run held, with seconds held and cost (price × seconds, per-second billing)."""
    held: dict[str, dict] = {}
    for e in events:
        if e["type"] == "node_launched":
            held[e["instance_id"]] = {
                "instance_id": e["instance_id"], "cloud": e["cloud"], "region": e["region"], "zone": e["zone"],
                "instance_type": e["instance_type"], "spot": e["spot"], "usd_per_hour": e["usd_per_hour"],
                "on_demand_usd_per_hour": e["on_demand_usd_per_hour"],
                # Billing starts when the VM was rented (a cloud VM is recorded once it joined).
                "launched_at": e.get("launched_at", e["t"]), "released_at": None,
                "end": None}
        elif e["type"] in ("node_released", "node_preempted") and e["instance_id"] in held:
            held[e["instance_id"]]["released_at"] = e.get("released_at", e["t"])
            held[e["instance_id"]]["end"] = e["type"].removeprefix("node_")
    out = []
    for h in held.values():
        seconds = max(0.0, (h["released_at"] or now) - h["launched_at"])
        out.append({"instance_id": h["instance_id"], "cloud": h["cloud"], "region": h["region"], "zone": h["zone"],
                    "instance_type": h["instance_type"], "spot": h["spot"], "usd_per_hour": h["usd_per_hour"],
                    "seconds": round(seconds, 3), "cost_usd": round(seconds * h["usd_per_hour"] / 3600, 6),
                    "ended": h["end"] or "held"})
    return out


def _recovery_s(events: list[dict], steps: list[dict]) -> list[float]:
    """For each replica lost while training: seconds from the loss to the next outer step the
    re-formed world completed."""
    out = []
    for e in events:
        if e["type"] != "replica_lost" or e.get("phase") == "setup":
            continue
        nxt = next((s for s in steps if s["t"] > e["t"]), None)
        if nxt is not None:
            out.append(round(nxt["t"] - e["t"], 3))
    return out


def _effective(steps: list[dict], instances: list[dict]) -> float | None:
    """Fraction of rented node-seconds that produced kept training progress: each completed outer
    step credits its duration to every replica whose pseudo-gradient it applied."""
    rented = sum(i["seconds"] for i in instances)
    if rented <= 0:
        return None
    useful = sum((s["inner_s"] + s["sync_s"]) * len(s["replicas"]) for s in steps)
    return round(min(1.0, useful / rented), 4)


def cost_so_far(events: list[dict], now: float) -> float:
    """USD accrued by every VM the run has held, up to `now`."""
    return sum(i["cost_usd"] for i in _instances(events, now))


def build_report(events: list[dict], now: float | None = None) -> dict:
    """The report.json figures, computed from ledger events alone."""
    start = next((e for e in events if e["type"] == "run_started"), None)
    end = next((e for e in reversed(events) if e["type"] == "run_ended"), None)
    if now is None:
        now = end["t"] if end else (events[-1]["t"] if events else 0.0)
    steps = [e for e in events if e["type"] == "outer_step"]
    instances = _instances(events, now)
    cost = sum(i["cost_usd"] for i in instances)
    tokens = steps[-1]["tokens_total"] if steps else 0
    errors = [e["message"] for e in events if e["type"] == "error"]
    deleted = {e["step"] for e in events if e["type"] == "checkpoint_deleted"}
    train_s = sum(e["inner_s"] + e["sync_s"] for e in steps)
    report = {
        "run": start["run"] if start else None,
        "status": end["status"] if end else "running",
        "recipe_digest": start.get("recipe_digest") if start else None,
        "tokens": tokens,
        "outer_steps": steps[-1]["outer_step"] if steps else 0,
        "inner_steps": steps[-1]["inner_step"] if steps else 0,
        # First inner step's loss of the run; mean loss over the last inner phase.
        "loss_first": steps[0]["losses"][0] if steps and steps[0]["losses"] else None,
        "loss_last": (sum(steps[-1]["losses"]) / len(steps[-1]["losses"])) if steps and steps[-1]["losses"] else None,
        "wall_s": round(now - start["t"], 3) if start else 0.0,
        "train_s": round(train_s, 3),
        "first_step_s": round(steps[0]["t"] - steps[0]["inner_s"] - steps[0]["sync_s"] - start["t"], 3)
        if steps and start else None,
        "tokens_per_s": round(tokens / train_s, 1) if train_s > 0 else 0.0,
        "cost_usd": round(cost, 6),
        "usd_per_mtok": round(cost / tokens * 1e6, 6) if tokens else None,
        "instances": instances,
        # A VM the cloud reclaims counts once, whether it was killed outright or after a notice
        # (and whether or not the run released it before the deadline).
        "preemptions": len({e["instance_id"] for e in events if e["type"] in ("node_preempted", "node_notice")}),
        "preemptions_with_notice": len({e["instance_id"] for e in events if e["type"] == "node_notice"}),
        "preemptions_without_notice": len({e["instance_id"] for e in events
                                           if e["type"] == "node_preempted" and not e.get("with_notice")}),
        "drained": sum(1 for e in events if e["type"] == "replica_drained"),
        "joins": sum(1 for e in events if e["type"] == "replica_joined" and e.get("outer_step", 0) > 0),
        "replicas_lost": sum(1 for e in events if e["type"] == "replica_lost" and e.get("phase") != "setup"),
        "recovery_s": _recovery_s(events, steps),
        "lost_inner_steps": sum(e.get("lost_inner_steps", 0) for e in events if e["type"] == "replica_lost"),
        "sync_retries": sum(e["attempts"] - 1 for e in events if e["type"] == "sync_retried"),
        "effective_training_time": _effective(steps, instances),
        "driver_restarts": max(0, sum(1 for e in events if e["type"] == "run_started") - 1),
        "capacity_wait_s": round(sum(e.get("waited_s", 0) for e in events if e["type"] == "capacity_wait_ended"), 3),
        "resumed_from_step": next((e["from_step"] for e in events if e["type"] == "resumed"), None),
        "restored_from_checkpoint": sum(1 for e in events if e["type"] == "world_restored" and e.get("path")),
        "max_replicas_seen": max((len(e["replicas"]) for e in steps), default=0),
        # Checkpoints still kept (retention deletes the older ones).
        "checkpoints": [e["path"] for e in events if e["type"] == "checkpoint_saved" and e["step"] not in deleted],
        "budget_exhausted": next((e["reason"] for e in events if e["type"] == "budget_exhausted"), None),
        "errors": errors,
    }
    return report


def write_report(run_dir: str | Path) -> dict:
    """Rebuild `report.json` in `run_dir` from its ledger (atomic replace)."""
    run_dir = Path(run_dir)
    report = build_report(read_events(run_dir / "events.jsonl"))
    tmp = run_dir / "report.json.tmp"
    tmp.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, run_dir / "report.json")
    return report


def summary_table(report: dict):
    """A rich table of the headline figures."""
    from rich.table import Table

    table = Table(title=f"elastic run {report['run']}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")

    def fmt(v, spec=""):
        return "-" if v is None else format(v, spec)

    rows = [
        ("status", report["status"]),
        ("outer steps", fmt(report["outer_steps"])),
        ("tokens", fmt(report["tokens"], ",")),
        ("loss first → last", f"{fmt(report['loss_first'], '.3f')} → {fmt(report['loss_last'], '.3f')}"),
        ("wall time", f"{report['wall_s']:.1f} s"),
        ("tokens/s (training)", fmt(report["tokens_per_s"], ",.0f")),
        ("cost", f"${report['cost_usd']:.4f}"),
        ("$ per 1M tokens", fmt(report["usd_per_mtok"], ".4f")),
        ("instances", str(len(report["instances"]))),
        ("preemptions / joins", f"{report['preemptions']} / {report['joins']}"),
        ("recovery (median)", f"{statistics.median(report['recovery_s']):.1f} s" if report["recovery_s"] else "-"),
        ("effective training time", fmt(report["effective_training_time"], ".1%")),
    ]
    for k, v in rows:
        table.add_row(k, v)
    return table
