"""Separate networks on one machine: Linux network namespaces standing in for regions and clouds.

Each region is a private subnet behind its own NAT router; the routers meet on one shared
"internet" bridge. A host of a region (a "VM") reaches the internet through its router's
masquerade, and is reachable from the internet only on the overlay's UDP port of its public
address (1:1 NAT, as an EC2 public IP behind a security group that opens that one port). Hosts of
different regions therefore reach each other only over the overlay, exactly as on clouds.

    ns <tag>-inet        bridge "inet" on 198.18.0.0/16 (RFC 2544 test range); counters in nft
    ns <tag>-r<i>        router of region i: "pub" 198.18.i.1 on the bridge (rate limit here),
                         "lan" bridge 10.<100+i>.0.1/24, NAT
    ns <tag>-r<i>h<k>    host k of region i: "eth0" 10.<100+i>.0.<10+k>, public 198.18.i.<10+k>

Every name carries the lab's tag (`el` + 4 hex digits), so two labs never collide and
`cleanup_orphans` finds what a dead process left behind. Needs root and iproute2 + nftables.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

PREFIX = "el"
INTERNET = "198.18.0.0/16"
OVERLAY_PORT = 51820   # elastic.overlay.OVERLAY_PORT; providers/ does not import elastic's core


class LabError(RuntimeError):
    """The lab could not be built (not root, a tool missing, a command refused)."""


def missing_requirements() -> str | None:
    """Why a lab cannot be built here, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [t for t in ("ip", "nft", "tc") if shutil.which(t) is None]
    if missing:
        return f"missing {', '.join(missing)} (install iproute2 and nftables)"
    return None


def netem_available() -> bool:
    """Whether this kernel has the netem qdisc (link delay and loss)."""
    ns = f"{PREFIX}probe{secrets.token_hex(2)}"
    try:
        _run("ip", "netns", "add", ns)
        _run("ip", "-n", ns, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
        return subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "p0", "root",
                               "netem", "delay", "1ms"], capture_output=True).returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _run(*args: str, input_text: str | None = None) -> str:
    try:
        return subprocess.run(args, input=input_text, capture_output=True, text=True, check=True,
                              timeout=30).stdout
    except subprocess.CalledProcessError as e:
        raise LabError(f"{' '.join(args)}: {e.stderr.strip()}") from e


def _in(ns: str, *args: str, input_text: str | None = None) -> str:
    return _run("ip", "netns", "exec", ns, *args, input_text=input_text)


@dataclass(frozen=True)
class Link:
    """A region's uplink to the internet bridge (applied to what leaves the region).

    Args:
        rate_mbit: bandwidth cap, Mbit/s (None: unlimited).
        delay_ms: one-way delay added, milliseconds (needs the netem qdisc).
        loss_pct: packets dropped, percent (needs the netem qdisc).
    """

    rate_mbit: float | None = None
    delay_ms: float = 0.0
    loss_pct: float = 0.0


@dataclass
class Host:
    """A "VM": a namespace on its region's private subnet.

    Args:
        netns: its namespace (run a process there with `ip netns exec`).
        region: region name.
        private_ip: address on the region's subnet (what the cloud calls the private IP).
        public_ip: its 1:1 NAT address on the internet bridge (overlay UDP port only).
    """

    netns: str
    region: str
    private_ip: str
    public_ip: str


@dataclass
class _Region:
    name: str
    index: int
    router: str
    link: Link
    hosts: dict[str, Host] = field(default_factory=dict)
    next_host: int = 0


class Lab:
    """Regions as namespaces behind NAT routers on one internet bridge.

    Args:
        regions: region name -> its uplink.
        tag: name prefix (default: a fresh `el` + 4 hex digits).

    Use as a context manager, or call `down()` in a `finally`: it removes every namespace, and
    with it every interface, route and NAT rule the lab made.
    """

    def __init__(self, regions: dict[str, Link], tag: str | None = None):
        reason = missing_requirements()
        if reason:
            raise LabError(reason)
        if not 0 < len(regions) < 100:
            raise LabError("a lab has 1 to 99 regions")
        self.tag = tag or f"{PREFIX}{secrets.token_hex(2)}"
        self.inet = f"{self.tag}-inet"
        self._regions = {name: _Region(name, i + 1, f"{self.tag}-r{i + 1}", link)
                         for i, (name, link) in enumerate(regions.items())}
        self._veths = 0
        try:
            self._make_internet()
            for region in self._regions.values():
                self._make_router(region)
        except BaseException:
            self.down()
            raise

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    # -- building ---------------------------------------------------------------------------------

    def _veth(self, ns_a: str, name_a: str, ns_b: str, name_b: str) -> None:
        """A veth pair with one end in each namespace (made under unique temporary names)."""
        self._veths += 1
        tmp_a, tmp_b = f"{self.tag}a{self._veths}", f"{self.tag}b{self._veths}"
        _run("ip", "link", "add", tmp_a, "type", "veth", "peer", "name", tmp_b)
        for tmp, ns, name in ((tmp_a, ns_a, name_a), (tmp_b, ns_b, name_b)):
            _run("ip", "link", "set", tmp, "netns", ns)
            _run("ip", "-n", ns, "link", "set", tmp, "name", name)
            _run("ip", "-n", ns, "link", "set", name, "up")

    def _make_internet(self) -> None:
        _run("ip", "netns", "add", self.inet)
        _run("ip", "-n", self.inet, "link", "set", "lo", "up")
        _run("ip", "-n", self.inet, "link", "add", "inet", "type", "bridge")
        _run("ip", "-n", self.inet, "link", "set", "inet", "up")
        # Counters of what crosses the internet: the overlay's UDP, and anything else by protocol.
        _in(self.inet, "nft", "-f", "-", input_text=f"""
table bridge lab {{
  chain count {{ type filter hook forward priority 0; policy accept;
    udp dport {OVERLAY_PORT} counter comment "overlay"
    meta l4proto tcp counter comment "tcp"
    meta l4proto udp udp dport != {OVERLAY_PORT} counter comment "other_udp"
  }}
}}
""")

    def _make_router(self, region: _Region) -> None:
        ns, i = region.router, region.index
        _run("ip", "netns", "add", ns)
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        self._veth(ns, "pub", self.inet, f"r{i}")
        _run("ip", "-n", self.inet, "link", "set", f"r{i}", "master", "inet")
        _run("ip", "-n", ns, "address", "add", f"198.18.{i}.1/16", "dev", "pub")
        _run("ip", "-n", ns, "link", "add", "lan", "type", "bridge")
        _run("ip", "-n", ns, "address", "add", f"10.{100 + i}.0.1/24", "dev", "lan")
        _run("ip", "-n", ns, "link", "set", "lan", "up")
        _in(ns, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        _in(ns, "nft", "-f", "-", input_text=f"""
table ip nat {{
  map inbound {{ type ipv4_addr : ipv4_addr; }}
  map outbound {{ type ipv4_addr : ipv4_addr; }}
  chain pre {{ type nat hook prerouting priority dstnat;
    iifname "pub" udp dport {OVERLAY_PORT} dnat to ip daddr map @inbound
  }}
  chain post {{ type nat hook postrouting priority srcnat;
    oifname "pub" snat to ip saddr map @outbound
    oifname "pub" masquerade
  }}
}}
""")
        self._shape(region)

    def _shape(self, region: _Region) -> None:
        link = region.link
        if link.delay_ms or link.loss_pct:
            if not netem_available():
                raise LabError(f"region {region.name}: delay_ms/loss_pct need the netem qdisc, "
                               "which this kernel lacks (rate_mbit works without it)")
            args = ["netem", "delay", f"{link.delay_ms}ms", "loss", f"{link.loss_pct}%",
                    "limit", "100000"]
            if link.rate_mbit:
                args += ["rate", f"{link.rate_mbit}mbit"]
        elif link.rate_mbit:
            # Token bucket: a burst of ~1 ms at the rate, a queue of 50 ms before drops.
            burst_b = max(int(link.rate_mbit * 1e6 / 8 / 1000), 16 * 1024)
            args = ["tbf", "rate", f"{link.rate_mbit}mbit", "burst", str(burst_b), "latency", "50ms"]
        else:
            return
        _in(region.router, "tc", "qdisc", "replace", "dev", "pub", "root", *args)

    def add_host(self, region_name: str) -> Host:
        """A new host in `region_name`, with its private address and its public 1:1 NAT address."""
        region = self._regions[region_name]
        region.next_host += 1
        k, i = region.next_host, region.index
        if k > 200:
            raise LabError(f"region {region_name}: at most 200 hosts")
        host = Host(f"{region.router}h{k}", region_name, f"10.{100 + i}.0.{10 + k}",
                    f"198.18.{i}.{10 + k}")
        _run("ip", "netns", "add", host.netns)
        try:
            _run("ip", "-n", host.netns, "link", "set", "lo", "up")
            self._veth(host.netns, "eth0", region.router, f"h{k}")
            _run("ip", "-n", region.router, "link", "set", f"h{k}", "master", "lan")
            _run("ip", "-n", host.netns, "address", "add", f"{host.private_ip}/24", "dev", "eth0")
            _run("ip", "-n", host.netns, "route", "add", "default", "via", f"10.{100 + i}.0.1")
            _run("ip", "-n", region.router, "address", "add", f"{host.public_ip}/32", "dev", "pub")
            _in(region.router, "nft", "add", "element", "ip", "nat", "inbound",
                f"{{ {host.public_ip} : {host.private_ip} }}")
            _in(region.router, "nft", "add", "element", "ip", "nat", "outbound",
                f"{{ {host.private_ip} : {host.public_ip} }}")
        except BaseException:
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
            raise
        region.hosts[host.netns] = host
        return host

    def remove_host(self, host: Host) -> None:
        """Take a host off its network (a released or preempted VM)."""
        region = self._regions[host.region]
        if region.hosts.pop(host.netns, None) is None:
            return
        subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
        for args in (["nft", "delete", "element", "ip", "nat", "inbound", f"{{ {host.public_ip} }}"],
                     ["nft", "delete", "element", "ip", "nat", "outbound", f"{{ {host.private_ip} }}"],
                     ["ip", "address", "del", f"{host.public_ip}/32", "dev", "pub"]):
            subprocess.run(["ip", "netns", "exec", region.router, *args], capture_output=True)

    def router_of(self, region_name: str) -> Host:
        """The region's router as a host on the internet (for measuring the bare link)."""
        region = self._regions[region_name]
        return Host(region.router, region_name, f"10.{100 + region.index}.0.1",
                    f"198.18.{region.index}.1")

    # -- observing --------------------------------------------------------------------------------

    def internet_counters(self) -> dict[str, dict[str, int]]:
        """Packets and bytes that crossed the internet bridge: `overlay` (UDP to the overlay port),
        `tcp`, `other_udp`."""
        doc = json.loads(_in(self.inet, "nft", "-j", "list", "table", "bridge", "lab"))
        out = {}
        for item in doc["nftables"]:
            rule = item.get("rule")
            if not rule or "comment" not in rule:
                continue
            counter = next(e["counter"] for e in rule["expr"] if "counter" in e)
            out[rule["comment"]] = {"packets": counter["packets"], "bytes": counter["bytes"]}
        return out

    def namespaces(self) -> list[str]:
        """The lab's namespaces that exist now."""
        return [n for n in list_namespaces() if n.startswith(self.tag + "-")]

    # -- teardown ---------------------------------------------------------------------------------

    def down(self) -> None:
        """Remove every namespace of the lab (and the veths, addresses and rules in them), and
        stop every process still running in one. Safe to call twice."""
        remove_namespaces(self.tag)


def list_namespaces() -> list[str]:
    """Every network namespace on this machine."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pids_in(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def remove_namespaces(tag: str, grace_s: float = 2.0) -> list[str]:
    """Stop every process in, then delete, each namespace named `<tag>-…`; returns their names.
    Processes get SIGTERM (wireguard-go then removes its control socket) and `grace_s` seconds
    before SIGKILL."""
    gone = [n for n in list_namespaces() if n.startswith(tag + "-")]
    pids = [pid for ns in gone for pid in _pids_in(ns)]
    _signal(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
        time.sleep(0.05)   # waiting for processes to exit, bounded by grace_s
    _signal(pids, signal.SIGKILL)
    for ns in gone:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    return gone


def cleanup_orphans(alive_tags: set[str] = frozenset()) -> list[str]:
    """Remove the namespaces of labs whose tag is not in `alive_tags` (what a killed run left)."""
    tags = {n.split("-")[0] for n in list_namespaces()
            if n.startswith(PREFIX) and "-" in n and len(n.split("-")[0]) == len(PREFIX) + 4}
    removed = []
    for tag in sorted(tags - set(alive_tags)):
        removed += remove_namespaces(tag)
    return removed
