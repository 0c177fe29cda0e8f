"""The run's overlay network: one WireGuard interface per node, peers added and revoked by the driver.

Every node of a run (head, GPU VMs, the driver's host) holds a key pair it made itself; only the
public key ever leaves the node. The driver gives each node an overlay address and tells every
node which peers to accept (public key, the endpoint where it is reachable, the overlay address it
may send from). Releasing or losing a node removes its peer everywhere, so its key no longer
reaches anyone.

The interface is kernel WireGuard where the kernel has it, otherwise the userspace
`wireguard-go` (same `wg` control tool either way). Everything here shells out to `ip`, `wg` and
`wireguard-go`, optionally inside a network namespace (the local stand-in for separate hosts).

On clouds the driver keeps the run's `Roster` (every member's public facts) and publishes it as the
peers document in the run's Ray KV; each node's watcher applies it (`apply`), so members learn of
new peers and forget revoked ones. Who peers with whom is one pure function (`peers_for`): two
members reach each other directly when either has a public endpoint (or both sit on one private
network); two without one talk through the head, which forwards between its peers. A node runs
`python -m elastic.net.overlay up` at boot (its private key on stdin, never in a file or an argument).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

log = logging.getLogger(__name__)

OVERLAY_PORT = 51820
"""UDP port every node listens on; the only port a cloud opens to the internet."""
OVERLAY_NET = ipaddress.ip_network("100.80.0.0/16")
"""Overlay addresses (shared address space, RFC 6598): never routed on a cloud's own network."""
IFNAME = "elwg0"
"""Interface name on a node. Inside a namespace the name is derived from the namespace instead:
wireguard-go's control socket (/var/run/wireguard/<name>.sock) is shared by all namespaces."""
KEEPALIVE_S = 25
UP_TIMEOUT_S = 10.0
PEERS_KV_KEY = "elastic/overlay/peers"
"""Ray internal KV key of the run's peers document (the driver writes it, the nodes' watchers read it)."""
UAPI_DIR = Path("/var/run/wireguard")
"""Where wireguard-go listens for `wg` (<name>.sock), one directory for every network namespace."""
HEAD_IP = "100.80.0.1"
OWNERS = Path("/run/elastic/owners")
"""One file per live network lab or `head: local` overlay interface a run made on this machine,
named by its tag, holding the pid of the process that owns it: `elastic down --orphans` removes
those whose owner is gone."""
RUN_IFNAME = re.compile(r"elw[0-9a-f]{8}")
"""Names of the interfaces `head: local` runs make here (`providers.cloud.CloudNetwork`)."""


class OverlayError(RuntimeError):
    """The overlay could not be set up (missing tool, interface did not come up)."""


def overlay_ip(index: int) -> str:
    """The overlay address of the `index`-th node of a run (1 is the head)."""
    if not 0 < index < OVERLAY_NET.num_addresses - 1:
        raise ValueError(f"overlay index {index} out of range")
    return str(OVERLAY_NET.network_address + index)


def missing_tools() -> list[str]:
    """The command-line tools the overlay needs that are not on PATH."""
    return [t for t in ("ip", "wg", "wireguard-go") if shutil.which(t) is None]


@dataclass(frozen=True)
class Peer:
    """A node this node accepts traffic from and sends to.

    Args:
        public_key: its WireGuard public key (base64).
        overlay_ip: its overlay address.
        endpoint: "host:port" where its UDP port is reachable, or None when it has no public
            endpoint (it reaches us first; replies follow its source address).
        allowed_ips: overlay addresses routed to it (default: its own /32; the head also carries
            the addresses of nodes without an endpoint of their own).
    """

    public_key: str
    overlay_ip: str
    endpoint: str | None = None
    allowed_ips: tuple[str, ...] = ()


def _cmd(netns: str | None, *args: str) -> list[str]:
    return (["ip", "netns", "exec", netns] if netns else []) + list(args)


def _tail(output, lines: int = 3) -> str:
    """The last lines a process wrote to the file `output`, on one line ("no output": none)."""
    output.seek(0)
    said = [x.strip() for x in output.read().decode(errors="replace").splitlines() if x.strip()]
    return " | ".join(said[-lines:])[-500:] or "no output"


def _run(netns: str | None, *args: str, input_text: str | None = None) -> str:
    try:
        out = subprocess.run(_cmd(netns, *args), input=input_text, capture_output=True, text=True,
                             check=True, timeout=30)
    except FileNotFoundError as e:
        raise OverlayError(f"{args[0]} not found: install wireguard-tools and wireguard-go") from e
    except subprocess.CalledProcessError as e:
        raise OverlayError(f"{' '.join(args[:3])} failed: {e.stderr.strip() or e.returncode}") from e
    return out.stdout


def keypair(netns: str | None = None) -> tuple[str, str]:
    """A new (private, public) WireGuard key pair, made by `wg` on this node."""
    private = _run(netns, "wg", "genkey").strip()
    public = _run(netns, "wg", "pubkey", input_text=private + "\n").strip()
    return private, public


class Interface:
    """This node's overlay interface.

    Args:
        netns: network namespace to run in (None: the current one).
        ifname: interface name (default: IFNAME, or one derived from `netns`).
    """

    def __init__(self, netns: str | None = None, ifname: str | None = None):
        self.netns = netns
        self.ifname = ifname or (f"elw{zlib.crc32(netns.encode()):08x}" if netns else IFNAME)
        self.public_key: str | None = None
        self.userspace = False
        self._proc: subprocess.Popen | None = None

    def up(self, address: str, private_key: str, listen_port: int = OVERLAY_PORT, detach: bool = False) -> None:
        """Create the interface with `address` on the overlay network and `private_key`.

        Args:
            address: this node's overlay address.
            private_key: its WireGuard private key (given to `wg` on stdin only).
            listen_port: UDP port (0: any free one).
            detach: a userspace interface outlives this process (a node's boot script exits;
                wireguard-go daemonises itself); otherwise it is this object's child.
        """
        try:
            _run(self.netns, "ip", "link", "add", self.ifname, "type", "wireguard")
        except OverlayError:
            if detach:
                self._start_detached()
            else:
                self._start_userspace()
        try:
            _run(self.netns, "wg", "set", self.ifname, "private-key", "/dev/stdin", "listen-port",
                 str(listen_port), input_text=private_key + "\n")
            _run(self.netns, "ip", "address", "add", f"{address}/{OVERLAY_NET.prefixlen}",
                 "dev", self.ifname)
            _run(self.netns, "ip", "link", "set", self.ifname, "up")
            self.public_key = _run(self.netns, "wg", "show", self.ifname, "public-key").strip()
        except BaseException:
            self.down()
            raise

    def _start_detached(self) -> None:
        if shutil.which("wireguard-go") is None:
            raise OverlayError("the kernel has no WireGuard and wireguard-go is not installed")
        self.userspace = True
        # Without WG_PROCESS_FOREGROUND wireguard-go forks, and its parent exits once the device is up.
        _run(self.netns, "wireguard-go", self.ifname)

    def _start_userspace(self) -> None:
        if shutil.which("wireguard-go") is None:
            raise OverlayError("the kernel has no WireGuard and wireguard-go is not installed")
        self.userspace = True
        env = dict(os.environ, WG_PROCESS_FOREGROUND="1", LOG_LEVEL="error")
        # wireguard-go logs to its stdout (why it failed to start, too): kept in a file, not a
        # pipe, so that a daemon that logs on is never blocked by a pipe nobody reads.
        with tempfile.TemporaryFile() as output:
            self._proc = subprocess.Popen(_cmd(self.netns, "wireguard-go", self.ifname), env=env,
                                          stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                                          start_new_session=True)
            deadline = time.monotonic() + UP_TIMEOUT_S
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    raise OverlayError(f"wireguard-go exited with {self._proc.returncode}: {_tail(output)}")
                if _uapi_listening(self.ifname):
                    return
                time.sleep(0.05)   # polling for its control socket; bounded by UP_TIMEOUT_S
            said = _tail(output)
        self.down()
        raise OverlayError(f"wireguard-go did not create {self.ifname} within {UP_TIMEOUT_S:.0f} s: {said}")

    @property
    def pid(self) -> int | None:
        """The process id of this interface's wireguard-go (None: kernel WireGuard, or detached)."""
        return self._proc.pid if self._proc is not None else None

    def set_peer(self, peer: Peer) -> None:
        """Accept `peer` (or update its endpoint)."""
        allowed = ",".join(peer.allowed_ips or (f"{peer.overlay_ip}/32",))
        args = ["wg", "set", self.ifname, "peer", peer.public_key, "allowed-ips", allowed,
                "persistent-keepalive", str(KEEPALIVE_S)]
        if peer.endpoint:
            args += ["endpoint", peer.endpoint]
        _run(self.netns, *args)

    def remove_peer(self, public_key: str) -> None:
        """Revoke a peer: its key no longer reaches this node."""
        _run(self.netns, "wg", "set", self.ifname, "peer", public_key, "remove")

    def forward(self) -> None:
        """Forward packets between this interface's peers (the head relays for nodes that cannot
        reach each other directly); only this interface, not the host's others."""
        _run(self.netns, "sysctl", "-qw", f"net.ipv4.conf.{self.ifname}.forwarding=1")

    def exists(self) -> bool:
        """Whether the interface is there (e.g. made by the controller's boot script)."""
        return subprocess.run(_cmd(self.netns, "wg", "show", self.ifname), capture_output=True).returncode == 0

    def read_public_key(self) -> str:
        """The public key of an interface that exists already (`exists`)."""
        self.public_key = _run(self.netns, "wg", "show", self.ifname, "public-key").strip()
        return self.public_key

    def handshaken(self, public_key: str) -> bool:
        """Whether a WireGuard handshake with the peer `public_key` has completed."""
        return self.peers().get(public_key, {}).get("latest_handshake", 0) > 0

    def peers(self) -> dict[str, dict]:
        """Public key -> {endpoint, allowed_ips, latest_handshake (unix s, 0 never), rx_bytes,
        tx_bytes} as WireGuard reports them."""
        out = {}
        for line in _run(self.netns, "wg", "show", self.ifname, "dump").splitlines()[1:]:
            key, _psk, endpoint, allowed, handshake, rx, tx, _ka = line.split("\t")
            out[key] = {"endpoint": None if endpoint == "(none)" else endpoint,
                        "allowed_ips": allowed, "latest_handshake": int(handshake),
                        "rx_bytes": int(rx), "tx_bytes": int(tx)}
        return out

    def down(self) -> None:
        """Remove the interface and stop wireguard-go; safe to call twice."""
        subprocess.run(_cmd(self.netns, "ip", "link", "del", self.ifname), capture_output=True)
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.terminate()
                try:
                    self._proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
            if self._proc.stderr:
                self._proc.stderr.close()
            self._proc = None


def _uapi_listening(ifname: str) -> bool:
    """Whether wireguard-go accepts `wg` on `ifname`'s control socket yet. Asked by connecting here,
    not with `wg show`: `wg` deletes a socket that refuses it (a dead daemon's, it assumes), and
    wireguard-go's socket refuses between its bind and its listen; deleted there, wireguard-go
    exits ("Failed to listen on uapi socket: no such file or directory", seen in the suite)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(UAPI_DIR / f"{ifname}.sock"))
        except OSError:
            return False
    return True


def claim(tag: str) -> None:
    """Record this process as the owner of what is named `tag` on this machine (OWNERS)."""
    OWNERS.mkdir(parents=True, exist_ok=True)
    (OWNERS / tag).write_text(str(os.getpid()))


def disclaim(tag: str) -> None:
    """`tag` is gone: forget its owner (safe to call twice)."""
    (OWNERS / tag).unlink(missing_ok=True)


def owner_alive(tag: str) -> bool:
    """Whether the process that claimed `tag` still runs (False when none did)."""
    try:
        pid = int((OWNERS / tag).read_text())
    except (OSError, ValueError):
        return False
    return os.path.exists(f"/proc/{pid}")


def remove_orphans() -> list[str]:
    """Remove this machine's overlay interfaces of `head: local` runs whose process is gone (a
    driver killed before its teardown), with their wireguard-go; returns their names."""
    links = json.loads(_run(None, "ip", "-j", "link", "show"))
    gone = [link["ifname"] for link in links
            if RUN_IFNAME.fullmatch(link["ifname"]) and not owner_alive(link["ifname"])]
    for name in gone:
        subprocess.run(["ip", "link", "del", name], capture_output=True)
        # A detached wireguard-go outlives its tun only until its next read; do not wait for that.
        out = subprocess.run(["pgrep", "-f", f"wireguard-go {name}$"], capture_output=True, text=True).stdout
        for pid in out.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        disclaim(name)
    return gone


# -- the run's roster: who is on the overlay, and who peers with whom ------------------------------

@dataclass(frozen=True)
class Member:
    """A node of a run's overlay, as the peers document lists it: public facts only.

    Args:
        name: the node's name (its instance id; `head` for the head).
        overlay_ip: its overlay address.
        public_key: its WireGuard public key (base64).
        endpoint: "ip:port" where the internet reaches its overlay port (a VM's public address),
            or None (no public address: it is reached through the head, or dials out itself).
        site: the private network it sits on (`aws/us-east-1`, `gcp/default`); members of one site
            with a `private_endpoint` each reach each other there, not over the internet.
        private_endpoint: "ip:port" of its overlay port on its site's private network, or None.
    """

    name: str
    overlay_ip: str
    public_key: str
    endpoint: str | None = None
    site: str = ""
    private_endpoint: str | None = None


def _direct(a: Member, b: Member) -> str | None:
    """How `a` reaches `b` directly: b's endpoint as seen from a ("" when b must dial a: only a has
    an endpoint), or None when neither can start a handshake with the other."""
    if a.site and a.site == b.site and a.private_endpoint and b.private_endpoint:
        return b.private_endpoint
    if b.endpoint:
        return b.endpoint
    return "" if a.endpoint else None


def peers_for(me: Member, members: Sequence[Member], head_ip: str = HEAD_IP) -> list[Peer]:
    """The WireGuard peers `me` should hold in a run of `members` (pure).

    Mesh: every pair of members that can reach each other directly (either has a public
    endpoint, or both sit on one site's private network) are peers of each other, so traffic
    between two VMs with public addresses never passes the head. Two members that cannot (neither
    has an endpoint) talk through the head: the other's /32 rides on the head's peer entry
    (`allowed_ips`), and the head forwards between its peers. The head peers with everyone.
    """
    head = next((m for m in members if m.overlay_ip == head_ip), None)
    relayed: list[str] = []
    out: list[Peer] = []
    for other in members:
        if other.public_key == me.public_key:
            continue
        how = _direct(me, other)
        if how is None and head is not None and head_ip not in (me.overlay_ip, other.overlay_ip):
            relayed.append(f"{other.overlay_ip}/32")
            continue
        out.append(Peer(other.public_key, other.overlay_ip, how or None))
    if relayed:
        out = [Peer(p.public_key, p.overlay_ip, p.endpoint, (f"{p.overlay_ip}/32", *relayed))
               if p.overlay_ip == head_ip else p for p in out]
    return out


def encode_members(members: Sequence[Member]) -> str:
    """The peers document: JSON, one object per member (public keys and addresses only)."""
    return json.dumps([asdict(m) for m in sorted(members, key=lambda m: m.overlay_ip)], sort_keys=True)


def decode_members(doc: str) -> list[Member]:
    return [Member(**m) for m in json.loads(doc)]


def apply(iface: Interface, me: Member, members: Sequence[Member], head_ip: str = HEAD_IP) -> list[str]:
    """Bring `iface`'s peers to what `peers_for(me, members)` says: add missing peers, update
    routes that changed, revoke keys no longer listed. An endpoint WireGuard learnt by roaming is
    left alone. Returns the public keys revoked."""
    current = iface.peers()
    wanted = peers_for(me, members, head_ip)
    for peer in wanted:
        have = current.get(peer.public_key)
        allowed = ",".join(peer.allowed_ips or (f"{peer.overlay_ip}/32",))
        if have is None or sorted(have["allowed_ips"].split(",")) != sorted(allowed.split(",")) \
                or (peer.endpoint and not have["endpoint"]):
            iface.set_peer(peer)
    keep = {p.public_key for p in wanted}
    revoked = [key for key in current if key not in keep]
    for key in revoked:
        iface.remove_peer(key)
    return revoked


class Roster:
    """The driver's list of a run's overlay members; every change is applied to the head's own
    interface and handed to `publish` (the peers document, for the nodes' watchers).

    Args:
        head: the head as a member (overlay address HEAD_IP).
        iface: the head's interface (None: nothing to apply here, e.g. in a unit test).
        publish: called with the peers document after each change (None: not published).
    """

    def __init__(self, head: Member, iface: Interface | None = None,
                 publish: Callable[[str], None] | None = None):
        self.head = head
        self._iface = iface
        self._publish = publish
        self._members: dict[str, Member] = {head.name: head}
        self._lock = threading.Lock()
        self._next = ipaddress.ip_address(head.overlay_ip) + 1
        self._free: list[str] = []

    def allocate_ip(self) -> str:
        """An overlay address no member holds (a released node's address is reused)."""
        with self._lock:
            if self._free:
                return self._free.pop(0)
            ip = self._next
            if ip not in OVERLAY_NET or ip == OVERLAY_NET.broadcast_address:
                raise OverlayError("the overlay's addresses are used up")
            self._next += 1
            return str(ip)

    def release_ip(self, ip: str) -> None:
        """Give back an address `allocate_ip` handed out that never joined."""
        with self._lock:
            if ip not in self._free and all(m.overlay_ip != ip for m in self._members.values()):
                self._free.append(ip)

    def add(self, member: Member) -> None:
        """Admit `member` (replacing one of the same name)."""
        with self._lock:
            self._members[member.name] = member
            self._changed()

    def remove(self, name: str) -> Member | None:
        """Revoke the member `name`: its key leaves the head at once and every node with its next
        poll of the peers document. Returns it (None when unknown)."""
        with self._lock:
            member = self._members.pop(name, None) if name != self.head.name else None
            if member is not None:
                self._free.append(member.overlay_ip)
                self._changed()
            return member

    def members(self) -> list[Member]:
        with self._lock:
            return list(self._members.values())

    def _changed(self) -> None:
        members = list(self._members.values())
        if self._iface is not None:
            apply(self._iface, self.head, members, self.head.overlay_ip)
        if self._publish is not None:
            self._publish(encode_members(members))


# -- a node's side --------------------------------------------------------------------------------

def _peer_arg(text: str) -> Peer:
    key, _, rest = text.partition(",")
    ip, _, endpoint = rest.partition(",")
    if not key or not ip:
        raise argparse.ArgumentTypeError(f"--peer {text!r}: expected KEY,OVERLAY_IP[,HOST:PORT]")
    return Peer(key, ip, endpoint or None)


def wait_handshake(iface: Interface, public_key: str, timeout_s: float) -> bool:
    """Poll until `iface` completed a handshake with `public_key`; False after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not iface.handshaken(public_key):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)   # polling WireGuard's handshake time, bounded by timeout_s
    return True


def main(argv: list[str] | None = None) -> int:
    """`python -m elastic.net.overlay up`: bring this node's interface up (private key on stdin, or made
    here with --new-key), add the first peer (the head), wait for its handshake, print the public key."""
    p = argparse.ArgumentParser(prog="python -m elastic.net.overlay", description="this node's overlay interface")
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="create the interface")
    up.add_argument("--address", required=True, help="this node's overlay address")
    up.add_argument("--listen-port", type=int, default=OVERLAY_PORT)
    up.add_argument("--ifname", default=IFNAME)
    up.add_argument("--new-key", action="store_true", help="make the key pair here instead of reading stdin")
    up.add_argument("--peer", type=_peer_arg, help="KEY,OVERLAY_IP[,HOST:PORT] of the head")
    up.add_argument("--wait-handshake-s", type=float, default=0.0)
    up.add_argument("--forward", action="store_true", help="forward between peers (the head relays)")
    args = p.parse_args(argv)
    private = keypair()[0] if args.new_key else sys.stdin.readline().strip()
    if not private:
        print("elastic.net.overlay: no private key on stdin", file=sys.stderr)
        return 2
    iface = Interface(ifname=args.ifname)
    iface.up(args.address, private, listen_port=args.listen_port, detach=True)
    del private
    if args.forward:
        iface.forward()
    if args.peer is not None:
        iface.set_peer(args.peer)
        if args.wait_handshake_s and not wait_handshake(iface, args.peer.public_key, args.wait_handshake_s):
            print(f"elastic.net.overlay: no handshake with {args.peer.overlay_ip} within "
                  f"{args.wait_handshake_s:g} s", file=sys.stderr)
            return 1
    print(iface.public_key)
    return 0


if __name__ == "__main__":
    sys.exit(main())
