"""Regions as network namespaces behind NAT routers, joined only by the WireGuard overlay.

Needs root, iproute2, nftables, wireguard-tools and wireguard-go (.ci/run installs them); every
test removes the namespaces, interfaces and processes it made, also when it fails.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from elastic.net import overlay
from providers.local import localnet
from tests.conftest import new_namespaces, no_cloud_env, run_cli

pytestmark = pytest.mark.usefixtures("root_tools")

PORT = 7000


def _serve(ns: str, connections: int) -> subprocess.Popen:
    """A TCP server in `ns` on every address, port PORT: answers `hello` to at most `connections`
    connections, and exits after 60 s at the latest."""
    code = ("import socket\ns = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            f"s.bind(('0.0.0.0', {PORT})); s.listen(); s.settimeout(60)\nprint('up', flush=True)\n"
            f"for _ in range({connections}):\n    c, _ = s.accept(); c.sendall(b'hello'); c.close()\n")
    proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", code],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"
    return proc


def _reach(ns: str, host: str, timeout_s: float = 2.0) -> bool:
    """Whether a TCP connection from `ns` to host:PORT gets the server's `hello`."""
    code = (f"import socket\ns = socket.create_connection(('{host}', {PORT}), timeout={timeout_s})\n"
            "s.settimeout(5); print(s.recv(5).decode())")
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=30)
    return out.returncode == 0 and out.stdout.strip() == "hello"


@pytest.fixture
def lab():
    the_lab = localnet.Lab({"region-a": localnet.Link(), "region-b": localnet.Link(rate_mbit=500)})
    try:
        yield the_lab
    finally:
        the_lab.down()
        assert the_lab.namespaces() == []


@pytest.fixture
def meshed(lab):
    """Hosts a (region-a) and b (region-b), each with an overlay interface, peered both ways."""
    a, b = lab.add_host("region-a"), lab.add_host("region-b")
    ifaces = []
    try:
        for i, host in enumerate((a, b), start=1):
            iface = overlay.Interface(host.netns)
            ifaces.append(iface)
            private, _public = overlay.keypair(host.netns)
            iface.up(overlay.overlay_ip(i), private)
        ifaces[0].set_peer(overlay.Peer(ifaces[1].public_key, overlay.overlay_ip(2), f"{b.public_ip}:{overlay.OVERLAY_PORT}"))
        ifaces[1].set_peer(overlay.Peer(ifaces[0].public_key, overlay.overlay_ip(1), f"{a.public_ip}:{overlay.OVERLAY_PORT}"))
        yield a, b, ifaces
    finally:
        for iface in ifaces:
            iface.down()


def test_without_the_overlay_a_host_cannot_reach_another_regions_private_or_public_address(lab):
    a, b = lab.add_host("region-a"), lab.add_host("region-b")
    server = _serve(a.netns, connections=1)
    try:
        assert not _reach(b.netns, a.private_ip)   # no route between private subnets
        assert not _reach(b.netns, a.public_ip)    # the 1:1 NAT opens the overlay's UDP port only
        assert _reach(a.netns, a.private_ip)       # control: the server does answer
    finally:
        server.kill()
        server.wait()


def test_the_overlay_joins_two_regions_and_only_its_udp_crosses_the_internet(lab, meshed):
    a, b, ifaces = meshed
    server = _serve(a.netns, connections=2)
    before = lab.internet_counters()
    try:
        assert _reach(b.netns, overlay.overlay_ip(1), timeout_s=10)
        assert _reach(b.netns, overlay.overlay_ip(1))
    finally:
        server.kill()
        server.wait()
    after = lab.internet_counters()
    delta = {k: after[k]["packets"] - before[k]["packets"] for k in after}
    assert delta["overlay"] > 0
    assert delta["tcp"] == 0 and delta["other_udp"] == 0
    # The peers shook hands at each other's public endpoints (mesh, no relay).
    assert ifaces[1].peers()[ifaces[0].public_key]["latest_handshake"] > 0
    assert ifaces[0].peers()[ifaces[1].public_key]["endpoint"] == f"{b.public_ip}:{overlay.OVERLAY_PORT}"


def test_a_revoked_key_no_longer_reaches_its_peer(lab, meshed):
    a, b, ifaces = meshed
    server = _serve(a.netns, connections=2)
    try:
        assert _reach(b.netns, overlay.overlay_ip(1), timeout_s=10)
        ifaces[0].remove_peer(ifaces[1].public_key)   # b was released: a forgets its key
        assert ifaces[1].public_key not in ifaces[0].peers()
        assert not _reach(b.netns, overlay.overlay_ip(1), timeout_s=3)
    finally:
        server.kill()
        server.wait()


def test_teardown_leaves_no_namespace_interface_or_wireguard_process(tmp_path):
    lab = localnet.Lab({"region-a": localnet.Link()})
    try:
        host = lab.add_host("region-a")
        iface = overlay.Interface(host.netns)
        iface.up(overlay.overlay_ip(1), overlay.keypair(host.netns)[0])
        assert iface.userspace == (subprocess.run(["ip", "link", "add", "elprobe0", "type", "wireguard"],
                                                  capture_output=True).returncode != 0)
        assert lab.namespaces()
        assert localnet.cleanup_orphans() == []   # its owner (this process) is alive
        # A run killed without its teardown: its owner is gone, only the orphan sweep is left.
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True).stdout.strip()
        (overlay.OWNERS / lab.tag).write_text(dead)
        # `elastic down --orphans` sweeps it, also for a user with no cloud configured (exit 0).
        proc = run_cli("down", "--orphans", "--yes", env=no_cloud_env(tmp_path))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "removed what dead runs left on this machine: " in proc.stdout
        removed = proc.stdout.split("removed what dead runs left on this machine: ")[1].split("\n")[0]
        assert set(removed.split(", ")) >= {f"{lab.tag}-inet", f"{lab.tag}-r1", host.netns}
        assert lab.namespaces() == []
    finally:
        lab.down()
        subprocess.run(["ip", "link", "del", "elprobe0"], capture_output=True)
    assert lab.namespaces() == []
    assert subprocess.run(["pgrep", "-f", f"wireguard-go {iface.ifname}"], capture_output=True).returncode == 1
    assert subprocess.run(["ip", "link", "show", iface.ifname], capture_output=True).returncode != 0


def test_link_delay_takes_netem_or_a_relay_and_loss_without_netem_is_refused_with_nothing_left():
    before = localnet.list_namespaces()
    with localnet.Lab({"region-a": localnet.Link(delay_ms=20, rate_mbit=100)}) as lab:
        qdisc = subprocess.run(["ip", "netns", "exec", lab.router_of("region-a").netns, "tc",
                                "qdisc", "show", "dev", "pub"], capture_output=True, text=True).stdout
        if localnet.netem_available():
            assert lab.delay_by == "netem" and "netem" in qdisc and "delay 20" in qdisc
        else:
            # Rate by the kernel's token bucket; the delay by the overlay's relays (next test).
            assert lab.delay_by == "relay" and "tbf" in qdisc and "netem" not in qdisc
            with pytest.raises(localnet.LabError, match="loss_pct needs the netem qdisc"):
                localnet.Lab({"region-a": localnet.Link(loss_pct=1)})
    assert new_namespaces(before) == set()


def test_a_regions_delay_raises_the_round_trip_over_the_overlay_by_twice_the_one_way_delay():
    """The run's overlay (`LocalNetwork`, the driver's host in region-a, a node in region-b), both
    uplinks delayed 25 ms: a TCP handshake to the node's overlay address takes one round trip of
    at least 50 ms (the lab without delay: under a millisecond), through netem or, on a kernel
    without it, the relay; only the overlay crosses the internet; nothing of it is left after."""
    delay_ms = 25
    net = localnet.LocalNetwork({"region-a": localnet.Link(delay_ms=delay_ms),
                                 "region-b": localnet.Link(delay_ms=delay_ms, rate_mbit=200)}, "region-a")
    relays: list[int] = []
    try:
        node = net.add_host("region-b")
        relays = localnet._pids_in(net.lab.inet)
        assert (net.lab.delay_by, len(relays) > 0) in {("netem", False), ("relay", True)}
        server = _serve(node.host.netns, connections=4)
        before = net.lab.internet_counters()
        rtts_ms = []
        try:
            for _ in range(4):
                t0 = time.perf_counter()
                with socket.create_connection((node.overlay_ip, PORT), timeout=10) as conn:
                    rtts_ms.append((time.perf_counter() - t0) * 1000)
                    assert conn.recv(5) == b"hello"
        finally:
            server.kill()
            server.wait()
        after = net.lab.internet_counters()
        assert 2 * delay_ms <= min(rtts_ms) < 2 * delay_ms + 25, rtts_ms
        assert after["overlay"]["packets"] > before["overlay"]["packets"]
        assert after["tcp"] == before["tcp"] and after["other_udp"] == before["other_udp"]
    finally:
        net.down()
    assert net.lab.namespaces() == []
    assert not [pid for pid in relays if os.path.exists(f"/proc/{pid}")]


def test_two_nodes_without_public_endpoints_talk_through_the_head(lab):
    """Nodes b and c admitted without endpoints (as behind NAT with no public address) cannot
    handshake with each other: `peers_for` routes each other's overlay address through the head,
    which forwards between its peers; a TCP connection from b to c then works, and c's key is not
    a peer of b's."""
    # b and c sit in region-b (the lab's routers do no hairpin NAT to a public address of their own
    # region); with no endpoints and no private ones admitted, they have only the head between them.
    h, b, c = lab.add_host("region-a"), lab.add_host("region-b"), lab.add_host("region-b")
    ifaces = {name: overlay.Interface(host.netns) for name, host in (("h", h), ("b", b), ("c", c))}
    try:
        for i, name in enumerate(("h", "b", "c"), start=1):
            ifaces[name].up(overlay.overlay_ip(i), overlay.keypair(ifaces[name].netns)[0])
        ifaces["h"].forward()
        head = overlay.Member("head", overlay.overlay_ip(1), ifaces["h"].public_key,
                              f"{h.public_ip}:{overlay.OVERLAY_PORT}")
        roster = overlay.Roster(head, ifaces["h"])
        nodes = {name: overlay.Member(name, overlay.overlay_ip(i), ifaces[name].public_key)   # no endpoint
                 for i, name in ((2, "b"), (3, "c"))}
        for m in nodes.values():
            roster.add(m)
        for name, m in nodes.items():
            overlay.apply(ifaces[name], m, roster.members(), head_ip=overlay.overlay_ip(1))
        assert set(ifaces["b"].peers()) == {head.public_key}          # no direct peer c
        assert set(ifaces["b"].peers()[head.public_key]["allowed_ips"].split(",")) == {
            f"{overlay.overlay_ip(1)}/32", f"{overlay.overlay_ip(3)}/32"}
        server = _serve(c.netns, connections=1)
        try:
            assert _reach(b.netns, overlay.overlay_ip(3), timeout_s=10)
        finally:
            server.kill()
            server.wait()
        relayed = ifaces["h"].peers()
        assert relayed[nodes["b"].public_key]["rx_bytes"] > 0 and relayed[nodes["c"].public_key]["tx_bytes"] > 0
    finally:
        for iface in ifaces.values():
            iface.down()
