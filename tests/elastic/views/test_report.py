"""The report is a view of the ledger: hand-made ledgers with known times, prices and losses."""

from __future__ import annotations

import io
import json

import pytest

from elastic.record.billing import cost_so_far
from elastic.record.events import RunEnded, RunStarted
from elastic.record.ledger import Ledger, read_events
from elastic.views.report import build_report, headline_rows, summary_table
from elastic.views.report_html import write_report
from tests.elastic.recipe.test_recipe import run_cli

T0 = 1_700_000_000.0  # run start, unix seconds


def node_launched(t: float, instance_id: str, usd_per_hour: float, spot: bool = True) -> dict:
    # The fields launch.py writes: the instance, its node, and the offer it was rented at.
    return {"t": t, "type": "node_launched", "instance_id": instance_id, "ray_node_id": f"ray-{instance_id}",
            "role": "replica", "cloud": "local", "region": "local-1", "zone": "local-1a",
            "instance_type": "local-cpu", "spot": spot, "usd_per_hour": usd_per_hour,
            "on_demand_usd_per_hour": 3 * usd_per_hour, "cpus": 1, "gpus": 0, "accelerator": None}


def outer_step(t: float, step: int, losses: list[float], tokens_total: int, inner_s: float, sync_s: float,
               replicas=(0, 1), inner_steps: int = 20) -> dict:
    return {"t": t, "type": "outer_step", "outer_step": step, "inner_step": step * inner_steps, "epoch": 0,
            "replicas": list(replicas), "losses": losses, "tokens": 40_960, "tokens_total": tokens_total,
            "inner_s": inner_s, "sync_s": sync_s, "bytes_sent": 1_000_000, "data_cursor": step * 320}


def run_events(ended: bool = True) -> list[dict]:
    """Two nodes at different prices; `a` released at +300 s, `b` never released; two outer steps."""
    events = [
        {"t": T0, "type": "run_started", "run": "tiny-1", "recipe": "tiny", "recipe_digest": "0123456789abcdef",
         "pid": 4242, "target_replicas": 2, "ranks_per_replica": 1},
        node_launched(T0 + 0, "a", usd_per_hour=0.36),
        node_launched(T0 + 10, "b", usd_per_hour=1.80),
        {"t": T0 + 12, "type": "replica_joined", "replica": 0, "instance_id": "a", "outer_step": 0, "epoch": 0},
        {"t": T0 + 12, "type": "replica_joined", "replica": 1, "instance_id": "b", "outer_step": 0, "epoch": 0},
        outer_step(T0 + 100, 1, losses=[5.5, 5.25], tokens_total=40_960, inner_s=80.0, sync_s=10.0),
        {"t": T0 + 101, "type": "checkpoint_saved", "step": 1, "local": "/tmp/stage/step-00000001", "stall_s": 0.5},
        {"t": T0 + 104, "type": "checkpoint_uploaded", "step": 1, "uri": "s3://b/run/", "bytes": 1234,
         "seconds": 3.25},
        outer_step(T0 + 200, 2, losses=[3.0, 2.0], tokens_total=81_920, inner_s=90.0, sync_s=10.0),
        {"t": T0 + 300, "type": "node_released", "instance_id": "a"},
    ]
    if ended:
        events.append({"t": T0 + 360, "type": "run_ended", "status": "completed", "wall_s": 359.9})
    return events


def test_a_resumed_run_counts_only_the_tokens_it_trained():
    """Resumed from a checkpoint at 1,000,000 tokens, the run trains two outer steps of 40,960
    tokens in 190 s: its tokens/s and USD per 1M tokens are of those 81,920 tokens."""
    events = run_events()
    for e in events:
        if e["type"] == "outer_step":
            e["tokens_total"] += 1_000_000
    events.insert(5, {"t": T0 + 12, "type": "resumed", "from_step": 10, "uri": "s3://b/run/"})
    r = build_report(events)
    assert r["tokens"] == 1_081_920 and r["tokens_this_run"] == 81_920
    assert r["tokens_per_s"] == pytest.approx(81_920 / 190, abs=0.05)
    assert r["usd_per_mtok"] == pytest.approx(0.205 / 81_920 * 1e6, abs=1e-6)


def write_ledger(path, events: list[dict]) -> None:
    path.write_text("".join(json.dumps(e) + "\n" for e in events), encoding="utf-8")


def test_figures_of_a_completed_run():
    r = build_report(run_events())
    assert r["run"] == "tiny-1"
    assert r["status"] == "completed"
    assert r["recipe_digest"] == "0123456789abcdef"
    # a: 300 s at $0.36/h = $0.03; b: launched at +10, never released, costed to run end (+360): 350 s at
    # $1.80/h = $0.175.
    by_id = {i["instance_id"]: i for i in r["instances"]}
    assert by_id["a"]["seconds"] == 300 and by_id["a"]["cost_usd"] == pytest.approx(0.03)
    assert by_id["a"]["ended"] == "released"
    assert by_id["b"]["seconds"] == 350 and by_id["b"]["cost_usd"] == pytest.approx(0.175)
    assert by_id["b"]["ended"] == "held"
    assert r["cost_usd"] == pytest.approx(0.205)
    assert r["tokens"] == 81_920
    assert r["outer_steps"] == 2
    assert r["inner_steps"] == 40
    assert r["loss_first"] == 5.375         # the mean of the first outer step's losses (its progress line)
    assert r["loss_last"] == 2.5            # the mean of the last outer step's losses
    assert r["usd_per_mtok"] == pytest.approx(0.205 / 81_920 * 1e6, abs=1e-6)
    assert r["wall_s"] == 360
    assert r["train_s"] == 190              # (80 + 10) + (90 + 10)
    assert r["tokens_per_s"] == pytest.approx(81_920 / 190, abs=0.05)
    assert r["first_step_s"] == 10          # +100 - (80 + 10) - start
    assert r["preemptions"] == 0
    assert r["joins"] == 0                  # joins at outer step 0 are the start, not a rejoin
    assert r["joins_at_start"] == 2         # ... said apart, not hidden: the console printed them
    assert dict(headline_rows(r))["preemptions / joins"] == "0 / 0 (+2 at the start)"
    assert r["max_replicas_seen"] == 2
    assert r["checkpoints"] == ["s3://b/run/step-00000001"]
    assert (r["checkpoint_stall_s"], r["checkpoint_upload_s"]) == (0.5, 3.25)
    assert r["estimates"]["checkpoint_bytes_written"] == 1234
    assert r["errors"] == []


def test_running_when_no_run_ended():
    r = build_report(run_events(ended=False))
    assert r["status"] == "running"
    # Without run_ended the view ends at the last event (+300): b has been held 290 s.
    assert r["wall_s"] == 300
    by_id = {i["instance_id"]: i for i in r["instances"]}
    assert by_id["b"]["seconds"] == 290 and by_id["b"]["cost_usd"] == pytest.approx(290 * 1.80 / 3600)
    assert r["cost_usd"] == pytest.approx(0.03 + 290 * 1.80 / 3600)


def test_now_costs_held_nodes_up_to_now():
    events = run_events(ended=False)
    r = build_report(events, now=T0 + 1010)
    by_id = {i["instance_id"]: i for i in r["instances"]}
    assert by_id["a"]["seconds"] == 300     # released: now does not matter
    assert by_id["b"]["seconds"] == 1000
    assert r["cost_usd"] == pytest.approx(0.03 + 0.5)
    assert cost_so_far(events, T0 + 1010) == pytest.approx(r["cost_usd"])


def test_failed_run_with_preemption_and_rejoin():
    events = run_events(ended=False)[:-1] + [
        {"t": T0 + 250, "type": "node_preempted", "instance_id": "b"},
        {"t": T0 + 260, "type": "replica_joined", "replica": 2, "instance_id": "c", "outer_step": 2, "epoch": 1},
        {"t": T0 + 270, "type": "error", "message": "RuntimeError: boom"},
        {"t": T0 + 280, "type": "node_released", "instance_id": "a"},
        {"t": T0 + 290, "type": "run_ended", "status": "failed", "wall_s": 290.0},
    ]
    r = build_report(events)
    assert r["status"] == "failed"
    by_id = {i["instance_id"]: i for i in r["instances"]}
    assert by_id["b"]["ended"] == "preempted" and by_id["b"]["seconds"] == 240
    assert by_id["a"]["seconds"] == 280
    assert r["cost_usd"] == pytest.approx(280 * 0.36 / 3600 + 240 * 1.80 / 3600)
    assert r["preemptions"] == 1
    assert r["joins"] == 1
    assert r["errors"] == ["RuntimeError: boom"]


def test_empty_and_stepless_ledgers():
    empty = build_report([])
    assert empty["status"] == "running" and empty["run"] is None
    assert empty["tokens"] == 0 and empty["cost_usd"] == 0 and empty["usd_per_mtok"] is None
    assert empty["loss_first"] is None and empty["loss_last"] is None

    events = run_events()[:3] + [{"t": T0 + 20, "type": "run_ended", "status": "interrupted", "wall_s": 20}]
    r = build_report(events)
    assert r["status"] == "interrupted"
    assert r["outer_steps"] == 0 and r["tokens"] == 0 and r["usd_per_mtok"] is None
    assert r["first_step_s"] is None
    assert r["cost_usd"] == pytest.approx(20 * 0.36 / 3600 + 10 * 1.80 / 3600)


def test_read_events_skips_a_torn_last_line(tmp_path):
    path = tmp_path / "events.jsonl"
    events = run_events()
    write_ledger(path, events)
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"t": 1700000400.0, "type": "outer_st')   # a crash mid-write: no closing brace, no newline
    assert read_events(path) == events
    assert build_report(read_events(path)) == build_report(events)


def test_read_events_of_missing_file(tmp_path):
    assert read_events(tmp_path / "events.jsonl") == []


def test_ledger_appends_and_reads_back(tmp_path):
    path = tmp_path / "run" / "events.jsonl"
    ledger = Ledger(path)
    first = ledger.append(RunStarted(run="r", recipe="tiny", recipe_digest="0" * 16))
    ledger.append(RunEnded(status="completed", wall_s=1.0))
    ledger.close()
    assert read_events(path) == ledger.events
    assert ledger.events[0] == first and first["type"] == "run_started" and isinstance(first["t"], float)
    assert build_report(read_events(path))["status"] == "completed"


def test_ledger_reopened_after_a_torn_line_keeps_new_events(tmp_path):
    path = tmp_path / "events.jsonl"
    write_ledger(path, run_events(ended=False))
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"t": 1700000400.0, "type": "outer_st')
    ledger = Ledger(path)
    assert ledger.events == run_events(ended=False)
    ledger.append(RunEnded(status="completed", wall_s=1.0))
    ledger.close()
    assert read_events(path)[-1]["type"] == "run_ended"
    assert read_events(path) == ledger.events


def test_write_report_is_atomic_and_matches_build_report(tmp_path):
    write_ledger(tmp_path / "events.jsonl", run_events())
    (tmp_path / "report.json").write_text("stale\n")
    old_inode = (tmp_path / "report.json").stat().st_ino
    report = write_report(tmp_path)
    assert report == build_report(run_events())
    assert json.loads((tmp_path / "report.json").read_text()) == report
    # Replaced, not rewritten in place: a reader never sees a half-written report.
    assert (tmp_path / "report.json").stat().st_ino != old_inode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["events.jsonl", "report.html", "report.json"]


def test_cli_report_regenerates_identical_report(tmp_path):
    write_ledger(tmp_path / "events.jsonl", run_events())
    write_report(tmp_path)
    expected = (tmp_path / "report.json").read_bytes()
    (tmp_path / "report.json").unlink()
    proc = run_cli("report", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "report.json").read_bytes() == expected
    assert "tiny-1" in proc.stdout and "completed" in proc.stdout


def test_summary_table_renders_missing_figures():
    from rich.console import Console

    console = Console(width=100, record=True, file=io.StringIO())
    console.print(summary_table(build_report([])))
    text = console.export_text()
    assert "running" in text and "- → -" in text


def test_sync_bytes_per_token_against_data_parallel():
    """Two steps of two replicas × one rank, 1,000,000 bytes each per step, 40,960 tokens per step,
    H = 20, a model of 10⁶ parameters: DDP would send 4 (n−1) H P = 8·10⁷ bytes per step."""
    events = run_events()
    events.insert(3, {"t": T0 + 12, "type": "world_formed", "epoch": 2, "replicas": [0, 1], "outer_step": 0,
                      "params": 1_000_000})
    for e in events:
        if e["type"] == "outer_step":
            e["steps_done"] = {"0": 20, "1": 20}
            e["network_s"] = 1.5
    sync = build_report(events)["sync"]
    assert sync["bytes_sent"] == 2 * 2 * 1_000_000
    assert sync["bytes_per_token"] == round(4_000_000 / 81_920, 4)
    assert sync["ddp_bytes_per_token"] == round(2 * 80_000_000 / 81_920, 4)
    assert sync["vs_ddp"] == 40.0 and sync["network_s"] == 3.0
    # A ledger from before the field (no params): no comparison, never a wrong one.
    assert build_report(run_events())["sync"]["vs_ddp"] is None
