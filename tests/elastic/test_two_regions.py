"""recipes/local-two-regions.yaml for real: two regions in network namespaces of their own behind
NAT routers, the driver's host in region-a, one replica in each region, joined only by the
WireGuard overlay; a hard preemption in region-b and the replacement's join."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from elastic import overlay
from elastic.ledger import read_events
from elastic.report import build_report
from providers.local import localnet
from tests.conftest import REPO, cli_env

REQUIRES = localnet.missing_requirements() or (
    f"missing {', '.join(overlay.missing_tools())}" if overlay.missing_tools() else None)
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(REQUIRES is not None, reason=f"network lab unavailable: {REQUIRES}")]


def test_two_regions_train_over_the_overlay_survive_a_preemption_and_leave_nothing(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "tests.servers.two_regions_driver", str(run_dir),
                           json.dumps({"train.outer_steps": 6, "checkpoint.every_outer_steps": 3,
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
