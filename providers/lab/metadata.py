"""A lab machine's metadata server at 169.254.169.254:80 inside its network namespace, answering
as its cloud's does: EC2's IMDSv2 (a session token from `PUT /latest/api/token`, then
`/latest/meta-data/...` with it; 401 without) or Compute Engine's (`/computeMetadata/v1/...` with
`Metadata-Flavor: Google`, 403 without; `?wait_for_change=true` long polls by ETag). It serves
what the node's boot script, its watcher and the SDKs on it read, and nothing else (404).

Interruption notices are set by the lab (`notify`): EC2's `spot/instance-action`, Compute
Engine's `instance/preempted` turning TRUE.

Each server is a process of its own in its machine's namespace (`MetadataServer` starts it),
answering from a file the lab writes."""

from __future__ import annotations

import argparse
import hashlib
import http.server
import json
import os
import secrets
import subprocess
import sys
import threading
import time
import urllib.parse
from datetime import datetime, timezone
from pathlib import Path

ADDRESS = "169.254.169.254"
AWS_TOKEN_MAX_TTL_S = 21600
READY_TIMEOUT_S = 60.0   # a Python start on a busy host
WAIT_POLL_S = 0.2
PARENT_POLL_S = 1.0
REPO = Path(__file__).resolve().parents[2]


def _iso(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class MetadataServer:
    """One machine's metadata server: a process of its own inside the machine's network namespace
    (`python -m providers.lab.metadata`), so that it answers in time whatever the process that
    booted the machine is busy with (the SDKs on a VM give IMDS one second). It serves the answers
    in `values.json` beside it and rereads them when the file changes (`set`, `notify`, or anyone
    writing the file); it ends with the process that started it.

    Args:
        netns_name: the machine's network namespace (169.254.169.254 is added to its loopback).
        cloud: "aws" or "gcp".
        values: path below the API's root (`meta-data/instance-id`, `instance/zone`) -> answer.
        root: a directory of its own: `values.json` (its answers), `requests` (the paths asked,
            one a line: what the machine read), `log` (its errors).
    """

    def __init__(self, netns_name: str, cloud: str, values: dict[str, str], root: Path):
        self.cloud, self.root = cloud, root
        self._values = dict(values)
        root.mkdir(parents=True, exist_ok=True)
        self._write()
        subprocess.run(["ip", "-n", netns_name, "address", "add", f"{ADDRESS}/32", "dev", "lo"],
                       check=True, capture_output=True)
        with open(root / "log", "ab", buffering=0) as log:
            self._proc = subprocess.Popen(
                ["ip", "netns", "exec", netns_name, sys.executable, "-m", "providers.lab.metadata", "--cloud", cloud,
                 "--root", str(root)], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))},
                start_new_session=True)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not (root / "ready").exists():   # it binds, then says so: the machine's first request finds it
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"metadata server in {netns_name} did not start: "
                                   f"{(root / 'log').read_text(errors='replace')[-500:]}")
            time.sleep(0.05)   # polling its readiness, bounded by the deadline

    @property
    def requests(self) -> list[str]:
        """The paths the machine asked, in order."""
        try:
            return (self.root / "requests").read_text().splitlines()
        except OSError:
            return []

    def set(self, path: str, value: str) -> None:
        """Change one answer (long polls waiting on it return)."""
        self.update({path: value})

    def update(self, values: dict[str, str]) -> None:
        """Change answers at once."""
        self._values.update(values)
        self._write()

    def get(self, path: str) -> str | None:
        return self._values.get(path)

    def _write(self) -> None:
        tmp = self.root / "values.json.tmp"
        tmp.write_text(json.dumps(self._values))
        tmp.replace(self.root / "values.json")

    def notify(self, lead_s: float) -> None:
        """An interruption notice, the instance to go in `lead_s` seconds (EC2's two minutes,
        Compute Engine's 30 s on a real cloud)."""
        if self.cloud == "aws":
            self.set("meta-data/spot/instance-action",
                     json.dumps({"action": "terminate", "time": _iso(time.time() + lead_s)}))
        else:
            self.set("instance/preempted", "TRUE")

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=10)


class _Server:
    """The metadata server's process: answers from `root/values.json`, reread when it changes."""

    def __init__(self, cloud: str, root: Path):
        self.cloud, self.root = cloud, root
        self._values: dict[str, str] = {}
        self._mtime_ns = -1
        self._tokens: dict[str, float] = {}   # IMDSv2 session token -> expiry (monotonic s)
        self._lock = threading.Lock()
        self._requests = open(root / "requests", "a", buffering=1)

    def note(self, path: str) -> None:
        with self._lock:
            self._requests.write(path + "\n")

    def _get(self, path: str) -> str | None:
        with self._lock:
            try:
                mtime = (self.root / "values.json").stat().st_mtime_ns
                if mtime != self._mtime_ns:
                    self._values, self._mtime_ns = json.loads((self.root / "values.json").read_text()), mtime
            except (OSError, ValueError):
                pass   # being replaced: the answers read last stand
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
                server.note(self.path)
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
                server.note(url.path)
                if self.headers.get("Metadata-Flavor") != "Google":
                    return self.answer(403, "Missing Metadata-Flavor:Google header.")
                path = url.path.removeprefix("/computeMetadata/v1/")
                query = dict(urllib.parse.parse_qsl(url.query))
                value = server._get(path)
                if value is not None and query.get("wait_for_change") == "true":
                    value = server._wait(path, query.get("last_etag"), float(query.get("timeout_sec", 300)))
                if value is None:
                    return self.answer(404)
                # JSON answers (token, an account's details) say so: google-auth parses by the type.
                ctype = "application/json" if value.startswith("{") else "application/text"
                self.answer(200, value, {"ETag": _etag(value), "Metadata-Flavor": "Google", "Content-Type": ctype})

        return Handler

    def _wait(self, path: str, etag: str | None, timeout_s: float) -> str | None:
        deadline = time.monotonic() + timeout_s
        while True:
            value = self._get(path)
            if value is None or etag is None or _etag(value) != etag or time.monotonic() >= deadline:
                return value
            time.sleep(WAIT_POLL_S)   # a long poll: the answer is reread until it changes or time is up


def _etag(value: str) -> str:
    return hashlib.sha1(value.encode()).hexdigest()[:16]


class _Quiet(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def log_message(self, *args):
        pass

    def answer(self, status: int, body: str = "", headers: dict | None = None) -> None:
        payload = body.encode()
        self.send_response(status)
        headers = {"Content-Type": "text/plain", **(headers or {})}
        for k, v in headers.items():
            self.send_header(k, v)
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
        values.update(aws_credentials(instance_id, role))
    return values


def aws_credentials(instance_id: str, role: str) -> dict[str, str]:
    """IMDS's answers for the instance's role: its name, and credentials in EC2's shape (moto
    accepts any key; the lab's gateway holds them to the node's policy)."""
    return {"meta-data/iam/role": role, f"meta-data/iam/security-credentials/{role}": json.dumps({
        "Code": "Success", "LastUpdated": _iso(time.time()), "Type": "AWS-HMAC",
        "AccessKeyId": "ASIA" + hashlib.sha1(instance_id.encode()).hexdigest()[:16].upper(),
        "SecretAccessKey": secrets.token_hex(20), "Token": secrets.token_hex(32),
        "Expiration": _iso(time.time() + 6 * 3600)})}


def gcp_values(name: str, instance_id: str, zone: str, project: str, private_ip: str, public_ip: str,
               startup_script: str, account: str | None, token: str | None) -> dict[str, str]:
    """What Compute Engine's metadata server says of one instance."""
    values = {"instance/id": instance_id, "instance/name": name, "instance/hostname": f"{name}.{zone}.c.{project}.internal",
              "instance/zone": f"projects/{project}/zones/{zone}", "project/project-id": project,
              "instance/network-interfaces/0/ip": private_ip,
              "instance/network-interfaces/0/access-configs/0/external-ip": public_ip,
              "instance/attributes/startup-script": startup_script,
              "instance/preempted": "FALSE", "instance/maintenance-event": "NONE"}
    # gcloud and google-auth ask whether they run on Compute Engine (the numeric project id), which
    # accounts the VM has (the listing), then one account's details (`?recursive=true`) and token.
    values["project/numeric-project-id"] = str(int(hashlib.sha1(project.encode()).hexdigest()[:10], 16))
    if account:
        values["instance/service-accounts/"] = f"default/\n{account}/\n"
        scopes = "https://www.googleapis.com/auth/cloud-platform"
        for alias in ("default", account):
            values[f"instance/service-accounts/{alias}/"] = json.dumps(
                {"aliases": ["default"], "email": account, "scopes": [scopes]})
            values[f"instance/service-accounts/{alias}/email"] = account
            values[f"instance/service-accounts/{alias}/scopes"] = scopes + "\n"
            if token:
                values[f"instance/service-accounts/{alias}/token"] = json.dumps(
                    {"access_token": token, "expires_in": 3599, "token_type": "Bearer"})
    return values


class _HTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        # A client that gave up (its SDK's timeout) is no error of the server's.
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError, TimeoutError)):
            super().handle_error(request, client_address)


def main(argv: list[str] | None = None) -> int:
    """The metadata server's process: serve until the process that started it ends."""
    p = argparse.ArgumentParser(description="a lab machine's metadata server (run by providers.lab.vmlab)")
    p.add_argument("--cloud", choices=("aws", "gcp"), required=True)
    p.add_argument("--root", type=Path, required=True)
    args = p.parse_args(argv)
    server = _Server(args.cloud, args.root)
    handler = server._aws_handler() if args.cloud == "aws" else server._gcp_handler()
    httpd = _HTTPServer((ADDRESS, 80), handler)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()
    (args.root / "ready").touch()
    parent = os.getppid()
    while os.getppid() == parent:   # its lab's process ended (killed too): so does it
        time.sleep(PARENT_POLL_S)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
