"""The local cluster starts light: no dashboard, no node agents, yet nodes join and run actors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import elastic
from tests.conftest import process_alive

IDLE_AGENT = Path(elastic.__file__).parent / "run" / "idle_agent.py"


def _raylet_of(node_id: str):
    import psutil

    return next(p for p in psutil.process_iter(["cmdline"])
                if any(a == f"--node_id={node_id}" for a in (p.info["cmdline"] or [])))


@pytest.mark.slow
def test_a_light_node_runs_no_agents_and_still_runs_actors(local_cluster, nodes):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    [node_id] = nodes(1)
    raylet = _raylet_of(node_id)
    agents = [" ".join(c.cmdline()) for c in raylet.children() if "default_worker.py" not in " ".join(c.cmdline())]
    # Both of the raylet's agents are the idle stand-in: no dashboard agent, no runtime env agent.
    assert len(agents) == 2 and all(str(IDLE_AGENT) in a for a in agents), agents
    assert not any("dashboard/agent.py" in a or "runtime_env/agent/main.py" in a for a in agents)
    # The head runs no API server (dashboard.py) either.
    import psutil

    assert not any("dashboard/dashboard.py" in " ".join(p.info["cmdline"] or [])
                   for p in psutil.process_iter(["cmdline"])
                   if p.info["cmdline"] and local_cluster.session_dir in " ".join(p.info["cmdline"]))

    @ray.remote(num_cpus=1)
    def where() -> str:
        return ray.get_runtime_context().get_node_id()

    strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
    assert ray.get(where.options(scheduling_strategy=strategy).remote(), timeout=60) == node_id


def test_the_idle_agent_reports_its_ports_as_not_served_and_follows_its_parent(tmp_path):
    node = "ab" * 28
    # Its parent (a shell standing in for the raylet) ends: the stand-in ends with it.
    shell = subprocess.Popen(["sh", "-c", f'RAY_RAYLET_PID=$$ "{sys.executable}" -S "{IDLE_AGENT}" '
                                          f'--session-dir="{tmp_path}" --node-id={node} '
                                          f'--ports=metrics_agent_port,runtime_env_agent_port & echo $!; wait'],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    agent_pid = int(shell.stdout.readline())
    deadline = time.monotonic() + 30
    files = [tmp_path / f"metrics_agent_port_{node}", tmp_path / f"runtime_env_agent_port_{node}"]
    while not all(f.exists() for f in files):
        assert time.monotonic() < deadline, list(tmp_path.iterdir())
        time.sleep(0.05)   # polling for the stand-in's port files with a deadline
    assert [f.read_text() for f in files] == ["-1", "-1"]
    assert not list(tmp_path.glob("*.tmp"))
    os.kill(shell.pid, signal.SIGKILL)
    shell.wait()
    deadline = time.monotonic() + 10
    while process_alive(agent_pid):
        assert time.monotonic() < deadline, "the stand-in outlived its parent"
        time.sleep(0.05)   # polling for the stand-in's exit with a deadline


@pytest.mark.slow
def test_a_cluster_elastic_starts_leaves_the_users_current_ray_cluster_alone():
    """A user's own cluster (`ray start`) is what `ray.init()` without an address connects to,
    through Ray's "current cluster" file. A run's cluster starts and stops beside it without
    pointing that file at itself (Ray's `Cluster` would, saying so on the console) or deleting it."""
    import shutil
    import tempfile

    temp = Path(tempfile.mkdtemp(prefix="elr", dir="/tmp"))   # short: Ray's socket paths live under it
    try:
        pointer = temp / "ray" / "ray_current_cluster"
        pointer.parent.mkdir()
        pointer.write_text("127.0.0.1:6379")
        started = subprocess.run(
            [sys.executable, "-c", "from elastic.run.cluster import LocalCluster\n"
             "c = LocalCluster()\nprint('head at', c.address, flush=True)\nc.shutdown()"],
            env={**os.environ, "RAY_TMPDIR": str(temp)}, capture_output=True, text=True, timeout=120)
        assert started.returncode == 0 and "head at 127.0.0.1:" in started.stdout, started.stderr[-2000:]
        assert pointer.read_text() == "127.0.0.1:6379"
        assert "Overwriting previous Ray address" not in started.stdout + started.stderr
        assert list((temp / "ray").glob("session_*")), "the run's cluster kept its files elsewhere"
    finally:
        shutil.rmtree(temp, ignore_errors=True)
