"""Autodown: every cloud VM of a run ends itself when the driver is gone (kill -9 included), and at
resources.max_vm_hours, whatever the machine that launched it does. The watcher runs for real as
the bootstrap starts it, against the run's Ray cluster, an IMDSv2 server and moto (127.0.0.1)."""

from __future__ import annotations

import base64
import signal
import subprocess
import sys
import time

import boto3

from providers.watcher import HEARTBEAT_KV_KEY, Autodown
from tests.conftest import REPO, cli_env
from tests.providers.test_aws import aws_recipe, instances, price_rule, provider


def test_autodown_counts_from_the_last_change_of_the_heartbeat():
    a = Autodown(after_s=10, now_s=0)
    assert not a.due(None, 9)            # no heartbeat yet: counted from the start
    assert not a.due("1.0", 9.5)
    assert not a.due("1.0", 19)          # the same value again is no news
    assert a.due("1.0", 19.5)
    b = Autodown(after_s=10, now_s=0)
    assert not b.due("1.0", 5) and not b.due(None, 14)   # unreadable (head gone): the clock runs on
    assert b.due(None, 15)
    assert Autodown(after_s=10, now_s=0).due(None, 10)   # a driver that never beat


def state(instance_id: str) -> str:
    return next(vm["State"]["Name"] for vm in instances("us-west-2") if vm["InstanceId"] == instance_id)


def _beating_driver(address: str, env: dict) -> subprocess.Popen:
    """A driver that beats as Driver._heartbeat does, in a process of its own for the test to kill."""
    return subprocess.Popen([sys.executable, "-c", (
        "import ray, time\nfrom providers.watcher import beat\n"
        f"ray.init(address={address!r}, log_to_driver=False)\n"
        "while True:\n    beat()\n    time.sleep(0.5)\n")], cwd=REPO, env=env)


def _stop(*procs: subprocess.Popen) -> None:
    """Kill what a test started that is still running (every exit path)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def _wait_for_beats(n: int = 10) -> None:
    from ray.experimental import internal_kv

    beats, deadline = set(), time.monotonic() + 60
    while len(beats) < n and time.monotonic() < deadline:   # ~5 s of a live driver: > autodown_after_s
        beats.add(internal_kv._internal_kv_get(HEARTBEAT_KV_KEY))
        time.sleep(0.1)
    assert len(beats) >= n, "the driver never beat"


def test_a_driver_killed_with_sigkill_leaves_no_vm_billing(aws_env, imds, local_cluster, tmp_path):
    """The watcher, seeing no heartbeat for autodown_after_s after kill -9 of the driver, shuts its
    VM down through the OS (`shutdown -h now`; here ELASTIC_HALT_CMD records the call) and never
    calls TerminateInstances, which the node's role is not granted: EC2 terminates the VM by its
    shutdown behaviour. The whole path on a booted machine: tests/providers/test_vmlab.py."""
    aws_env.rules.append(price_rule)
    p = provider(aws_recipe(**{"resources.regions": "[us-west-2]", "resources.autodown_after_s": 3}), run="run-kill")
    offer = p.offers(p.recipe.resources)[0]
    vm = p._create(offer, "run-kill", "replica").instance_id
    ec2 = boto3.client("ec2", region_name="us-west-2")
    assert ec2.describe_instance_attribute(InstanceId=vm, Attribute="instanceInitiatedShutdownBehavior")[
        "InstanceInitiatedShutdownBehavior"]["Value"] == "terminate"
    user_data = base64.b64decode(ec2.describe_instance_attribute(InstanceId=vm, Attribute="userData")[
        "UserData"]["Value"]).decode()
    assert "--autodown-after-s 3 " in user_data and "shutdown -h +4320" in user_data   # 72 h
    imds.paths["/latest/meta-data/placement/region"] = "us-west-2"
    halted = tmp_path / "halted"

    env = cli_env(**aws_env.env, ELASTIC_IMDS_URL=imds.url, ELASTIC_HALT_CMD=f"touch {halted}")
    driver = _beating_driver(local_cluster.address, env)
    # The VM's watcher, started as infra/bootstrap.sh.tmpl starts it.
    watcher = subprocess.Popen([sys.executable, "-m", "providers.watcher", "--cloud", "aws", "--instance-id", vm,
                                "--address", local_cluster.gcs_address, "--autodown-after-s", "3"],
                               cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for_beats()
        assert watcher.poll() is None and not halted.exists()   # a live driver's VM stays
        driver.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        driver.wait(timeout=10)
        out, _ = watcher.communicate(timeout=3 + 60)
        took_s = time.monotonic() - killed_at
        assert watcher.returncode == 0 and halted.exists(), out
        assert "no heartbeat from the driver" in out
        assert aws_env.count("TerminateInstances") == 0 and state(vm) == "running"   # the OS's shutdown ends it
        print(f"VM shut down {took_s:.1f} s after kill -9 of the driver (autodown_after_s 3)")
    finally:
        _stop(driver, watcher)
        p.close()


def test_gcp_vms_carry_the_hard_limit(gcp_fake):
    from tests.providers.test_gcp import _offer, _provider

    p, recipe = _provider(**{"resources.accelerators": "L4:1", "resources.max_vm_hours": 2,
                             "resources.autodown_after_s": 90})
    p._create(_offer(p, recipe), "run-cap", "replica")
    [(_, vm)] = gcp_fake.instances.items()
    assert vm["scheduling"]["maxRunDuration"]["seconds"] in (7200, "7200")
    assert vm["scheduling"]["instanceTerminationAction"] == "DELETE"
    script = {i["key"]: i["value"] for i in vm["metadata"]["items"]}["startup-script"]
    assert "shutdown -h +120" in script and "--autodown-after-s 90 " in script


def test_a_gcp_vm_deletes_itself_when_its_driver_is_killed(gcp_fake, local_cluster):
    """GCP: the VM's watcher, seeing no heartbeat for autodown_after_s after kill -9 of the driver,
    deletes its own instance through the Compute API with the token of the run's own service
    account (disk included), with no command from anyone. The fake holds that token to IAM: the
    delete passes only through the grant on the VM's own policy."""
    import json

    from tests.providers.test_gcp import _offer, _provider

    p, recipe = _provider(run="run-gkill", **{"resources.accelerators": "L4:1", "resources.autodown_after_s": 3})
    inst = p._create(_offer(p, recipe), "run-gkill", "replica")
    token = gcp_fake.token_of(gcp_fake.instances[inst.instance_id]["serviceAccounts"][0]["email"])
    gcp_fake.vm_metadata.update({"instance/zone": f"projects/1234/zones/{inst.offer.zone}",
                                 "instance/service-accounts/default/token":
                                     json.dumps({"access_token": token, "expires_in": 3599, "token_type": "Bearer"})})
    env = cli_env(**gcp_fake.env(), ELASTIC_HALT_CMD="false")   # a shutdown would fail: the API must do it
    driver = _beating_driver(local_cluster.address, env)
    watcher = subprocess.Popen([sys.executable, "-m", "providers.watcher", "--cloud", "gcp", "--instance-id",
                                inst.instance_id, "--address", local_cluster.gcs_address, "--autodown-after-s", "3"],
                               cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for_beats()
        assert watcher.poll() is None and inst.instance_id in gcp_fake.instances   # a live driver's VM stays
        driver.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        driver.wait(timeout=10)
        out, _ = watcher.communicate(timeout=3 + 60)
        took_s = time.monotonic() - killed_at
        assert inst.instance_id not in gcp_fake.instances, out
        assert watcher.returncode == 0 and f"deleted {inst.instance_id} (itself)" in out, out
        [delete] = [r for r in gcp_fake.requests if r["method"] == "DELETE" and r["path"].endswith(inst.instance_id)]
        assert delete["authorization"] == f"Bearer {token}"
        print(f"GCP VM deleted itself {took_s:.1f} s after kill -9 of the driver (autodown_after_s 3)")
    finally:
        _stop(driver, watcher)
        p.close()
