"""`elastic launch` as a user runs it: a subprocess that starts its own local Ray cluster."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from elastic.policy.market import Market
from elastic.recipe.model import load_recipe
from elastic.record.ledger import read_events
from elastic.storage import checkpoint as ckpt
from elastic.storage.stores import open_storage
from tests.conftest import REPO, cli_env, run_cli
from tests.servers.object_stores import GateProxy

pytestmark = pytest.mark.slow

SMALL = ["--set", "model.layers=1", "--set", "model.width=64", "--set", "data.corpus_bytes=300000"]


def session_pids(run_dir: Path) -> dict[int, str]:
    """The processes of the Ray cluster the run started, with their command lines: its GCS,
    raylets, agents, and workers not yet retitled `ray::...` (a worker a raylet was starting as its
    node went: it outlives its raylet for a moment unless the driver ends it)."""
    started = [e for e in read_events(run_dir / "events.jsonl") if e["type"] == "cluster_started"]
    assert started, "the run recorded no cluster"
    marker = started[0]["session_dir"].encode()
    pids = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if marker in (cmdline := (d / "cmdline").read_bytes()):
                    pids[int(d.name)] = cmdline.replace(b"\0", b" ")[:160].decode(errors="replace")
            except OSError:
                continue
    return pids


class Launched(subprocess.Popen):
    """An `elastic launch` whose output (stdout and stderr) a thread reads as it comes. A test that
    polls the ledger meanwhile never leaves the pipe full: a run writes about 130 bytes a step, and
    a driver whose pipe (64 KB) is full blocks in its next write, as any program does."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)
        self._lines: list[str] = []
        self._reader = threading.Thread(target=self._lines.extend, args=(self.stdout,), daemon=True)
        self._reader.start()

    def output(self) -> str:
        """What the run wrote so far."""
        return "".join(self._lines)

    def communicate(self, input=None, timeout=None):
        """Wait for the run to end; (everything it wrote, None), as `Popen.communicate`."""
        self.wait(timeout)
        self._reader.join()
        return self.output(), None


def launch(run_dir: Path, *args: str, recipe: str = "recipes/local-tiny.yaml", **kw) -> Launched:
    env = cli_env(PYTHONUNBUFFERED="1", **kw.get("env", {}))
    return Launched([sys.executable, "-m", "elastic", "launch", str(REPO / recipe), "--run-dir", str(run_dir), *args],
                    cwd=kw.get("cwd", REPO), env=env)


def interrupt(proc: Launched) -> None:
    """End a launch the test left running (it failed first) as Ctrl-C does: the run releases its
    nodes and stops its cluster."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def assert_every_node_released(events):
    launched = {e["instance_id"] for e in events if e["type"] == "node_launched"}
    released = {e["instance_id"] for e in events if e["type"] == "node_released"}
    assert launched and launched == released


REPORT_FIELDS = ("cost_usd", "usd_per_mtok", "tokens_this_run", "on_demand_equivalent_usd", "savings_pct", "effective_training_time",
                 "wasted_usd", "instances", "gpu_hours", "by_cloud", "by_region", "by_instance_type", "estimates")


def assert_outputs_of_any_ending(run_dir: Path, out: str) -> dict:
    """Every ending writes report.json and report.html, and `elastic report` rebuilds the same bytes."""
    report = json.loads((run_dir / "report.json").read_text())
    assert all(k in report for k in REPORT_FIELDS), [k for k in REPORT_FIELDS if k not in report]
    assert set(report["wasted_usd"]) == {"preemption", "capacity_wait", "checkpoint_stalls", "never_joined", "setup_failed",
                                         "driver_lost", "total"}
    html = (run_dir / "report.html").read_text()
    # Seven charts, each drawn or, with nothing to draw (no VM ever rented), saying so.
    assert html.count('<svg class="chart"') + html.count('class="empty"') == 7 and "<script" not in html
    assert "on-demand equivalent" in out          # the summary table was printed
    written = (run_dir / "report.json").read_bytes()
    rebuilt = elastic_cli("report", str(run_dir))
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert (run_dir / "report.json").read_bytes() == written
    return report


def test_launch_trains_and_reports(tmp_path):
    run_dir = tmp_path / "run"
    cache = {"ELASTIC_CACHE": str(tmp_path / "cache")}   # this run's throughput history only
    args = [*SMALL, "--set", "train.outer_steps=8", "--set", "checkpoint.every_outer_steps=4"]
    before = run_cli("plan", "recipes/local-tiny.yaml", *args, "--json", **cache)
    proc = launch(run_dir, *args, env=cache)
    torch_in_driver = driver_maps_torch(proc)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    # The driver serves the world's store without torch (elastic.train.store): torch's library
    # was never mapped into it, in any look at its memory map while it ran.
    assert not torch_in_driver.result(timeout=30)
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "completed"
    assert report["outer_steps"] == 8
    assert report["loss_last"] <= 0.8 * report["loss_first"]
    assert len(report["instances"]) == 2 and all(i["cost_usd"] > 0 for i in report["instances"])
    # The total is the unrounded costs' sum, rounded once; each instance's is rounded on its own.
    n = len(report["instances"])
    assert report["cost_usd"] == pytest.approx(sum(i["cost_usd"] for i in report["instances"]), abs=0.5e-6 * (n + 1))
    assert report["tokens"] == 8 * 2 * 20 * 8 * 128
    # A float32 sync every H = 20 steps sends H / 2 = 10× less than DDP's bf16 gradient every step.
    assert report["sync"]["vs_ddp"] == 10.0 and report["sync"]["bytes_sent"] > 0
    assert_outputs_of_any_ending(run_dir, out)
    # local-tiny's market does not move: every second at $0.40/h against $1.20/h on demand.
    assert report["on_demand_equivalent_usd"] == pytest.approx(3 * report["cost_usd"], rel=1e-3)
    assert report["savings_pct"] == pytest.approx(66.67, abs=0.01)
    events = read_events(run_dir / "events.jsonl")
    assert_every_node_released(events)
    assert [e["step"] for e in events if e["type"] == "checkpoint_saved"] == [4, 8]
    # Each step times every replica's own inner phase: the market measures this model's throughput
    # on the run's instance type from the ledger alone.
    steps = [e for e in events if e["type"] == "outer_step"]
    assert all(set(e["inner_s_by_replica"]) == set(e["steps_done"]) for e in steps)
    market = Market(load_recipe(run_dir / "recipe.yaml").planner, tokens_per_inner_step=8 * 128)
    market.observe(events)
    measured = market.measured_tokens_per_s()
    trained_s = sum(s for e in steps for s in e["inner_s_by_replica"].values())
    assert list(measured) == [("local", "local-cpu")]
    assert measured[("local", "local-cpu")] == pytest.approx(report["tokens"] / trained_s)
    manifest = json.loads((run_dir / "checkpoints/step-00000008/elastic.json").read_text())
    assert manifest["step"] == 8 and manifest["data_cursor"] == 8 * 2 * 20 * 8
    assert (run_dir / "recipe.yaml").read_text().startswith("name: local-tiny")
    assert "completed" in out and "Traceback" not in out
    # The run's own head and raylets are gone.
    assert not session_pids(run_dir)
    check_driver_log(run_dir, events)
    check_plans_learn(report, json.loads(before.stdout), args, cache)
    check_checkpoint_cli(run_dir / "checkpoints")


def driver_maps_torch(proc: Launched) -> Future:
    """Whether torch's library is ever mapped into the driver `proc` while it runs: its memory map
    read every 0.1 s until it exits (a library, once loaded, stays mapped to the end)."""
    def watch() -> bool:
        while proc.poll() is None:
            try:
                if "libtorch" in Path(f"/proc/{proc.pid}/maps").read_text():
                    return True
            except OSError:
                pass
            time.sleep(0.1)   # sampling the map, not waiting for an event
        return False

    pool = ThreadPoolExecutor(1)
    future = pool.submit(watch)
    pool.shutdown(wait=False)
    return future


def check_driver_log(run_dir: Path, events: list[dict]) -> None:
    """driver.log is elastic's own: JSON lines at INFO, every ledger event among them, no Ray noise."""
    from elastic.run.logs import read_log

    records = read_log(run_dir / "driver.log")
    assert records and all(r["logger"].startswith(("elastic", "providers")) for r in records)
    logged = [r["event"]["type"] for r in records if r["logger"] == "elastic.record.events"]
    assert logged == [e["type"] for e in events]                 # every event, in order
    assert {r["level"] for r in records} == {"INFO"}
    text = (run_dir / "driver.log").read_text()
    assert "Raylet" not in text and "state-dump" not in text and "Traceback" not in text


def check_plans_learn(report: dict, before: dict, args: list[str], cache: dict) -> None:
    """The run recorded what it measured; `elastic plan` of the same recipe now predicts the run's
    tokens/s within 30 % and says the figure is measured (before the run it was an estimate)."""
    assert before["tokens_per_s_source"] == "estimate"
    pva = report["plan_vs_actual"]
    assert pva["planned"]["tokens_per_s"] == before["useful_tokens_per_s"] and pva["planned"]["source"] == "estimate"
    assert pva["actual"]["tokens_per_s"] == report["tokens_per_s"]
    after = run_cli("plan", "recipes/local-tiny.yaml", *args, "--json", **cache)
    assert after.returncode == 0, after.stderr
    doc = json.loads(after.stdout)
    assert doc["tokens_per_s_source"] == "measured"
    assert doc["useful_tokens_per_s"] == pytest.approx(report["tokens_per_s"], rel=0.30)
    table = run_cli("plan", "recipes/local-tiny.yaml", *args, **cache)
    assert "measured" in table.stdout and "useful tokens/s (measured)" in table.stdout


elastic_cli = run_cli


def check_checkpoint_cli(root: Path):
    """`elastic checkpoints list|verify` on a real run's checkpoints, then on damaged ones."""
    (root / "step-00000012").mkdir()                       # a save that never finished
    (root / "step-00000012" / "__0_0.distcp").write_bytes(b"partial")
    listed = elastic_cli("checkpoints", "list", f"file://{root}")
    assert listed.returncode == 0, listed.stderr
    rows = [line for line in listed.stdout.splitlines() if line.strip().startswith("│")]
    assert [r.split("│")[1].strip() for r in rows] == ["4", "8", "12"]
    assert "no (partial)" in rows[2] and "yes" in rows[0] and "yes" in rows[1]
    ok = elastic_cli("checkpoints", "verify", str(root))
    assert ok.returncode == 0 and "step 8" in ok.stdout     # the partial one is never taken for whole
    shard = sorted((root / "step-00000004").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF                            # flip one byte
    shard.write_bytes(bytes(data))
    bad = elastic_cli("checkpoints", "verify", str(root), "--step", "4")
    assert bad.returncode == 1 and shard.name in bad.stderr and "sha256" in bad.stderr
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    missing = elastic_cli("checkpoints", "verify", str(root), "--step", "5")
    assert missing.returncode == 2 and "no complete checkpoint at step 5" in missing.stderr


def test_launch_refuses_a_run_dir_that_holds_a_run(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "events.jsonl").write_text('{"t": 1, "type": "run_started", "run": "x"}\n')
    proc = launch(run_dir)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "already holds a run" in out and "Traceback" not in out
    assert (run_dir / "events.jsonl").read_text() == '{"t": 1, "type": "run_started", "run": "x"}\n'


def test_sigterm_and_sighup_end_a_run_as_ctrl_c_does():
    """Inside a run, SIGTERM (docker stop, systemd) and SIGHUP (a closed SSH session) raise the
    KeyboardInterrupt that Ctrl-C raises, so the run releases its nodes (end to end below, with
    SIGHUP); outside, the handlers are as they were."""
    from elastic.run import stop

    before = {s: signal.getsignal(s) for s in stop.SIGNALS}
    with stop.raise_interrupt():
        assert signal.getsignal(signal.SIGTERM) is signal.getsignal(signal.SIGHUP) is not signal.SIG_DFL
        for s in stop.SIGNALS:
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(s)
    assert {s: signal.getsignal(s) for s in before} == before


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")   # the lost interrupt, on purpose
def test_a_stop_signal_whose_interrupt_a_finalizer_swallowed_still_stops_the_run():
    """Python runs a signal handler wherever the main thread is; inside a finalizer (`__del__`, as
    Ray's handles run) the KeyboardInterrupt is printed as ignored and lost. The driver's tick
    (`stop.check`) raises it again; a handler something replaced is put back; outside a run
    `check` does nothing."""
    import gc

    from elastic.run import stop

    class Handle:
        def __del__(self):
            signal.raise_signal(signal.SIGINT)   # the handler runs here: its KeyboardInterrupt is lost

    with stop.raise_interrupt():
        stop.check()                             # nothing came: nothing raised
        Handle()
        gc.collect()                             # (CPython frees it at once; in case it did not)
        with pytest.raises(KeyboardInterrupt):
            stop.check()
    stop.check()                                 # outside the run: nothing
    with stop.raise_interrupt():
        stop.check()                             # a new run starts with no stop pending
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # something replaced the handler
        stop.check()
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)


def test_budget_stops_the_run_with_a_final_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    # Two nodes at $0.40/h: about 30 s of renting, enough for a first outer step on a busy 2-core
    # machine (the suite runs two workers) before the budget stops the run. Every inner step takes
    # at least 100 ms (a slow VM): the ranks wait out most of those 30 s instead of spending two
    # cores' worth of the suite's CPU on them (36 CPU-s with 20 ms, 20 with 100 ms).
    max_usd = 0.0067
    proc = launch(run_dir, *SMALL, "--allow-partial", "--set", "train.outer_steps=1000", "--set", f"budget.max_usd={max_usd}",
                  "--set", "checkpoint.every_outer_steps=0", env={"ELASTIC_FAULT_STEP_DELAY_S": "0.1"})
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 3, out
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "budget_exhausted"
    assert "budget.max_usd" in report["budget_exhausted"]
    assert_outputs_of_any_ending(run_dir, out)
    assert 0 < report["outer_steps"] < 1000
    # Spend stops at the cap, give or take the seconds it takes to release two nodes.
    release_margin_usd = 2 * 0.40 * 5 / 3600
    assert report["cost_usd"] <= max_usd + release_margin_usd
    events = read_events(run_dir / "events.jsonl")
    assert_every_node_released(events)
    saved = [e["step"] for e in events if e["type"] == "checkpoint_saved"]
    assert saved == [report["outer_steps"]]   # the final checkpoint holds the last step
    assert (run_dir / "metrics.jsonl").read_text().count("\n") == report["inner_steps"]


def test_resume_continues_from_the_latest_checkpoint_in_another_world_shape(tmp_path, s3_server, request):
    """Checkpoints through a real S3 server (moto on 127.0.0.1): the bucket is created, the nodes
    upload in the background, list/verify read it, and a run of another shape resumes from it."""
    uri = f"s3://ckpt-{uuid.uuid4().hex[:8]}/run1"
    first = launch(tmp_path / "first", *SMALL, "--set", "train.outer_steps=4", "--set", "checkpoint.every_outer_steps=2",
                   "--set", f"checkpoint.uri={uri}")
    out, _ = first.communicate(timeout=300)
    assert first.returncode == 0, out
    events = read_events(tmp_path / "first" / "events.jsonl")
    assert [e["step"] for e in events if e["type"] == "checkpoint_uploaded"] == [2, 4]
    listed = elastic_cli("checkpoints", "list", uri)
    assert listed.returncode == 0 and listed.stdout.count("yes") == 2, listed.stderr
    verified = elastic_cli("checkpoints", "verify", uri)
    assert verified.returncode == 0 and "step 4" in verified.stdout, verified.stderr
    # Resuming a run whose checkpoint is already at train.outer_steps trains nothing more (one
    # replica, the one that loads the checkpoint, is all it takes to find that out): on a copy of
    # the checkpoints, beside the second run (the launches below write at `uri`).
    done_uri = f"{uri}-done"
    store, copy = open_storage(uri), open_storage(done_uri)
    for name in store.list():
        copy.write_bytes(name, store.read_bytes(name))
    done = launch(tmp_path / "done", *SMALL, "--set", "train.outer_steps=4", "--set", f"checkpoint.uri={done_uri}",
                  "--set", "world.replicas=1", "--resume")
    request.addfinalizer(lambda: interrupt(done))
    second = launch(tmp_path / "second", *SMALL, "--set", "train.outer_steps=6", "--set", f"checkpoint.uri={uri}",
                    "--set", "world.replicas=1", "--set", "world.ranks_per_replica=2", "--resume")
    out, _ = second.communicate(timeout=300)
    assert second.returncode == 0, out
    report = json.loads((tmp_path / "second" / "report.json").read_text())
    assert report["status"] == "completed" and report["resumed_from_step"] == 4
    assert report["outer_steps"] == 6
    steps = [e["outer_step"] for e in read_events(tmp_path / "second" / "events.jsonl") if e["type"] == "outer_step"]
    assert steps == [5, 6]
    first_losses = json.loads((tmp_path / "first" / "report.json").read_text())
    assert report["loss_last"] < first_losses["loss_first"]
    # The newest checkpoint (run "second"'s, authenticated with its key) altered in storage by a
    # writer of the bucket without that key: one byte of a shard flipped and its sha256 in the
    # manifest recomputed. The manifest's HMAC refuses it and the run resumes from the one before
    # (run "first"'s, checked with first's key), saying so in the ledger.
    store = open_storage(uri)
    before = [c["step"] for c in ckpt.listing(store) if c["complete"]][-2]
    shard = "step-00000006/__0_0.distcp"
    data = bytearray(store.read_bytes(shard))
    data[len(data) // 2] ^= 0xFF
    store.write_bytes(shard, bytes(data))
    manifest = json.loads(store.read_bytes(f"step-00000006/{ckpt.MANIFEST}"))
    assert manifest["run"] == "second"
    for f in manifest["files"]:
        if f["name"] == "__0_0.distcp":
            f["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
    store.write_bytes(f"step-00000006/{ckpt.MANIFEST}", json.dumps(manifest).encode())
    # `checkpoints verify` finds it as a restore would: every file matches, the HMAC does not.
    tampered = elastic_cli("checkpoints", "verify", uri)
    assert tampered.returncode == 1 and "HMAC does not match run 'second'" in tampered.stderr, tampered.stderr
    third = launch(tmp_path / "third", *SMALL, "--set", "train.outer_steps=6", "--set", f"checkpoint.uri={uri}",
                   "--resume")
    out, _ = third.communicate(timeout=300)
    assert third.returncode == 0, out
    events = read_events(tmp_path / "third" / "events.jsonl")
    skipped = [e for e in events if e["type"] == "checkpoint_skipped"]
    assert [e["step"] for e in skipped] == [None] and "HMAC does not match run 'second'" in skipped[0]["message"]
    assert skipped[0]["message"].startswith("step-00000006/")
    assert [e["from_step"] for e in events if e["type"] == "resumed"] == [before]
    assert [e["outer_step"] for e in events if e["type"] == "outer_step"] == list(range(before + 1, 7))
    out, _ = done.communicate(timeout=300)
    assert done.returncode == 0, out
    events = read_events(tmp_path / "done" / "events.jsonl")
    assert [e["from_step"] for e in events if e["type"] == "resumed"] == [4]
    assert not [e for e in events if e["type"] in ("outer_step", "checkpoint_saved")]


def test_resume_without_a_checkpoint_is_bad_input(tmp_path):
    proc = launch(tmp_path / "run", "--set", f"checkpoint.uri=file://{tmp_path / 'none'}", "--resume")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "no complete checkpoint" in out and "Traceback" not in out
    assert not (tmp_path / "run").exists()     # refused before anything was written


def test_a_run_whose_output_nobody_reads_trains_on_and_prints_everything_once_read(tmp_path):
    """The launch's stdout is a pipe of one page (4 KB: about 30 steps of progress lines) that the
    test leaves unread until the ledger says the run ended: the driver queued its lines instead of
    blocking on them, and gives every one of them once the reader comes."""
    import fcntl

    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "elastic", "launch", str(REPO / "recipes/local-tiny.yaml"),
                             "--run-dir", str(run_dir), *SMALL, "--set", "train.outer_steps=120",
                             "--set", "train.inner_steps=2", "--set", "checkpoint.every_outer_steps=0"],
                            cwd=REPO, env=cli_env(PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        fcntl.fcntl(proc.stdout.fileno(), fcntl.F_SETPIPE_SZ, 4096)
        deadline = time.monotonic() + 240
        ledger = run_dir / "events.jsonl"
        while not any(e["type"] == "run_ended" for e in (read_events(ledger) if ledger.exists() else [])):
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not end within 240 s"
            time.sleep(0.2)   # polling the ledger, bounded by the deadline
        out, _ = proc.communicate(timeout=60)
    finally:
        interrupt(proc)
    assert proc.returncode == 0, out
    assert sum(1 for e in read_events(ledger) if e["type"] == "outer_step") == 120
    assert sum(ln.startswith("outer ") for ln in out.splitlines()) == 120, out
    assert out.rstrip().splitlines()[-1].startswith("report: ") and "dropped" not in out


def test_no_capacity_ends_insufficient_capacity_with_a_report(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "--set", "local.capacity=0", "--set", "world.capacity_timeout_s=2")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 4, out
    report = assert_outputs_of_any_ending(run_dir, out)
    assert report["status"] == "insufficient_capacity"
    assert report["instances"] == [] and report["cost_usd"] == 0 and report["savings_pct"] is None
    assert (run_dir / "report.html").read_text().count('class="empty"') == 7   # every chart, bars included, says so
    assert not (run_dir / "driver-stacks.txt").exists()   # left only when a SIGUSR1 asked for the stacks
    assert not session_pids(run_dir)


def test_a_preemptible_run_tells_its_story_and_a_closed_session_releases_every_node(tmp_path):
    """local-preemptible, small and fast, on a market whose spot prices move and whose nodes are
    preempted at random (about one a node every 20 s here, half with a notice; none in a node's
    first 15 s, the recipe's time to start and join). Once the ledger holds a preemption and a
    committed checkpoint, the SSH session closes (SIGHUP: the interrupt path Ctrl-C takes; the
    test above shows SIGHUP and SIGTERM raise the KeyboardInterrupt that SIGINT raises). The
    transcript has one line per node rented, notice, preemption, join and committed checkpoint (as
    many as the ledger holds), then the summary and the report path; every node is released and
    each VM is billed at its moving price."""
    run_dir = tmp_path / "run"
    proc = launch(run_dir, *SMALL, "--allow-partial", "--set", "train.outer_steps=1000", "--set", "train.inner_steps=5",
                  "--set", "checkpoint.every_outer_steps=3", "--set", "local.market.preempt_per_hour=3",
                  recipe="recipes/local-preemptible.yaml",
                  # Every inner step takes at least 100 ms (slow VMs): the run waits for the market's
                  # preemption mostly asleep rather than on the suite's CPU.
                  env={"ELASTIC_CACHE": str(tmp_path / "cache"), "COLUMNS": "80", "ELASTIC_FAULT_STEP_DELAY_S": "0.1"})
    ledger = run_dir / "events.jsonl"

    def story_told() -> bool:
        events = read_events(ledger)
        return (any(e["type"] == "node_preempted" for e in events)
                and any(e["type"] == "checkpoint_uploaded" for e in events))

    def stacks() -> str:
        """SIGUSR1: the driver appends every thread's stack to driver-stacks.txt and goes on."""
        path = run_dir / "driver-stacks.txt"
        before = path.stat().st_size if path.exists() else 0
        def size() -> int:
            return path.stat().st_size if path.exists() else 0

        proc.send_signal(signal.SIGUSR1)
        until = time.monotonic() + 30
        while size() == before and time.monotonic() < until:
            time.sleep(0.1)
        # The handler writes the dump a line at a time: read it once it stopped growing (a read
        # between two writes once cut the main thread's stack short of elastic/run/driver.py).
        last = -1
        while size() != last and time.monotonic() < until:
            last = size()
            time.sleep(0.3)
        return path.read_text()[before:] if path.exists() else ""

    deadline = time.monotonic() + 240
    while not story_told():
        assert proc.poll() is None, proc.output()
        assert time.monotonic() < deadline, "no preemption and checkpoint within 240 s; the driver's threads:\n" + stacks()
        time.sleep(0.2)
    # A driver asked for its stacks writes them (the main thread is in the run's loop) and trains on.
    dumped = stacks()
    assert "Current thread" in dumped and "elastic/run/driver.py" in dumped, dumped
    proc.send_signal(signal.SIGHUP)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    report = assert_outputs_of_any_ending(run_dir, out)
    assert report["status"] == "interrupted" and report["outer_steps"] >= 1
    events = read_events(ledger)
    lines = out.splitlines()

    def count(kind: str) -> int:
        return sum(1 for e in events if e["type"] == kind)

    assert sum(" preempted: local-" in ln for ln in lines) == count("node_preempted") >= 1, out
    assert sum(" notice: local-" in ln for ln in lines) == count("node_notice")
    assert sum(" joined: replica " in ln for ln in lines) == count("replica_joined")
    assert sum(" rented local-" in ln for ln in lines) == count("node_launched")
    assert sum(" checkpoint step " in ln and "committed" in ln for ln in lines) == count("checkpoint_uploaded")
    # Piped at 80 columns: the summary table keeps whole words, the report path is one line.
    assert any(ln.startswith("report: ") and ln.endswith("report.html") for ln in lines), out
    # The driver recorded the held VMs' moving prices and the report billed each interval at its price.
    prices = [e for e in events if e["type"] == "node_price"]
    assert prices and sum(i["price_changes"] for i in report["instances"]) == len(prices)
    at_launch_price = sum(i["seconds"] * i["usd_per_hour"] / 3600 for i in report["instances"])
    assert report["cost_usd"] != pytest.approx(at_launch_price, rel=1e-4)
    # Every node the run rented was preempted or, at the end, released: none is left billing.
    launched = {e["instance_id"] for e in events if e["type"] == "node_launched"}
    gone = {e["instance_id"] for e in events if e["type"] in ("node_preempted", "node_released")}
    assert launched and launched == gone
    assert events[-1]["type"] == "run_ended"
    assert "Traceback" not in out
    assert not session_pids(run_dir)


@pytest.mark.parametrize("refusals", [1, 1000])
def test_a_final_checkpoint_the_store_refuses_is_saved_again_or_the_run_fails(tmp_path, s3_server, refusals):
    """The store refuses the final checkpoint's manifest (AccessDenied): the run saves it once more
    while its world still holds the work. Once refused, that second save lands and the run
    completes; refused every time, the run fails with one line saying which checkpoint is missing,
    rather than ending "completed" with its last steps unsaved, and still releases every node."""
    proxy = GateProxy(s3_server)
    left = {"n": refusals}

    def answer(method, path, headers, body):
        if method == "PUT" and path.split("?")[0].endswith(f"/step-00000004/{ckpt.MANIFEST}") and left["n"]:
            left["n"] -= 1
            return 403, (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>AccessDenied</Code>"
                         b"<Message>Access Denied</Message></Error>"), "application/xml"
        return None
    proxy.answer = answer
    uri = f"s3://ckpt-{uuid.uuid4().hex[:8]}/run"
    run_dir = tmp_path / "run"
    try:
        proc = launch(run_dir, *SMALL, "--set", "train.outer_steps=4", "--set", "checkpoint.every_outer_steps=2",
                      "--set", f"checkpoint.uri={uri}", env={"AWS_ENDPOINT_URL": proxy.url})
        out, _ = proc.communicate(timeout=300)
    finally:
        proxy.stop()
    events = read_events(run_dir / "events.jsonl")
    assert_every_node_released(events)
    failed = [e["step"] for e in events if e["type"] == "checkpoint_upload_failed"]
    uploaded = [e["step"] for e in events if e["type"] == "checkpoint_uploaded"]
    report = json.loads((run_dir / "report.json").read_text())
    if refusals == 1:
        assert proc.returncode == 0, out
        assert failed == [4] and uploaded == [2, 4] and report["status"] == "completed"
    else:
        assert proc.returncode == 1, out
        assert failed == [4, 4] and uploaded == [2] and report["status"] == "failed"
        assert "checkpoint 4 was not written (manifest not written: " in out and "AccessDenied" in out, out
        assert "Traceback" not in out
    assert ckpt.latest(open_storage(uri), ckpt.open_keys(uri, run_dir))["step"] == (4 if refusals == 1 else 2)


def test_failed_run_logs_its_traceback(tmp_path):
    """A cloud run that fails inside the driver (--offline skipped the preflight; there are no
    credentials): one line at the user, the whole traceback in driver.log."""
    from elastic.run.logs import read_log

    run_dir = tmp_path / "run"
    env = cli_env(AWS_EC2_METADATA_DISABLED="true", AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
                  AWS_CONFIG_FILE=str(tmp_path / "none"), ELASTIC_CACHE=str(tmp_path / "cache"))
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_ENDPOINT_URL"):
        env.pop(k, None)
    r = run_cli("launch", "recipes/aws-smoke.yaml", "--offline", "--run-dir", str(run_dir), env=env, timeout=200)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr and "credentials" in r.stdout
    failed = [rec for rec in read_log(run_dir / "driver.log") if rec["level"] == "ERROR"]
    assert failed and "run failed" in failed[-1]["msg"]
    tb = failed[-1]["traceback"]
    assert tb.startswith("Traceback (most recent call last)") and "UserError" in tb and "credentials" in tb
