"""`elastic status` (live view from the ledger) and `elastic report --compare`, as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic.views.status import latest_run_dir, snapshot
from tests.conftest import REPO, cli_env, run_cli
from tests.elastic.views.test_report_costs import T0, ended, started, vm


def step(t: float, n: int, loss: float, replicas=(0, 1)) -> dict:
    return {"t": t, "type": "outer_step", "outer_step": n, "inner_step": 10 * n, "epoch": 0,
            "replicas": list(replicas), "losses": [loss], "tokens": 2000, "tokens_total": 2000 * n,
            "inner_s": 8.0, "sync_s": 2.0, "bytes_sent": 0, "data_cursor": n}


def live_run(pid: int | None = None) -> list[dict]:
    """Two VMs ($0.36/h and $0.72/h) since T0, outer steps every 20 s from +20 to +100."""
    return [started(pid=pid if pid is not None else os.getpid()),
            vm(T0, "a", usd=0.36, on_demand=1.08), vm(T0, "b", usd=0.72, on_demand=2.16),
            *[step(T0 + 20 * n, n, 5.0 - n / 2) for n in range(1, 6)]]


def write_run(run_dir: Path, events: list[dict], outer_steps: int = 20) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "recipe.yaml").write_text(f"name: s\ntrain:\n  outer_steps: {outer_steps}\n")
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run_dir


def cli(*args, cwd=REPO):
    return run_cli(*args, cwd=cwd, COLUMNS="120")


def test_snapshot_figures():
    s = snapshot(live_run(), now=T0 + 120, target_outer_steps=20)
    assert s["status"] == "running" and not s["ended"]
    assert s["outer_step"] == 5 and s["world"] == 2 and s["vms_held"] == 2
    assert s["loss"] == 2.5
    assert s["tokens_per_s"] == pytest.approx(5 * 2000 / (5 * 10))     # recent steps: tokens ÷ busy seconds
    assert s["usd_so_far"] == pytest.approx(120 * 1.08 / 3600)           # both VMs, 120 s
    assert s["burn_usd_per_hour"] == pytest.approx(1.08)
    # 15 steps to go at 20 s each (the pace from step 1 to step 5), at $1.08/h.
    assert s["projected_usd"] == pytest.approx(120 * 1.08 / 3600 + 15 * 20 * 1.08 / 3600)


def test_snapshot_of_an_ended_run_and_of_a_dead_driver():
    events = live_run() + [{"t": T0 + 110, "type": "node_released", "instance_id": "a"},
                           {"t": T0 + 110, "type": "node_released", "instance_id": "b"}, ended(T0 + 111)]
    s = snapshot(events, now=T0 + 9999, target_outer_steps=20)
    assert s["ended"] and s["status"] == "completed"
    assert s["usd_so_far"] == pytest.approx(110 * 1.08 / 3600) and s["projected_usd"] == s["usd_so_far"]
    assert s["burn_usd_per_hour"] == 0 and s["vms_held"] == 0
    assert s["world"] == 0 and s["world_last"] == 2      # nothing trains once the run is over
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = snapshot(live_run(pid=dead.pid), now=T0 + 120)
    assert gone["ended"] and "driver gone" in gone["status"]
    # A ledger written on another machine (copied here): its pid means nothing on this one.
    elsewhere = live_run(pid=dead.pid)
    elsewhere[0]["host"] = "some-other-host.invalid"
    assert snapshot(elsewhere, now=T0 + 120)["status"] == "running"


def test_a_paused_run_shows_paused_with_no_world_and_no_burn():
    # The pause rule released both VMs after step 5: nothing trains, nothing bills, it says why.
    events = live_run() + [{"t": T0 + 105, "type": "node_released", "instance_id": "a"},
                           {"t": T0 + 105, "type": "node_released", "instance_id": "b"},
                           {"t": T0 + 105, "type": "world_paused", "outer_step": 5, "usd_per_mtok": 0.3,
                            "threshold_usd_per_mtok": 0.1, "need": 0.2}]
    s = snapshot(events, now=T0 + 600, target_outer_steps=20)
    assert s["status"].startswith("paused") and not s["ended"]
    assert s["world"] == 0 and s["world_last"] == 2 and s["vms_held"] == 0 and s["burn_usd_per_hour"] == 0
    assert s["usd_so_far"] == pytest.approx(105 * 1.08 / 3600)
    unpaused = events + [{"t": T0 + 700, "type": "world_unpaused", "paused_s": 595.0, "usd_per_mtok": 0.1,
                          "threshold_usd_per_mtok": 0.1, "need": 0.2}]
    assert snapshot(unpaused, now=T0 + 710)["status"] == "running"


def test_status_once_and_default_run_dir(tmp_path):
    old = write_run(tmp_path / "runs" / "old", live_run() + [ended(T0 + 101)])
    new = write_run(tmp_path / "runs" / "new", live_run())
    os.utime(old / "events.jsonl", (time.time() - 60, time.time() - 60))
    assert latest_run_dir(tmp_path / "runs") == new
    proc = cli("status", "--once", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = cli("report", cwd=tmp_path)     # `report` too defaults to the newest run
    assert report.returncode == 0 and f"report: {Path('runs') / 'new' / 'report.json'}" in report.stdout, report
    assert "running" in proc.stdout and "5/20" in proc.stdout and "$1.0800/h" in proc.stdout
    proc = cli("status", str(old))          # an ended run: one snapshot, no waiting
    assert proc.returncode == 0 and "completed" in proc.stdout


def test_status_without_a_run_is_one_line(tmp_path):
    proc = cli("status", cwd=tmp_path)
    assert proc.returncode == 2 and "no run under runs/" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    proc = cli("status", str(tmp_path / "nope"), "--once")
    assert proc.returncode == 2 and "no events.jsonl" in proc.stderr


class Lines:
    """A process's stdout lines, read in the background, waited for with a deadline."""

    def __init__(self, proc):
        import queue
        import threading

        self._q = queue.Queue()
        self._t = threading.Thread(target=lambda: [self._q.put(line) for line in proc.stdout] + [self._q.put(None)],
                                   daemon=True)
        self._t.start()

    def wait_for(self, text: str, timeout_s: float = 30) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            line = self._q.get(timeout=max(0.01, deadline - time.monotonic()))
            assert line is not None, f"the process ended before printing {text!r}"
            if text in line:
                return line

    def rest(self, timeout_s: float = 30) -> str:
        self._t.join(timeout_s)
        return "".join(iter(self._q.get_nowait, None))


def test_status_follows_the_ledger_until_the_run_ends(tmp_path):
    run_dir = write_run(tmp_path / "run", live_run())
    proc = subprocess.Popen([sys.executable, "-m", "elastic", "status", str(run_dir)], cwd=REPO,
                            env=cli_env(COLUMNS="160"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = Lines(proc)
        assert "running" in lines.wait_for("outer 5/20")
        with open(run_dir / "events.jsonl", "a") as f:       # the run goes on: the view follows
            f.write(json.dumps(step(T0 + 120, 6, 1.25)) + "\n")
        assert "loss 1.2500" in lines.wait_for("outer 6/20")
        assert proc.poll() is None
        with open(run_dir / "events.jsonl", "a") as f:
            f.write(json.dumps(ended(T0 + 130)) + "\n")
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
        out = lines.rest()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "completed" in out and "6/20" in out     # the final table


def test_report_compare_prints_both_runs(tmp_path):
    a = write_run(tmp_path / "spot", live_run() + [ended(T0 + 101)])
    b = write_run(tmp_path / "other", live_run()[:4] + [ended(T0 + 50, "interrupted")])
    proc = cli("report", str(a), "--compare", str(b))
    assert proc.returncode == 0, proc.stderr
    assert "spot" in proc.stdout and "other" in proc.stdout
    assert "completed" in proc.stdout and "interrupted" in proc.stdout
    assert (a / "report.json").exists() and (a / "report.html").exists()
    assert not (b / "report.json").exists()          # the other run is read, not written
    proc = cli("report", str(a), "--compare", str(tmp_path / "missing"))
    assert proc.returncode == 2 and "no events.jsonl" in proc.stderr


def test_the_story_tells_a_pause_and_a_restore_after_it_apart_from_a_loss():
    from elastic.record.events import read

    def story(record: dict) -> tuple[str | None, str]:
        [e] = read([{"t": T0, **record}])
        return e.story(), e.story_style()

    paused = {"type": "world_paused", "outer_step": 7, "usd_per_mtok": 0.3, "threshold_usd_per_mtok": 0.1,
              "need": 0.2}
    assert story(paused) == ("paused at outer step 7: the market's $0.3000 per 1M tokens is dear "
                             "(trains at ≤ $0.1000); every replica VM released", "")
    assert story({"type": "world_unpaused", "paused_s": 5400.0, "usd_per_mtok": 0.1,
                  "threshold_usd_per_mtok": 0.1, "need": 0.2})[0] == "unpaused after 90 min: $0.1000 per 1M tokens"
    assert story({"type": "world_unpaused", "paused_s": 60.0, "usd_per_mtok": 0.5,
                  "threshold_usd_per_mtok": 0.1, "need": 0.97})[0].endswith("(the deadline needs the time)")
    restored = {"type": "world_restored", "from_step": 7, "uri": "file:///c"}
    assert story({**restored, "after": "pause"}) == ("pause over: the world starts again from checkpoint step 7", "")
    assert story(restored) == ("every replica lost: restarting from checkpoint step 7", "red")   # an older ledger
