"""A lab machine's metadata server at 169.254.169.254:80 inside its network namespace, answering
as its cloud's does: EC2's IMDSv2 (a session token from `PUT /latest/api/token`, then
`/latest/meta-data/...` with it; 401 without) or Compute Engine's (`/computeMetadata/v1/...` with
`Metadata-Flavor: Google`, 403 without; `?wait_for_change=true` long polls by ETag). It serves
what the node's boot script, its watcher and the SDKs on it read, and nothing else (404).

Interruption notices are set by the lab (`notify`): EC2's `spot/instance-action`, Compute
Engine's `instance/preempted` turning TRUE."""

from __future__ import annotations

import hashlib
import http.server
import json
import secrets
import threading
import time
import urllib.parse
from datetime import datetime, timezone

from providers.lab import netns

ADDRESS = "169.254.169.254"
AWS_TOKEN_MAX_TTL_S = 21600


def _iso(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class MetadataServer:
    """One machine's metadata server.

    Args:
        netns: the machine's network namespace (169.254.169.254 is added to its loopback).
        cloud: "aws" or "gcp".
        values: path below the API's root (`meta-data/instance-id`, `instance/zone`) -> answer.
    """

    def __init__(self, netns_name: str, cloud: str, values: dict[str, str]):
        self.cloud = cloud
        self._values = dict(values)
        self._tokens: dict[str, float] = {}   # IMDSv2 session token -> expiry (monotonic s)
        self._changed = threading.Condition()
        self.requests: list[str] = []          # paths asked, in order (what the machine read)
        import subprocess
        subprocess.run(["ip", "-n", netns_name, "address", "add", f"{ADDRESS}/32", "dev", "lo"],
                       check=True, capture_output=True)
        handler = self._aws_handler() if cloud == "aws" else self._gcp_handler()
        self._server = netns.inside(netns_name, lambda: http.server.ThreadingHTTPServer((ADDRESS, 80), handler))
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                         name=f"metadata-{netns_name}", daemon=True).start()

    def set(self, path: str, value: str) -> None:
        """Change one answer (long polls waiting on it return)."""
        with self._changed:
            self._values[path] = value
            self._changed.notify_all()

    def notify(self, lead_s: float) -> None:
        """An interruption notice, the instance to go in `lead_s` seconds (EC2's two minutes,
        Compute Engine's 30 s on a real cloud)."""
        if self.cloud == "aws":
            self.set("meta-data/spot/instance-action",
                     json.dumps({"action": "terminate", "time": _iso(time.time() + lead_s)}))
        else:
            self.set("instance/preempted", "TRUE")

    def close(self) -> None:
        with self._changed:
            self._changed.notify_all()
        self._server.shutdown()
        self._server.server_close()

    def _get(self, path: str) -> str | None:
        with self._changed:
            return self._values.get(path)

    # -- EC2 IMDSv2 --------------------------------------------------------------------------------

    def _aws_handler(self):
        server = self

        class Handler(_Quiet):
            def do_PUT(self):
                ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds", "")
                if self.path != "/latest/api/token":
                    return self.answer(404)
                if not ttl.isdigit() or not 1 <= int(ttl) <= AWS_TOKEN_MAX_TTL_S:
                    return self.answer(400)
                token = secrets.token_urlsafe(32)
                server._tokens[token] = time.monotonic() + int(ttl)
                self.answer(200, token, {"X-aws-ec2-metadata-token-ttl-seconds": ttl})

            def do_GET(self):
                server.requests.append(self.path)
                expiry = server._tokens.get(self.headers.get("X-aws-ec2-metadata-token", ""))
                if expiry is None or expiry < time.monotonic():
                    return self.answer(401)
                path = self.path.removeprefix("/latest/")
                if path == "meta-data/iam/security-credentials/":
                    role = server._get("meta-data/iam/role")
                    return self.answer(200, role) if role else self.answer(404)
                value = server._get(path)
                self.answer(200, value) if value is not None else self.answer(404)

        return Handler

    # -- Compute Engine ----------------------------------------------------------------------------

    def _gcp_handler(self):
        server = self

        class Handler(_Quiet):
            def do_GET(self):
                url = urllib.parse.urlparse(self.path)
                server.requests.append(url.path)
                if self.headers.get("Metadata-Flavor") != "Google":
                    return self.answer(403, "Missing Metadata-Flavor:Google header.")
                path = url.path.removeprefix("/computeMetadata/v1/")
                query = dict(urllib.parse.parse_qsl(url.query))
                value = server._get(path)
                if value is not None and query.get("wait_for_change") == "true":
                    value = server._wait(path, query.get("last_etag"), float(query.get("timeout_sec", 300)))
                if value is None:
                    return self.answer(404)
                self.answer(200, value, {"ETag": _etag(value), "Metadata-Flavor": "Google"})

        return Handler

    def _wait(self, path: str, etag: str | None, timeout_s: float) -> str | None:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                value = self._values.get(path)
                left = deadline - time.monotonic()
                if value is None or etag is None or _etag(value) != etag or left <= 0:
                    return value
                self._changed.wait(min(left, 1.0))


def _etag(value: str) -> str:
    return hashlib.sha1(value.encode()).hexdigest()[:16]


class _Quiet(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def log_message(self, *args):
        pass

    def answer(self, status: int, body: str = "", headers: dict | None = None) -> None:
        payload = body.encode()
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


def aws_values(instance_id: str, instance_type: str, zone: str, private_ip: str, public_ip: str,
               user_data: str, role: str | None) -> dict[str, str]:
    """What EC2's IMDS says of one instance; with `role`, credentials the lab's endpoint
    recognises as that instance's (moto accepts any key; the lab's gate holds them to the node's
    policy)."""
    values = {"meta-data/instance-id": instance_id, "meta-data/instance-type": instance_type,
              "meta-data/placement/availability-zone": zone, "meta-data/placement/region": zone[:-1],
              "meta-data/local-ipv4": private_ip, "meta-data/public-ipv4": public_ip,
              "meta-data/hostname": f"ip-{private_ip.replace('.', '-')}.{zone[:-1]}.compute.internal",
              "user-data": user_data}
    if role:
        expires = _iso(time.time() + 6 * 3600)
        values["meta-data/iam/role"] = role
        values[f"meta-data/iam/security-credentials/{role}"] = json.dumps({
            "Code": "Success", "LastUpdated": _iso(time.time()), "Type": "AWS-HMAC",
            "AccessKeyId": "ASIA" + hashlib.sha1(instance_id.encode()).hexdigest()[:16].upper(),
            "SecretAccessKey": secrets.token_hex(20), "Token": secrets.token_hex(32), "Expiration": expires})
    return values


def gcp_values(name: str, instance_id: str, zone: str, project: str, private_ip: str, public_ip: str,
               startup_script: str, account: str | None, token: str | None) -> dict[str, str]:
    """What Compute Engine's metadata server says of one instance."""
    values = {"instance/id": instance_id, "instance/name": name, "instance/hostname": f"{name}.{zone}.c.{project}.internal",
              "instance/zone": f"projects/{project}/zones/{zone}", "project/project-id": project,
              "instance/network-interfaces/0/ip": private_ip,
              "instance/network-interfaces/0/access-configs/0/external-ip": public_ip,
              "instance/attributes/startup-script": startup_script,
              "instance/preempted": "FALSE", "instance/maintenance-event": "NONE"}
    if account:
        values["instance/service-accounts/default/email"] = account
    if token:
        values["instance/service-accounts/default/token"] = json.dumps(
            {"access_token": token, "expires_in": 3599, "token_type": "Bearer"})
    return values
