"""The VM lab (providers/lab): instances started through moto's EC2 and the Compute Engine fake
boot as machines of this host and run the script their provider sent, verbatim: the real
bootstrap (infra/bootstrap.sh.tmpl), the install from a wheel of this checkout, the metadata
server at 169.254.169.254, and the OS shutdown that ends the instance by its shutdown behaviour.

Needs root, iproute2, nftables and wireguard-tools (CI runs these with ELASTIC_REQUIRE_ROOT_TESTS=1:
a missing tool fails there)."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest

from tests.conftest import REPO
from tests.providers.test_aws import aws_recipe, price_rule, provider

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("root_tools")]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    """A wheel of this checkout (what the lab machines install: no index, no internet), built as
    `elastic rehearse` builds it."""
    from providers.lab.rehearse import checkout_wheel

    return str(checkout_wheel(tmp_path_factory.mktemp("wheels")))


def _install(wheel: str) -> str:
    return f"pip install -q --no-deps --no-index --force-reinstall {wheel}"


@pytest.fixture
def lab(aws_env, moto_server, gcp_fake):
    from providers.lab.vmlab import AwsCloud, VmLab

    from providers.lab.vmlab import HOST_STAGING

    staging_before = HOST_STAGING.exists()
    vmlab = VmLab(aws=AwsCloud(moto_server, ["us-west-2"]), gcp=gcp_fake, gcp_regions=["us-central1"])
    try:
        yield vmlab
    finally:
        vmlab.down()
        assert not [n for n in _namespaces() if n.startswith(vmlab.tag)]
        assert not vmlab.root.exists()
        # The machines' staging mount point on this host's /tmp goes with them (where it was not before).
        assert HOST_STAGING.exists() == staging_before


@pytest.fixture
def owned_lab(monkeypatch, tmp_path, gcp_fake):
    """A lab that owns EC2 (moto served from this process: `providers.lab.ec2.LabEC2`), so the
    addresses and consoles EC2 names are the machines'; the test's proxy in front of it (prices)."""
    from providers.lab.ec2 import LabEC2
    from providers.lab.vmlab import AwsCloud, VmLab
    from tests.conftest import AWSProxy

    ec2 = LabEC2()
    proxy = AWSProxy(ec2.url)
    proxy.rules.append(price_rule)
    env = {"AWS_ENDPOINT_URL": proxy.url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
           "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"), "AWS_CONFIG_FILE": str(tmp_path / "none")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    vmlab = None
    try:
        told: list[str] = []
        told_unlisted: list[str] = []

        def tell(line: str) -> None:
            # A machine's end is told before the lab unlists it: whoever waits for it to go then
            # finds its end told too.
            if vmlab.machine(line.split()[0]) is None:
                told_unlisted.append(line)
            told.append(line)

        vmlab = VmLab(aws=AwsCloud(ec2.url, ["us-west-2"], server=ec2), gcp=gcp_fake, gcp_regions=["us-central1"],
                      on_end=tell)
        vmlab.told = told   # what it said as each machine ended (`elastic rehearse` prints these lines)
        yield vmlab
    finally:
        if vmlab is not None:
            vmlab.down()
        proxy.close()
        ec2.stop()
    assert not [n for n in _namespaces() if n.startswith(vmlab.tag)]
    assert not told_unlisted, told_unlisted


def _namespaces() -> list[str]:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()


def _state(vm: str) -> str:
    ec2 = boto3.client("ec2", region_name="us-west-2")
    return ec2.describe_instances(InstanceIds=[vm])["Reservations"][0]["Instances"][0]["State"]["Name"]


def test_a_vm_runs_the_bootstrap_as_sent_and_a_failed_install_shows_in_its_console(aws_env, lab):
    aws_env.rules.append(price_rule)
    recipe = aws_recipe(**{"resources.regions": "[us-west-2]", "resources.max_vm_hours": 2,
                           "aws.install": "pip install --no-deps --no-index /nonexistent/elastic-0.1.0-py3-none-any.whl"})
    p = provider(recipe, run="run-lab")
    try:
        vm = p._create(p.offers(recipe.resources)[0], "run-lab", "replica").instance_id
        machine = lab.wait_for(lambda: lab.machine(vm), 30, f"{vm} booting")
        sent = base64.b64decode(boto3.client("ec2", region_name="us-west-2").describe_instance_attribute(
            InstanceId=vm, Attribute="userData")["UserData"]["Value"]).decode()
        assert (machine.root / "os" / "user-data").read_text() == sent          # verbatim
        lab.wait_for(lambda: "user data exited" in lab.console(vm), 60, "the boot script ending")
        console = lab.console(vm, 200)
        assert "elastic bootstrap: run run-lab, cloud aws" in console           # the script's own words
        assert "/nonexistent/elastic-0.1.0-py3-none-any.whl" in console and "exited with status 1" in console
        # The boot log inside the machine holds the same story; the host's /var/log does not.
        log = machine.file("/var/log/elastic-bootstrap.log").read_text()
        assert "elastic bootstrap: run run-lab" in log and "/nonexistent/" in log
        # `shutdown -h +120` (max_vm_hours 2) was scheduled first, not done; the failed boot moved it
        # to 10 minutes from then (nothing else would end a VM that never joins if its driver is gone).
        assert "shutdown -h +120" in sent and "this VM shuts down in 10 minutes" in console
        due = machine.shutdown_scheduled()
        assert due is not None and 9 * 60 < due - machine.booted_at < 11 * 60 + 60
        assert machine.alive() and _state(vm) == "running"
        # Released through the API: the machine goes, with its namespace.
        p.terminate(vm)
        lab.wait_for(lambda: lab.machine(vm) is None, 30, f"{vm} powering off")
        assert not [n for n in _namespaces() if n == machine.netns]
    finally:
        p.close()


def test_vms_end_themselves_through_the_production_path(aws_env, moto_server, lab, wheel):
    """The wheel installs; the watcher's `end_self` (what autodown calls) on AWS runs the OS
    shutdown (the node may not TerminateInstances: the lab's gateway refuses it, as
    node-policy.json does) and EC2 terminates the VM by its shutdown behaviour; on GCP the VM
    deletes itself through the Compute API with its service account's token from the metadata
    server."""
    ec2 = boto3.client("ec2", region_name="us-west-2")
    iam = boto3.client("iam", region_name="us-east-1")
    iam.create_role(RoleName="elastic-node", AssumeRolePolicyDocument="{}")
    iam.create_instance_profile(InstanceProfileName="elastic-node")
    iam.add_role_to_instance_profile(InstanceProfileName="elastic-node", RoleName="elastic-node")
    imds = "http://169.254.169.254/latest"
    script = "\n".join([
        "#!/bin/bash", "set -euo pipefail", _install(wheel),
        "python3 -c 'import elastic, providers.watcher; print(\"installed at\", elastic.__file__)'",
        f"TOKEN=$(curl -sf -X PUT {imds}/api/token -H 'X-aws-ec2-metadata-token-ttl-seconds: 300')",
        f"ID=$(curl -sf -H \"X-aws-ec2-metadata-token: $TOKEN\" {imds}/meta-data/instance-id)",
        # What the role may not do, answered as AWS would.
        "aws ec2 terminate-instances --instance-ids \"$ID\" || echo \"refused as expected\"",
        "python3 -c \"import sys; from providers.watcher import end_self; end_self('aws', sys.argv[1])\" \"$ID\"",
        "sleep 600", ""])
    vm = ec2.run_instances(ImageId="ami-12c6146b", InstanceType="t3.micro", MinCount=1, MaxCount=1, UserData=script,
                           InstanceInitiatedShutdownBehavior="terminate",
                           IamInstanceProfile={"Name": "elastic-node"})["Instances"][0]["InstanceId"]
    started = time.monotonic()
    lab.wait_for(lambda: _state(vm) == "terminated", 120, f"{vm} terminated by its own shutdown")
    console = lab.console(vm, 200)
    assert lab.ended[vm] == "terminated", console
    assert f"installed at {lab.root / vm / 'venv'}" in console   # this checkout's wheel, not the host's copy
    assert "UnauthorizedOperation" in console and "refused as expected" in console
    print(f"AWS VM ended itself {time.monotonic() - started:.1f} s after its launch")


def test_a_gcp_vm_deletes_itself_with_its_own_account(lab, gcp_fake, wheel):
    from tests.providers.test_gcp import _offer, _provider

    md = "http://metadata.google.internal/computeMetadata/v1"
    install = "\n".join([
        _install(wheel),
        f"NAME=$(curl -sf -H 'Metadata-Flavor: Google' {md}/instance/name)",
        "python3 -c \"import sys; from providers.watcher import end_self; end_self('gcp', sys.argv[1])\" \"$NAME\"",
        "sleep 600"])
    p, recipe = _provider(run="run-glab", **{"resources.accelerators": "L4:1", "resources.regions": "[us-central1]",
                                             "gcp.install": install})
    inst = p._create(_offer(p, recipe), "run-glab", "replica")
    lab.wait_for(lambda: inst.instance_id not in gcp_fake.instances, 120, f"{inst.instance_id} deleted by itself")
    lab.wait_for(lambda: lab.machine(inst.instance_id) is None, 30, f"{inst.instance_id} powered off")
    console = lab.console(inst.instance_id, 200)
    assert f"deleted {inst.instance_id} (itself)" in console and lab.ended[inst.instance_id] == "api", console


def test_a_vm_whose_install_fails_is_released_and_named_with_the_tail_of_its_boot_log(owned_lab, gcp_fake):
    """AWS and GCP VMs whose install fails never join: each launch sees the failure on the VM's
    console (GetConsoleOutput, getSerialPortOutput) long before its 600 s join timeout, releases
    the VM, and its JoinTimeout (the ledger's `node_join_timeout`, the driver's story line) names
    the VM and ends with its boot log, whose failing line is what a run that stops renting names.
    The addresses the clouds name are the lab machines' own."""
    from concurrent.futures import ThreadPoolExecutor

    from elastic.record.events import NodeJoinTimeout
    from elastic.run.rentals import _cause
    from providers.base import JoinTimeout
    from providers.cloud import BOOT_FAILED_MARK
    from tests.providers.test_gcp import _offer, _provider

    lab = owned_lab
    broken = "pip install --no-deps --no-index /nonexistent/elastic-0.1.0-py3-none-any.whl"
    # The install fails within seconds of the boot (pip's start); the join timeout is far beyond
    # the 180 s the test waits for the launches: only the console's failure line can end them.
    aws_p = provider(aws_recipe(**{"resources.regions": "[us-west-2]", "resources.join_timeout_s": 600,
                                   "world.capacity_timeout_s": 600, "aws.install": broken}), run="run-broken")
    gcp_p, gcp_recipe = _provider(run="run-gbroken", **{"resources.accelerators": "L4:1",
                                                         "resources.regions": "[us-central1]",
                                                         "resources.join_timeout_s": 600, "gcp.install": broken})

    def launch(p, offer, run):
        with pytest.raises(JoinTimeout) as info:
            p.launch(offer, run, "replica")
        return info.value

    try:
        with ThreadPoolExecutor(2) as pool:
            aws_f = pool.submit(launch, aws_p, aws_p.offers(aws_p.recipe.resources)[0], "run-broken")
            gcp_f = pool.submit(launch, gcp_p, _offer(gcp_p, gcp_recipe), "run-gbroken")
            vm = lab.wait_for(lambda: next((m for m in list(lab.machines) if m.startswith("i-")), None), 60, "the AWS VM booting")
            host = lab.hosts[vm]
            described = boto3.client("ec2", region_name="us-west-2").describe_instances(
                InstanceIds=[vm])["Reservations"][0]["Instances"][0]
            assert (described["PrivateIpAddress"], described["PublicIpAddress"]) == (host.private_ip, host.public_ip)
            aws_exc, gcp_exc = aws_f.result(timeout=180), gcp_f.result(timeout=180)
    finally:
        aws_p.close()
        gcp_p.close()
    for exc in (aws_exc, gcp_exc):
        iid = exc.instance.instance_id
        assert exc.boot_failed and "its boot script failed" in str(exc) and exc.waited_s < 180, str(exc)
        assert "/nonexistent/elastic-0.1.0-py3-none-any.whl" in exc.console_tail, exc.console_tail
        assert BOOT_FAILED_MARK in exc.console_tail and len(exc.console_tail.splitlines()) <= 10
        assert "/nonexistent/" in _cause(exc.console_tail), exc.console_tail
        line = NodeJoinTimeout(instance_id=iid, timeout_s=exc.timeout_s, boot_log=exc.console_tail,
                               boot_failed=exc.boot_failed).story()
        assert line.startswith(f"never joined: {iid} (its boot script failed); its boot log ends:")
        assert "/nonexistent/" in line
        lab.wait_for(lambda: lab.machine(iid) is None and iid in lab.ended, 30, f"{iid} released")
        # The lab's own account of its end carries the failed boot's console too.
        [end] = [t for t in lab.told if t.startswith(f"{iid} ")]
        assert "its user data failed, its console ends:" in end and "/nonexistent/" in end, end
    assert _state(aws_exc.instance.instance_id) == "terminated"
    assert gcp_exc.instance.instance_id not in gcp_fake.instances


REHEARSE_RECIPE = """\
name: rehearse-test
model: {layers: 2, width: 128, heads: 2, context: 32}
data: {corpus_bytes: 200000}
train: {inner_steps: 4, outer_steps: 3, batch_size: 4, seq_len: 32, inner_lr: 0.003, warmup_steps: 2}
world: {min_replicas: 2, replicas: 2, max_replicas: 2, ranks_per_replica: 1, capacity_timeout_s: 600}
resources:
  clouds: [aws]
  regions: [us-west-2]
  accelerators: A10G
  head: local
  join_timeout_s: 600
  autodown_after_s: 60
aws:
  ami_ssm_parameter: /aws/service/ami-amazon-linux-latest/al2023-ami-kernel-default-x86_64
  node_role_boundary: elastic-node
"""


def _model_bytes(recipe: Path) -> int:
    """The recipe's model's parameters in float32: what a replica's state weighs (about 1.7 MB
    here, ten times what a node's joining sends over the overlay)."""
    from elastic.models import build_model
    from elastic.recipe.model import load_recipe

    return 4 * sum(p.numel() for p in build_model(load_recipe(str(recipe), []).model).parameters())


def _leftovers(tag: str, driver_pid: int, run_dir: Path) -> list[str]:
    """What a rehearsal with lab `tag`, driver `driver_pid` and run directory `run_dir` left on this
    machine (its VMs' checkpoint staging is on their own disks: none on this host's)."""
    from elastic.storage.checkpoint import destination, staging_root

    left = [f"netns {n}" for n in _namespaces() if n.startswith(tag)]
    staging = Path(staging_root(None, run_dir.name, destination(None, run_dir)))
    left += [f"staging {staging}"] if staging.exists() else []
    left += [f"link {link}" for link in subprocess.run(["ip", "-br", "link"], capture_output=True,
                                                      text=True).stdout.split("\n") if link.startswith(tag)]
    left += [f"dir /run/elastic-lab/{tag}"] if Path(f"/run/elastic-lab/{tag}").exists() else []
    try:
        os.killpg(driver_pid, 0)
        left.append(f"processes of the driver's session {driver_pid}")
    except ProcessLookupError:
        pass
    pids = subprocess.run(["pgrep", "-f", f"elastic-lab/{tag}"], capture_output=True, text=True).stdout.split()
    left += [f"process {pid}" for pid in pids]
    from elastic.net import overlay
    if overlay.OWNERS.exists():
        left += [f"overlay {c.name}" for c in overlay.OWNERS.iterdir() if c.read_text().strip() == str(driver_pid)]
    return left


def test_rehearse_runs_an_aws_recipe_to_completed_over_the_overlay(tmp_path):
    """`elastic rehearse`, as a user runs it: two VMs boot the provider's user data, install the
    wheel, read their overlay keys with their instance role's credentials from their metadata
    servers, join the overlay and Ray, train two replicas, and are released at the end; the run
    completes with its report, the replicas' syncs crossed the WireGuard overlay, and nothing of
    the lab is left."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(REHEARSE_RECIPE)
    run_dir = tmp_path / "run"

    def checkout() -> set[str]:   # (pytest's own .pytest_cache may come meanwhile)
        return {p.name for p in REPO.iterdir() if not p.name.startswith(".")}
    before = checkout()   # the rehearsal builds its wheel elsewhere
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "elastic", "rehearse", str(recipe), "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"})
    took_s = time.monotonic() - started
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    tag, driver = re.search(r"rehearse: lab (el[0-9a-f]{4}) at \S+; driver pid (\d+)", out).groups()
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "completed" and report["outer_steps"] == 3, out[-3000:]
    assert (run_dir / "report.html").exists()
    ends = re.findall(r"rehearse: (i-[0-9a-f]+) \(aws\) ended: ([^,]+), \d+ s after its boot; overlay (\d+) bytes "
                      r"received, (\d+) sent", out)
    assert len(ends) == 2 and {how for _, how, _, _ in ends} == {"released through its cloud's API"}, out[-3000:]
    # Each outer step's sync between the two replicas crossed WireGuard: three model's worth
    # each way (a join alone carries a tenth of one).
    for vm, _, received, sent in ends:
        assert int(received) > 2 * _model_bytes(recipe) and int(sent) > 2 * _model_bytes(recipe), (vm, received, sent)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not _leftovers(tag, int(driver), run_dir)
    assert checkout() <= before, f"the rehearsal left {checkout() - before} in the checkout"
    print(f"rehearsal completed in {took_s:.0f} s; overlay bytes (VM, in, out): {[(e[0], e[2], e[3]) for e in ends]}")


MULTI_RECIPE = """\
name: rehearse-multi
model: {layers: 2, width: 128, heads: 2, context: 32}
data: {corpus_bytes: 200000}
train: {inner_steps: 4, outer_steps: 100000, batch_size: 4, seq_len: 32, inner_lr: 0.003, warmup_steps: 2}
world: {min_replicas: 2, replicas: 3, max_replicas: 3, ranks_per_replica: 1, capacity_timeout_s: 900}
resources:
  clouds: [aws, gcp]
  regions: [us-west-2, us-east-1, us-central1]
  accelerators: "L4:1"
  head: local
  join_timeout_s: 150
  autodown_after_s: 20
planner: {spread_min: 3}
aws:
  ami_ssm_parameter: /aws/service/ami-amazon-linux-latest/al2023-ami-kernel-default-x86_64
  node_role_boundary: elastic-node
"""


class _Lines:
    """A process's output lines as they come, each with the monotonic time it was read."""

    def __init__(self, proc: subprocess.Popen):
        import threading

        self.lines: list[tuple[float, str]] = []
        self._new = threading.Condition()
        self._proc = proc
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            with self._new:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self._new.notify_all()
        with self._new:
            self._new.notify_all()

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait(self, pattern: str, timeout_s: float, count: int = 1) -> list[re.Match]:
        """The first `count` matches of `pattern`, waiting up to `timeout_s` for them."""
        deadline = time.monotonic() + timeout_s
        with self._new:
            while True:
                found = [m for _, line in self.lines if (m := re.search(pattern, line))]
                if len(found) >= count:
                    return found[:count]
                left = deadline - time.monotonic()
                if left <= 0 or (self._proc.poll() is not None and not self._new.wait(0.5)):
                    raise AssertionError(f"no {count} x {pattern!r} within {timeout_s:g} s:\n{self.text()[-6000:]}")
                self._new.wait(min(left, 1.0))   # the output may end before the process does: look again

    def when(self, pattern: str) -> float:
        return next(t for t, line in self.lines if re.search(pattern, line))


def test_rehearse_three_regions_two_clouds_a_spot_notice_drains_and_a_killed_driver_leaves_nothing(tmp_path):
    """`elastic rehearse` of a recipe over two AWS regions and one GCP region: the three replicas
    train over the overlay; an interruption notice served by one VM's metadata server (the
    rehearsal's `interrupt` file) drains that replica and its VM is left for EC2 to reclaim (which
    bills nothing for it, being in its first hour); a replacement joins; then the driver
    is killed with SIGKILL, and every VM ends itself through the production path (the watcher's
    autodown: AWS `shutdown`, terminated by its shutdown behaviour; GCP deletes itself with its
    own account) within autodown_after_s + 60 s, and nothing of the lab is left."""
    import signal

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(MULTI_RECIPE)
    # Every inner step takes at least 100 ms (a slow VM, on every machine of the lab): the replicas
    # train from their join to the driver's kill, and would otherwise spend two cores' worth of the
    # suite's CPU on it while the lab waits on boots, the notice and the autodown.
    proc = subprocess.Popen([sys.executable, "-m", "elastic", "rehearse", str(recipe), "--run-dir", str(tmp_path / "run")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200",
                                 "ELASTIC_FAULT_STEP_DELAY_S": "0.1"})
    out = _Lines(proc)
    try:
        tag, driver = out.wait(r"rehearse: lab (el[0-9a-f]{4}) at \S+; driver pid (\d+)", 600)[0].groups()
        joined = out.wait(r"joined: replica \d+ on (\S+)", 1200, count=3)
        out.wait(r"^outer \d+/", 300)
        # (A VM that never joins, its `ray start` timed out on this busy host, is replaced.)
        rented = dict(re.findall(r"rented (\S+): \S+ in (\w+:[\w-]+)", out.text()))
        where = {m[1]: rented[m[1]] for m in joined}
        assert sorted(w.split(":")[0] for w in where.values()) == ["aws", "aws", "gcp"], where
        vm = next(iid for iid, w in where.items() if w.startswith("aws:"))
        (Path(f"/run/elastic-lab/{tag}") / vm / "interrupt").touch()
        out.wait(rf"notice: {vm} ", 120)
        out.wait(rf"drained: replica \d+ on {vm} ", 180)
        # EC2 bills nothing for a spot VM it interrupts within its first hour, and the seconds of one
        # the user terminates: the driver leaves the drained VM for EC2 to reclaim when the notice
        # runs out, rather than terminating it.
        out.wait(rf"left to its cloud: {vm} goes at its notice's deadline", 60)
        # Its replacement joins (a VM still booting when the driver dies has no watcher yet).
        out.wait(r"joined: replica \d+ on (\S+)", 900, count=4)
        live = {m[1] for m in joined} - {vm} | {out.wait(r"joined: replica \d+ on (\S+)", 1, count=4)[3][1]}
        os.kill(int(driver), signal.SIGKILL)
        killed = time.monotonic()
        assert proc.wait(timeout=20 + 60 + 120) == 128 + signal.SIGKILL, out.text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=300)
    text = out.text()
    # The noticed VM ended as EC2 took it at the notice's deadline, or through its own autodown
    # should the driver's kill come first: never through the API, as a VM the run terminated.
    assert re.search(rf"rehearse: {vm} \(aws\) ended: (reclaimed by its cloud|terminated by its own shutdown)", text), \
        text[-4000:]
    for iid in live:
        how = "terminated by its own shutdown" if iid.startswith("i-") else "released through its cloud's API"
        pattern = rf"rehearse: {iid} \(\w+\) ended: {how}"
        assert re.search(pattern, text), text[-4000:]
        assert out.when(pattern) - killed <= 20 + 60, f"{iid} ended {out.when(pattern) - killed:.0f} s after the kill"
    assert "did not end itself" not in text
    assert not _leftovers(tag, int(driver), tmp_path / "run")
