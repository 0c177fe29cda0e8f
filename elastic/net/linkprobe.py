"""Measured links: round-trip time and throughput between two nodes of a run, over the addresses Ray
knows them by (their overlay addresses on a run with an overlay, elastic/net/netaddr.py).

A zero-CPU actor on the peer node listens on its node address and answers small messages, then
counts the bytes of a bulk transfer; a zero-CPU task on the measured node pings it and sends for
`duration_s`. The driver runs one measurement when a node joins, to a held node on another site
(`link_measured` in the ledger);
the market turns the measurements into sync seconds per pair of sites, which the planner uses
instead of its guess (`planner.cross_region_sync_s`).
"""

from __future__ import annotations

import socket
import statistics
import struct
import threading
import time

PINGS = 10
DURATION_S = 2.0
CHUNK_BYTES = 256 * 1024
TIMEOUT_S = 30.0


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError("peer closed the connection")
        buf += part
    return buf


class _Sink:
    """The peer's side: echoes PINGS one-byte messages, then counts bytes until the sender closes
    its half, and answers the count (8 bytes)."""

    def __init__(self):
        from elastic.net.netaddr import node_ip

        self._server = socket.create_server((node_ip(), 0))
        self._server.settimeout(TIMEOUT_S)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def address(self) -> tuple[str, int]:
        return self._server.getsockname()[:2]

    def _serve(self) -> None:
        try:
            conn, _ = self._server.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(TIMEOUT_S)
            for _ in range(PINGS):
                conn.sendall(_recv_exact(conn, 1))
            total = 0
            while part := conn.recv(CHUNK_BYTES):
                total += len(part)
            conn.sendall(struct.pack("!Q", total))
        self._server.close()


def _probe(host: str, port: int, duration_s: float) -> dict:
    """The measured node's side: PINGS round trips, then `duration_s` of bulk sending."""
    with socket.create_connection((host, port), timeout=TIMEOUT_S) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = []
        for _ in range(PINGS):
            t0 = time.perf_counter()
            sock.sendall(b"p")
            _recv_exact(sock, 1)
            rtts.append(time.perf_counter() - t0)
        chunk = bytes(CHUNK_BYTES)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < duration_s:
            sock.sendall(chunk)
        sock.shutdown(socket.SHUT_WR)
        received = struct.unpack("!Q", _recv_exact(sock, 8))[0]   # the peer has all of it now
        elapsed = time.perf_counter() - t0
    return {"rtt_ms": round(statistics.median(rtts) * 1000, 3),
            "mbit_s": round(received * 8 / elapsed / 1e6, 3), "duration_s": round(elapsed, 3)}


def measure(node_id: str, peer_node_id: str, duration_s: float | None = None) -> dict:
    """RTT (median of PINGS, ms) and throughput (Mbit/s, over `duration_s`, default DURATION_S) from
    Ray node `node_id` to `peer_node_id`, over their node addresses. Call from the driver (attached
    to the cluster)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    def on(node):
        return NodeAffinitySchedulingStrategy(node, soft=False)

    sink = ray.remote(num_cpus=0)(_Sink).options(scheduling_strategy=on(peer_node_id)).remote()
    try:
        host, port = ray.get(sink.address.remote(), timeout=TIMEOUT_S)
        probe = ray.remote(num_cpus=0)(_probe).options(scheduling_strategy=on(node_id))
        duration_s = DURATION_S if duration_s is None else duration_s
        return ray.get(probe.remote(host, port, duration_s), timeout=TIMEOUT_S + duration_s)
    finally:
        ray.kill(sink)
