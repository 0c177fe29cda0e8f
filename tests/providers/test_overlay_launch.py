"""A run whose replicas sit in two AWS regions (moto) and one GCP region (the fake), on the run's
real overlay head: the driver makes each VM's key pair, stores the private key in that cloud's
secret store, admits the public key on the head's WireGuard interface (and in the peers document)
before the node can join, and revokes it when the VM goes. The "VMs" boot as local raylets; each
boot reads its key from the secret store as the bootstrap would and joins only once the head
knows that key (what `elastic.net.overlay up --wait-handshake-s` waits for on a real VM).

Needs root and wireguard-tools (the head's interface is real; CI runs as root)."""

from __future__ import annotations

import base64
import json
import logging
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import boto3
import pytest

from elastic.net import overlay
from tests.conftest import join_as_vm, polled_events, tiny_recipe
from tests.providers.test_aws import spot_history

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("root_tools")]   # the overlay's head: root, wireguard-tools

RUN = "wg-multi"
AWS_REGIONS = ("us-east-1", "us-west-2")
AWS_ROWS = {"us-east-1": [("us-east-1a", "p4d.24xlarge", 12.0, "2026-01-01T10:00:00Z")],
            "us-west-2": [("us-west-2b", "p4de.24xlarge", 9.0, "2026-01-01T10:00:00Z")]}


def _public_key(private: str) -> str:
    return subprocess.run(["wg", "pubkey"], input=private + "\n", capture_output=True, text=True,
                          check=True).stdout.strip()


class FakeVMs:
    """Boots each VM of the run as a local raylet labelled with its instance id, once the head's
    interface admitted the key the VM reads from its cloud's secret store; stops it when the
    cloud says the VM is gone."""

    def __init__(self, cluster, net, gcp_fake):
        self.cluster, self.net, self.gcp = cluster, net, gcp_fake
        self.nodes: dict[str, str] = {}
        self.admitted: dict[str, str] = {}   # instance id -> public key the head knew before it joined
        self.private_keys: set[str] = set()   # what the VMs read from the secret stores
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # Raylets die with the thread that started them: start them all from one long-lived thread.
        self._starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vm-boot")
        self._aws = threading.Thread(target=self._watch_aws, daemon=True)
        gcp_fake.on_insert, gcp_fake.on_delete = self._boot_gcp, self._stop_node
        self._aws.start()

    def _boot(self, instance_id: str, read_key) -> None:
        deadline = time.monotonic() + 30
        private = None
        while time.monotonic() < deadline and not self._stop.is_set():
            private = read_key()
            if private and _public_key(private) in self.net.iface.peers():
                break
            time.sleep(0.1)   # polling as the node's handshake wait does, bounded by the deadline
        else:
            return
        with self._lock:
            self.admitted[instance_id] = _public_key(private)
            self.private_keys.add(private)
        node = join_as_vm(self.cluster, instance_id)
        with self._lock:
            self.nodes[instance_id] = node

    def _boot_gcp(self, name, body):
        script = {i["key"]: i["value"] for i in body["metadata"]["items"]}["startup-script"]
        secret = script.split("--secret=")[-1].split()[0]   # the node key's secret (the last one named)

        def read():
            versions = self.gcp.secrets.get(secret, {}).get("versions")
            return versions[-1] if versions else None
        self._starter.submit(self._boot, name, read)

    def _watch_aws(self):
        seen = set()
        while not self._stop.wait(0.3):
            for region in AWS_REGIONS:
                ec2, ssm = boto3.client("ec2", region_name=region), boto3.client("ssm", region_name=region)
                for r in ec2.describe_instances()["Reservations"]:
                    for vm in r["Instances"]:
                        iid, state = vm["InstanceId"], vm["State"]["Name"]
                        if state in ("pending", "running") and iid not in seen:
                            seen.add(iid)
                            raw = ec2.describe_instance_attribute(InstanceId=iid, Attribute="userData")
                            script = base64.b64decode(raw["UserData"]["Value"]).decode()
                            param = script.split("--with-decryption --name ")[1].split()[0]

                            def read(ssm=ssm, param=param):
                                try:
                                    return ssm.get_parameter(Name=param, WithDecryption=True)["Parameter"]["Value"]
                                except ssm.exceptions.ParameterNotFound:
                                    return None
                            self._starter.submit(self._boot, iid, read)
                        elif state not in ("pending", "running"):
                            self._stop_node(iid)

    def _stop_node(self, instance_id):
        with self._lock:
            node = self.nodes.pop(instance_id, None)
        if node is not None:
            self.cluster.remove_node(node, graceful=False)

    def close(self):
        self._stop.set()
        self._aws.join(timeout=10)
        for iid in list(self.nodes):
            self._stop_node(iid)
        self._starter.shutdown(wait=True)


def test_replicas_in_two_aws_regions_and_gcp_join_the_overlay_and_leave_it(aws_env, gcp_fake, local_cluster,
                                                                          tmp_path, monkeypatch, caplog):
    from ray.experimental import internal_kv

    from elastic.net import linkprobe
    from elastic.run.driver import run_attached
    from providers import cloud
    from providers.cloud import CloudNetwork

    aws_env.rules.append(lambda action, region, params: spot_history(AWS_ROWS[region])
                         if action == "DescribeSpotPriceHistory" and region in AWS_ROWS else None)
    monkeypatch.setattr(linkprobe, "DURATION_S", 0.3)   # a short bulk transfer: loopback here
    monkeypatch.setattr(cloud, "STATE_POLL_S", 1.0)
    net = CloudNetwork()
    monkeypatch.setattr(local_cluster, "network", net)
    vms = FakeVMs(local_cluster, net, gcp_fake)
    full: list[list[overlay.Member]] = []

    def on_phase(driver, phase, members):
        if len(members) == 3 and not full:
            full.append(net.roster.members())
            full.append(dict(net.iface.peers()))
            full.append(overlay.decode_members(internal_kv._internal_kv_get(overlay.PEERS_KV_KEY).decode()))

    for name in ("elastic", "providers"):   # the project's loggers, all of them (driver.log takes INFO)
        caplog.set_level(logging.DEBUG, logger=name)
    recipe = tiny_recipe(**{
        "resources.clouds": "[aws, gcp]", "resources.head": "local", "resources.accelerators": "A100:8",
        "resources.regions": "[us-east-1, us-west-2, us-east1]", "resources.join_timeout_s": 60,
        "planner.tokens_per_s": "{A100: 3000}", "planner.spread_min": 3, "planner.cross_region_sync_s": 0,
        "world.replicas": 3, "world.min_replicas": 3, "world.max_replicas": 3, "world.capacity_timeout_s": 120,
        "train.outer_steps": 2, "aws.ami_ssm_parameter":
            "/aws/service/ami-amazon-linux-latest/al2023-ami-kernel-default-x86_64"})
    try:
        status, events = run_attached(recipe, local_cluster, tmp_path / "run", on_phase=on_phase, run_name=RUN)
        head_peers_after = net.iface.peers()
    finally:
        vms.close()
        net.down()
    assert status == "completed"
    launched = [e for e in events if e["type"] == "node_launched" and e["joined"]]
    assert {(e["cloud"], e["region"]) for e in launched} == {("aws", "us-east-1"), ("aws", "us-west-2"),
                                                             ("gcp", "us-east1")}
    # Each VM joined only after the head admitted the key it read from its cloud's secret store.
    assert {e["instance_id"] for e in launched} <= set(vms.admitted)
    members, head_peers, doc = full
    by_name = {m.name: m for m in members}
    assert set(by_name) == {"head"} | {e["instance_id"] for e in launched}
    for e in launched:
        m = by_name[e["instance_id"]]
        assert m.public_key == vms.admitted[e["instance_id"]] and m.endpoint.endswith(":51820")
        assert m.site == ("gcp/default" if e["cloud"] == "gcp" else f"aws/{e['region']}")
        assert overlay.overlay_ip(2) <= m.overlay_ip and m.overlay_ip != overlay.HEAD_IP
    gcp_vm = by_name[next(e["instance_id"] for e in launched if e["cloud"] == "gcp")]
    assert gcp_vm.endpoint.startswith("203.0.113.")                # the fake's public (natIP) address
    assert set(head_peers) == {m.public_key for m in members if m.name != "head"}
    assert {m.name for m in doc} == set(by_name)                   # what the nodes' watchers apply
    # Released at the end: every key revoked on the head, none left in either secret store.
    assert head_peers_after == {}
    assert [m.name for m in overlay.decode_members(internal_kv._internal_kv_get(overlay.PEERS_KV_KEY).decode())] \
        == ["head"]
    for region in AWS_REGIONS:
        left = boto3.client("ssm", region_name=region).describe_parameters()["Parameters"]
        assert not [p["Name"] for p in left if p["Name"].startswith(f"/elastic/{RUN}/wg-")]
    assert not [s for s in gcp_fake.secrets if "-wg-" in s]
    # No node's private key in the run's ledger, report or any file of its run directory, nor in
    # anything the project logged (botocore's own debug log, off by default, would show the SSM
    # request that stores it).
    assert len(vms.private_keys) >= 3
    from elastic.views.report import build_report

    written = "".join(f.read_text(errors="replace") for f in (tmp_path / "run").rglob("*") if f.is_file())
    written += json.dumps(build_report(events))
    assert "events.jsonl" in {f.name for f in (tmp_path / "run").rglob("*")}
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name.split(".")[0] in ("elastic", "providers"))
    assert logged and not [k for k in vms.private_keys if k in logged]
    assert not [k for k in vms.private_keys if k in written]
    # Each node but the first measured its link to a node on another site.
    links = [e for e in events if e["type"] == "link_measured"]
    assert len(links) >= 2 and all(e["site"] != e["peer_site"] and e["rtt_ms"] > 0 and e["mbit_s"] > 0
                                   for e in links)
    assert {e["site"] for e in links} | {e["peer_site"] for e in links} <= {"aws/us-east-1", "aws/us-west-2",
                                                                           "gcp/us-east1"}


def test_a_vm_the_cloud_lost_has_its_key_revoked_on_the_head_at_once(aws_env, monkeypatch):
    """A spot VM that vanished without a notice the driver saw: the state poll of `events()` finds
    it gone, reports it preempted, and its key leaves the head's WireGuard interface, the roster and
    the peers document in that same call, along with its secret."""
    from types import SimpleNamespace

    from providers import build, cloud
    from providers.cloud import CloudNetwork, NodeJoin
    from tests.providers.test_aws import aws_recipe, price_rule

    aws_env.rules.append(price_rule)
    monkeypatch.setattr(cloud, "STATE_POLL_S", 0.0)
    docs: list[str] = []
    monkeypatch.setattr(cloud, "publish_peers", docs.append)
    net = CloudNetwork()
    try:
        p = build("aws", aws_recipe(**{"resources.regions": "[us-west-2]"}),
                  SimpleNamespace(network=net, address="100.80.0.1:6379"), "run-lost")
        offer = p.offers(p.recipe.resources)[0]
        # What `launch` does for a VM up to its node's join: key, VM, admission on the roster.
        ip = net.roster.allocate_ip()
        private, public = overlay.keypair()
        join = NodeJoin(ip, public, "wg-lost", p._put_node_key(offer, "run-lost", "wg-lost", private), net.head)
        inst = p._create(offer, "run-lost", "replica", join=join)
        public_ip, private_ip = p._addresses(inst)
        net.roster.add(overlay.Member(inst.instance_id, ip, public, f"{public_ip}:51820", p.site(offer)))
        inst.ray_node_id = "joined"
        p._held[inst.instance_id] = inst
        p._keys[inst.instance_id] = (offer, "wg-lost")
        assert public in net.iface.peers()
        assert polled_events(p) == []                         # running: nothing happens
        boto3.client("ec2", region_name="us-west-2").terminate_instances(InstanceIds=[inst.instance_id])
        [ev] = polled_events(p)
        assert (ev.instance_id, ev.kind) == (inst.instance_id, "preempted")
        assert public not in net.iface.peers()
        assert [m.name for m in net.roster.members()] == ["head"]
        assert [m.name for m in overlay.decode_members(docs[-1])] == ["head"]
        ssm = boto3.client("ssm", region_name="us-west-2")
        assert not [x for x in ssm.describe_parameters()["Parameters"] if x["Name"].endswith("/wg-lost")]
        p.close()
    finally:
        net.down()
