"""recipes/local-two-regions.yaml for real: two regions in network namespaces of their own behind
NAT routers, the driver's host in region-a, one replica in each region, joined only by the
WireGuard overlay; a hard preemption in region-b and the replacement's join."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from elastic.net import overlay
from elastic.record.ledger import read_events
from elastic.views.report import build_report
from providers.local import localnet
from tests.conftest import REPO, cli_env

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("root_tools")]


def test_two_regions_train_over_the_overlay_survive_a_preemption_and_leave_nothing(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "tests.servers.two_regions_driver", str(run_dir),
                           json.dumps({"train.outer_steps": 6, "checkpoint.every_outer_steps": 3,
                                       # one preemption, the test's own (below), not the market's
                                       "local.market.preempt_per_hour": 0,
                                       # both regions in every step: the world waits for the replacement
                                       "world.min_replicas": 2})],
                          capture_output=True, text=True, cwd=REPO, env=cli_env(), timeout=600)
    assert proc.stdout.strip(), proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "error" not in out, out
    assert out["status"] == "completed"
    events = read_events(run_dir / "events.jsonl")
    report = build_report(events)
    regions = {e["instance_id"]: e["region"] for e in events if e["type"] == "node_launched"}
    assert set(regions.values()) == {"region-a", "region-b"}
    # The region-b node was lost, a replacement in region-b joined, and outer steps after the
    # join averaged a replica from each region again.
    assert out["preempted"] and regions[out["preempted"]] == "region-b"
    assert report["preemptions"] >= 1 and report["joins"] >= 1
    steps = [e for e in events if e["type"] == "outer_step"]
    assert len(steps[-1]["replicas"]) == 2
    losses = [sum(e["losses"]) / len(e["losses"]) for e in steps]
    assert losses[-1] < losses[0]
    # Only the overlay crossed the internet between the regions: WireGuard's UDP, never TCP.
    assert out["counters"]["overlay"]["packets"] > 0
    assert out["counters"]["tcp"]["packets"] == 0 and out["counters"]["other_udp"]["packets"] == 0
    # Each joiner measured its link to the node in the other region, over the overlay (the TCP of
    # the measurement is inside it: no TCP crossed the bridge above), at the lab's shaped rates.
    links = [e for e in events if e["type"] == "link_measured"]
    assert links and all({e["site"], e["peer_site"]} == {"local/region-a", "local/region-b"} for e in links)
    assert all(e["rtt_ms"] > 0 and 0 < e["mbit_s"] < 1100 for e in links)   # 1000 Mbit/s: the faster uplink
    # The preempted node's key reaches no member any more.
    assert out["key_still_known"] == []
    # Nothing of the run is left on this machine.
    assert out["left"] == []
    assert not [n for n in localnet.list_namespaces() if n.startswith(out["tag"])]
    assert subprocess.run(["pgrep", "-f", f"wireguard-go {out['tag']}"], capture_output=True).returncode == 1


def test_ctrl_c_while_nodes_join_leaves_no_namespace_interface_or_wireguard_process(tmp_path):
    """`elastic launch recipes/local-two-regions.yaml` interrupted (SIGINT) once a node in region-b
    has joined over the overlay: exit 130, and nothing of its network is left on this machine."""
    import signal
    import time

    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "elastic", "launch", "recipes/local-two-regions.yaml",
                             "--run-dir", str(run_dir), "--allow-partial", "--set", "train.outer_steps=1000"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=cli_env())
    deadline = time.monotonic() + 120
    ledger = run_dir / "events.jsonl"
    while not any(e["type"] == "node_launched" and e.get("region") == "region-b" and e.get("joined")
                  for e in (read_events(ledger) if ledger.exists() else [])):
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "no region-b node joined within 120 s"
        time.sleep(0.2)   # polling the ledger, bounded by the deadline
    tag = next(e["tag"] for e in read_events(ledger) if e["type"] == "network_started")
    spaces = [n for n in localnet.list_namespaces() if n.startswith(tag)]
    # Each host's wireguard-go (named for its namespace) and the driver's host's own.
    wg_names = [overlay.Interface(n).ifname for n in spaces if "h" in n.split("-")[1]] + [f"{tag}wg"]
    assert len(wg_names) >= 2
    if not Path("/sys/module/wireguard").exists():   # userspace WireGuard: a process per interface
        assert all(subprocess.run(["pgrep", "-f", f"wireguard-go {w}$"], capture_output=True).returncode == 0
                   for w in wg_names)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert json.loads((run_dir / "report.json").read_text())["status"] == "interrupted"
    assert not [n for n in localnet.list_namespaces() if n.startswith(tag)]
    assert not [w for w in wg_names
                if subprocess.run(["pgrep", "-f", f"wireguard-go {w}$"], capture_output=True).returncode == 0]
    assert subprocess.run(["ip", "link", "show", f"{tag}wg"], capture_output=True).returncode != 0
    assert not (overlay.OWNERS / tag).exists()
