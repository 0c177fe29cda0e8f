"""The VM lab: watches the clouds' APIs (moto's EC2 at an endpoint, the local Compute Engine fake)
for instances, boots each as a lab machine (`providers.lab.machine`) with its metadata server
(`providers.lab.metadata`) and its gateways to the APIs (`providers.lab.gateway`), and ends it as
its cloud would:

- the API terminated / deleted / stopped it: the machine is powered off;
- the machine halted itself (`shutdown`, `poweroff`): it is powered off and, by the instance's
  shutdown behaviour, terminated or stopped in moto (EC2's InstanceInitiatedShutdownBehavior),
  stopped (TERMINATED) in the Compute Engine fake, as a guest OS shutdown does there.

Everything it makes carries the network lab's tag (`el` + 4 hex digits): `down()` removes it, on
every exit path of the caller; `cleanup_orphans()` removes what a killed process left.
"""

from __future__ import annotations

import base64
import json
import logging
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from providers.lab import machine as machines
from providers.lab.gateway import Gateway, node_actions
from providers.lab.metadata import MetadataServer, aws_credentials, aws_values, gcp_values
from elastic.net.overlay import OVERLAY_PORT
from providers.local import localnet

log = logging.getLogger(__name__)

POLL_S = 0.3
LIVE_EC2 = ("pending", "running")
LIVE_GCE = ("PROVISIONING", "STAGING", "RUNNING")
WORK_ROOT = Path("/run/elastic-lab")
HOST_STAGING = Path("/tmp/elastic-staging")   # each machine's staging is mounted here (machine.py's boot script)
AWS_NOTICE_S = 120.0   # EC2's spot interruption notice comes two minutes ahead
GCE_NOTICE_S = 30.0    # Compute Engine's preemption notice, 30 s
DRIVER_NETWORK = "driver"   # the lab's region where the driver's host sits (not a cloud's)
FAILED_BOOT_LINES = 15      # a failed boot's console lines told with the VM's end


@dataclass
class AwsCloud:
    """moto's EC2, as the lab reaches it.

    Args:
        endpoint: moto's URL on this host.
        regions: the regions whose instances boot (one lab region each).
        server: moto served from this process (`providers.lab.ec2.LabEC2`), whose answers the
            lab makes true (addresses, console output); None: moto elsewhere, as it answers.
    """

    endpoint: str
    regions: list[str]
    server: object | None = None


class VmLab:
    """Every instance of the given clouds, booted as a machine of this host.

    Args:
        aws: moto's EC2 (None: no AWS).
        gcp: the Compute Engine fake (`providers.lab.gcefake.GCEFake`, running; None: no GCP).
        gcp_regions: the GCP regions whose instances boot.
        env: extra environment every machine's OS sets.
        on_end: called with one line when a machine ends (how, after how long, the bytes its
            WireGuard interfaces carried); default: logged.
    """

    def __init__(self, aws: AwsCloud | None = None, gcp=None, gcp_regions: list[str] = (),
                 env: dict[str, str] | None = None, on_end=None):
        regions = [*(aws.regions if aws else []), *gcp_regions, DRIVER_NETWORK]
        self.aws, self.gcp, self.env = aws, gcp, dict(env or {})
        self.gcp_regions = set(gcp_regions)
        self.net = localnet.Lab({r: localnet.Link() for r in regions})
        self.tag = self.net.tag
        self.root = WORK_ROOT / self.tag
        self.machines: dict[str, machines.Machine] = {}
        self.hosts: dict[str, localnet.Host] = {}
        self.metadata: dict[str, MetadataServer] = {}
        self.gateways: dict[str, list[Gateway]] = {}
        self.ended: dict[str, str] = {}          # instance id -> how it ended ("terminated", "stopped", "api")
        self.boot_errors: dict[str, str] = {}
        self.overlay_bytes: dict[str, tuple[int, int]] = {}   # instance id -> (received, sent) at its end
        self._reclaim_at: dict[str, float] = {}   # instance id -> unix time its cloud takes it back
        self._on_end = on_end or (lambda line: log.info("lab: %s", line))
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._clients: dict[tuple[str, str], object] = {}
        self._clients_lock = threading.Lock()
        self._node_actions = node_actions()
        # Each machine mounts its own staging over this host's /tmp/elastic-staging, made (empty)
        # where it was not: `down` removes it again then.
        self._staging_made = not HOST_STAGING.exists()
        self.root.mkdir(parents=True, exist_ok=True)
        # The lab is the clouds' network: the addresses they name and the consoles they show are
        # the machines'.
        if aws is not None and aws.server is not None:
            aws.server.addresses = self._reserve
            aws.server.console = self._console_of
        if gcp is not None:
            gcp.addresses = lambda name, zone: self._reserve(name, zone.rsplit("-", 1)[0])
            gcp.console = lambda name: self._console_of(name) or ""
        self._thread = threading.Thread(target=self._loop, name=f"vmlab-{self.tag}", daemon=True)
        self._thread.start()

    def _aws(self, service: str, region: str):
        """The lab's client of moto's `service` in `region`, made once: the loop asks EC2 every
        POLL_S, and making a boto3 client costs ~25 ms of CPU (made every round, it was 40 % of
        the lab's CPU). A session of its own: boto3's default session is not safe across threads."""
        with self._clients_lock:
            if (service, region) not in self._clients:
                from providers.aws.sdk import session

                # The lab is EC2 itself here: moto takes any key.
                self._clients[service, region] = session().client(
                    service, region_name=region, endpoint_url=self.aws.endpoint, aws_access_key_id="lab",
                    aws_secret_access_key="lab")
            return self._clients[service, region]

    # -- the loop ---------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self._round()
            except Exception as exc:   # noqa: BLE001 -- an API briefly out of reach: the next round asks again
                log.warning("lab: %s", exc)

    def _round(self) -> None:
        live: dict[str, tuple] = {}
        if self.aws is not None:
            for region in self.aws.regions:
                ec2 = self._aws("ec2", region)
                for r in ec2.describe_instances()["Reservations"]:
                    for vm in r["Instances"]:
                        if vm["State"]["Name"] in LIVE_EC2:
                            live[vm["InstanceId"]] = ("aws", region, vm)
        if self.gcp is not None:
            for name, vm in self.gcp.snapshot().items():
                region = vm["zone"].rsplit("/", 1)[-1][:-2]
                if vm.get("status", "RUNNING") in LIVE_GCE and region in self.gcp_regions:
                    live[name] = ("gcp", region, vm)
        for iid, (cloud, region, vm) in live.items():
            if iid not in self.machines and iid not in self.ended and iid not in self.boot_errors:
                try:
                    self._boot(iid, cloud, region, vm)
                except Exception as exc:   # noqa: BLE001 -- noted; the other instances still boot
                    log.warning("lab: %s did not boot: %s", iid, exc)
                    self.boot_errors[iid] = str(exc)
        for iid, (cloud, _, vm) in live.items():
            md = self.metadata.get(iid)
            if cloud == "aws" and md is not None and md.get("meta-data/iam/role") is None and vm.get("IamInstanceProfile"):
                # EC2 (moto) associates the profile just after the instance is listed.
                if role := self._role_of(vm["IamInstanceProfile"]):
                    md.update(aws_credentials(iid, role))
        for iid, m in list(self.machines.items()):
            if iid not in live:
                self._power_off(iid, "api")
            elif m.shutdown_due():
                self._halted(iid)
            elif iid in self._reclaim_at and time.time() >= self._reclaim_at[iid]:
                self._reclaim(iid)
            elif (m.root / "interrupt").exists() and not m.interrupted:
                m.interrupted = True
                self.notify(iid)

    # -- booting ----------------------------------------------------------------------------------

    def _reserve(self, iid: str, region: str) -> tuple[str, str] | None:
        """The network host of an instance being created (its cloud asks before it answers):
        (private IP, public IP); None for a region the lab does not have."""
        if region not in self.net._regions or region == DRIVER_NETWORK:
            return None
        with self._lock:
            host = self.hosts.get(iid) or self.net.add_host(region)
            self.hosts[iid] = host
        return host.private_ip, host.public_ip

    def _console_of(self, iid: str) -> str | None:
        """Instance `iid`'s whole console (None: no machine of this lab)."""
        with self._lock:
            known = iid in self.hosts or iid in self.ended or iid in self.boot_errors
        return self.console(iid, machines.CONSOLE_LINES) if known else None

    def attach_driver(self) -> dict[str, str]:
        """Put this machine (the driver's host, the overlay's head of a `head: local` run) on a
        network of its own behind a NAT that forwards the overlay's port to it, as a user's
        machine at home or in an office; the VMs reach it across the lab's internet. Returns the
        environment that makes a run's head interface reachable there
        (`ELASTIC_OVERLAY_ENDPOINT`: its public address, `ELASTIC_OVERLAY_LISTEN_PORT`)."""
        port = OVERLAY_PORT + 1 + int(self.tag[len(localnet.PREFIX):], 16) % 10_000
        root = self.net.attach_root(DRIVER_NETWORK, port)
        return {"ELASTIC_OVERLAY_ENDPOINT": f"{root.public_ip}:{OVERLAY_PORT}",
                "ELASTIC_OVERLAY_LISTEN_PORT": str(port)}

    def _boot(self, iid: str, cloud: str, region: str, vm: dict) -> None:
        with self._lock:
            host = self.hosts.get(iid) or self.net.add_host(region)
            self.hosts[iid] = host
        root = self.root / iid
        closers = []
        try:
            if cloud == "aws":
                script, env, values = self._aws_boot(iid, region, vm, host, closers)
                hostname = f"ip-{host.private_ip.replace('.', '-')}"
            else:
                script, env, values = self._gcp_boot(iid, vm, host, closers)
                hostname = iid
            md = MetadataServer(host.netns, cloud, values, root / "metadata")
            closers.append(md.close)
            m = machines.boot(iid, cloud, host.netns, root, hostname, script, {**env, **self.env})
        except BaseException:
            for close in closers:
                close()
            self.net.remove_host(host)
            with self._lock:
                self.hosts.pop(iid, None)
            raise
        m.closers = closers
        with self._lock:
            self.machines[iid], self.metadata[iid] = m, md
        log.info("lab: %s (%s %s) booted at %s / %s", iid, cloud, region, host.private_ip, host.public_ip)

    def _aws_boot(self, iid: str, region: str, vm: dict, host, closers: list):
        ec2 = self._aws("ec2", region)
        raw = ec2.describe_instance_attribute(InstanceId=iid, Attribute="userData")["UserData"].get("Value", "")
        script = base64.b64decode(raw).decode() if raw else ""
        gw = Gateway(host.netns, self.aws.endpoint, allowed=self._node_actions)
        closers.append(gw.close)
        self.gateways[iid] = [gw]
        role = self._role_of(vm.get("IamInstanceProfile") or {})
        values = aws_values(iid, vm["InstanceType"], vm["Placement"]["AvailabilityZone"], host.private_ip,
                            host.public_ip, script, role)
        # The machine's SDKs find the API at the gateway, their credentials at the metadata server.
        return script, {"AWS_ENDPOINT_URL": gw.url, "AWS_DEFAULT_REGION": region}, values

    def _role_of(self, profile: dict) -> str | None:
        """The IAM role of an instance profile (`IamInstanceProfile` of DescribeInstances), as
        IMDS names it under `iam/security-credentials/`; None: no profile, or one without a role
        (as on EC2, the machine then has no credentials)."""
        name = profile.get("Arn", "").rsplit("/", 1)[-1]
        if not name:
            return None
        iam = self._aws("iam", "us-east-1")
        roles = iam.get_instance_profile(InstanceProfileName=name)["InstanceProfile"]["Roles"]
        return roles[0]["RoleName"] if roles else None

    def _gcp_boot(self, name: str, vm: dict, host, closers: list):
        items = {i["key"]: i["value"] for i in vm.get("metadata", {}).get("items", [])}
        script = items.get("startup-script", "")
        gw = Gateway(host.netns, self.gcp.url)
        closers.append(gw.close)
        self.gateways[name] = [gw]
        accounts = vm.get("serviceAccounts") or []
        email = accounts[0]["email"] if accounts else None
        token = self.gcp.token_of(email) if email and email in self.gcp.service_accounts else None
        zone = vm["zone"].rsplit("/", 1)[-1]
        values = gcp_values(name, str(vm.get("id", name)), zone, self.gcp.project, host.private_ip, host.public_ip,
                            script, email, token)
        env = {k: gw.url for k, v in self.gcp.env().items() if v == self.gcp.url}
        # gcloud (the script's secret reads) finds the Secret Manager at the gateway.
        env["CLOUDSDK_API_ENDPOINT_OVERRIDES_SECRETMANAGER"] = gw.url + "/"
        env["CLOUDSDK_CORE_PROJECT"] = self.gcp.project
        return script, env, values

    # -- ending -----------------------------------------------------------------------------------

    def _halted(self, iid: str) -> None:
        """The machine ran `shutdown`: off, and its cloud acts by the instance's shutdown behaviour."""
        m, region = self.machines[iid], self.hosts[iid].region
        if m.cloud == "aws":
            ec2 = self._aws("ec2", region)
            behaviour = ec2.describe_instance_attribute(InstanceId=iid, Attribute="instanceInitiatedShutdownBehavior")[
                "InstanceInitiatedShutdownBehavior"]["Value"]
            ended = "terminated" if behaviour == "terminate" else "stopped"
        else:
            ended = "stopped"   # a guest OS shutdown stops a Compute Engine VM
        self._power_off(iid, ended, f"{ended} by its own shutdown")
        if m.cloud == "aws":
            (ec2.terminate_instances if ended == "terminated" else ec2.stop_instances)(InstanceIds=[iid])
        else:
            self.gcp.guest_shutdown(iid)

    def _power_off(self, iid: str, why: str, how: str | None = None) -> None:
        """Every process of the machine ends, its network host goes, its end is told (`how`, by
        default what `why` says); only then is it no longer listed, and `ended[iid]` is `why`: a
        caller waiting for it to go finds nothing of it left, and its end told."""
        with self._lock:
            m, host = self.machines.get(iid), self.hosts.get(iid)
        if m is None:
            return
        self.overlay_bytes[iid] = _wireguard_bytes(m)
        m.power_off()
        if host is not None:
            self.net.remove_host(host)
        self._say_end(iid, m, how or {"api": "released through its cloud's API"}.get(why, why))
        with self._lock:
            self.ended.setdefault(iid, why)
            for held in (self.machines, self.hosts, self.metadata, self.gateways):
                held.pop(iid, None)

    def _say_end(self, iid: str, m: machines.Machine, how: str) -> None:
        received, sent = self.overlay_bytes.get(iid, (0, 0))
        line = (f"{iid} ({m.cloud}) ended: {how}, {time.time() - m.booted_at:.0f} s after its boot; "
                f"overlay {received} bytes received, {sent} sent")
        # A boot script that failed, or never finished, is why a VM never joined: what it said last
        # comes with its end.
        status = m.user_data_status()
        if status != 0:
            line += (f"; its user data {'had not finished' if status is None else 'failed'}, its console ends:\n"
                     + "\n".join(f"    {t}" for t in m.console_tail(FAILED_BOOT_LINES).splitlines()))
        self._on_end(line)

    # -- what tests and rehearse do ----------------------------------------------------------------

    def machine(self, iid: str) -> machines.Machine | None:
        with self._lock:
            return self.machines.get(iid)

    def wait_for(self, predicate, timeout_s: float, what: str):
        """Poll `predicate()` every POLL_S until it returns something truthy (returned); raise
        TimeoutError naming `what` after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(POLL_S)   # polling a condition, bounded by the deadline
        raise TimeoutError(f"lab: {what} within {timeout_s:g} s")

    def notify(self, iid: str, lead_s: float | None = None) -> None:
        """An interruption notice on instance `iid`'s metadata server; its cloud reclaims it
        `lead_s` later (default: EC2's two minutes, Compute Engine's 30 s)."""
        m = self.machines[iid]
        lead_s = (AWS_NOTICE_S if m.cloud == "aws" else GCE_NOTICE_S) if lead_s is None else lead_s
        self.metadata[iid].notify(lead_s)
        self._reclaim_at[iid] = time.time() + lead_s

    def _reclaim(self, iid: str) -> None:
        """The cloud takes a spot VM back (its notice ran out): terminated on EC2, preempted
        (TERMINATED) on Compute Engine."""
        self._reclaim_at.pop(iid, None)
        m = self.machines[iid]
        if m.cloud == "aws":
            self._aws("ec2", self.hosts[iid].region).terminate_instances(InstanceIds=[iid])
        else:
            self.gcp.preempt(iid)
        self._power_off(iid, "reclaimed by its cloud after an interruption notice")

    def console(self, iid: str, lines: int = 40) -> str:
        """The tail of instance `iid`'s serial console (also after it ended, until `down`)."""
        m = self.machines.get(iid)
        if m is not None:
            return m.console_tail(lines)
        try:
            return "\n".join((self.root / iid / "console").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def down(self) -> None:
        """Power off every machine and remove the network lab and the machines' files (idempotent)."""
        self._stop.set()
        if self.aws is not None and self.aws.server is not None:
            self.aws.server.addresses = self.aws.server.console = None
        if self.gcp is not None:
            self.gcp.addresses = self.gcp.console = None
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)
        for iid in list(self.machines):
            self._power_off(iid, "lab down")
        self.net.down()
        with self._clients_lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()
        shutil.rmtree(self.root, ignore_errors=True)
        if self._staging_made:
            try:
                HOST_STAGING.rmdir()   # only empty: a run of this host's that stages there keeps it
            except OSError:
                pass


def _wireguard_bytes(m: machines.Machine) -> tuple[int, int]:
    """(received, sent) bytes over every WireGuard interface of machine `m`, since each came up:
    the interfaces' own counters (`ip -s link`; wireguard-go's TUN device counts each packet
    decrypted in as received and each one to encrypt as sent). Not `wg show transfer`: its counters
    are per peer and go with the peer, and a node's watcher revokes the peer of a VM released
    before this one (the run's other replica, whose syncs those were)."""
    received = sent = 0
    for ifname in m.run("wg", "show", "interfaces").split():
        shown = m.run("ip", "-s", "-j", "link", "show", "dev", ifname)   # "" once the interface is gone
        for link in json.loads(shown) if shown else []:
            received, sent = received + link["stats64"]["rx"]["bytes"], sent + link["stats64"]["tx"]["bytes"]
    return received, sent


def cleanup_orphans() -> list[str]:
    """Remove what labs of dead processes left: their machines' processes and namespaces (the
    network lab's `cleanup_orphans`) and their directories."""
    removed = localnet.cleanup_orphans()
    if WORK_ROOT.exists():
        for d in WORK_ROOT.iterdir():
            if not any(n.startswith(d.name + "-") for n in localnet.list_namespaces()):
                shutil.rmtree(d, ignore_errors=True)
    return removed
