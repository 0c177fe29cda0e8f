"""On a Compute Engine node: the watcher's notice poller. It waits on the metadata server's
`instance/preempted` and `instance/maintenance-event` long polls (`MetadataWatch`; base URL
`ELASTIC_GCP_METADATA_URL`, which the tests point at a local server). Standard library only."""

from __future__ import annotations

import logging
import os
import threading
import time

from providers.gcp.provider import MAINTENANCE_NOTICE_S, METADATA_URL, METADATA_URL_ENV, PREEMPT_NOTICE_S

log = logging.getLogger(__name__)

BLOCKING = True   # `poll` waits for the notice itself: no pause between two calls


def metadata_url() -> str:
    """Base URL of the metadata server (`ELASTIC_GCP_METADATA_URL` points it at a test server)."""
    return (os.environ.get(METADATA_URL_ENV) or METADATA_URL).rstrip("/")


def _metadata_get(base: str, key: str, etag: str | None, wait_s: int) -> tuple[str, str | None]:
    """`instance/KEY` and its ETag. With `etag`, a long poll: the server answers once the value's
    ETag differs from it (at once if it already does), or after `wait_s`."""
    import urllib.request
    query = f"?wait_for_change=true&last_etag={etag}&timeout_sec={wait_s}" if etag else ""
    req = urllib.request.Request(f"{base}/instance/{key}{query}", headers={"Metadata-Flavor": "Google"})
    with urllib.request.urlopen(req, timeout=wait_s + 10) as resp:
        return resp.read().decode().strip(), resp.headers.get("ETag")


class MetadataWatch:
    """Waits on the metadata server (`wait_for_change=true`) for `instance/preempted` to turn TRUE
    and for `instance/maintenance-event` to announce a TERMINATE, one thread each; the first sets
    `notice` ({"kind": "notice", "deadline": unix time, "action": "preempted" | "maintenance"}).

    Args:
        base: metadata base URL (default `metadata_url()`).
        wait_s: longest single long poll, seconds (the server answers earlier on a change).
    """

    def __init__(self, base: str | None = None, wait_s: int = 60):
        self.base = base or metadata_url()
        self.notice: dict | None = None
        self.fired = threading.Event()
        self._stop = threading.Event()
        self._wait_s = wait_s
        self._threads = [
            threading.Thread(target=self._poll, args=("preempted", "preempted", PREEMPT_NOTICE_S),
                             name="gcp-preempted", daemon=True),
            threading.Thread(target=self._poll, args=("maintenance-event", "maintenance", MAINTENANCE_NOTICE_S),
                             name="gcp-maintenance", daemon=True)]
        for t in self._threads:
            t.start()

    @staticmethod
    def _triggered(action: str, value: str) -> bool:
        return value.upper() == "TRUE" if action == "preempted" else value.upper().startswith("TERMINATE")

    def _poll(self, key: str, action: str, notice_s: float) -> None:
        etag = None   # the first read answers at once (a notice may already be there), then long polls
        while not (self._stop.is_set() or self.fired.is_set()):
            try:
                value, etag = _metadata_get(self.base, key, etag, self._wait_s)
            except OSError as exc:   # the metadata server briefly out of reach: ask again shortly
                log.warning("metadata %s: %s", key, exc)
                self._stop.wait(1.0)
                continue
            if self._triggered(action, value) and not self.fired.is_set():
                self.notice = {"kind": "notice", "deadline": time.time() + notice_s, "action": action}
                self.fired.set()

    def wait(self, timeout_s: float | None) -> dict | None:
        """The notice, once one came within `timeout_s`; else None."""
        return self.notice if self.fired.wait(timeout_s) else None

    def stop(self) -> None:
        self._stop.set()


_watches: dict[str, MetadataWatch] = {}


def poll(base: str | None = None, wait_s: float = 5.0) -> dict | None:
    """The watcher's poller for GCP (`providers.watcher.watch`): blocks up to `wait_s`
    on the long polls of `MetadataWatch` (started on first call) and returns the notice as soon as
    it comes, else None."""
    base = base or metadata_url()
    if base not in _watches:
        _watches[base] = MetadataWatch(base)
    return _watches[base].wait(wait_s)


def terminate_self(instance_id: str) -> bool:
    """DELETE this VM (disk included) through the Compute API as the VM's own service account:
    project, zone and an access token come from the metadata server (a node's run account may
    delete its own VMs, through the grant the driver puts on each VM's policy; the controller's
    account, `elastic-driver`, elastic's instances). The API is `ELASTIC_GCP_COMPUTE_ENDPOINT`
    only when that is loopback (tests); the token goes nowhere but Google's API. True when it did;
    False (the OS shutdown then stops the VM) when that is refused or out of reach."""
    import json
    import urllib.error
    import urllib.parse
    import urllib.request

    from providers.gcp.api import COMPUTE_ENDPOINT_ENV

    base = metadata_url()

    def read(path: str) -> str:
        req = urllib.request.Request(f"{base}/{path}", headers={"Metadata-Flavor": "Google"})
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.read().decode().strip()

    try:
        project, zone = read("project/project-id"), read("instance/zone").rsplit("/", 1)[-1]
        token = json.loads(read("instance/service-accounts/default/token"))["access_token"]
        endpoint = os.environ.get(COMPUTE_ENDPOINT_ENV, "")
        local = urllib.parse.urlparse(endpoint).hostname in ("127.0.0.1", "localhost", "::1")
        api = endpoint.rstrip("/") if local else "https://compute.googleapis.com"
        req = urllib.request.Request(f"{api}/compute/v1/projects/{project}/zones/{zone}/instances/{instance_id}",
                                     method="DELETE", headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=30):
            pass
    except (OSError, ValueError, KeyError) as exc:   # HTTPError (refused) is an OSError too
        log.warning("could not delete itself through the API (%s): shutting down", exc)
        return False
    log.warning("deleted %s (itself)", instance_id)
    return True
