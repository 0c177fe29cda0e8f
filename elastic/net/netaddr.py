"""Which address each service of a run binds and advertises: decided here, and only here.

A node is known to the cluster by its Ray node IP (the address its raylet registered with: the
head's `--node-ip-address`, or the address a joining VM reaches the head from). Every service a
rank offers or dials uses that address, never what the machine's hostname happens to resolve to
(often 127.0.0.1 or an address another host cannot reach):

- the driver's TCPStore (every process group rendezvouses through it) listens on, and is dialled
  at, the driver node's Ray node IP only (`store_listener`); it is loopback only when the whole
  cluster is on loopback (a local run);
- the outer (cross-replica) gloo group of a rank binds and advertises the rank node's Ray node IP.

An overlay network changes the answers here and nothing else.
"""

from __future__ import annotations


def node_ip() -> str:
    """This process's node address as the cluster knows it (Ray's node IP of the raylet it runs
    under, or of the node `ray.init` attached the driver to). Call after `ray.init` or in an actor."""
    import ray

    return ray.util.get_node_ip_address()


def store_host() -> str:
    """Host every rank dials for the driver's TCPStore: the driver node's Ray node IP (call in the
    driver). The store listens there only (`store_listener`)."""
    return node_ip()


def store_listener(host: str) -> tuple[int, int]:
    """A listening TCP socket on `host` (a free port) for the store's server: (its file
    descriptor, whose ownership passes to `elastic.train.store.StoreServer`, and its port). The
    store listens there only, not on every interface of the machine: on a run with an overlay,
    on the node's overlay address."""
    import socket

    sock = socket.create_server((host, 0), backlog=512)
    port = sock.getsockname()[1]
    return sock.detach(), port


def gloo_device(ip: str | None = None):
    """A gloo device that binds to, and advertises to its peers, `ip` (default: this rank's node
    IP). Gloo's default device advertises the hostname's address instead, which on many hosts is
    127.0.0.1: a peer on another node would dial its own loopback."""
    import torch.distributed as dist

    return dist.ProcessGroupGloo.create_device(hostname=ip or node_ip())
