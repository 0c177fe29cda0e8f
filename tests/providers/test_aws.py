"""The aws provider against a moto server on 127.0.0.1 (boto3 follows AWS_ENDPOINT_URL), with a
proxy in front of moto that answers chosen actions with AWS errors or chosen spot prices."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import threading
import time

import boto3
import pytest

from tests.conftest import REPO, aws_error, cli_env, events_within, join_as_vm, polled_events, run_cli, tiny_recipe

NS = 'xmlns="http://ec2.amazonaws.com/doc/2016-11-15/"'


def spot_history(items: list[tuple[str, str, float, str]], next_token: str = "") -> tuple[int, str]:
    """A DescribeSpotPriceHistory answer: (zone, instance type, USD/h, ISO time) rows."""
    rows = "".join(f"<item><instanceType>{t}</instanceType><productDescription>Linux/UNIX</productDescription>"
                   f"<spotPrice>{p}</spotPrice><timestamp>{ts}</timestamp><availabilityZone>{z}</availabilityZone></item>"
                   for z, t, p, ts in items)
    return 200, (f"<DescribeSpotPriceHistoryResponse {NS}><requestId>t</requestId><spotPriceHistorySet>{rows}"
                 f"</spotPriceHistorySet><nextToken>{next_token}</nextToken></DescribeSpotPriceHistoryResponse>")


PRICES = {   # region -> pages of rows; us-east-1a's g5.xlarge has an older, cheaper row that must lose
    "us-east-1": [[("us-east-1a", "g5.xlarge", 0.50, "2026-01-01T10:00:00Z"),
                   ("us-east-1a", "g5.xlarge", 0.10, "2026-01-01T09:00:00Z")],
                  [("us-east-1b", "g5.xlarge", 0.45, "2026-01-01T10:00:00Z"),
                   ("us-east-1b", "g5.12xlarge", 1.60, "2026-01-01T10:00:00Z")]],
    "us-west-2": [[("us-west-2a", "g5.xlarge", 0.40, "2026-01-01T10:00:00Z"),
                   ("us-west-2c", "g5.2xlarge", 0.42, "2026-01-01T10:00:00Z")]],
}


def three_regions(action, region, params):
    """An account with three regions enabled (moto knows every region; real accounts have fewer)."""
    if action != "DescribeRegions":
        return None
    items = "".join(f"<item><regionName>{r}</regionName><regionEndpoint>ec2.{r}.amazonaws.com</regionEndpoint>"
                    f"<optInStatus>opt-in-not-required</optInStatus></item>" for r in ("us-east-1", "us-west-2", "eu-west-1"))
    return 200, f"<DescribeRegionsResponse {NS}><requestId>t</requestId><regionInfo>{items}</regionInfo></DescribeRegionsResponse>"


def price_rule(action, region, params):
    if action != "DescribeSpotPriceHistory" or region not in PRICES:
        return None
    pages = PRICES[region]
    page = int(params.get("NextToken") or 0)
    return spot_history(pages[page], str(page + 1) if page + 1 < len(pages) else "")


def aws_recipe(**overrides):
    base = {"resources.clouds": "[aws]", "resources.regions": "[us-east-1, us-west-2]",
            "resources.accelerators": "A10G", "resources.head": "local", "resources.join_timeout_s": 1,
            "world.capacity_timeout_s": 30,
            "aws.ami_ssm_parameter": "/aws/service/ami-amazon-linux-latest/al2023-ami-kernel-default-x86_64"}
    return tiny_recipe(**{**base, **overrides})


def provider(recipe=None, run="run-a"):
    from providers import build
    return build("aws", recipe or aws_recipe(), None, run)


def aws_cli(*args, env):
    """The CLI with the test's AWS environment (endpoint, credentials, cache) added."""
    return run_cli(*args, **env)


def instances(region: str, run: str | None = None) -> list[dict]:
    ec2 = boto3.client("ec2", region_name=region)
    out = [vm for r in ec2.describe_instances()["Reservations"] for vm in r["Instances"]]
    return [vm for vm in out if run is None or {"Key": "elastic:run", "Value": run} in vm.get("Tags", [])]


# -- prices ------------------------------------------------------------------------------------------

def test_prices_latest_per_zone_across_regions_ranked_per_gpu_hour(aws_env):
    aws_env.rules.append(price_rule)
    offers = provider().offers(aws_recipe().resources)
    got = [(o.zone, o.instance_type, o.usd_per_hour) for o in offers]
    assert got == [("us-west-2a", "g5.xlarge", 0.40),      # 0.40 per GPU-hour; at a tie the cheaper VM first
                   ("us-east-1b", "g5.12xlarge", 1.60),    # 0.40 per GPU-hour, 4 GPUs
                   ("us-west-2c", "g5.2xlarge", 0.42),
                   ("us-east-1b", "g5.xlarge", 0.45),
                   ("us-east-1a", "g5.xlarge", 0.50)]      # the latest row, not the older 0.10
    assert aws_env.count("DescribeSpotPriceHistory") == 3   # two pages in us-east-1, one in us-west-2
    by_type = {o.instance_type: o for o in offers}
    assert (by_type["g5.12xlarge"].gpus, by_type["g5.12xlarge"].cpus, by_type["g5.12xlarge"].gpu) == (4, 48, "A10G")
    assert by_type["g5.xlarge"].on_demand_usd_per_hour == 1.006
    # A count keeps only instance types with that many GPUs.
    four = provider().offers(aws_recipe(**{"resources.accelerators": "A10G:4"}).resources)
    assert [o.instance_type for o in four] == ["g5.12xlarge"]


def test_prices_cli_table_json_cache_and_refresh(aws_env):
    aws_env.rules.append(price_rule)
    args = ["prices", "--cloud", "aws", "--accelerator", "A10G", "--region", "us-east-1", "--region", "us-west-2"]
    proc = aws_cli(*args, "--json", env=aws_env.env)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [r["usd_per_gpu_hour"] for r in rows] == sorted(r["usd_per_gpu_hour"] for r in rows)
    assert {r["region"] for r in rows} == {"us-east-1", "us-west-2"} and len({r["zone"] for r in rows}) == 4
    assert rows[1]["instance_type"] == "g5.12xlarge" and rows[1]["usd_per_gpu_hour"] == 0.4
    calls = aws_env.count("DescribeSpotPriceHistory")
    table = aws_cli(*args, env=aws_env.env)
    assert table.returncode == 0, table.stderr
    lines = [ln for ln in table.stdout.splitlines() if "│ aws" in ln]
    assert [ln.split("│")[3].strip() for ln in lines] == [r["zone"] for r in rows]   # same rows, same order
    assert aws_env.count("DescribeSpotPriceHistory") == calls   # served from the disk cache
    assert aws_cli(*args, "--refresh", env=aws_env.env).returncode == 0
    assert aws_env.count("DescribeSpotPriceHistory") == calls + 3   # --refresh read them again


def test_throttling_is_retried_by_botocore_adaptive_mode(aws_env):
    throttled = []

    def throttle_twice(action, region, params):
        if action == "DescribeSpotPriceHistory" and len(throttled) < 2:
            throttled.append(region)
            return aws_error("RequestLimitExceeded", "Request limit exceeded.", status=503)
        return None

    aws_env.rules.extend([throttle_twice, price_rule])
    p = provider(aws_recipe(**{"resources.regions": "[us-west-2]"}))
    assert p.client("ec2", "us-west-2").meta.config.retries["mode"] == "adaptive"
    offers = p.offers(p.recipe.resources)
    assert [o.zone for o in offers] == ["us-west-2a", "us-west-2c"]
    assert len(throttled) == 2 and aws_env.count("DescribeSpotPriceHistory") == 3


def test_missing_credentials_is_one_clear_line(aws_env, tmp_path):
    env = {k: v for k, v in aws_env.env.items() if not k.startswith("AWS_ACCESS") and not k.startswith("AWS_SECRET")}
    proc = subprocess.run([sys.executable, "-m", "elastic", "prices", "--cloud", "aws", "--accelerator", "A10G"],
                          capture_output=True, text=True, cwd=REPO, timeout=60,
                          env={k: v for k, v in cli_env(**env).items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")})
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "no AWS credentials found" in proc.stderr and "AWS_ACCESS_KEY_ID" in proc.stderr


def test_denied_permission_names_the_action_and_the_policy(aws_env):
    aws_env.rules.append(lambda a, r, p: aws_error("UnauthorizedOperation", "You are not authorized")
                         if a == "DescribeSpotPriceHistory" else None)
    proc = aws_cli("prices", "--cloud", "aws", "--accelerator", "L4", "--region", "eu-west-1", env=aws_env.env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "ec2:DescribeSpotPriceHistory" in proc.stderr and "infra/aws/driver-policy.json" in proc.stderr


# -- launching ---------------------------------------------------------------------------------------

def test_launch_request_spot_imdsv2_tags_user_data_then_join_timeout_terminates(aws_env, monkeypatch):
    from providers.base import JoinTimeout

    monkeypatch.setenv("RAY_AUTH_TOKEN", "s3cret-cluster-token")
    aws_env.rules.append(price_rule)
    p = provider(aws_recipe(**{"resources.regions": "[us-west-2]"}), run="run-launch")
    offer = p.offers(p.recipe.resources)[0]
    t0 = time.time()
    with pytest.raises(JoinTimeout) as info:
        p.launch(offer, "run-launch", "replica")
    exc = info.value
    assert exc.instance.launched_at >= t0 and exc.released_at - exc.instance.launched_at >= 1.0
    [vm] = instances("us-west-2", "run-launch")
    assert vm["InstanceId"] == exc.instance.instance_id
    assert vm["State"]["Name"] in ("shutting-down", "terminated")     # the join timeout released it
    assert vm["InstanceLifecycle"] == "spot" and vm["InstanceType"] == offer.instance_type
    assert vm["Placement"]["AvailabilityZone"] == offer.zone
    assert vm["MetadataOptions"]["HttpTokens"] == "required"
    tags = {t["Key"]: t["Value"] for t in vm["Tags"]}
    assert (tags["elastic:run"], tags["elastic:role"], tags["elastic:recipe"]) == ("run-launch", "replica", "test")
    ec2 = boto3.client("ec2", region_name="us-west-2")
    raw = ec2.describe_instance_attribute(InstanceId=vm["InstanceId"], Attribute="userData")["UserData"]["Value"]
    script = base64.b64decode(raw).decode()
    assert script.startswith("#!/bin/bash") and "python3 -m elastic.run.cluster start --address=" in script
    assert "elastic.run=run-launch" in script and "python3 -m providers.watcher --cloud aws" in script
    assert "/elastic/run-launch/ray-token" in script          # fetched on the node with its role ...
    for secret in ("s3cret-cluster-token", "testing", "AWS_SECRET"):  # ... never written into user data
        assert secret not in script
    ssm = boto3.client("ssm", region_name="us-west-2")
    param = ssm.get_parameter(Name="/elastic/run-launch/ray-token", WithDecryption=True)["Parameter"]
    assert param["Type"] == "SecureString" and param["Value"] == "s3cret-cluster-token"
    p.close()   # the run's token goes with it
    with pytest.raises(ssm.exceptions.ParameterNotFound):
        ssm.get_parameter(Name="/elastic/run-launch/ray-token")


def _join(p, offer, run: str):
    """What the launch path makes for a node of a run with an overlay: a key pair (the private key
    into the cloud's secret store) and the head as the first peer."""
    from elastic.net import overlay
    from providers.cloud import NodeJoin

    private, public = overlay.keypair()
    head = overlay.Member("head", overlay.HEAD_IP, overlay.keypair()[1], "198.51.100.7:51820")
    return private, NodeJoin("100.80.0.2", public, "wg-100-80-0-2", p._put_node_key(offer, run, "wg-100-80-0-2", private),
                             head)


@pytest.mark.skipif(not __import__("shutil").which("wg"), reason="needs wireguard-tools (wg) for key pairs")
def test_bootstrap_joins_the_overlay_before_ray_with_its_key_from_ssm_never_in_user_data(aws_env):
    """The node's user data brings up the overlay (head as first peer) before it joins Ray
    (`elastic.run.cluster start`), which binds the node's overlay address; the private key is an
    SSM SecureString under the run's own path (which only the run's node role reads), never in
    user data, and goes at release."""
    import subprocess

    aws_env.rules.append(price_rule)
    p = provider(aws_recipe(**{"resources.regions": "[us-west-2]"}), run="run-wg")
    offer = p.offers(p.recipe.resources)[0]
    private, join = _join(p, offer, "run-wg")
    inst = p._create(offer, "run-wg", "replica", join=join)
    ec2 = boto3.client("ec2", region_name="us-west-2")
    raw = ec2.describe_instance_attribute(InstanceId=inst.instance_id, Attribute="userData")["UserData"]["Value"]
    script = base64.b64decode(raw).decode()
    assert private not in script and "PrivateKey" not in script
    up = script.index("python3 -m elastic.net.overlay up --address \"$OVERLAY_IP\"")
    assert script.index("OVERLAY_IP=100.80.0.2") < up < script.index("python3 -m elastic.run.cluster start --address=")
    # wireguard-go is installed where the kernel has no WireGuard module, before the overlay comes up.
    assert script.index("modprobe wireguard 2>/dev/null || command -v wireguard-go") \
        < script.index("apt-get install -y wireguard-go") < up
    assert f"--peer {join.head.public_key},100.80.0.1,198.51.100.7:51820 " in script
    assert "aws ssm get-parameter --region us-west-2 --with-decryption --name /elastic/run-wg/wg-100-80-0-2" in script
    assert '--node-ip-address="$OVERLAY_IP"' in script and '--overlay-ip "$OVERLAY_IP"' in script
    ssm = boto3.client("ssm", region_name="us-west-2")
    param = ssm.get_parameter(Name="/elastic/run-wg/wg-100-80-0-2", WithDecryption=True)["Parameter"]
    assert param["Type"] == "SecureString" and param["Value"] == private
    assert subprocess.run(["wg", "pubkey"], input=private + "\n", capture_output=True, text=True).stdout.strip() \
        == join.public_key
    public_ip, private_ip = p._addresses(inst)     # the endpoint the driver admits it at
    vm = instances("us-west-2", "run-wg")[0]
    assert (public_ip, private_ip) == (vm["PublicIpAddress"], vm["PrivateIpAddress"]) and public_ip
    p._drop_node_key(offer, "run-wg", join.key_name)
    with pytest.raises(ssm.exceptions.ParameterNotFound):
        ssm.get_parameter(Name="/elastic/run-wg/wg-100-80-0-2")
    p._drop_node_key(offer, "run-wg", join.key_name)   # idempotent
    p.terminate(inst.instance_id)
    p.close()


@pytest.mark.parametrize("code", ["InsufficientInstanceCapacity", "SpotMaxPriceTooLow",
                                  "MaxSpotInstanceCountExceeded", "VcpuLimitExceeded"])
def test_capacity_refusals_are_capacity_errors(aws_env, code):
    from providers.base import CapacityError, JoinTimeout

    aws_env.rules.extend([lambda a, r, p: aws_error(code) if a == "RunInstances" else None, price_rule])
    p = provider(aws_recipe(**{"resources.regions": "[us-west-2]"}))
    offer = p.offers(p.recipe.resources)[0]
    with pytest.raises(CapacityError, match=code) as info:
        p.launch(offer, "run-a", "replica")
    assert not isinstance(info.value, JoinTimeout)
    assert instances("us-west-2") == [] and p.list_instances("run-a") == []


def test_state_poll_sees_a_vm_that_vanished_without_notice(aws_env, monkeypatch):
    import providers.cloud as cloud

    aws_env.rules.append(price_rule)
    p = provider(aws_recipe(**{"resources.regions": "[us-west-2]"}), run="run-poll")
    inst = p._create(p.offers(p.recipe.resources)[0], "run-poll", "replica")
    ec2 = boto3.client("ec2", region_name="us-west-2")
    [vol] = ec2.describe_volumes(Filters=[{"Name": "tag:elastic:run", "Values": ["run-poll"]}])["Volumes"]
    assert vol["Attachments"][0]["InstanceId"] == inst.instance_id   # the root volume carries the run's tags
    inst.ray_node_id = "joined"     # as if its node had joined
    p._held[inst.instance_id] = inst
    monkeypatch.setattr(cloud, "STATE_POLL_S", 0.0)
    assert polled_events(p) == []   # still running
    boto3.client("ec2", region_name="us-west-2").terminate_instances(InstanceIds=[inst.instance_id])
    [ev] = polled_events(p)
    # Terminated by someone (EC2's reason is the user's): not an interruption AWS would not bill.
    assert (ev.instance_id, ev.kind, ev.with_notice, ev.reclaimed) == (inst.instance_id, "preempted", False, False)

    # A VM EC2 itself interrupted: its answer names the reason (the shape of a real
    # DescribeInstances answer for an interrupted spot VM), and the event says the cloud took it.
    other = p._create(p.offers(p.recipe.resources)[0], "run-poll", "replica")
    other.ray_node_id = "joined"
    p._held[other.instance_id] = other

    def interrupted(action, region, params):
        if action != "DescribeInstances":
            return None
        return 200, (f"<DescribeInstancesResponse {NS}><requestId>t</requestId><reservationSet><item>"
                     f"<reservationId>r-1</reservationId><instancesSet><item><instanceId>{other.instance_id}</instanceId>"
                     "<instanceState><code>48</code><name>terminated</name></instanceState><stateReason>"
                     "<code>Server.SpotInstanceTermination</code><message>Server.SpotInstanceTermination: Spot instance "
                     "termination</message></stateReason></item></instancesSet></item></reservationSet>"
                     "</DescribeInstancesResponse>")

    aws_env.rules.insert(0, interrupted)
    [ev] = polled_events(p)
    assert (ev.instance_id, ev.kind, ev.with_notice, ev.reclaimed) == (other.instance_id, "preempted", False, True)


def test_a_state_poll_the_cloud_is_slow_to_answer_holds_no_events_call(aws_env, monkeypatch):
    """The state poll runs on a thread of its own: while DescribeInstances is held (an SDK retrying
    a throttled call), `events()` (the driver's 0.1 s tick) returns at once, asking only once, and
    takes the answer when it comes."""
    import providers.cloud as cloud

    aws_env.rules.append(price_rule)
    p = provider(aws_recipe(**{"resources.regions": "[us-west-2]"}), run="run-slow-poll")
    inst = p._create(p.offers(p.recipe.resources)[0], "run-slow-poll", "replica")
    inst.ray_node_id = "joined"
    p._held[inst.instance_id] = inst
    held, arrived, asked = threading.Event(), threading.Event(), []

    def slow(action, region, params):
        if action == "DescribeInstances":
            asked.append(action)
            arrived.set()
            held.wait(timeout=60)
        return None

    aws_env.rules.insert(0, slow)
    monkeypatch.setattr(cloud, "STATE_POLL_S", 0.0)
    try:
        assert p.events() == []                  # the poll is asked ...
        assert arrived.wait(timeout=30)          # ... and held at the cloud
        for _ in range(3):
            started = time.monotonic()
            assert p.events() == []
            assert time.monotonic() - started < 1.0
        assert len(asked) == 1
    finally:
        held.set()
    boto3.client("ec2", region_name="us-west-2").terminate_instances(InstanceIds=[inst.instance_id])
    [ev] = polled_events(p)
    assert (ev.instance_id, ev.kind) == (inst.instance_id, "preempted")


# -- elastic down ------------------------------------------------------------------------------------

def test_down_terminates_a_runs_instances_in_every_region_and_orphans(aws_env, tmp_path):
    aws_env.rules.extend([price_rule, three_regions])
    p = provider(aws_recipe(), run="run-down")
    east, west = p.offers(p.recipe.resources)[0], next(o for o in p.offers(p.recipe.resources) if o.region == "us-west-2")
    mine = [p._create(east, "run-down", "replica").instance_id, p._create(west, "run-down", "replica").instance_id]
    other = p._create(west, "run-other", "replica")
    p._tag_heartbeat([other], time.time() - 3600)   # its driver last beat an hour ago
    env = {**aws_env.env}
    no = aws_cli("down", "run-down", env=env)
    assert no.returncode == 2 and "--yes" in no.stderr     # not a terminal: never terminates unasked
    assert all(vm["State"]["Name"] == "running" for vm in instances("us-east-1") + instances("us-west-2"))
    proc = aws_cli("down", "run-down", "--yes", env=env)
    assert proc.returncode == 0, proc.stderr
    state = {vm["InstanceId"]: vm["State"]["Name"] for vm in instances("us-east-1") + instances("us-west-2")}
    assert all(state[i] in ("shutting-down", "terminated") for i in mine) and state[other.instance_id] == "running"
    proc = aws_cli("down", "--orphans", "--yes", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "run-other" in proc.stdout
    assert {r for a, r in aws_env.calls if a == "DescribeInstances"} >= {"us-east-1", "us-west-2", "eu-west-1"}
    state = {vm["InstanceId"]: vm["State"]["Name"] for vm in instances("us-west-2")}
    assert state[other.instance_id] in ("shutting-down", "terminated")


def test_down_orphans_judges_runs_by_their_heartbeat_in_the_cloud(aws_env, tmp_path):
    """No run directory anywhere (the runs were started on other machines): a run whose driver
    beat a minute ago survives, one whose newest beat is older than --stale-after-s goes, its
    controller included."""
    aws_env.rules.extend([price_rule, three_regions])
    p = provider(aws_recipe(**{"resources.regions": "[us-west-2]"}), run="run-live")
    offer = p.offers(p.recipe.resources)[0]
    live = [p._create(offer, "run-live", "replica"), p._create(offer, "run-live", "replica")]
    for inst in live:
        p._held[inst.instance_id] = inst
    p.heartbeat("run-live", time.time() - 60)             # as the run's driver does, every 60 s
    assert aws_env.count("CreateTags") == 1               # one call for all the run's VMs in a region
    dead = [p._create(offer, "run-dead", "replica"), p._create(offer, "run-dead", "controller")]
    p._tag_heartbeat(dead[:1], time.time() - 900)
    p._tag_heartbeat(dead[1:], time.time() - 700)         # the newest of a run's beats counts
    proc = aws_cli("down", "--orphans", "--yes", "--stale-after-s", "600", env=aws_env.env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "terminated 2 instance(s)" in proc.stdout
    state = {vm["InstanceId"]: vm["State"]["Name"] for vm in instances("us-west-2")}
    assert all(state[i.instance_id] == "running" for i in live)
    assert all(state[i.instance_id] in ("shutting-down", "terminated") for i in dead)
    bad = aws_cli("down", "--orphans", "--yes", "--stale-after-s", "nan", env=aws_env.env)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


def test_driver_release_ends_the_controller_and_strays_of_its_run(aws_env, local_cluster, tmp_path):
    """The driver on a controller (head: controller) releases its nodes, then what the cloud still
    holds for the run: a VM whose launch it lost track of; the controller it runs on goes last,
    after the ledger is closed (and the report and the record written): `release_controller`."""
    from elastic.record.ledger import Ledger
    from elastic.run.driver import Driver

    terminated = []
    aws_env.rules.extend([price_rule, lambda a, r, params: terminated.append(params) if a == "TerminateInstances" else None])
    recipe = aws_recipe(**{"resources.regions": "[us-west-2]", "aws.controller_region": "us-west-2"})
    from providers import build
    p = build("aws", recipe, local_cluster, "run-ctl")    # as the driver builds it: with its cluster
    ctl = p.launch_controller("run-ctl", "name: x\n")
    offer = p.offers(recipe.resources)[0]
    held = p._create(offer, "run-ctl", "replica")
    p._held[held.instance_id] = held
    stray = p._create(offer, "run-ctl", "replica").instance_id       # launched, never recorded
    other = p._create(offer, "run-other", "replica").instance_id
    p.heartbeat("run-ctl", time.time())                    # the first beat finds the controller
    tags = {vm["InstanceId"]: {t["Key"]: t["Value"] for t in vm["Tags"]} for vm in instances("us-west-2")}
    assert "elastic:heartbeat" in tags[ctl.instance_id] and "elastic:heartbeat" in tags[held.instance_id]
    assert "elastic:heartbeat" not in tags[other]
    run_dir = tmp_path / "run-ctl"
    run_dir.mkdir()
    ledger = Ledger(run_dir / "events.jsonl")
    driver = Driver(recipe, run_dir, ledger)
    driver.providers = {"aws": p}
    driver.release_all()
    state = {vm["InstanceId"]: vm["State"]["Name"] for vm in instances("us-west-2")}
    assert state[ctl.instance_id] == "running"          # the run's record is not written yet
    ledger.close()
    driver.release_controller()
    state = {vm["InstanceId"]: vm["State"]["Name"] for vm in instances("us-west-2")}
    for gone in (ctl.instance_id, held.instance_id, stray):
        assert state[gone] in ("shutting-down", "terminated"), gone
    assert state[other] == "running"
    assert terminated[-1]["InstanceId.1"] == ctl.instance_id     # the controller goes last


# -- acceptance: elastic launch of a real AWS recipe whose VMs never join -----------------------------

@pytest.mark.slow
def test_launch_smoke_recipe_no_node_joins_ends_clean_and_billed(aws_env, tmp_path):
    """recipes/aws-smoke.yaml with the head here: the first launch is refused for capacity (that
    offer cools down, the next one is tried), one is throttled (botocore retries it), the VMs moto
    starts never join, each is terminated at the join timeout, and the run ends with one line."""
    refused, throttled = [], []

    def faults(action, region, params):
        if action != "RunInstances":
            return None
        if not refused:
            refused.append((params.get("Placement.AvailabilityZone"), params.get("InstanceType")))
            return aws_error("InsufficientInstanceCapacity", "We currently do not have sufficient capacity.")
        if not throttled:
            throttled.append(1)
            return aws_error("RequestLimitExceeded", "Request limit exceeded.", status=503)
        return None

    aws_env.rules.extend([faults, price_rule])
    run_dir = tmp_path / "aws-smoke-run"
    proc = aws_cli("launch", "recipes/aws-smoke.yaml", "--run-dir", str(run_dir),
                   "--set", "resources.join_timeout_s=3", "--set", "world.capacity_timeout_s=7", env=aws_env.env)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    [line] = [ln for ln in proc.stdout.splitlines() if "no node joined" in ln]
    assert "no node joined within 3 s" in line and "1 launch(es) refused for capacity" in line
    events = [json.loads(ln) for ln in (run_dir / "events.jsonl").read_text().splitlines()]
    kinds = [e["type"] for e in events]
    assert kinds.count("capacity_error") == 1 and kinds[-1] == "run_ended" and events[-1]["status"] == "insufficient_capacity"
    [error] = [e for e in events if e["type"] == "capacity_error"]
    assert (error["zone"], error["instance_type"], error["spot"]) == (*refused[0], True)   # a spot launch refused
    launched = [e for e in events if e["type"] == "node_launched"]
    assert launched and all(e["joined"] is False and e["ray_node_id"] is None for e in launched)
    assert (launched[0]["zone"], launched[0]["instance_type"]) != refused[0]   # the refused offer cooled down
    timed_out = {e["instance_id"] for e in events if e["type"] == "node_join_timeout"}
    released = {e["instance_id"] for e in events if e["type"] == "node_released"}
    assert timed_out and {e["instance_id"] for e in launched} == released
    assert aws_env.count("RunInstances") == len(launched) + 2    # + the refusal + the throttled try
    # Nothing of the run is left running in any region.
    for region in ("us-east-1", "us-west-2"):
        assert all(vm["State"]["Name"] in ("shutting-down", "terminated") for vm in instances(region, run_dir.name))
    assert sum(len(instances(r, run_dir.name)) for r in ("us-east-1", "us-west-2")) == len(launched)
    # The report bills the seconds each VM ran: at least the join timeout for those that timed out.
    report = json.loads((run_dir / "report.json").read_text())
    billed = {i["instance_id"]: i for i in report["instances"]}
    assert set(billed) == released
    for iid in timed_out:
        assert billed[iid]["seconds"] >= 3.0 and billed[iid]["ended"] == "released" and billed[iid]["cloud"] == "aws"


def test_head_controller_starts_an_on_demand_controller_vm_that_down_stops(aws_env, tmp_path):
    aws_env.rules.append(price_rule)
    run_dir = tmp_path / "ctl-run"
    ckpt_uri = "checkpoint.uri=s3://ckpt-ctl/run"   # a controller run checkpoints to a bucket
    args = ["launch", "recipes/aws-smoke.yaml", "--set", "resources.head=controller", "--set", ckpt_uri,
            "--set", "aws.controller_instance_profile=elastic-driver"]
    missing = aws_cli(*args, "--run-dir", str(tmp_path / "no-profile"), env=aws_env.env)
    assert missing.returncode == 2 and "NoSuchEntity" in missing.stderr and "Traceback" not in missing.stderr
    assert missing.stderr.count("\n") == 1
    iam = boto3.client("iam", region_name="us-east-1")   # what infra/aws/ creates
    iam.create_role(RoleName="elastic-driver", AssumeRolePolicyDocument="{}")
    iam.create_instance_profile(InstanceProfileName="elastic-driver")
    iam.add_role_to_instance_profile(InstanceProfileName="elastic-driver", RoleName="elastic-driver")
    proc = aws_cli("launch", "recipes/aws-smoke.yaml", "--set", "resources.head=controller", "--set", ckpt_uri,
                   "--set", "aws.controller_instance_profile=elastic-driver", "--run-dir", str(run_dir), "--detach",
                   env={**aws_env.env, "AWS_SECRET_ACCESS_KEY": "dont-leak-this-secret"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [vm] = instances("us-east-1", "ctl-run")
    assert vm["State"]["Name"] == "running" and "InstanceLifecycle" not in vm      # on-demand
    tags = {t["Key"]: t["Value"] for t in vm["Tags"]}
    assert tags["elastic:role"] == "controller" and vm["InstanceType"] == "m7i.large"
    assert vm["MetadataOptions"]["HttpTokens"] == "required"
    assert vm["IamInstanceProfile"]["Arn"].endswith("elastic-driver")
    ec2 = boto3.client("ec2", region_name="us-east-1")
    raw = ec2.describe_instance_attribute(InstanceId=vm["InstanceId"], Attribute="userData")["UserData"]["Value"]
    script = base64.b64decode(raw).decode()
    assert "ray start --head" in script and "elastic launch recipe.yaml --set resources.head=local" in script
    # It runs again at every boot (cloud-init's per-boot scripts), and a driver started after a
    # reboot continues the run on this VM (its lost driver's directory moved aside).
    assert "install -m 0700 \"$0\" /var/lib/cloud/scripts/per-boot/elastic-controller.sh" in script
    assert script.index("mv runs/") < script.index("export ELASTIC_INSTANCE_ID") < script.index("elastic launch recipe.yaml")
    [recipe_b64] = re.findall(r"echo (\S+) \| base64 -d", script)
    assert "name: aws-smoke" in base64.b64decode(recipe_b64).decode()
    assert "dont-leak-this-secret" not in script and "AWS_SECRET" not in script
    # Autodown on the controller too: its watcher shuts it down when its driver stops beating, and
    # its own shutdown terminates it.
    assert "python3 -m providers.watcher --cloud aws" in script and "--autodown-after-s 600 " in script
    assert ec2.describe_instance_attribute(InstanceId=vm["InstanceId"], Attribute="instanceInitiatedShutdownBehavior")[
        "InstanceInitiatedShutdownBehavior"]["Value"] == "terminate"
    events = [json.loads(ln) for ln in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["type"] for e in events] == ["run_started", "node_launched", "controller_started"]
    assert vm["InstanceId"] in proc.stdout
    # The record beside the checkpoints holds what this machine recorded (the controller's driver
    # continues it), and no secret.
    from elastic.record import remote
    record = remote.open_record("s3://ckpt-ctl/run", "ctl-run")
    assert record.read("events")[0] == (run_dir / "events.jsonl").read_bytes()
    assert b"dont-leak-this-secret" not in record.whole("recipe.yaml")
    # `--resume RUN`: a new controller for the same run, recorded after the first; without
    # --run-dir, its local directory is runs/RUN-resumed-<time> where the command runs.
    here = tmp_path / "here"
    here.mkdir()
    again = run_cli("launch", str(REPO / args[1]), *args[2:], "--resume", "ctl-run", "--detach", env=aws_env.env,
                    cwd=here)
    assert again.returncode == 0, again.stdout + again.stderr
    assert [p.name.startswith("ctl-run-resumed-") for p in (here / "runs").iterdir()] == [True]
    assert len(instances("us-east-1", "ctl-run")) == 2
    assert [n for n, _ in record.parts("events")] == [1, 2, 3, 4]
    # `down` from anywhere, by the record's URI: every VM of the run, both controllers.
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    down = aws_cli("down", "s3://ckpt-ctl/run/record/ctl-run", "--yes", env={**aws_env.env, "TMPDIR": str(scratch)})
    assert down.returncode == 0, down.stderr
    assert all(vm["State"]["Name"] in ("shutting-down", "terminated") for vm in instances("us-east-1", "ctl-run"))
    assert list(scratch.iterdir()) == []   # the recipe it copied out of the record is gone with it


# -- infra/aws ---------------------------------------------------------------------------------------

def test_account_setup_is_idempotent_and_its_output_launches(aws_env, tmp_path):
    """infra/aws/setup_account.py against moto: bucket, policies, the controller's role, the SSH
    group; run twice; its recipe section is accepted by a launch (the node gets its run's own
    profile, bounded by elastic-node, its run's own group and the SSH group)."""
    script = REPO / "infra" / "aws" / "setup_account.py"
    args = [sys.executable, str(script), "--bucket", "ckpt-bucket", "--region", "us-east-1", "--region", "us-west-2",
            "--data-bucket", "shards-bucket", "--ssh-cidr", "203.0.113.7/32"]
    for _ in range(2):
        env = cli_env(**aws_env.env)
        proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stderr
    section = json.loads(proc.stdout[proc.stdout.index("{"):proc.stdout.rindex("}") + 1])
    iam = boto3.client("iam", region_name="us-east-1")
    policies = {p["PolicyName"]: p for p in iam.list_policies(Scope="Local")["Policies"]}
    for name in ("elastic-node", "elastic-driver"):
        doc = iam.get_policy_version(PolicyArn=policies[name]["Arn"],
                                     VersionId=policies[name]["DefaultVersionId"])["PolicyVersion"]["Document"]
        doc = json.loads(doc) if isinstance(doc, str) else doc
        s3_access = {r: sorted(st["Action"]) for st in doc["Statement"] if any(a.startswith("s3:") for a in st["Action"])
                     for r in st["Resource"]}
        # The checkpoint bucket read and written; the shards of data.uri only read; no other bucket.
        read_write = ["s3:DeleteObject", "s3:GetObject", "s3:ListBucket", "s3:PutObject"]
        assert s3_access == {"arn:aws:s3:::ckpt-bucket": read_write, "arn:aws:s3:::ckpt-bucket/*": read_write,
                             "arn:aws:s3:::shards-bucket": ["s3:GetObject", "s3:ListBucket"],
                             "arn:aws:s3:::shards-bucket/*": ["s3:GetObject", "s3:ListBucket"]}, (name, s3_access)
        assert "${" not in json.dumps(doc)
    assert "elastic-node" not in {r["RoleName"] for r in iam.list_roles()["Roles"]}   # a boundary, no shared role
    ec2 = boto3.client("ec2", region_name="us-west-2")
    [group] = ec2.describe_security_groups(Filters=[{"Name": "group-name", "Values": ["elastic-access"]}])["SecurityGroups"]
    [rule] = group["IpPermissions"]
    assert (rule["FromPort"], rule["ToPort"], rule["IpRanges"]) == (22, 22, [{"CidrIp": "203.0.113.7/32"}])
    assert rule["UserIdGroupPairs"] == []       # no open ports among all elastic VMs of all runs
    # The printed section, used by a recipe: the VM gets its run's profile and groups.
    aws_env.rules.append(price_rule)
    p = provider(aws_recipe(**{"resources.regions": "[us-west-2]", **{f"aws.{k}": v for k, v in section["aws"].items()}}),
                 run="run-infra")
    inst = p._create(p.offers(p.recipe.resources)[0], "run-infra", "replica")
    [vm] = instances("us-west-2", "run-infra")
    assert vm["InstanceId"] == inst.instance_id and vm["IamInstanceProfile"]["Arn"].endswith("/elastic-run-run-infra")
    names = {g["GroupName"] for g in vm["SecurityGroups"]}
    assert names == {"elastic-run-run-infra", "elastic-access"}


def test_driver_policy_allows_every_call_the_provider_makes():
    import re as _re

    source = "".join((REPO / "providers" / "aws" / f).read_text() for f in ("provider.py", "scope.py"))
    calls = _re.findall(r'\bcall\("(ec2|ssm|iam|sts)", [\w.]+, "(\w+)"', source.replace("_call(", "call("))
    calls += [("ec2", c) for c in _re.findall(r'get_paginator\("(\w+)"\)', source)]
    calls += [("ec2", "describe_regions")] if "describe_regions" in source else []
    actions = {f"{svc}:" + "".join(w.capitalize() for w in c.split("_")) for svc, c in calls}
    assert {"iam:CreateRole", "ec2:CreateSecurityGroup", "ssm:PutParameter", "sts:GetCallerIdentity"} <= actions
    doc = json.loads((REPO / "infra" / "aws" / "driver-policy.json").read_text())
    allowed = {a for st in doc["Statement"] if st["Effect"] == "Allow"
               for a in ([st["Action"]] if isinstance(st["Action"], str) else st["Action"])}
    assert actions and actions <= allowed, sorted(actions - allowed)


# -- a VM whose node joins: the label wait, a forwarded notice, termination (real local Ray) -------

@pytest.mark.slow
def test_launch_returns_once_the_vms_node_joins_and_notices_arrive(aws_env, local_cluster):
    """moto rents the VM; a raylet labelled with its instance id stands in for the VM's boot
    script joining. The provider returns it with that Ray node; a notice the node's watcher
    forwards through Ray's KV becomes a NodeEvent; terminating it ends the VM."""
    import threading

    from providers import build, watcher

    aws_env.rules.append(price_rule)
    recipe = aws_recipe(**{"resources.regions": "[us-west-2]", "resources.join_timeout_s": 60,
                          "world.capacity_timeout_s": 60})
    p = build("aws", recipe, local_cluster, "run-join")
    offer = p.offers(recipe.resources)[0]
    result = {}
    t = threading.Thread(target=lambda: result.update(inst=p.launch(offer, "run-join", "replica")))
    t.start()
    deadline = time.monotonic() + 30
    while not instances("us-west-2", "run-join") and time.monotonic() < deadline:
        time.sleep(0.05)
    [vm] = instances("us-west-2", "run-join")
    node_id = join_as_vm(local_cluster, vm["InstanceId"])
    try:
        t.join(timeout=30)
        inst = result["inst"]
        assert (inst.instance_id, inst.ray_node_id) == (vm["InstanceId"], node_id)
        assert [i.instance_id for i in p.list_instances("run-join")] == [inst.instance_id]
        assert p.events() == []
        deadline_unix = time.time() + 120
        watcher.forward(inst.instance_id, {"kind": "notice", "deadline": deadline_unix, "action": "terminate"})
        [ev] = events_within(p)
        assert (ev.instance_id, ev.kind, ev.deadline) == (inst.instance_id, "notice", deadline_unix)
        assert p.events() == []   # reported once
        p.terminate(inst.instance_id)
        assert instances("us-west-2", "run-join")[0]["State"]["Name"] in ("shutting-down", "terminated")
        assert p.list_instances("run-join") == []
    finally:
        local_cluster.remove_node(node_id)
        p.close()


# -- runs scoped from each other: own role, own token, own prefix, own security group ----------------

def _permits(policy: dict, action: str, resource: str, **conditions: str) -> bool:
    """Whether `policy` allows `action` on `resource`, by moto's IAM policy evaluator."""
    from moto.iam.access_control import IAMPolicy, PermissionResult

    result = IAMPolicy(json.dumps(policy)).is_action_permitted(action, resource,
                                                   incoming_condition_values=conditions or None)
    return result == PermissionResult.PERMITTED


def _token_exists(run: str, region: str = "us-west-2") -> bool:
    ssm = boto3.client("ssm", region_name=region)
    try:
        ssm.get_parameter(Name=f"/elastic/{run}/ray-token")
        return True
    except ssm.exceptions.ParameterNotFound:
        return False


def test_each_run_gets_its_own_role_token_prefix_and_security_group(aws_env, monkeypatch):
    """Two runs in one account: each VM carries its run's own instance profile, whose role (bounded
    by the reviewed elastic-node policy) reads only its own token and writes only under its own
    checkpoint prefix; each VM sits in its run's own security group, which opens only the overlay's
    UDP port.
    When a run ends, its role, profile, group and token are gone; the other run's stay."""
    aws_env.rules.append(price_rule)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "secret-token-value")
    iam = boto3.client("iam", region_name="us-east-1")
    boundary = (REPO / "infra" / "aws" / "node-policy.json").read_text()
    boundary = boundary.replace("${BUCKET}", "ckpts").replace("${DATA_BUCKET}", "shards")
    iam.create_policy(PolicyName="elastic-node", PolicyDocument=boundary)
    runs = {}
    for run in ("run-a", "run-b"):
        recipe = aws_recipe(**{"resources.regions": "[us-west-2]", "aws.node_role_boundary": "elastic-node",
                               "checkpoint.uri": f"s3://ckpts/team/{run}"})
        p = provider(recipe, run=run)
        inst = p._create(p.offers(recipe.resources)[0], run, "replica")
        runs[run] = (p, inst)
    vms = {vm["InstanceId"]: vm for vm in instances("us-west-2")}
    ec2 = boto3.client("ec2", region_name="us-west-2")
    groups = {}
    for run, (p, inst) in runs.items():
        vm = vms[inst.instance_id]
        assert vm["IamInstanceProfile"]["Arn"].endswith(f"/elastic-run-{run}")
        role = iam.get_role(RoleName=f"elastic-run-{run}")["Role"]
        assert role["PermissionsBoundary"]["PermissionsBoundaryArn"].endswith(":policy/elastic-node")
        doc = iam.get_role_policy(RoleName=f"elastic-run-{run}", PolicyName="run")["PolicyDocument"]
        doc = json.loads(doc) if isinstance(doc, str) else doc
        other = "run-b" if run == "run-a" else "run-a"
        token = "arn:aws:ssm:us-west-2:123456789012:parameter/elastic/{}/ray-token"
        both = [doc, json.loads(boundary)]   # what the node may do: its inline policy within the boundary
        assert all(_permits(d, "ssm:GetParameter", token.format(run)) for d in both)
        assert not _permits(doc, "ssm:GetParameter", token.format(other))        # run A denied run B's token
        assert _permits(doc, "s3:PutObject", f"arn:aws:s3:::ckpts/team/{run}/step-1/shard-0")
        assert not _permits(doc, "s3:PutObject", f"arn:aws:s3:::ckpts/team/{other}/step-1/shard-0")
        assert not _permits(doc, "s3:GetObject", f"arn:aws:s3:::ckpts/team/{other}/manifest.json")
        [gid] = [g["GroupId"] for g in vm["SecurityGroups"]]
        [group] = ec2.describe_security_groups(GroupIds=[gid])["SecurityGroups"]
        assert group["GroupName"] == f"elastic-run-{run}"
        # Only the overlay's UDP port is open (to anyone: WireGuard answers only the run's keys).
        [perm] = group["IpPermissions"]
        assert (perm["IpProtocol"], perm["FromPort"], perm["ToPort"]) == ("udp", 51820, 51820)
        assert [r["CidrIp"] for r in perm["IpRanges"]] == ["0.0.0.0/0"] and not perm["UserIdGroupPairs"]
        groups[run] = gid
        # The token went to the run's own parameter, never into the user data.
        ssm = boto3.client("ssm", region_name="us-west-2")
        assert ssm.get_parameter(Name=f"/elastic/{run}/ray-token", WithDecryption=True)["Parameter"]["Value"] \
            == "secret-token-value"
        assert "secret-token-value" not in base64.b64decode(
            ec2.describe_instance_attribute(InstanceId=inst.instance_id, Attribute="userData")["UserData"]["Value"]).decode()
    assert groups["run-a"] != groups["run-b"]
    # run-a ends: its VM is terminated, then what it owned besides goes; run-b keeps all of its own.
    p, inst = runs["run-a"]
    p.terminate(inst.instance_id)
    p.close()
    roles = {r["RoleName"] for r in iam.list_roles()["Roles"]}
    profiles = {i["InstanceProfileName"] for i in iam.list_instance_profiles()["InstanceProfiles"]}
    assert "elastic-run-run-a" not in roles | profiles
    assert "elastic-run-run-b" in roles and "elastic-run-run-b" in profiles
    names = {g["GroupName"] for g in ec2.describe_security_groups()["SecurityGroups"]}
    assert "elastic-run-run-a" not in names and "elastic-run-run-b" in names
    assert not _token_exists("run-a") and _token_exists("run-b")


def test_a_runs_nodes_neither_write_nor_read_the_records_beside_its_checkpoints():
    """The run's record (elastic/record/remote.py) sits under `<checkpoint.uri>/record/`: the
    driver's identity writes it, not the run's nodes, which may write checkpoints right beside it;
    and a later run that checkpoints to the same prefix (`--resume` under another name) cannot read
    the earlier run's ledger, log or report, nor another run's node a record under its own prefix."""
    from elastic.record import remote
    from providers.aws.scope import node_policy

    for uri, key in (("s3://ckpts/team/run-a", "team/run-a"), ("s3://ckpts", "")):
        policy = node_policy("run-a", uri, "s3://shards/tok")
        at = f"arn:aws:s3:::ckpts/{key + '/' if key else ''}"
        assert _permits(policy, "s3:PutObject", f"{at}step-00000002/shard-0")
        assert _permits(policy, "s3:GetObject", f"{at}step-00000002/shard-0")
        assert _permits(policy, "s3:ListBucket", "arn:aws:s3:::ckpts", **({"s3:prefix": f"{key}/"} if key else {}))
        for run in ("run-a", "earlier-run"):
            for part in ("events/000001.jsonl", "metrics/000003.jsonl", "driver/000002.log", "report.json",
                         "report.html", "recipe.yaml"):
                name = f"{at}{remote.RECORD}/{run}/{part}"
                for action in ("s3:PutObject", "s3:DeleteObject", "s3:GetObject"):
                    assert not _permits(policy, action, name), (uri, action, name)
    other = node_policy("run-b", "s3://ckpts/team/run-b", None)
    assert not _permits(other, "s3:GetObject", f"arn:aws:s3:::ckpts/team/run-a/{remote.RECORD}/run-a/report.json")


def test_down_removes_a_dead_runs_role_group_and_token(aws_env, monkeypatch):
    """A driver killed with SIGKILL cleans nothing up: `elastic down RUN --yes` terminates the
    VMs and then deletes the run's token, its nodes' overlay keys, role, instance profile and
    security group."""
    aws_env.rules.extend([price_rule, three_regions])
    monkeypatch.setenv("RAY_AUTH_TOKEN", "t0k3n")
    iam = boto3.client("iam", region_name="us-east-1")
    boundary = (REPO / "infra" / "aws" / "node-policy.json").read_text()
    iam.create_policy(PolicyName="elastic-node",
                      PolicyDocument=boundary.replace("${BUCKET}", "b").replace("${DATA_BUCKET}", "d"))
    recipe = aws_recipe(**{"resources.regions": "[us-west-2]", "aws.node_role_boundary": "elastic-node"})
    p = provider(recipe, run="run-dead")
    offer = p.offers(recipe.resources)[0]
    p._create(offer, "run-dead", "replica")
    p._put_node_key(offer, "run-dead", "wg-100-80-0-9", "a-node-key")   # a VM booting, and then the driver dies
    assert _token_exists("run-dead") and iam.get_role(RoleName="elastic-run-run-dead")
    proc = aws_cli("down", "run-dead", "--yes", env={**aws_env.env, "AWS_DEFAULT_REGION": "us-west-2"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "elastic-run-run-dead" not in {r["RoleName"] for r in iam.list_roles()["Roles"]}
    assert not iam.list_instance_profiles()["InstanceProfiles"]
    ec2 = boto3.client("ec2", region_name="us-west-2")
    assert "elastic-run-run-dead" not in {g["GroupName"] for g in ec2.describe_security_groups()["SecurityGroups"]}
    assert not _token_exists("run-dead")
    assert not boto3.client("ssm", region_name="us-west-2").get_parameters_by_path(Path="/elastic/run-dead/")["Parameters"]
