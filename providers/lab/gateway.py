"""What a lab machine reaches the clouds' APIs through: an HTTP gateway on its own loopback (a
socket opened in its network namespace) that passes requests on to the API's endpoint on this
host (moto, the Compute Engine fake). The machine's environment names it (`AWS_ENDPOINT_URL`,
`ELASTIC_GCP_*_ENDPOINT`), so the script it runs is the one the provider sent.

On AWS the gateway holds the machine's requests to the node's IAM grant as infra/ writes it
(`infra/aws/node-policy.json`, the permissions boundary of every node role): an action the
policy does not allow is answered AccessDenied, as AWS would (moto itself checks nothing).
Resources are not checked, only actions."""

from __future__ import annotations

import fnmatch
import http.client
import http.server
import json
import threading
import urllib.parse
from pathlib import Path

from providers.lab import netns

NODE_POLICY = Path(__file__).resolve().parents[2] / "infra" / "aws" / "node-policy.json"
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade"}


def node_actions(policy: Path = NODE_POLICY) -> list[str]:
    """The IAM actions `policy` allows (patterns, e.g. `ssm:GetParameter`, `s3:*`)."""
    doc = json.loads(policy.read_text(encoding="utf-8"))
    out = []
    for st in doc["Statement"]:
        if st.get("Effect") == "Allow":
            actions = st["Action"]
            out += [actions] if isinstance(actions, str) else actions
    return out


def aws_action(method: str, path: str, headers, body: bytes) -> str:
    """The IAM action of one AWS API request (`ec2:TerminateInstances`, `ssm:GetParameter`,
    `s3:GetObject`), from its signature's service and its Action / X-Amz-Target / S3 verb."""
    auth = headers.get("Authorization", "")
    scope = auth.split("Credential=", 1)[1].split(",")[0].split("/") if "Credential=" in auth else []
    service = scope[3] if len(scope) > 3 else ""
    target = headers.get("X-Amz-Target", "")
    if target:
        return f"{service}:{target.rpartition('.')[2]}"
    if service == "s3":
        parts = urllib.parse.urlparse(path)
        key = parts.path.lstrip("/").partition("/")[2]
        if method in ("GET", "HEAD"):
            return "s3:GetObject" if key else "s3:ListBucket"
        return {"PUT": "s3:PutObject", "POST": "s3:PutObject", "DELETE": "s3:DeleteObject"}.get(method, "s3:*")
    params = dict(urllib.parse.parse_qsl(body.decode(errors="replace")))
    params.update(urllib.parse.parse_qsl(urllib.parse.urlparse(path).query))
    return f"{service}:{params.get('Action', '')}"


def _denied_body(action: str) -> tuple[str, str]:
    service = action.partition(":")[0]
    message = f"You are not authorized to perform: {action} (the node's grant, infra/aws/node-policy.json)"
    if service in ("ec2",):
        return "text/xml", (f'<?xml version="1.0" encoding="UTF-8"?><Response><Errors><Error><Code>'
                            f"UnauthorizedOperation</Code><Message>{message}</Message></Error></Errors>"
                            "<RequestID>lab</RequestID></Response>")
    if service == "s3":
        return "application/xml", f"<Error><Code>AccessDenied</Code><Message>{message}</Message></Error>"
    return "application/x-amz-json-1.1", json.dumps({"__type": "AccessDeniedException", "message": message})


class Gateway:
    """One machine's way to one API endpoint.

    Args:
        netns_name: the machine's network namespace (the gateway listens on its 127.0.0.1).
        upstream: the endpoint on this host (`http://127.0.0.1:PORT`).
        allowed: IAM action patterns the machine may call (None: everything passes).
    """

    def __init__(self, netns_name: str, upstream: str, allowed: list[str] | None = None):
        self.upstream = urllib.parse.urlparse(upstream)
        self.allowed = allowed
        self.denied: list[str] = []   # actions refused, in order
        self.called: list[str] = []   # actions passed on (AWS)
        self._server = netns.inside(netns_name, lambda: http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                                                                         self._handler()))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                         name=f"gateway-{netns_name}", daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self):
        gw = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _relay(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if gw.allowed is not None:
                    action = aws_action(self.command, self.path, self.headers, body)
                    if not any(fnmatch.fnmatchcase(action, p) for p in gw.allowed):
                        gw.denied.append(action)
                        ctype, text = _denied_body(action)
                        payload = text.encode()
                        self.send_response(403)
                        self.send_header("Content-Type", ctype)
                        self.send_header("Content-Length", str(len(payload)))
                        self.end_headers()
                        self.wfile.write(payload)
                        return
                    gw.called.append(action)
                conn = http.client.HTTPConnection(gw.upstream.hostname, gw.upstream.port, timeout=330)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
                    conn.request(self.command, self.path, body=body or None, headers=headers)
                    resp = conn.getresponse()
                    payload = resp.read()
                finally:
                    conn.close()
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP_HEADERS and k.lower() != "content-length":
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _relay

        return Handler
