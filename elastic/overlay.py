"""The run's overlay network: one WireGuard interface per node, peers added and revoked by the driver.

Every node of a run (head, GPU VMs, the driver's host) holds a key pair it made itself; only the
public key ever leaves the node. The driver gives each node an overlay address and tells every
node which peers to accept (public key, the endpoint where it is reachable, the overlay address it
may send from). Releasing or losing a node removes its peer everywhere, so its key no longer
reaches anyone.

The interface is kernel WireGuard where the kernel has it, otherwise the userspace
`wireguard-go` (same `wg` control tool either way). Everything here shells out to `ip`, `wg` and
`wireguard-go`, optionally inside a network namespace (the local stand-in for separate hosts).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import subprocess
import time
import zlib
from dataclasses import dataclass

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

    def up(self, address: str, private_key: str, listen_port: int = OVERLAY_PORT) -> None:
        """Create the interface with `address` on the overlay network and `private_key`."""
        try:
            _run(self.netns, "ip", "link", "add", self.ifname, "type", "wireguard")
        except OverlayError:
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

    def _start_userspace(self) -> None:
        if shutil.which("wireguard-go") is None:
            raise OverlayError("the kernel has no WireGuard and wireguard-go is not installed")
        self.userspace = True
        env = dict(os.environ, WG_PROCESS_FOREGROUND="1", LOG_LEVEL="error")
        self._proc = subprocess.Popen(_cmd(self.netns, "wireguard-go", self.ifname), env=env,
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.monotonic() + UP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace").strip()
                raise OverlayError(f"wireguard-go exited: {err or self._proc.returncode}")
            if subprocess.run(_cmd(self.netns, "wg", "show", self.ifname),
                              capture_output=True).returncode == 0:
                return
            time.sleep(0.05)   # polling for the tun device; bounded by UP_TIMEOUT_S
        self.down()
        raise OverlayError(f"wireguard-go did not create {self.ifname} within {UP_TIMEOUT_S:.0f} s")

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
