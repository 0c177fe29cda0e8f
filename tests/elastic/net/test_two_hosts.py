"""A world over two hosts that share no loopback: the regression test for the store and the outer
group advertising 127.0.0.1 (issue 15). Real Ray, real gloo, a real network namespace."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, cli_env

pytestmark = pytest.mark.slow


def test_replicas_on_two_hosts_train_together_every_outer_step(netns_host):
    overrides = {"train.outer_steps": 3, "world.step_timeout_s": 60, "world.sync_timeout_s": 20}
    # A LocalCluster started earlier in this session keeps Ray single-host for this process
    # (elastic/run/cluster.py); the two hosts need Ray's multi-node default.
    env = {k: v for k, v in cli_env().items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    proc = subprocess.run([sys.executable, "-m", "tests.servers.two_hosts_driver", netns_host.name,
                           netns_host.host_ip, netns_host.peer_ip, json.dumps(overrides)],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=240)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stderr[-3000:]
    out = json.loads(lines[-1])
    assert "error" not in out, (out, proc.stderr[-3000:])
    print(f"two hosts: cluster formed in {out['cluster_s']} s, 2 replicas × 3 outer steps in {out['train_s']} s")
    assert out["lost"] == []
    assert sorted(out["replicas_on"].values()) == ["host", "peer"]
    assert out["steps"] == [[0, 1]] * 3          # every outer step averaged both hosts' replicas
    assert out["identical_theta"]
