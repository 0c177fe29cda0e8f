"""Object-storage servers on 127.0.0.1 for the tests: moto (S3), gcp-storage-emulator (GCS), and a
gate proxy that can hold chosen requests, to cut an upload off at a chosen point."""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit


class MotoS3:
    """A moto server (all of AWS, S3 used here) on a free loopback port."""

    def __init__(self):
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)   # no line per request
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        self.url = f"http://127.0.0.1:{self._server._server.port}"

    def stop(self) -> None:
        self._server.stop()


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
    """An HTTP proxy in front of `upstream` that holds every request matching `hold(method, path)`
    until `release()`. `held` is set once a request is being held."""

    def __init__(self, upstream: str):
        up = urlsplit(upstream)
        self.hold = lambda method, path: False
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
                conn = http.client.HTTPConnection(up.hostname, up.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "transfer-encoding"}
                headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                conn.close()

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
