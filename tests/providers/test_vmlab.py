"""The VM lab (providers/lab): instances started through moto's EC2 and the Compute Engine fake
boot as machines of this host and run the script their provider sent, verbatim: the real
bootstrap (infra/bootstrap.sh.tmpl), the install from a wheel of this checkout, the metadata
server at 169.254.169.254, and the OS shutdown that ends the instance by its shutdown behaviour.

Needs root, iproute2, nftables and wireguard-tools (CI runs these with ELASTIC_REQUIRE_ROOT_TESTS=1:
a missing tool fails there)."""

from __future__ import annotations

import base64
import subprocess
import sys
import time

import boto3
import pytest

from tests.conftest import REPO
from tests.providers.test_aws import aws_recipe, price_rule, provider

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("root_tools")]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    """A wheel of this checkout (what the lab machines install: no index, no internet)."""
    out = tmp_path_factory.mktemp("wheels")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(REPO)], check=True, timeout=300)
    [whl] = out.glob("elastic-*.whl")
    return str(whl)


def _install(wheel: str) -> str:
    return f"pip install -q --no-deps --no-index --force-reinstall {wheel}"


@pytest.fixture
def lab(aws_env, moto_server, gcp_fake):
    from providers.lab.vmlab import AwsCloud, VmLab

    vmlab = VmLab(aws=AwsCloud(moto_server, ["us-west-2"]), gcp=gcp_fake, gcp_regions=["us-central1"])
    try:
        yield vmlab
    finally:
        vmlab.down()
        assert not [n for n in _namespaces() if n.startswith(vmlab.tag)]
        assert not vmlab.root.exists()


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
        # `shutdown -h +120` (max_vm_hours 2) is scheduled, not done.
        due = machine.shutdown_scheduled()
        assert due is not None and 119 * 60 < due - machine.booted_at < 121 * 60
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
