"""On an EC2 node: the watcher's notice poller (IMDSv2: a spot interruption or a rebalance
recommendation) and the VM ending itself. The metadata base URL comes from `ELASTIC_IMDS_URL`
(default: the link-local address), so tests point it at a local server. Standard library only."""

from __future__ import annotations

import json
import logging
import os
import urllib.error
import urllib.request
from datetime import datetime

log = logging.getLogger(__name__)

DEFAULT_IMDS_URL = "http://169.254.169.254"
AWS_TOKEN_TTL_S = 21600
BLOCKING = False   # one look per call; the watcher pauses between two


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


def poll(base: str | None = None) -> dict | None:
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


def terminate_self(instance_id: str) -> bool:
    """Never through the API: a node's role may not call TerminateInstances (`infra/aws/node-policy.json`
    grants it none). The OS shutdown ends the VM instead: VMs are launched with
    InstanceInitiatedShutdownBehavior terminate. Always False."""
    return False
