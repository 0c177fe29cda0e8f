"""`elastic launch --address` on a Ray cluster the user started, dashboard included: the run's own
clusters start light (no dashboard, no agents), and what a user asks Ray for still works there."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
import urllib.request

import pytest

from elastic.record.ledger import read_events
from tests.conftest import REPO, cli_env, run_cli

pytestmark = pytest.mark.slow

# The user's head, as `ray start --head --node-ip-address=127.0.0.1 --include-dashboard=true` starts
# it (on loopback: the test sends nothing elsewhere; the dashboard on the first free port from Ray's
# 8265); it prints its address and the dashboard's, and shuts down when its
# standard input closes (the test's end, the test's process killed included). It leaves this
# machine's "current cluster" file (what `ray.init()` without an address joins) alone, as a run's
# own clusters do.
HEAD = textwrap.dedent("""
    import os, sys
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster
    from elastic.run.cluster import _users_ray_address_kept
    ray_constants.ENABLE_RAY_CLUSTER = False
    temp_dir = sys.argv[1]
    with _users_ray_address_kept():
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "num_gpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": True,
            "dashboard_host": "127.0.0.1", "temp_dir": temp_dir,
            "object_store_memory": 80 * 1024 * 1024})
        print(cluster.address, cluster.head_node.webui_url, flush=True)
        sys.stdin.read()
        cluster.shutdown()
""")


def dashboard(url: str, path: str) -> dict:
    with urllib.request.urlopen(f"http://{url}{path}", timeout=10) as answer:
        return json.loads(answer.read())


def test_a_run_on_the_users_cluster_shows_in_its_dashboard_and_in_status(tmp_path):
    temp_dir = tempfile.mkdtemp(prefix="ray-user-")   # short: Ray's socket paths live under it
    # TMPDIR: the dashboard's forkserver leaves its socket's directory behind when the head ends.
    head = subprocess.Popen([sys.executable, "-c", HEAD, temp_dir], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=cli_env(TMPDIR=temp_dir))
    try:
        address, url = (head.stdout.readline().split() + ["", ""])[:2]
        assert address and url.startswith("127.0.0.1:"), "the user's head did not start with its dashboard"
        assert dashboard(url, "/api/version")["ray_version"]

        run_dir = tmp_path / "run"
        launched = run_cli("launch", str(REPO / "recipes/local-tiny.yaml"), "--address", address,
                           "--run-dir", str(run_dir), "--set", "train.outer_steps=2", timeout=120)
        assert launched.returncode == 0, launched.stdout + launched.stderr
        events = read_events(run_dir / "events.jsonl")
        assert events[-1]["type"] == "run_ended" and events[-1]["status"] == "completed", events[-1]
        nodes = {e["ray_node_id"] for e in events if e["type"] == "node_launched"}
        assert len(nodes) == 2
        assert {e["instance_id"] for e in events if e["type"] == "node_launched"} == \
            {e["instance_id"] for e in events if e["type"] == "node_released"}

        # The user's dashboard saw the run's nodes join its cluster (Ray's state API, as its pages use).
        listed = dashboard(url, "/api/v0/nodes?limit=100&detail=false")["data"]["result"]["result"]
        assert nodes <= {n["node_id"] for n in listed}, listed
        # And the head is still the user's, serving after the run left it.
        assert dashboard(url, "/api/version")["ray_version"]

        status = run_cli("status", str(run_dir), "--once")
        assert status.returncode == 0, status.stderr
        assert "completed" in status.stdout, status.stdout
    finally:
        head.stdin.close()
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)
