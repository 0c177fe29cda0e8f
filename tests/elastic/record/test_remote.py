"""The run's record in storage (elastic/record/remote.py) and the commands that read it from any
machine (elastic/views/runs.py): parts, continuation, and a run followed, lost and resumed end to end."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from elastic.record import remote
from elastic.storage.stores import open_storage
from tests.conftest import REPO, cli_env, run_cli


def test_a_file_streams_in_parts_of_whole_lines_and_reads_back_whole(tmp_path):
    run_dir = tmp_path / "RUN"
    run_dir.mkdir()
    record = remote.open_record(str(tmp_path / "ck"), "RUN", create=True)
    stream = remote.RecordStream(record, run_dir)
    (run_dir / "events.jsonl").write_bytes(b'{"type":"a","t":1}\n{"type":"b","t":2')   # a torn last line
    stream.flush()
    assert record.read("events")[0] == b'{"type":"a","t":1}\n'
    with open(run_dir / "events.jsonl", "ab") as f:
        f.write(b'}\n')
    stream.flush()
    stream.flush()   # nothing new: no empty part
    assert [n for n, _ in record.parts("events")] == [1, 2]
    assert record.read("events")[0] == (run_dir / "events.jsonl").read_bytes()
    assert record.read("events", after=1)[0] == b'{"type":"b","t":2}\n'
    # A driver that continues the record numbers its parts after those there.
    again = remote.RecordStream(record, run_dir, skip={"events": (run_dir / "events.jsonl").stat().st_size})
    with open(run_dir / "events.jsonl", "ab") as f:
        f.write(b'{"type":"c","t":3}\n')
    again.start()
    again.close()   # the last part written, and its thread gone: a run leaves no thread behind
    assert [n for n, _ in record.parts("events")] == [1, 2, 3]
    assert not any(t.name == "record-stream" for t in threading.enumerate())
    assert [r.run for r in remote.runs_at(str(tmp_path / "ck"))] == ["RUN"]


def test_the_vms_a_lost_driver_held_are_billed_until_their_autodown_and_the_new_controller_is_not():
    def launched(vm, t, role="replica"):
        return {"type": "node_launched", "t": t, "instance_id": vm, "ray_node_id": None, "role": role,
                "launched_at": t, "joined": True, "cloud": "aws", "region": "r", "zone": "z",
                "instance_type": "x", "gpu": "", "gpus": 0, "cpus": 1, "spot": True, "usd_per_hour": 1.0,
                "on_demand_usd_per_hour": 2.0}
    events = [{"type": "run_started", "t": 0, "run": "R", "recipe": "r", "recipe_digest": "d", "head": "controller"},
              launched("c1", 1, "controller"),
              {"type": "controller_started", "t": 1, "instance_id": "c1", "cloud": "aws", "region": "r"},
              {"type": "run_started", "t": 5, "run": "R", "recipe": "r", "recipe_digest": "d"},
              launched("n1", 10), {"type": "outer_step", "t": 100},
              # `elastic launch --resume R` on a laptop: a new controller (not the lost driver's last event)
              {"type": "run_started", "t": 4999, "run": "R", "recipe": "r", "recipe_digest": "d", "head": "controller"},
              launched("c2", 5000, "controller"),
              {"type": "controller_started", "t": 5000, "instance_id": "c2", "cloud": "aws", "region": "r"}]
    assert remote.earlier_part(events) and not remote.earlier_part(events[:3])
    assert remote.last_seen(events) == 100 and remote.last_seen(events[:3]) is None
    assert sorted(remote.lost_vms(events, now_s=6000, autodown_after_s=600)) == [("c1", 700), ("n1", 700)]
    # The first controller booted again (no new controller): its boot script names it, and the
    # driver it starts continues the run on it, so it is no VM the lost driver left.
    rebooted = events[:6]
    assert sorted(remote.lost_vms(rebooted, now_s=6000, autodown_after_s=600)) == [("c1", 700), ("n1", 700)]
    assert remote.lost_vms(rebooted, now_s=6000, autodown_after_s=600, this_vm="c1") == [("n1", 700)]


def test_the_report_prices_a_lost_driver():
    """The report's `driver_lost`: the seconds without a driver, the VMs it left held billed until
    their autodown (no driver used them: waste), the outer steps trained again."""
    from elastic.views.report import build_report, headline_rows

    def launched(vm, t, role="replica"):
        return {"type": "node_launched", "t": t, "instance_id": vm, "ray_node_id": None, "role": role,
                "launched_at": t, "joined": True, "cloud": "local", "region": "r", "zone": "z",
                "instance_type": "x", "gpu": "", "gpus": 0, "cpus": 1, "spot": False, "usd_per_hour": 3.6,
                "on_demand_usd_per_hour": 3.6}
    events = [{"type": "run_started", "t": 0, "run": "R", "recipe": "r", "recipe_digest": "d", "pid": 1, "host": "h"},
              launched("n1", 10),
              {"type": "run_started", "t": 1000, "run": "R", "recipe": "r", "recipe_digest": "d", "pid": 2, "host": "h"},
              {"type": "node_released", "t": 1001, "instance_id": "n1", "released_at": 700.0},
              {"type": "driver_lost", "t": 1001, "last_seen_at": 100.0, "instance_ids": ["n1"], "outer_step": 3},
              {"type": "resumed", "t": 1050, "from_step": 2, "uri": "file:///ck", "saved_replicas": 1, "saved_ranks": 1},
              launched("n1", 1060),   # the local cloud numbers the new driver's VMs from 1 again
              {"type": "node_released", "t": 1090, "instance_id": "n1", "released_at": None},
              {"type": "run_ended", "t": 1100, "status": "completed"}]
    r = build_report(events)
    # 600 s at $3.60/h: $0.60 of the VM held with no driver, all of it waste.
    assert r["driver_lost"] == [{"down_s": 900.0, "vms": 1, "usd_held_unused": 0.6, "outer_steps_redone": 1}]
    assert r["wasted_usd"]["driver_lost"] == 0.6 and r["driver_restarts"] == 1
    # Both parts billed: the lost driver's VM to its autodown (690 s), the new one's (30 s).
    assert r["cost_usd"] == pytest.approx(0.72) and [i["instance_id"] for i in r["instances"]] == ["n1", "n1"]
    assert ("driver lost", "900 s without a driver, 1 VM(s) held unused $0.6000 until their autodown, "
                           "1 outer step(s) trained again") in headline_rows(r)


def _launch(cwd: Path, run: str, *args: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "elastic", "launch", str(REPO / "recipes/local-tiny.yaml"),
                             "--run-dir", f"runs/{run}", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _session_pids(session_dir: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if session_dir.encode() in (d / "cmdline").read_bytes():
                    out.append(int(d.name))
            except OSError:
                continue
    return out


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_a_run_followed_from_a_laptop_survives_its_lost_controller_and_resumes_with_one_report(tmp_path, request, scheme):
    """The "controller" runs what infra/controller.sh.tmpl runs (`elastic launch recipe --run-dir
    runs/RUN`, with head local) in a directory of its own; a separate "laptop" directory, which has
    no runs/, lists, follows and reports the run from the bucket. The controller is killed mid-run
    (kill -9, its directory deleted); the same command in a third directory continues the run from
    its record and latest checkpoint, and the report from the bucket equals the driver's, byte for byte."""
    # S3 on moto; Cloud Storage on its emulator, with the checkpoints' keys in the GCP fake's Secret Manager.
    for server in ("s3_server",) if scheme == "s3" else ("gcs_server", "gcp_fake"):
        request.getfixturevalue(server)
    uri = f"{scheme}://rec-{uuid.uuid4().hex[:8]}/ck"
    run = "RUN"
    env = cli_env(PYTHONUNBUFFERED="1", ELASTIC_CACHE=str(tmp_path / "cache"), ELASTIC_RUNS_URIS=uri)
    args = ["--set", "model.layers=1", "--set", "model.width=64", "--set", "data.corpus_bytes=300000",
            "--set", f"checkpoint.uri={uri}", "--set", "train.outer_steps=6", "--set", "checkpoint.every_outer_steps=1"]
    controller, laptop, second = (tmp_path / d for d in ("controller", "laptop", "second"))
    for d in (controller, laptop, second):
        d.mkdir()
    # The first controller's inner steps take at least 0.2 s each (fault injection: a slow VM), so
    # the run is still going when the laptop looks, however fast this machine is.
    first = _launch(controller, run, *args, env={**env, "ELASTIC_FAULT_STEP_DELAY_S": "0.2"})
    record = None
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            try:
                record = record or remote.open_record(uri, run)
                events = record.events()
            except Exception:
                events = []
            if any(e["type"] == "checkpoint_uploaded" for e in events):
                break
            assert first.poll() is None, first.stdout.read()
            time.sleep(1)
        else:
            pytest.fail("no checkpoint uploaded in time")
        # Followed from the laptop while it runs (one command: the run goes on meanwhile).
        status = run_cli("status", run, "--once", env=env, cwd=laptop)
        assert status.returncode == 0 and "running" in status.stdout, status.stdout + status.stderr
    finally:
        session = next((e["session_dir"] for e in (record.events() if record else [])
                        if e["type"] == "cluster_started"), None)
        first.send_signal(signal.SIGKILL)   # the controller is lost, mid-run
        first.wait()
        for pid in _session_pids(session) if session else []:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    shutil.rmtree(controller)
    assert not any(e["type"] == "run_ended" for e in record.events())
    listed = run_cli("runs", env=env, cwd=laptop)
    assert listed.returncode == 0 and run in listed.stdout, listed.stdout + listed.stderr
    logs = run_cli("logs", run, env=env, cwd=laptop)
    assert logs.returncode == 0 and "run_started" in logs.stdout, logs.stdout + logs.stderr
    # A new controller: the same command, elsewhere. It continues the record from the latest checkpoint.
    again = _launch(second, run, *args, env=env)
    follow = run_cli("logs", run, "--follow", env=env, cwd=laptop, timeout=400)
    out, _ = again.communicate(timeout=300)
    assert again.returncode == 0, out
    assert follow.returncode == 0 and "run ended" in follow.stdout, follow.stdout + follow.stderr
    report = run_cli("report", run, env=env, cwd=laptop)
    assert report.returncode == 0, report.stdout + report.stderr
    written = (second / "runs" / run / "report.json").read_bytes()
    assert (laptop / "reports" / run / "report.json").read_bytes() == written
    assert record.whole("report.json") == written
    assert record.read("events")[0] == (second / "runs" / run / "events.jsonl").read_bytes()
    doc = json.loads(written)
    assert doc["status"] == "completed" and doc["driver_restarts"] == 1 and doc["resumed_from_step"] >= 1
    # What the loss cost: the lost driver's nodes billed, unused, until their autodown.
    [lost] = doc["driver_lost"]
    assert lost["down_s"] > 0 and lost["vms"] == 2 and lost["usd_held_unused"] > 0 and lost["outer_steps_redone"] >= 0
    assert doc["wasted_usd"]["driver_lost"] == lost["usd_held_unused"]
    assert not (laptop / "runs").exists()
    store = open_storage(uri)
    assert any(n.startswith(f"record/{run}/metrics/") for n in store.list("record"))
