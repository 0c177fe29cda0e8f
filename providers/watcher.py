"""The instance watcher: runs on each cloud node (started by the bootstrap script), polls the
cloud's metadata server for an interruption notice every 5 s, and forwards the first one to the
driver through the Ray cluster (internal KV key `elastic/notice/<instance id>`; read by
`providers.cloud.CloudProvider.events`).

It also shuts its VM down when the driver's heartbeat (`beat`, a unix time the driver puts in the
cluster's KV every few seconds) has not changed for `--autodown-after-s`: a driver killed with
`kill -9`, an OOM kill or a closed SSH session releases nothing itself, so every VM ends itself
(AWS launches VMs with InstanceInitiatedShutdownBehavior=terminate; a GCP VM stops, and its
max run duration deletes it). The heartbeat being unreadable (the head gone) counts as no change.

On a run with an overlay (`--overlay-ip`), each round it also reads the run's peers document
(`elastic.net.overlay.PEERS_KV_KEY`, written by the driver) and applies it to this node's WireGuard
interface: new members become peers, revoked keys are removed.

Each cloud's own half lives in its provider's directory (`providers/<cloud>/watcher.py`: the
metadata poller and how a VM ends itself); AWS reads IMDSv2 at `ELASTIC_IMDS_URL`, GCP long-polls
its metadata server at `ELASTIC_GCP_METADATA_URL` (so the loop does not pause between polls
there), which the tests point at local servers. Standard library only, besides Ray.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import time

log = logging.getLogger(__name__)

POLL_S = 5.0
HEARTBEAT_KV_KEY = "elastic/driver-heartbeat"
HALT_CMD = ["shutdown", "-h", "now"]
KV_TIMEOUT_S = 5.0           # one read of the heartbeat or the peers, at most
GCS_RECONNECT_S = 10 ** 9    # Ray's reconnect timeout for the watcher's client: never


def connect(address: str) -> None:
    """Reach the cluster's KV through a bare GCS client, not `ray.init`: a Ray driver process is
    ended by Ray when its head goes away, and this one must outlive the head to shut the VM down.
    A bare client too ends its process once the head has been unreachable for Ray's reconnect
    timeout (60 s), which a head dying with its driver (`head: local`) always is: the watcher
    gives Ray a timeout it never reaches, and bounds each read itself (`KV_TIMEOUT_S`)."""
    os.environ["RAY_gcs_rpc_server_reconnect_timeout_s"] = str(GCS_RECONNECT_S)
    import ray
    from ray.experimental import internal_kv

    internal_kv._initialize_internal_kv(ray._raylet.GcsClient(address=address))


def _kv_get(key: str) -> bytes | None:
    """One read of the cluster's KV, given up after KV_TIMEOUT_S (raises)."""
    from ray.experimental import internal_kv

    return internal_kv.global_gcs_client.internal_kv_get(key.encode(), None, timeout=KV_TIMEOUT_S)


def beat(now: float | None = None) -> None:
    """The driver's heartbeat: its unix time in the cluster's KV (the driver calls this often)."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(HEARTBEAT_KV_KEY, repr(time.time() if now is None else now), overwrite=True)


def read_beat() -> str | None:
    """The driver's last heartbeat as stored, or None when it cannot be read (the head is gone)."""
    try:
        value = _kv_get(HEARTBEAT_KV_KEY)
    except Exception:   # any failure to reach the cluster is a missing heartbeat
        return None
    return value.decode() if value is not None else None


class Autodown:
    """When the driver is gone: the heartbeat unchanged (or unreadable) for `after_s` seconds.
    Judged by this VM's own monotonic clock, never by comparing clocks across machines.

    Args:
        after_s: `resources.autodown_after_s`.
        now_s: the monotonic time the watch starts (a driver that never beats counts from it).
    """

    def __init__(self, after_s: float, now_s: float):
        self.after_s = after_s
        self._beat: str | None = None
        self._changed_s = now_s

    def due(self, beat_value: str | None, now_s: float) -> bool:
        """Record the heartbeat read at `now_s`; True once the driver counts as gone."""
        if beat_value is not None and beat_value != self._beat:
            self._beat, self._changed_s = beat_value, now_s
        return now_s - self._changed_s >= self.after_s


def halt() -> None:
    """Shut this VM down: `ELASTIC_HALT_CMD` (whitespace-separated), default `shutdown -h now`."""
    cmd = os.environ.get("ELASTIC_HALT_CMD", "").split() or HALT_CMD
    subprocess.run(cmd, check=False)


def end_self(cloud: str, instance_id: str) -> None:
    """End this VM now: through its cloud's API where the VM may (`providers/<cloud>/watcher.py`'s
    `terminate_self`: a GCP VM deletes itself, disk included), else the OS shutdown (AWS VMs are
    launched with InstanceInitiatedShutdownBehavior terminate; a GCP VM stops: no GPU or vCPU
    billing, and `elastic down --orphans` or its max run duration deletes it)."""
    if not cloud_watcher(cloud).terminate_self(instance_id):
        halt()


def forward(instance_id: str, notice: dict) -> None:
    """Hand a notice to the driver: the run's Ray cluster KV (the node is connected to it)."""
    from ray.experimental import internal_kv

    from providers.cloud import NOTICE_KV_PREFIX

    internal_kv._internal_kv_put(NOTICE_KV_PREFIX + instance_id, json.dumps(notice), overwrite=True)


def _watcher_module(cloud: str) -> str:
    from providers import PROVIDERS

    return PROVIDERS[cloud].partition(":")[0].rpartition(".")[0] + ".watcher"


def watched_clouds() -> list[str]:
    """Clouds whose VMs run this watcher: those whose provider directory has a `watcher.py`."""
    import importlib.util

    from providers import PROVIDERS

    return sorted(c for c in PROVIDERS if importlib.util.find_spec(_watcher_module(c)) is not None)


def cloud_watcher(cloud: str):
    """The node-side module of `cloud`'s provider (`providers/<cloud>/watcher.py`): `poll()` (one
    look at the metadata server: a notice dict or None), `BLOCKING` (whether `poll` waits for the
    notice itself) and `terminate_self(instance_id)` (True when the VM ended itself via the API)."""
    import importlib

    return importlib.import_module(_watcher_module(cloud))


def read_peers() -> str | None:
    """The run's peers document as the driver last published it, or None (unreadable, or none yet)."""
    try:
        from elastic.net.overlay import PEERS_KV_KEY

        value = _kv_get(PEERS_KV_KEY)
    except Exception:   # the head unreachable: keep the peers as they are
        return None
    return value.decode() if value is not None else None


class PeerSync:
    """Applies the peers document to this node's interface when it changed.

    Args:
        overlay_ip: this node's overlay address (it finds itself in the document by it).
        iface: its interface (default: `elastic.net.overlay.IFNAME`).
    """

    def __init__(self, overlay_ip: str, iface=None):
        from elastic.net import overlay
        self.overlay_ip = overlay_ip
        self.iface = iface or overlay.Interface(ifname=overlay.IFNAME)
        self._applied: str | None = None

    def sync(self, doc: str | None) -> None:
        from elastic.net import overlay
        if doc is None or doc == self._applied:
            return
        members = overlay.decode_members(doc)
        me = next((m for m in members if m.overlay_ip == self.overlay_ip), None)
        if me is None:   # not (or no longer) a member: the driver revoked this node
            return
        revoked = overlay.apply(self.iface, me, members)
        if revoked:
            log.info("overlay: revoked %d peer(s)", len(revoked))
        self._applied = doc


def watch(cloud: str, instance_id: str, send=forward, poll_s: float = POLL_S, stop=None,
          autodown_after_s: float | None = None, on_driver_gone=None, poll=None,
          peers: PeerSync | None = None) -> None:
    """Poll until a notice comes (forward it, keep watching for an interruption after a
    rebalance) or `stop` is set. Metadata errors are logged and retried. With `autodown_after_s`,
    also read the driver's heartbeat each round, and call `on_driver_gone` (shut the VM down) and
    return once it has not changed for that long (default: `end_self`); after a notice, only that
    (and the peers) goes on: the driver may leave the VM for its cloud to reclaim at the deadline
    (`node_left_to_cloud`), and should the driver die and the reclaim not come, the VM still ends
    itself. `poll`: the cloud's poller (default: its watcher module's `poll`). `peers`: keeps the
    overlay's peers in step with the driver's document."""
    poll = poll or cloud_watcher(cloud).poll
    sent = set()
    autodown = Autodown(autodown_after_s, time.monotonic()) if autodown_after_s else None
    while stop is None or not stop.is_set():
        if autodown is not None and autodown.due(read_beat(), time.monotonic()):
            log.warning("no heartbeat from the driver for %.0f s: shutting this VM down", autodown.after_s)
            (on_driver_gone or (lambda: end_self(cloud, instance_id)))()
            return
        if peers is not None:
            try:
                peers.sync(read_peers())
            except Exception as exc:   # a failed `wg set` is retried with the next round
                log.warning("overlay: peers not applied: %s", exc)
        notice = None
        if "notice" not in sent:   # (a blocking poller would wait for a change that never comes)
            try:
                notice = poll()
            except (OSError, ValueError, KeyError) as exc:
                log.warning("metadata poll failed: %s", exc)
        if notice is not None and notice["kind"] not in sent:
            send(instance_id, notice)
            sent.add(notice["kind"])
            if notice["kind"] == "notice" and autodown is None:
                return   # nothing left to watch: the driver or the cloud ends the VM
        if stop is not None:
            if stop.wait(poll_s):
                return
        else:
            time.sleep(poll_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cloud", required=True, choices=watched_clouds())
    p.add_argument("--instance-id", required=True)
    p.add_argument("--address", required=True, help="the run's Ray head, HOST:PORT")
    p.add_argument("--overlay-ip", default=None, help="this node's overlay address: apply the run's peers document")
    p.add_argument("--autodown-after-s", type=float, default=None,
                   help="shut this VM down when the driver's heartbeat stops for this long")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    connect(args.address)
    watch(args.cloud, args.instance_id, poll_s=0.0 if cloud_watcher(args.cloud).BLOCKING else POLL_S,
          autodown_after_s=args.autodown_after_s, peers=PeerSync(args.overlay_ip) if args.overlay_ip else None)


if __name__ == "__main__":
    main()
