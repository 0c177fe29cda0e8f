"""A one-way delay for the overlay's UDP where the kernel has no netem qdisc.

Two members of a network lab in different regions exchange WireGuard datagrams through one relay
process between them (it runs in the lab's internet namespace; `localnet.Lab.relay` starts it):
what member a sends to the relay's port `a_port` leaves from `b_port` to b's overlay endpoint
`a_delay_ms` later, and what b sends to `b_port` leaves from `a_port` to a's `b_delay_ms` later.
A side that is told the relay port to send to starts the handshake; the other learns where to
answer from that first datagram (the relay's other port, or the port its router's NAT maps it to),
as WireGuard's endpoint roaming does. The delay is constant per direction, so a FIFO per direction
keeps the order; nothing is dropped silently: a datagram the kernel refuses to send is counted and
said on stderr. TCP inside the tunnel (gloo, Ray) sees the added round-trip time end to end, as
over a long link.

Standard library only, run as a script inside a namespace:

    python delayrelay.py BIND_IP A_PORT A_ENDPOINT A_DELAY_MS B_PORT B_ENDPOINT B_DELAY_MS

Prints `ready` once both ports are bound; on SIGTERM prints what it forwarded and dropped to stderr.
"""

from __future__ import annotations

import collections
import select
import signal
import socket
import sys
import time

BUFFER_B = 16 * 1024 * 1024
"""Socket buffers: a burst at the link's rate while the loop is busy (root may exceed rmem_max)."""
BATCH = 512
"""Datagrams read from one socket per wake-up before the due ones are sent."""


def _endpoint(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def _socket(bind_ip: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for opt, fallback in ((getattr(socket, "SO_RCVBUFFORCE", 33), socket.SO_RCVBUF),
                          (getattr(socket, "SO_SNDBUFFORCE", 32), socket.SO_SNDBUF)):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, BUFFER_B)
        except PermissionError:
            sock.setsockopt(socket.SOL_SOCKET, fallback, BUFFER_B)
    sock.bind((bind_ip, port))
    sock.setblocking(False)
    return sock


def relay(bind_ip: str, a_port: int, a_endpoint: str, a_delay_ms: float, b_port: int, b_endpoint: str,
          b_delay_ms: float) -> None:
    """Forward between the two sides until terminated (see the module's docstring).

    Args:
        bind_ip: the relay's address.
        a_port, b_port: the ports side a and side b send to.
        a_endpoint, b_endpoint: "ip:port" of each side's overlay port.
        a_delay_ms, b_delay_ms: one-way delay of what each side sends, milliseconds.
    """
    sa, sb = _socket(bind_ip, a_port), _socket(bind_ip, b_port)
    # socket received on -> (socket sent from, destination, delay s, FIFO of (due, datagram))
    routes = {sa: (sb, _endpoint(b_endpoint), a_delay_ms / 1000, collections.deque()),
              sb: (sa, _endpoint(a_endpoint), b_delay_ms / 1000, collections.deque())}
    counts = {"forwarded": 0, "dropped": 0}

    def stop(_signum, _frame):
        print(f"delayrelay {a_port}/{b_port}: forwarded {counts['forwarded']}, dropped {counts['dropped']}",
              file=sys.stderr, flush=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    print("ready", flush=True)
    while True:
        heads = [q[0][0] for _, _, _, q in routes.values() if q]
        timeout = max(0.0, min(heads) - time.monotonic()) if heads else None
        readable, _, _ = select.select(list(routes), [], [], timeout)
        now = time.monotonic()
        for sock in readable:
            _out, _dest, delay_s, queue = routes[sock]
            for _ in range(BATCH):
                try:
                    queue.append((now + delay_s, sock.recv(65535)))
                except BlockingIOError:
                    break
        now = time.monotonic()
        for out, dest, _delay_s, queue in routes.values():
            while queue and queue[0][0] <= now:
                data = queue.popleft()[1]
                try:
                    out.sendto(data, dest)
                    counts["forwarded"] += 1
                except BlockingIOError:
                    # The send buffer is full: keep the datagram (and the order) for the next round.
                    queue.appendleft((now, data))
                    break
                except OSError as e:
                    counts["dropped"] += 1
                    if counts["dropped"] == 1 or counts["dropped"] % 1000 == 0:
                        print(f"delayrelay {a_port}/{b_port}: dropped {counts['dropped']} ({e})",
                              file=sys.stderr, flush=True)


if __name__ == "__main__":
    ip, ap, ae, ad, bp, be, bd = sys.argv[1:8]
    relay(ip, int(ap), ae, float(ad), int(bp), be, float(bd))
