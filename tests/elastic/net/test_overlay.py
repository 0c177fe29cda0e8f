"""The run's overlay roster: who peers with whom (pure), and the roster applied to a real WireGuard
interface (in a network namespace this test makes and removes; needs root and wireguard-tools)."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
from pathlib import Path

import pytest

from elastic.net import overlay
from elastic.net.overlay import HEAD_IP, Member, Roster, decode_members, encode_members, peers_for
from tests.conftest import new_namespaces


def member(n: int, endpoint: bool = True, site: str = "", private: bool = False, name: str | None = None) -> Member:
    ip = overlay.overlay_ip(n)
    return Member(name or ("head" if n == 1 else f"vm-{n}"), ip, f"key{n}=", f"198.51.100.{n}:51820" if endpoint else None,
                  site, f"10.0.0.{n}:51820" if private else None)


def test_mesh_where_endpoints_allow_and_relay_through_the_head_where_not():
    head, a, b = member(1), member(2), member(3)          # a, b: public addresses
    c, d = member(4, endpoint=False), member(5, endpoint=False)   # behind NAT, no public address
    e, f = member(6, endpoint=False, site="gcp/default", private=True), member(7, endpoint=False, site="gcp/default",
                                                                            private=True)
    everyone = [head, a, b, c, d, e, f]
    by_ip = {p.overlay_ip: p for p in peers_for(a, everyone)}
    # a reaches b directly at its public endpoint (mesh: not through the head) ...
    assert by_ip[b.overlay_ip].endpoint == b.endpoint and by_ip[b.overlay_ip].allowed_ips == ()
    # ... and c, d without an endpoint of their own dial a (a has one): direct, no endpoint set here.
    assert by_ip[c.overlay_ip].endpoint is None
    # c and d can reach neither each other nor e/f directly: through the head, whose entry carries their /32s.
    seen_from_c = {p.overlay_ip: p for p in peers_for(c, everyone)}
    assert d.overlay_ip not in seen_from_c and e.overlay_ip not in seen_from_c
    assert set(seen_from_c[HEAD_IP].allowed_ips) == {f"{HEAD_IP}/32", f"{d.overlay_ip}/32", f"{e.overlay_ip}/32",
                                                     f"{f.overlay_ip}/32"}
    assert seen_from_c[a.overlay_ip].endpoint == a.endpoint
    # e and f share a private network: direct, at their private addresses.
    assert {p.overlay_ip: p for p in peers_for(e, everyone)}[f.overlay_ip].endpoint == f.private_endpoint
    # The head peers with everyone, each on its own /32.
    assert sorted(p.overlay_ip for p in peers_for(head, everyone)) == sorted(m.overlay_ip for m in everyone[1:])
    assert all(p.allowed_ips == () for p in peers_for(head, everyone))
    assert decode_members(encode_members(everyone)) == sorted(everyone, key=lambda m: m.overlay_ip)


def test_roster_allocates_reuses_and_publishes_public_facts_only():
    docs = []
    roster = Roster(member(1), publish=docs.append)
    ips = [roster.allocate_ip() for _ in range(2)]
    assert ips == ["100.80.0.2", "100.80.0.3"]
    roster.add(Member("vm-a", ips[0], "pubA=", "198.51.100.9:51820"))
    roster.add(Member("vm-b", ips[1], "pubB="))
    assert [m.name for m in decode_members(docs[-1])] == ["head", "vm-a", "vm-b"]
    assert roster.remove("vm-a").overlay_ip == ips[0]
    assert [m.name for m in decode_members(docs[-1])] == ["head", "vm-b"]
    assert roster.remove("vm-a") is None and roster.remove("head") is None   # the head stays
    assert roster.allocate_ip() == ips[0]                                   # a released address is reused
    roster.release_ip(ips[1])                                               # held by vm-b: not freed
    assert roster.allocate_ip() == "100.80.0.4"


needs_root = pytest.mark.usefixtures("root_tools")   # a WireGuard interface: root, wireguard-tools/-go


@pytest.fixture
def netns():
    name = f"elov{secrets.token_hex(2)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    iface = overlay.Interface(name)
    try:
        yield name, iface
    finally:
        iface.down()
        subprocess.run(["ip", "netns", "del", name], check=False)


@needs_root
def test_roster_changes_reach_the_heads_interface_and_a_nodes_watcher_applies_the_document(netns):
    """The head's interface follows the roster (a revoked key is gone at once); a node applying the
    published document gains the new members and loses the revoked one."""
    from providers.watcher import PeerSync

    ns, head_iface = netns
    head_iface.up(HEAD_IP, overlay.keypair(ns)[0], listen_port=0)
    head = Member("head", HEAD_IP, head_iface.public_key, "192.0.2.1:51820")
    docs = []
    roster = Roster(head, head_iface, publish=docs.append)
    node_iface = overlay.Interface(ns, ifname=f"{head_iface.ifname[:12]}n")
    try:
        node_ip = roster.allocate_ip()
        node_iface.up(node_ip, overlay.keypair(ns)[0], listen_port=0)
        roster.add(Member("vm-1", node_ip, node_iface.public_key, "192.0.2.2:51820"))
        keys = [overlay.keypair(ns)[1] for _ in range(2)]
        for i, key in enumerate(keys):
            roster.add(Member(f"vm-{i + 2}", roster.allocate_ip(), key, f"192.0.2.{i + 3}:51820"))
        assert set(head_iface.peers()) == {node_iface.public_key, *keys}
        sync = PeerSync(node_ip, node_iface)
        sync.sync(docs[-1])
        assert set(node_iface.peers()) == {head.public_key, *keys}
        assert node_iface.peers()[keys[0]]["endpoint"] == "192.0.2.3:51820"
        roster.remove("vm-2")
        assert keys[0] not in head_iface.peers()
        sync.sync(docs[-1])
        assert set(node_iface.peers()) == {head.public_key, keys[1]}   # revoked on the node too
    finally:
        node_iface.down()


@needs_root
def test_a_nodes_boot_command_brings_the_overlay_up_with_its_key_on_stdin_and_waits_for_the_head(netns):
    """`python -m elastic.net.overlay up` as the boot script runs it (in a second namespace, joined to
    the head's by a veth): the private key arrives on stdin, the head is the first peer, and the
    command returns once the head answered; it leaves the interface up when it exits."""
    import sys

    head_ns, head_iface = netns
    node_ns = f"{head_ns}n"
    veth = f"{head_ns}v"
    subprocess.run(["ip", "netns", "add", node_ns], check=True)
    node_iface = overlay.Interface(node_ns)
    try:
        subprocess.run(["ip", "link", "add", veth, "netns", head_ns, "type", "veth", "peer", "name", "eth0",
                        "netns", node_ns], check=True)
        for ns, dev, ip in ((head_ns, veth, "192.0.2.1/24"), (node_ns, "eth0", "192.0.2.2/24")):
            subprocess.run(["ip", "-n", ns, "addr", "add", ip, "dev", dev], check=True)
            subprocess.run(["ip", "-n", ns, "link", "set", dev, "up"], check=True)
        head_iface.up(HEAD_IP, overlay.keypair(head_ns)[0], listen_port=51820)
        private, public = overlay.keypair(node_ns)
        head_iface.set_peer(overlay.Peer(public, "100.80.0.2"))        # the driver admitted the node
        cmd = ["ip", "netns", "exec", node_ns, sys.executable, "-m", "elastic.net.overlay", "up", "--address", "100.80.0.2",
               "--ifname", node_iface.ifname, "--peer", f"{head_iface.public_key},{HEAD_IP},192.0.2.1:51820",
               "--wait-handshake-s", "20"]
        proc = subprocess.run(cmd, input=private + "\n", capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == public and private not in proc.stdout + proc.stderr
        assert node_iface.handshaken(head_iface.public_key) and head_iface.handshaken(public)
        empty = subprocess.run(cmd[:-2], input="", capture_output=True, text=True, timeout=60)
        assert empty.returncode == 2 and "no private key on stdin" in empty.stderr
    finally:
        node_iface.down()
        subprocess.run(["ip", "netns", "del", node_ns], check=False)


@needs_root
def test_a_wireguard_go_that_cannot_start_says_why(netns):
    """Userspace WireGuard writes why it stopped to its stdout: the error carries it (here the
    interface's name is taken by another device, so wireguard-go cannot create its TUN device)."""
    name, iface = netns
    subprocess.run(["ip", "netns", "exec", name, "ip", "link", "add", iface.ifname, "type", "veth",
                    "peer", "name", "elvpeer"], check=True)
    key = subprocess.run(["wg", "genkey"], capture_output=True, text=True, check=True).stdout.strip()
    with pytest.raises(overlay.OverlayError, match=r"wireguard-go exited with 1: .*Failed to create TUN device"):
        iface.up("100.80.0.9", key, listen_port=0)


def test_waiting_for_wireguard_go_leaves_a_socket_that_is_not_listening_yet(monkeypatch, tmp_path):
    # wireguard-go binds its control socket, then listens; `wg` deletes a socket that refuses it,
    # and wireguard-go then exits. The wait asks by connecting, which refuses and deletes nothing.
    monkeypatch.setattr(overlay, "UAPI_DIR", tmp_path)
    path = tmp_path / "elwtest.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as daemon:
        daemon.bind(str(path))
        assert not overlay._uapi_listening("elwtest")
        assert path.exists()
        daemon.listen()
        assert overlay._uapi_listening("elwtest")
    assert not overlay._uapi_listening("elwnone")


def test_the_drivers_store_listens_on_its_node_address_only():
    """The store every process group rendezvouses through (`elastic.train.store.StoreServer`)
    listens where `netaddr.store_listener` bound it (the node's overlay address on a run with an
    overlay), not on every interface: here this process listens on the store's port at 127.0.0.2
    only (/proc/net/tcp{,6}: another process of the machine may hold the same port on 127.0.0.1,
    which says nothing of the store), and torch's clients reach it there."""
    import datetime

    import torch.distributed as dist

    from elastic.net.netaddr import store_listener
    from elastic.train.store import StoreServer

    fd, port = store_listener("127.0.0.2")
    store = StoreServer(fd, timeout_s=10)
    try:
        client = dist.TCPStore("127.0.0.2", port, is_master=False, timeout=datetime.timedelta(seconds=10))
        client.set("k", "v")
        assert store.multi_get(["k"]) == [b"v"]
        assert _listening_here(port) == {"127.0.0.2"}
    finally:
        store.close()


def _listening_here(port: int) -> set[str]:
    """The addresses on which this process's sockets listen at TCP `port`."""
    import socket

    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[len("socket:["):-1])
    out = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address_hex, port_hex = fields[1].split(":")
            if fields[3] == "0A" and int(port_hex, 16) == port and fields[9] in mine:   # 0A: LISTEN
                raw = bytes.fromhex(address_hex)   # 32-bit words in host (little-endian) order
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                out.add(socket.inet_ntop(family, words))
    return out


def test_a_network_lab_without_root_is_one_line_naming_the_field(monkeypatch, tmp_path, capsys):
    """`elastic launch` of a recipe with `local.network` by a user without root: exit 2 and one
    line that names the field, before any cluster or namespace exists."""
    from elastic.cli import main
    from providers.local import localnet

    before = localnet.list_namespaces()
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    code = main(["launch", "recipes/local-two-regions.yaml", "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.splitlines() == [err], err
    assert "local.network" in err and "root" in err and "Traceback" not in err
    assert new_namespaces(before) == set()


@needs_root
def test_a_killed_head_local_runs_interface_is_swept_with_its_wireguard_go():
    """The head's interface of a `head: local` cloud run (`CloudNetwork`) is claimed by its process;
    once that process is gone (a driver killed before its teardown), the sweep of `elastic down
    --orphans` removes the interface and its wireguard-go, and leaves a live run's alone."""
    import sys

    from providers.cloud import CloudNetwork, CloudProvider

    net = CloudNetwork()
    name = net.iface.ifname
    try:
        assert overlay.owner_alive(name) and name not in CloudProvider.clean_orphans_here()
        assert net.iface.exists()
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout.strip()
        (overlay.OWNERS / name).write_text(dead)
        assert name in CloudProvider.clean_orphans_here()
        assert not net.iface.exists() and not (overlay.OWNERS / name).exists()
        assert subprocess.run(["pgrep", "-f", f"wireguard-go {name}$"], capture_output=True).returncode == 1
    finally:
        net.down()
