"""Servers on 127.0.0.1 for the tests and benchmarks: moto (AWS, S3 included), gcp-storage-emulator
(GCS), and a gate proxy that can hold chosen requests, to cut an upload off at a chosen point."""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit


class MotoServer:
    """A moto server process (EC2, SSM, IAM, S3, ...) on a free loopback port (its own process: it
    does not compete with the tests for the GIL)."""

    def __init__(self):
        import socket
        import subprocess
        import sys
        import time
        import urllib.request

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self._proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.url + "/moto-api/", timeout=2).read()
                return
            except OSError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self._proc.kill()
                    raise RuntimeError("moto server did not start")
                time.sleep(0.1)

    def stop(self) -> None:
        self._proc.kill()   # a test server: nothing to save
        self._proc.wait(timeout=10)


class GCSEmulator:
    """gcp-storage-emulator (the JSON API) in memory, on a free loopback port."""

    def __init__(self):
        from gcp_storage_emulator.server import create_server

        self._server = create_server("127.0.0.1", 0, in_memory=True)
        self._server.start()
        self.url = f"http://127.0.0.1:{self._server._api._httpd.server_address[1]}"

    def stop(self) -> None:
        self._server.stop()


class GateProxy:
    """An HTTP proxy in front of `upstream`. It holds every request matching `hold(method, path)`
    until `release()` (`held` is set once one is being held), and answers a request itself when
    `answer(method, path, headers, body)` returns (status, body bytes, content type)."""

    def __init__(self, upstream: str):
        up = urlsplit(upstream)
        self.hold = lambda method, path: False
        self.answer = lambda method, path, headers, body: None
        self.held = threading.Event()
        self._open = threading.Event()
        gate = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _forward(self):
                body = self._body()
                if gate.hold(self.command, self.path):
                    gate.held.set()
                    gate._open.wait()
                reply = gate.answer(self.command, self.path, self.headers, body)
                if reply is not None:
                    status, data, ctype = reply
                    self.send_response(status)
                    self.send_header("Content-Type", ctype)
                else:
                    conn = http.client.HTTPConnection(up.hostname, up.port, timeout=60)
                    headers = {k: v for k, v in self.headers.items() if k.lower() != "transfer-encoding"}
                    headers["Content-Length"] = str(len(body))
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    conn.close()
                    self.send_response(resp.status, resp.reason)
                    for k, v in resp.getheaders():
                        if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                            self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    parts = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return b"".join(parts)
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def release(self) -> None:
        self._open.set()

    def stop(self) -> None:
        self.release()
        self._httpd.shutdown()
        self._httpd.server_close()


class RecordingProxy(GateProxy):
    """A proxy in front of an object store that records each request as (method, object path):
    the URL path, percent-decoded, without the query."""

    def __init__(self, upstream: str):
        from urllib.parse import unquote

        super().__init__(upstream)
        self.requests: list[tuple[str, str]] = []
        self.answer = lambda method, path, headers, body: self.requests.append(
            (method, unquote(path.split("?")[0]))) and None

    def paths(self, method: str) -> list[str]:
        return [p for m, p in self.requests if m == method]
