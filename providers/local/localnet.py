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

A region's uplink `delay_ms` is the kernel's netem qdisc where it has one (all traffic leaving the
region is delayed); where it has none, the delay is added to the overlay's traffic only, by a
userspace relay per pair of members in different regions (providers/local/delayrelay.py, on
198.18.0.254 in the internet namespace; `Lab.relay`). `Lab.delay_by` says which.

Every name carries the lab's tag (`el` + 4 hex digits), so two labs never collide and
`cleanup_orphans` finds what a dead process left behind. Needs root and iproute2 + nftables.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from elastic.net import overlay
from elastic.net.overlay import OVERLAY_PORT

log = logging.getLogger(__name__)

PREFIX = "el"
INTERNET = "198.18.0.0/16"
HANDSHAKE_TIMEOUT_S = 20.0
RELAY_IP = "198.18.0.254"
"""The delay relays' address on the internet bridge (kernels without netem)."""
RELAY_PORTS = (40000, 60000)
"""UDP ports the relays take, two per pair of members."""


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
        delay_ms: one-way delay added, milliseconds: netem where the kernel has it, else a
            userspace relay on the overlay's traffic (`Lab.relay`).
        loss_pct: packets dropped, percent (needs the netem qdisc).
    """

    rate_mbit: float | None = None
    delay_ms: float = 0.0
    loss_pct: float = 0.0


@dataclass
class Host:
    """A "VM": a namespace on its region's private subnet.

    Args:
        netns: its namespace (run a process there with `ip netns exec`); None for this machine's
            own namespace (`Lab.attach_root`).
        region: region name.
        private_ip: address on the region's subnet (what the cloud calls the private IP).
        public_ip: its 1:1 NAT address on the internet bridge (overlay UDP port only).
    """

    netns: str | None
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
    with it every interface, route, NAT rule and relay process the lab made.

    `delay_by` is how uplink delays are made: "netem", "relay" (no netem here: only traffic sent
    through `relay`, the overlay's, is delayed) or None (no region has a delay).
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
        self.root: Host | None = None
        self.delay_by: str | None = None
        if any(link.delay_ms for link in regions.values()):
            self.delay_by = "netem" if netem_available() else "relay"
        self._relays: dict[tuple[str, str], subprocess.Popen] = {}   # (a, b public ip) -> process
        self._relay_counted = False
        self._next_relay_port = RELAY_PORTS[0]
        overlay.claim(self.tag)
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
        if link.loss_pct or (link.delay_ms and self.delay_by == "netem"):
            if not netem_available():
                raise LabError(f"region {region.name}: loss_pct needs the netem qdisc, which this kernel "
                               "lacks (rate_mbit works without it, delay_ms through a userspace relay)")
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
        self._stop_relays(lambda key: host.public_ip in key)
        _stop_and_delete([host.netns])
        for args in (["nft", "delete", "element", "ip", "nat", "inbound", f"{{ {host.public_ip} }}"],
                     ["nft", "delete", "element", "ip", "nat", "outbound", f"{{ {host.private_ip} }}"],
                     ["ip", "address", "del", f"{host.public_ip}/32", "dev", "pub"]):
            subprocess.run(["ip", "netns", "exec", region.router, *args], capture_output=True)

    def attach_root(self, region_name: str, listen_port: int) -> Host:
        """Put this machine's own namespace (the driver's host) on `region_name`'s private network,
        with a public 1:1 NAT address whose overlay port leads to `listen_port` here. Only the
        region's subnet and the lab's internet are routed there; nothing else changes."""
        region = self._regions[region_name]
        i = region.index
        subnet, internet = f"10.{100 + i}.0.0/24", INTERNET
        routes = json.loads(_run("ip", "-j", "route", "show"))
        lab_nets = [ipaddress.ip_network(subnet), ipaddress.ip_network(internet)]
        taken = [r["dst"] for r in routes if r.get("dst", "default") != "default"
                 and any(ipaddress.ip_network(r["dst"], strict=False).overlaps(n) for n in lab_nets)]
        if taken:
            raise LabError(f"this machine already routes {', '.join(taken)}: another network lab is "
                           "running, or the machine's own network overlaps the lab's")
        host = Host(None, region_name, f"10.{100 + i}.0.2", f"198.18.{i}.2")
        self._veths += 1
        outside = f"{self.tag}h0"
        _run("ip", "link", "add", outside, "type", "veth", "peer", "name", f"{self.tag}x0")
        _run("ip", "link", "set", f"{self.tag}x0", "netns", region.router)
        _run("ip", "-n", region.router, "link", "set", f"{self.tag}x0", "name", "h0")
        _run("ip", "-n", region.router, "link", "set", "h0", "master", "lan")
        _run("ip", "-n", region.router, "link", "set", "h0", "up")
        _run("ip", "address", "add", f"{host.private_ip}/24", "dev", outside)
        _run("ip", "link", "set", outside, "up")
        _run("ip", "route", "add", internet, "via", f"10.{100 + i}.0.1", "dev", outside)
        _run("ip", "-n", region.router, "address", "add", f"{host.public_ip}/32", "dev", "pub")
        _in(region.router, "nft", "add", "rule", "ip", "nat", "pre", "iifname", "pub", "ip", "daddr",
            host.public_ip, "udp", "dport", str(OVERLAY_PORT), "dnat", "to", f"{host.private_ip}:{listen_port}")
        _in(region.router, "nft", "add", "element", "ip", "nat", "outbound",
            f"{{ {host.private_ip} : {host.public_ip} }}")
        self.root = host
        return host

    def relay(self, a: Host, b: Host) -> str:
        """Put the pair's traffic through a delay relay (`delay_by` "relay"): a process in the
        internet namespace that holds what each side sends for its region's `delay_ms`. Returns
        the endpoint `a` sends to for `b`; `b` sees `a` at the relay's other port, which it learns
        from `a`'s first datagram. Both sides' overlay ports are their public addresses'
        OVERLAY_PORT. Stopped by `remove_host` of either, or `down`."""
        if self.delay_by != "relay":
            raise LabError("relay: no region of this lab has a delay to add in userspace")
        if a.region == b.region:
            raise LabError(f"relay: {a.public_ip} and {b.public_ip} share region {a.region}")
        if not self._relay_counted:
            # The relays' address and a counter of what they receive (local delivery, which the
            # bridge's forward counters do not see), named as the overlay's.
            _run("ip", "-n", self.inet, "address", "add", f"{RELAY_IP}/16", "dev", "inet")
            _in(self.inet, "nft", "-f", "-", input_text=f"""
table ip lab {{
  chain relayed {{ type filter hook input priority 0; policy accept;
    udp dport {RELAY_PORTS[0]}-{RELAY_PORTS[1]} counter comment "overlay"
  }}
}}
""")
            self._relay_counted = True
        a_port, b_port = self._next_relay_port, self._next_relay_port + 1
        if b_port > RELAY_PORTS[1]:
            raise LabError("relay: the relays' ports are used up")
        self._next_relay_port += 2
        script = Path(__file__).with_name("delayrelay.py")
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.inet, sys.executable, str(script), RELAY_IP,
             str(a_port), f"{a.public_ip}:{OVERLAY_PORT}", str(self._regions[a.region].link.delay_ms),
             str(b_port), f"{b.public_ip}:{OVERLAY_PORT}", str(self._regions[b.region].link.delay_ms)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, start_new_session=True)
        self._relays[(a.public_ip, b.public_ip)] = proc
        if proc.stdout.readline().strip() != "ready":
            self._stop_relays(lambda key: key == (a.public_ip, b.public_ip))
            raise LabError(f"relay between {a.public_ip} and {b.public_ip} did not start")
        return f"{RELAY_IP}:{a_port}"

    def _stop_relays(self, which: Callable[[tuple[str, str]], bool]) -> None:
        """Stop the relays whose (a, b) public-address pair `which` selects (SIGTERM, then SIGKILL)."""
        for key in [k for k in self._relays if which(k)]:
            proc = self._relays.pop(key)
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdout.close()

    def router_of(self, region_name: str) -> Host:
        """The region's router as a host on the internet (for measuring the bare link)."""
        region = self._regions[region_name]
        return Host(region.router, region_name, f"10.{100 + region.index}.0.1",
                    f"198.18.{region.index}.1")

    # -- observing --------------------------------------------------------------------------------

    def internet_counters(self) -> dict[str, dict[str, int]]:
        """Packets and bytes that crossed the internet bridge: `overlay` (UDP to the overlay port),
        `tcp`, `other_udp` (what the delay relays receive counts as `overlay`)."""
        out: dict[str, dict[str, int]] = {}
        tables = [("bridge", "lab")] + ([("ip", "lab")] if self._relay_counted else [])
        for family, table in tables:
            doc = json.loads(_in(self.inet, "nft", "-j", "list", "table", family, table))
            for item in doc["nftables"]:
                rule = item.get("rule")
                if not rule or "comment" not in rule:
                    continue
                counter = next(e["counter"] for e in rule["expr"] if "counter" in e)
                total = out.setdefault(rule["comment"], {"packets": 0, "bytes": 0})
                total["packets"] += counter["packets"]
                total["bytes"] += counter["bytes"]
        return out

    def namespaces(self) -> list[str]:
        """The lab's namespaces that exist now."""
        return [n for n in list_namespaces() if n.startswith(self.tag + "-")]

    # -- teardown ---------------------------------------------------------------------------------

    def down(self) -> None:
        """Remove every namespace of the lab (and the veths, addresses and rules in them), and
        stop every process still running in one (the delay relays first). Safe to call twice."""
        self._stop_relays(lambda key: True)
        remove_namespaces(self.tag)
        overlay.disclaim(self.tag)


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


def remove_namespaces(tag: str) -> list[str]:
    """Stop every process in, then delete, each namespace named `<tag>-…`; returns their names."""
    gone = [n for n in list_namespaces() if n.startswith(tag + "-")]
    _stop_and_delete(gone)
    # This machine's side: the head's overlay interface (its wireguard-go runs here) and the veth
    # into the lab (gone with its peer already, unless the namespace was not there).
    root_wg = f"{tag}wg"
    out = subprocess.run(["pgrep", "-f", f"wireguard-go {root_wg}$"], capture_output=True, text=True).stdout
    _signal([int(p) for p in out.split()], signal.SIGKILL)
    for ifname in (root_wg, f"{tag}h0"):
        subprocess.run(["ip", "link", "del", ifname], capture_output=True)
    return gone


def _stop_and_delete(namespaces: list[str], grace_s: float = 2.0) -> None:
    """Stop every process in the namespaces, then delete them. Processes get SIGTERM (wireguard-go
    then removes its control socket) and `grace_s` seconds before SIGKILL."""
    pids = [pid for ns in namespaces for pid in _pids_in(ns)]
    _signal(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
        time.sleep(0.05)   # waiting for processes to exit, bounded by grace_s
    _signal(pids, signal.SIGKILL)
    for ns in namespaces:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def cleanup_orphans() -> list[str]:
    """Remove every lab whose owning process is gone (a run killed before its teardown): its
    namespaces, processes and this machine's side of it. Returns the namespaces removed."""
    tags = {n.split("-")[0] for n in list_namespaces()
            if n.startswith(PREFIX) and len(n.split("-")[0]) == len(PREFIX) + 4}
    removed = []
    for tag in sorted(tags):
        if not overlay.owner_alive(tag):
            removed += remove_namespaces(tag)
            overlay.disclaim(tag)
    return removed


@dataclass
class Member:
    """A node of the local overlay.

    Args:
        host: where it sits in the lab.
        iface: its WireGuard interface.
        overlay_ip: its overlay address (what Ray and every service of the run use).
        listen_port: its WireGuard UDP port on its private address.
    """

    host: Host
    iface: overlay.Interface
    overlay_ip: str
    listen_port: int


class LocalNetwork:
    """A run's overlay over a network lab: the driver's host and every local node, as WireGuard
    peers of each other (a full mesh; every lab host has a public endpoint, which the newer member
    of each pair is given and the older one learns from its first handshake).

    Args:
        links: region name -> its uplink.
        head_region: region whose private network the driver's host joins.

    The head's overlay address is `head_ip`. `add_host` gives a region a new host on the overlay
    and makes it a peer of every member; `remove_host` revokes its key everywhere and removes it.
    """

    def __init__(self, links: dict[str, Link], head_region: str):
        self.lab = Lab(links)
        self._lock = threading.Lock()   # launches run in parallel threads
        self._members: dict[str, Member] = {}
        self._next_ip = 1
        try:
            port = OVERLAY_PORT + 1 + int(self.lab.tag[len(PREFIX):], 16) % 10_000
            root = self.lab.attach_root(head_region, port)
            self.head = self._join(root, overlay.Interface(None, ifname=f"{self.lab.tag}wg"), port)
        except BaseException:
            self.lab.down()
            raise
        self.head_ip = self.head.overlay_ip

    @property
    def tag(self) -> str:
        return self.lab.tag

    def _join(self, host: Host, iface: overlay.Interface, port: int) -> Member:
        member = Member(host, iface, overlay.overlay_ip(self._next_ip), port)
        self._next_ip += 1
        iface.up(member.overlay_ip, overlay.keypair(host.netns)[0], listen_port=port)
        for other in self._members.values():
            # Only the newcomer starts the handshake: `other` accepts its key with no endpoint and
            # learns it from the newcomer's first message. Two peers that both know each other's
            # endpoint each start a handshake at once; each answers the other's, which drops its
            # own, both answers are refused, and WireGuard tries again 5 s later, as often in step.
            other.iface.set_peer(overlay.Peer(member.iface.public_key, member.overlay_ip))
            iface.set_peer(overlay.Peer(other.iface.public_key, other.overlay_ip, self._endpoint(member, other)))
        self._members[member.overlay_ip] = member
        return member

    def _endpoint(self, a: Member, b: Member) -> str:
        """Where `a` sends to reach `b`: the private address inside one region (as within a VPC);
        across regions the public one, or the pair's delay relay where the lab adds uplink delays
        in userspace."""
        if a.host.region == b.host.region:
            return f"{b.host.private_ip}:{b.listen_port}"
        if self.lab.delay_by == "relay":
            return self.lab.relay(a.host, b.host)
        return f"{b.host.public_ip}:{OVERLAY_PORT}"

    def add_host(self, region: str) -> Member:
        """A new host ("VM") in `region`, on the overlay and peered with every member."""
        with self._lock:
            host = self.lab.add_host(region)
            iface = overlay.Interface(host.netns)
            try:
                member = self._join(host, iface, OVERLAY_PORT)
                self._await_handshake(member)
                return member
            except BaseException:
                iface.down()
                self.lab.remove_host(host)
                raise

    def _await_handshake(self, member: Member, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
        """Wait until the head and `member` completed a WireGuard handshake (their persistent
        keepalives start one at once): a node starts its raylet only once the overlay carries it,
        or its first connections to the head sit in TCP's retry back-off."""
        deadline = time.monotonic() + timeout_s
        while self.head.iface.peers().get(member.iface.public_key, {}).get("latest_handshake", 0) == 0:
            if time.monotonic() > deadline:
                raise overlay.OverlayError(f"{member.host.netns}: no WireGuard handshake with the head "
                                           f"within {timeout_s:.0f} s")
            time.sleep(0.05)   # polling WireGuard's handshake time, bounded by timeout_s

    def remove_host(self, member: Member) -> None:
        """Revoke `member`'s key on every other member, then take its host off the lab."""
        with self._lock:
            if self._members.pop(member.overlay_ip, None) is None:
                return
            for other in self._members.values():
                try:
                    other.iface.remove_peer(member.iface.public_key)
                except overlay.OverlayError:
                    log.warning("could not revoke %s on %s", member.overlay_ip, other.overlay_ip)
            member.iface.down()
            self.lab.remove_host(member.host)

    def members(self) -> list[Member]:
        with self._lock:
            return list(self._members.values())

    def down(self) -> None:
        """Remove every interface, namespace and process of the network; safe to call twice."""
        with self._lock:
            for member in list(self._members.values()):
                member.iface.down()
            self._members.clear()
            self.lab.down()
