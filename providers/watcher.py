"""The instance watcher: runs on each cloud node (started by the bootstrap script), polls the
cloud's metadata server for an interruption notice every 5 s, and forwards the first one to the
driver through the Ray cluster (internal KV key `elastic/notice/<instance id>`; read by
`providers.cloud.CloudProvider.events`).

It also shuts its VM down when the driver's heartbeat (`beat`, a unix time the driver puts in the
cluster's KV every few seconds) has not changed for `--autodown-after-s`: a driver killed with
`kill -9`, an OOM kill or a closed SSH session releases nothing itself, so every VM ends itself
(AWS launches VMs with InstanceInitiatedShutdownBehavior=terminate; a GCP VM stops, and its
max run duration deletes it). The heartbeat being unreadable (the head gone) counts as no change.

The metadata base URL comes from `ELASTIC_IMDS_URL` (default: the link-local address every cloud
uses), so the watcher can be pointed at a test server. On GCP the poller long-polls the metadata
server instead (`providers.gcp.MetadataWatch`, base URL `ELASTIC_GCP_METADATA_URL`), so the loop
does not pause between polls there. Standard library only, besides Ray.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime

log = logging.getLogger(__name__)

POLL_S = 5.0
HEARTBEAT_KV_KEY = "elastic/driver-heartbeat"
HALT_CMD = ["shutdown", "-h", "now"]
DEFAULT_IMDS_URL = "http://169.254.169.254"
AWS_TOKEN_TTL_S = 21600


def imds_url() -> str:
    return os.environ.get("ELASTIC_IMDS_URL", DEFAULT_IMDS_URL).rstrip("/")


def _http(method: str, url: str, headers: dict, timeout_s: float = 2.0) -> tuple[int, str]:
    req = urllib.request.Request(url, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def _unix(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def poll_aws(base: str | None = None) -> dict | None:
    """One IMDSv2 look: a session token (PUT /latest/api/token), then
    `spot/instance-action` (a spot interruption: `{"action": "terminate", "time": ISO}`) and
    `events/recommendations/rebalance` (elevated risk: `{"noticeTime": ISO}`). Returns
    `{"kind": "notice", "deadline": unix, "action": ...}`, `{"kind": "rebalance", "at": unix}`
    or None (404: nothing pending)."""
    base = base or imds_url()
    status, token = _http("PUT", f"{base}/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_S)})
    if status != 200:
        raise OSError(f"IMDSv2 token request answered {status}")
    headers = {"X-aws-ec2-metadata-token": token}
    status, body = _http("GET", f"{base}/latest/meta-data/spot/instance-action", headers)
    if status == 200 and body:
        doc = json.loads(body)
        return {"kind": "notice", "deadline": _unix(doc["time"]), "action": doc.get("action", "terminate")}
    status, body = _http("GET", f"{base}/latest/meta-data/events/recommendations/rebalance", headers)
    if status == 200 and body:
        return {"kind": "rebalance", "at": _unix(json.loads(body)["noticeTime"])}
    return None


def poll_gcp(base: str | None = None) -> dict | None:
    """GCP: waits up to POLL_S on the metadata server's `instance/preempted` and
    `instance/maintenance-event` long polls (`providers.gcp.MetadataWatch`); the notice as soon as
    it comes, else None."""
    from providers.gcp import poll_gcp as poll

    return poll(base, wait_s=POLL_S)


POLLERS = {"aws": poll_aws, "gcp": poll_gcp}
# Pollers that wait for the notice themselves (long polls): no pause between two calls.
BLOCKING_POLLERS = {"gcp"}


def connect(address: str) -> None:
    """Reach the cluster's KV through a bare GCS client, not `ray.init`: a Ray driver process is
    ended by Ray when its head goes away, and this one must outlive the head to shut the VM down."""
    import ray
    from ray.experimental import internal_kv

    internal_kv._initialize_internal_kv(ray._raylet.GcsClient(address=address))


def beat(now: float | None = None) -> None:
    """The driver's heartbeat: its unix time in the cluster's KV (the driver calls this often)."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(HEARTBEAT_KV_KEY, repr(time.time() if now is None else now), overwrite=True)


def read_beat() -> str | None:
    """The driver's last heartbeat as stored, or None when it cannot be read (the head is gone)."""
    try:
        from ray.experimental import internal_kv

        value = internal_kv._internal_kv_get(HEARTBEAT_KV_KEY)
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
    """End this VM now. AWS: TerminateInstances on itself where the VM's role allows it, else the
    OS shutdown, which terminates it (VMs are launched with InstanceInitiatedShutdownBehavior
    terminate; `infra/aws/node-policy.json` grants no TerminateInstances, so shutdown is the path
    there). GCP: instances.delete on itself with the VM's own service account (a token from the
    metadata server), so its disk goes too; where that is refused, the OS shutdown (the VM stops:
    no GPU or vCPU billing; `elastic down --orphans` deletes it)."""
    if cloud == "aws":
        try:
            import boto3

            base = imds_url()
            _, token = _http("PUT", f"{base}/latest/api/token",
                             {"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_S)})
            _, region = _http("GET", f"{base}/latest/meta-data/placement/region", {"X-aws-ec2-metadata-token": token})
            boto3.client("ec2", region_name=region).terminate_instances(InstanceIds=[instance_id])
            log.warning("terminated %s (itself)", instance_id)
            return
        except Exception as exc:   # no boto3, no region, refused: the shutdown below ends it too
            log.warning("could not terminate itself through the API (%s): shutting down", exc)
    elif cloud == "gcp":
        try:
            delete_gcp_self(instance_id)
            log.warning("deleted %s (itself)", instance_id)
            return
        except Exception as exc:   # no service account, refused, API out of reach: stop it at least
            log.warning("could not delete itself through the API (%s): shutting down", exc)
    halt()


def delete_gcp_self(name: str) -> None:
    """DELETE this GCP VM through the Compute API, as the VM's own service account: project, zone
    and an access token come from the metadata server. The API is `ELASTIC_GCP_COMPUTE_ENDPOINT`
    only when that is loopback (tests); the token goes nowhere else than Google's API."""
    from providers.gcp import COMPUTE_ENDPOINT_ENV, METADATA_URL, METADATA_URL_ENV

    base = os.environ.get(METADATA_URL_ENV, METADATA_URL).rstrip("/")

    def read(path: str) -> str:
        status, value = _http("GET", f"{base}/{path}", {"Metadata-Flavor": "Google"})
        if status != 200:
            raise OSError(f"metadata {path}: HTTP {status}")
        return value

    project, zone = read("project/project-id"), read("instance/zone")
    token = read("instance/service-accounts/default/token")
    endpoint = os.environ.get(COMPUTE_ENDPOINT_ENV, "")
    host = urllib.parse.urlparse(endpoint).hostname if endpoint else None
    api = endpoint.rstrip("/") if host in ("127.0.0.1", "localhost", "::1") else "https://compute.googleapis.com"
    status, body = _http("DELETE", f"{api}/compute/v1/projects/{project}/zones/{zone.rsplit('/', 1)[-1]}"
                                   f"/instances/{name}",
                         {"Authorization": f"Bearer {json.loads(token)['access_token']}"}, timeout_s=30.0)
    if status >= 300:
        raise OSError(f"instances.delete answered {status}: {body[:200]}")


def forward(instance_id: str, notice: dict) -> None:
    """Hand a notice to the driver: the run's Ray cluster KV (the node is connected to it)."""
    from ray.experimental import internal_kv

    from providers.cloud import NOTICE_KV_PREFIX

    internal_kv._internal_kv_put(NOTICE_KV_PREFIX + instance_id, json.dumps(notice), overwrite=True)


def watch(cloud: str, instance_id: str, send=forward, poll_s: float = POLL_S, stop=None,
          autodown_after_s: float | None = None, on_driver_gone=None) -> None:
    """Poll until a notice comes (forward it, keep watching for an interruption after a
    rebalance) or `stop` is set. Metadata errors are logged and retried. With `autodown_after_s`,
    also read the driver's heartbeat each round, and call `on_driver_gone` (shut the VM down) and
    return once it has not changed for that long (default: `end_self`)."""
    poll = POLLERS[cloud]
    sent = set()
    autodown = Autodown(autodown_after_s, time.monotonic()) if autodown_after_s else None
    while stop is None or not stop.is_set():
        if autodown is not None and autodown.due(read_beat(), time.monotonic()):
            log.warning("no heartbeat from the driver for %.0f s: shutting this VM down", autodown.after_s)
            (on_driver_gone or (lambda: end_self(cloud, instance_id)))()
            return
        try:
            notice = poll()
        except (OSError, ValueError, KeyError) as exc:
            log.warning("metadata poll failed: %s", exc)
            notice = None
        if notice is not None and notice["kind"] not in sent:
            send(instance_id, notice)
            sent.add(notice["kind"])
            if notice["kind"] == "notice":
                return
        if stop is not None:
            if stop.wait(poll_s):
                return
        else:
            time.sleep(poll_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cloud", required=True, choices=sorted(POLLERS))
    p.add_argument("--instance-id", required=True)
    p.add_argument("--address", required=True, help="the run's Ray head, HOST:PORT")
    p.add_argument("--autodown-after-s", type=float, default=None,
                   help="shut this VM down when the driver's heartbeat stops for this long")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    connect(args.address)
    watch(args.cloud, args.instance_id, poll_s=0.0 if args.cloud in BLOCKING_POLLERS else POLL_S,
          autodown_after_s=args.autodown_after_s)


if __name__ == "__main__":
    main()
