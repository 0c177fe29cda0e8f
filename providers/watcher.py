"""The instance watcher: runs on each cloud node (started by the bootstrap script), polls the
cloud's metadata server for an interruption notice every 5 s, and forwards the first one to the
driver through the Ray cluster (internal KV key `elastic/notice/<instance id>`; read by
`providers.cloud.CloudProvider.events`).

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
import time
import urllib.error
import urllib.request
from datetime import datetime

log = logging.getLogger(__name__)

POLL_S = 5.0
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


def forward(instance_id: str, notice: dict) -> None:
    """Hand a notice to the driver: the run's Ray cluster KV (the node is connected to it)."""
    from ray.experimental import internal_kv

    from providers.cloud import NOTICE_KV_PREFIX

    internal_kv._internal_kv_put(NOTICE_KV_PREFIX + instance_id, json.dumps(notice), overwrite=True)


def watch(cloud: str, instance_id: str, send=forward, poll_s: float = POLL_S, stop=None) -> None:
    """Poll until a notice comes (forward it, keep watching for an interruption after a
    rebalance) or `stop` is set. Metadata errors are logged and retried."""
    poll = POLLERS[cloud]
    sent = set()
    while stop is None or not stop.is_set():
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
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    import ray

    ray.init(address=args.address, log_to_driver=False)
    watch(args.cloud, args.instance_id, poll_s=0.0 if args.cloud in BLOCKING_POLLERS else POLL_S)


if __name__ == "__main__":
    main()
