"""A local stand-in for the Google Cloud endpoints the `gcp` provider talks to, on 127.0.0.1.

One threaded HTTP server answers, in the REST shapes the real client libraries send and parse:

- Compute Engine (`/compute/v1/projects/P/...`): zones list; machineTypes and acceleratorTypes
  aggregated lists; instances insert / get / list / aggregatedList / delete / setLabels (with the
  label fingerprint check); zone operations
  get / wait. Inserts honour `requestId` (a retried insert creates one VM), and bodies are stored
  so tests read back exactly what was sent.
- Cloud Billing Catalog (`/v1/services/6F81-5844-456A/skus`), paginated.
- Secret Manager (`/v1/projects/P/secrets`): create, list (by label), addVersion, access latest,
  delete, and the secret's IAM policy (setIamPolicy / getIamPolicy).
- IAM (`/v1/projects/P/serviceAccounts`): create, get, delete service accounts; `token_of(email)`
  hands a test the bearer token a VM running as that account would get from its metadata server.
- Cloud Storage bucket IAM policies (`/storage/v1/b/B/iam`, version 3 with conditions, etag
  checked); `bucket_allows` evaluates them (the object data itself is the GCS emulator's).
- Compute instance IAM policies (`instances/NAME/setIamPolicy`).

Requests bearing a service account's token are held to IAM: such a caller may access a secret
version only if the secret's policy grants it `secretAccessor`, and delete an instance only if that
instance's policy grants it the self-delete role; anything else is refused 403. Requests without one
are the driver's (every permission, as in the tests before service accounts existed).
- The metadata server (`/computeMetadata/v1/instance/preempted|maintenance-event`) with
  `wait_for_change` long polls, as seen from one VM.

Injected failures: paths refused 403 (a missing permission); a zone's inserts end in an operation error (`ZONE_RESOURCE_POOL_EXHAUSTED`,
`QUOTA_EXCEEDED`) or are refused at once with HTTP 403 `quotaExceeded`; the next N requests answer
429. Prices and zones are test data shaped like the real catalog, not a copy of it.

Run it by hand (for `elastic prices --cloud gcp`, `elastic launch recipes/gcp-smoke.yaml`):

    python -m providers.lab.gcefake --port 8089
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import itertools
import json
import re
import sys
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

SERVICE = "6F81-5844-456A"

# region -> {kind: (on-demand, spot)} USD per hour (per GiB-hour for ram); test data.
PRICES = {
    "us-central1": {"A100": (2.933908, 1.17), "A100-80GB": (3.92876, 1.57), "L4": (0.5603, 0.2241),
                    "T4": (0.35, 0.14), "V100": (2.48, 0.99), "a2-core": (0.031611, 0.0126),
                    "a2-ram": (0.004237, 0.0017), "g2-core": (0.024988, 0.00999), "g2-ram": (0.002927, 0.00117),
                    "n1-core": (0.031611, 0.00664), "n1-ram": (0.004237, 0.00089),
                    "e2-core": (0.021811, 0.006543), "e2-ram": (0.002923, 0.000877)},
    "us-east1": {"A100": (2.933908, 1.10), "T4": (0.35, 0.12), "a2-core": (0.031611, 0.0126),
                 "a2-ram": (0.004237, 0.0017), "n1-core": (0.031611, 0.00664), "n1-ram": (0.004237, 0.00089)},
    "europe-west4": {"A100": (3.2273, 1.29), "A100-80GB": (4.32, 1.65), "L4": (0.6163, 0.25), "T4": (0.385, 0.15),
                     "a2-core": (0.034773, 0.0139), "a2-ram": (0.004661, 0.00187), "g2-core": (0.027487, 0.011),
                     "g2-ram": (0.00322, 0.00129), "n1-core": (0.034773, 0.0073), "n1-ram": (0.004661, 0.00098)},
    "asia-southeast1": {"A100-80GB": (4.8, 1.40), "a2-core": (0.0389, 0.0155), "a2-ram": (0.0052, 0.0021)},
}
ZONES = {"us-central1-a": "UP", "us-central1-b": "UP", "us-central1-c": "UP", "us-east1-b": "UP",
         "us-east1-c": "UP", "europe-west4-a": "UP", "europe-west4-b": "DOWN", "asia-southeast1-c": "UP"}
# machine type -> (vCPUs, memory GiB, accelerator type, GPUs)
MACHINE_TYPES = {
    "a2-highgpu-1g": (12, 85, "nvidia-tesla-a100", 1), "a2-highgpu-8g": (96, 680, "nvidia-tesla-a100", 8),
    "a2-ultragpu-1g": (12, 170, "nvidia-a100-80gb", 1), "a2-ultragpu-8g": (96, 1360, "nvidia-a100-80gb", 8),
    "g2-standard-4": (4, 16, "nvidia-l4", 1), "g2-standard-24": (24, 96, "nvidia-l4", 2),
    "e2-standard-4": (4, 16, None, 0), "n1-standard-8": (8, 30, None, 0),
}
ZONE_MACHINE_TYPES = {
    "us-central1-a": ["a2-highgpu-1g", "a2-highgpu-8g", "a2-ultragpu-1g", "a2-ultragpu-8g", "g2-standard-4",
                      "g2-standard-24", "e2-standard-4", "n1-standard-8"],
    "us-central1-c": ["a2-highgpu-1g", "a2-highgpu-8g", "g2-standard-4", "n1-standard-8"],
    "us-east1-b": ["a2-highgpu-1g", "a2-highgpu-8g", "n1-standard-8"],
    "us-east1-c": ["n1-standard-8"],
    "europe-west4-a": ["a2-highgpu-1g", "a2-highgpu-8g", "a2-ultragpu-8g", "g2-standard-4", "n1-standard-8"],
    "europe-west4-b": ["a2-highgpu-8g"],
    "asia-southeast1-c": ["a2-ultragpu-1g"],
}
# zone -> {accelerator type: most cards per VM}
ZONE_ACCELERATORS = {
    "us-central1-a": {"nvidia-tesla-a100": 16, "nvidia-a100-80gb": 8, "nvidia-l4": 8, "nvidia-tesla-t4": 4,
                      "nvidia-tesla-v100": 8},
    "us-central1-c": {"nvidia-tesla-a100": 16, "nvidia-l4": 8, "nvidia-tesla-t4": 4},
    "us-east1-b": {"nvidia-tesla-a100": 16},
    "us-east1-c": {"nvidia-tesla-t4": 4},
    "europe-west4-a": {"nvidia-tesla-a100": 16, "nvidia-a100-80gb": 8, "nvidia-l4": 8, "nvidia-tesla-t4": 4},
    "europe-west4-b": {"nvidia-tesla-a100": 16, "nvidia-tesla-t4": 4},
    "asia-southeast1-c": {"nvidia-a100-80gb": 8},
}
_GPU_DESC = {"A100": "Nvidia Tesla A100 GPU", "A100-80GB": "Nvidia Tesla A100 80GB GPU", "L4": "Nvidia L4 GPU",
             "T4": "Nvidia Tesla T4 GPU", "V100": "Nvidia Tesla V100 GPU"}
_VM_DESC = {"a2": "A2 Instance", "g2": "G2 Instance", "n1": "N1 Predefined Instance", "e2": "E2 Instance"}
_GEO = {"us": "Americas", "europe": "EMEA", "asia": "APAC"}


def _money(usd: float) -> dict:
    units = int(usd)
    return {"currencyCode": "USD", "units": str(units), "nanos": int(round((usd - units) * 1e9))}


def catalog_skus() -> list[dict]:
    """The billing catalog the fake serves: GPU / core / ram SKUs per region, on-demand and Spot,
    plus SKUs the provider must ignore (commitments, licences, storage)."""
    skus, ids = [], itertools.count(1)

    def sku(desc, group, usage, region, usd, unit="h", family="Compute"):
        n = next(ids)
        skus.append({"name": f"services/{SERVICE}/skus/{n:04X}-TEST-{n:04X}", "skuId": f"{n:04X}-TEST-{n:04X}",
                     "description": desc,
                     "category": {"serviceDisplayName": "Compute Engine", "resourceFamily": family,
                                  "resourceGroup": group, "usageType": usage},
                     "serviceRegions": [region],
                     "pricingInfo": [{"pricingExpression": {"usageUnit": unit, "tieredRates": [
                         {"startUsageAmount": 0, "unitPrice": _money(usd)}]}}],
                     "serviceProviderName": "Google"})

    for region, table in PRICES.items():
        geo = _GEO[region.split("-")[0]]
        for kind, (od, spot) in table.items():
            if kind in _GPU_DESC:
                desc, group, unit = _GPU_DESC[kind], "GPU", "h"
            else:
                fam, part = kind.split("-")
                desc = f"{_VM_DESC[fam]} {'Core' if part == 'core' else 'Ram'}"
                group, unit = ("CPU" if part == "core" else "RAM"), ("h" if part == "core" else "GiBy.h")
            sku(f"{desc} running in {geo}", group, "OnDemand", region, od, unit)
            sku(f"Spot Preemptible {desc} running in {geo}", group, "Preemptible", region, spot, unit)
            if kind == "A100":
                sku(f"Commitment v1: {desc} in {geo} for 1 Year", "GPU", "Commit1Yr", region, od * 0.63)
        sku(f"Storage PD Capacity in {geo}", "SSD", "OnDemand", region, 0.00005, "GiBy.mo", family="Storage")
        sku(f"Licensing Fee for Windows Server 2022 Datacenter Edition running in {geo}", "CPU", "OnDemand",
            region, 0.046, family="License")
    return skus


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request, client_address) -> None:
        """A client that hung up before its answer (a driver a test killed) is no error of the fake's;
        anything else prints its traceback as usual."""
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


class GCPFake:
    """The fake endpoints and their state.

    Args:
        port: TCP port on 127.0.0.1 (0: any free port).
        project: the only project it knows.
        sku_page_size: most SKUs per page (small, so the client's pagination is exercised).
    """

    def __init__(self, port: int = 0, project: str = "elastic-test", sku_page_size: int = 7):
        self.project = project
        self.sku_page_size = sku_page_size
        self.skus = catalog_skus()
        self.zones = dict(ZONES)
        self.instances: dict[str, dict] = {}          # name -> instance resource
        self.label_sets: list[str] = []               # instance names, one per setLabels accepted
        self.operations: dict[str, dict] = {}
        self.requests: list[dict] = []                # every request: method, path, query, body
        self.insert_errors: dict[str, tuple[str, str]] = {}   # zone -> ("operation" | "http", code)
        self.metadata = {"preempted": "FALSE", "maintenance-event": "NONE"}
        # What a VM's metadata server says of its project, zone and service account (a test sets
        # the zone and token of the VM it plays).
        self.vm_metadata = {"project/project-id": project}
        # Called (in a thread of its own) when a VM is created / deleted: a test can "boot" a VM as
        # a local Ray node labelled with its name, and stop it again.
        self.on_insert = None   # (name, body) -> None
        self.on_delete = None   # (name) -> None
        # Set by the VM lab, which is the network here: (name, zone) -> (private IP, public IP) of
        # a VM being created (called before the insert answers), and name -> its serial console.
        self.addresses = None
        self.console = None
        self.secrets: dict[str, dict] = {}            # Secret Manager: id -> labels, version payloads
        self.firewalls: dict[str, dict] = {}          # firewall rule name -> rule resource
        self.service_accounts: dict[str, dict] = {}   # email -> service account resource
        self.bucket_policies: dict[str, dict] = {}    # bucket -> IAM policy (version, etag, bindings)
        self.instance_policies: dict[str, dict] = {}  # instance name -> IAM policy
        self._sa_tokens: dict[str, str] = {}          # bearer token -> service account email
        self.denied: list[str] = []                   # path patterns answered 403 (permission)
        self.quotas: dict[str, dict[str, float]] = {}  # region -> {metric: limit} (regions.get)
        self._by_request_id: dict[str, dict] = {}
        self._rate_limited = 0
        self._ids = itertools.count(1000)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._closing = False
        self._server = _Server(("127.0.0.1", port), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="gcp-fake", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def metadata_url(self) -> str:
        return f"{self.url}/computeMetadata/v1"

    def env(self) -> dict[str, str]:
        """Environment variables that point the provider (and its watcher) here."""
        return {"ELASTIC_GCP_COMPUTE_ENDPOINT": self.url, "ELASTIC_GCP_BILLING_ENDPOINT": self.url,
                "ELASTIC_GCP_SECRETS_ENDPOINT": self.url, "ELASTIC_GCP_IAM_ENDPOINT": self.url,
                "ELASTIC_GCP_STORAGE_ENDPOINT": self.url,
                "ELASTIC_GCP_METADATA_URL": self.metadata_url, "GOOGLE_CLOUD_PROJECT": self.project}

    def start(self) -> "GCPFake":
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._lock:
            self._closing = True
            self._changed.notify_all()
        self._server.shutdown()
        self._server.server_close()

    # -- what tests do ---------------------------------------------------------------------------

    def rate_limit(self, n: int) -> None:
        """The next `n` requests are answered 429 (rateLimitExceeded)."""
        with self._lock:
            self._rate_limited = n

    def deny(self, pattern: str) -> None:
        """Requests whose path matches `pattern` are refused 403 (the identity lacks the permission)."""
        with self._lock:
            self.denied.append(pattern)

    def inserted(self) -> list[dict]:
        """The bodies of every instances.insert request the fake accepted for processing."""
        with self._lock:
            return [r["body"] for r in self.requests if r["method"] == "POST" and r["path"].endswith("/instances")]

    def calls(self, method: str, pattern: str) -> list[dict]:
        with self._lock:
            return [r for r in self.requests if r["method"] == method and re.search(pattern, r["path"])]

    def token_of(self, email: str) -> str:
        """The bearer token a VM running as service account `email` gets from its metadata server."""
        with self._lock:
            assert email in self.service_accounts, f"fake: no service account {email}"
            token = f"ya29.fake-{hashlib.sha1(email.encode()).hexdigest()[:16]}"
            self._sa_tokens[token] = email
            return token

    def bucket_allows(self, email: str, permission: str, bucket: str, object_name: str | None = None,
                      list_prefix: str | None = None) -> bool:
        """Whether the bucket's IAM policy grants `permission` (`storage.objects.get|create|delete|
        list`) to service account `email` on `object_name` (or, for list, a listing of `list_prefix`),
        its conditions evaluated as Cloud Storage does for the forms elastic writes."""
        resource = f"projects/_/buckets/{bucket}" + (f"/objects/{object_name}" if object_name else "")
        with self._lock:
            for b in self.bucket_policies.get(bucket, {}).get("bindings", []):
                if f"serviceAccount:{email}" not in b.get("members", ()) or \
                        permission not in _STORAGE_ROLES.get(b["role"], ()):
                    continue
                if "condition" not in b or _condition_holds(b["condition"]["expression"], resource, list_prefix):
                    return True
        return False

    def set_metadata(self, key: str, value: str) -> None:
        """Change what the VM's metadata server says (wakes its `wait_for_change` long polls)."""
        with self._lock:
            self.metadata[key] = value
            self._changed.notify_all()

    def preempt(self, name: str) -> None:
        """The cloud reclaims a Spot VM: its metadata says so, and (termination action DELETE) it goes."""
        self.set_metadata("preempted", "TRUE")
        with self._lock:
            if self.instances.pop(name, None) is not None:
                self._hook(self.on_delete, name)

    def snapshot(self) -> dict[str, dict]:
        """Every instance as the fake holds it now (name -> a copy of its resource)."""
        with self._lock:
            return {name: json.loads(json.dumps(vm)) for name, vm in self.instances.items()}

    def guest_shutdown(self, name: str) -> None:
        """The VM's guest OS shut down: Compute Engine stops it (status TERMINATED, kept)."""
        with self._lock:
            if name in self.instances:
                self.instances[name]["status"] = "TERMINATED"

    # -- request handling ------------------------------------------------------------------------

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _body(self) -> dict | None:
                n = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(n)) if n else None

            def _send(self, status: int, doc, headers: dict | None = None) -> None:
                data = (doc if isinstance(doc, str) else json.dumps(doc)).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json" if not isinstance(doc, str) else "text/plain")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def _do(self, method: str) -> None:
                u = urlparse(self.path)
                query = {k: v[-1] for k, v in parse_qs(u.query).items()}
                body = self._body()
                if u.path.startswith("/computeMetadata/"):
                    return self._send(*fake._metadata(u.path, query, self.headers))
                with fake._lock:
                    fake.requests.append({"method": method, "path": u.path, "query": query, "body": body,
                                          "authorization": self.headers.get("Authorization")})
                    caller = fake._sa_tokens.get((self.headers.get("Authorization") or "").removeprefix("Bearer "))
                    if caller is not None and not fake._permitted(caller, method, u.path):
                        return self._send(403, {"error": {"code": 403, "status": "PERMISSION_DENIED",
                                                          "message": f"Permission denied for {caller} on {u.path}"}})
                    if fake._rate_limited > 0:
                        fake._rate_limited -= 1
                        return self._send(429, _error(429, "Rate Limit Exceeded", "rateLimitExceeded"))
                    if any(re.search(d, u.path) for d in fake.denied):
                        return self._send(403, _error(403, "Required 'compute.machineTypes.list' permission",
                                                      "forbidden"))
                    status, doc = fake._route(method, u.path, query, body)
                self._send(status, doc)

            def do_GET(self):
                self._do("GET")

            def do_POST(self):
                self._do("POST")

            def do_DELETE(self):
                self._do("DELETE")

            def do_PUT(self):
                self._do("PUT")

        return Handler

    def _permitted(self, email: str, method: str, path: str) -> bool:
        """What a caller with service account `email`'s token may do (called with the lock held)."""
        if m := re.fullmatch(r"/v1/projects/[^/]+/secrets/([^/:]+)/versions/latest:access", path):
            policy = self.secrets.get(m[1], {}).get("policy", {})
            return any(b.get("role") == "roles/secretmanager.secretAccessor" and f"serviceAccount:{email}" in
                       b.get("members", ()) for b in policy.get("bindings", []))
        if method == "DELETE" and (m := re.fullmatch(r"/compute/v1/projects/[^/]+/zones/[^/]+/instances/([^/]+)", path)):
            return any(b.get("role", "").endswith("/roles/elastic.nodeSelfDelete") and f"serviceAccount:{email}" in
                       b.get("members", ()) for b in self.instance_policies.get(m[1], {}).get("bindings", []))
        return False

    def _route(self, method: str, path: str, query: dict, body) -> tuple[int, dict]:
        """Answer one API request (called with the lock held)."""
        if m := re.fullmatch(r"/v1/projects/([^/]+)/secrets(?:/([^/:]+))?(:addVersion|/versions/latest:access|"
                             r":setIamPolicy|:getIamPolicy)?", path):
            if method == "GET" and not m[2] and not m[3]:
                return self._list_secrets(m[1], query.get("filter", ""))
            return self._secret(method, m[1], m[2] or query.get("secretId"), m[3], body)
        if m := re.fullmatch(r"/v1/projects/([^/]+)/serviceAccounts(?:/([^/]+))?", path):
            return self._service_account(method, m[1], m[2], body)
        if m := re.fullmatch(r"/storage/v1/b/([^/]+)/iam", path):
            return self._bucket_policy(method, m[1], body)
        if m := re.fullmatch(rf"/v1/services/{SERVICE}/skus", path):
            start = int(query.get("pageToken") or 0)
            size = min(int(query.get("pageSize") or 5000), self.sku_page_size)
            page = self.skus[start:start + size]
            nxt = str(start + size) if start + size < len(self.skus) else ""
            return 200, {"skus": page, "nextPageToken": nxt}
        m = re.fullmatch(r"/compute/v1/projects/([^/]+)/(.*)", path)
        if not m:
            return 404, _error(404, f"no such path {path}", "notFound")
        project, rest = m.groups()
        if project != self.project:
            return 404, _error(404, f"The resource 'projects/{project}' was not found", "notFound")
        base = f"{self.url}/compute/v1/projects/{project}"
        flt = _Filter(query.get("filter"))
        if rest == "zones" and method == "GET":
            return 200, {"items": [{"name": z, "status": s, "region": f"{base}/regions/{z.rsplit('-', 1)[0]}"}
                                   for z, s in self.zones.items()]}
        if m := re.fullmatch(r"regions/([^/]+)", rest):
            if not any(z.rsplit("-", 1)[0] == m[1] for z in self.zones):
                return 404, _error(404, f"The resource 'projects/{project}/regions/{m[1]}' was not found", "notFound")
            return 200, {"name": m[1], "status": "UP", "quotas": [
                {"metric": k, "limit": v, "usage": 0} for k, v in self.quotas.get(m[1], {}).items()]}
        if rest == "aggregated/machineTypes":
            items = {}
            for zone, names in ZONE_MACHINE_TYPES.items():
                mts = [_machine_type(n, zone) for n in names if flt.match({"name": n})]
                items[f"zones/{zone}"] = {"machineTypes": mts} if mts else _empty_scope()
            return 200, {"items": items}
        if rest == "aggregated/acceleratorTypes":
            return 200, {"items": {f"zones/{zone}": {"acceleratorTypes": [
                {"name": a, "zone": f"{base}/zones/{zone}", "maximumCardsPerInstance": n}
                for a, n in accels.items()]} for zone, accels in ZONE_ACCELERATORS.items()}}
        if rest == "aggregated/instances":
            items = {}
            for inst in self.instances.values():
                if flt.match(inst):
                    items.setdefault(f"zones/{inst['zone'].rsplit('/', 1)[-1]}", {"instances": []})["instances"].append(inst)
            return 200, {"items": items}
        if m := re.fullmatch(r"global/firewalls(?:/([^/]+))?", rest):
            return self._firewall(method, base, m[1], body)
        m = re.fullmatch(r"zones/([^/]+)/(instances|operations)(?:/([^/]+))?(/wait|/setLabels|/setIamPolicy|/serialPort)?", rest)
        if not m:
            return 404, _error(404, f"no such path {path}", "notFound")
        zone, kind, name, verb = m.groups()
        if zone not in self.zones:
            return 404, _error(404, f"The resource 'zones/{zone}' was not found", "notFound")
        if kind == "operations":
            op = self.operations.get(name)
            if op is None:
                return 404, _error(404, f"operation {name} not found", "notFound")
            op["status"] = "DONE"   # the fake's work is done when the operation is first looked at
            return 200, op
        if method == "POST" and name is None:
            return self._insert(base, zone, query, body)
        if method == "GET" and name is None:
            return 200, {"items": [i for i in self.instances.values() if i["zone"].endswith(f"/{zone}")
                                   and flt.match(i)]}
        inst = self.instances.get(name)
        if inst is None or not inst["zone"].endswith(f"/{zone}"):
            return 404, _error(404, f"The resource 'projects/{project}/zones/{zone}/instances/{name}' was not "
                                    "found", "notFound")
        if method == "GET" and verb == "/serialPort":   # port 1, from the start: what the VM wrote
            contents = self.console(name) if self.console is not None else ""
            return 200, {"kind": "compute#serialPortOutput", "contents": contents, "start": "0",
                         "next": str(len(contents.encode())), "selfLink": f"{inst['selfLink']}/serialPort"}
        if method == "GET":
            return 200, inst
        if method == "POST" and verb == "/setLabels":   # optimistic locking, as the API does
            if body.get("labelFingerprint") != inst["labelFingerprint"]:
                return 412, _error(412, "Labels fingerprint either invalid or resource labels have changed",
                                   "conditionNotMet")
            inst["labels"] = dict(body.get("labels") or {})
            inst["labelFingerprint"] = _etag(json.dumps(inst["labels"], sort_keys=True))
            self.label_sets.append(name)
            return 200, self._operation(base, zone, "setLabels", name)
        if method == "POST" and verb == "/setIamPolicy":
            self.instance_policies[name] = {**body["policy"], "etag": _etag(json.dumps(body["policy"]))}
            return 200, self.instance_policies[name]
        if method == "DELETE":
            del self.instances[name]
            self._hook(self.on_delete, name)
            return 200, self._operation(base, zone, "delete", name)
        return 405, _error(405, "method not allowed", "badRequest")

    def _secret(self, method: str, project: str, name: str, verb: str | None, body) -> tuple[int, dict]:
        """Secret Manager: create, add a version, read the latest, delete."""
        if project != self.project:
            return 404, _error(404, f"project {project} not found", "notFound")
        full = f"projects/{project}/secrets/{name}"
        if method == "POST" and verb is None:
            if name in self.secrets:
                return 409, {"error": {"code": 409, "message": f"Secret [{full}] already exists.",
                                       "status": "ALREADY_EXISTS"}}
            self.secrets[name] = {"labels": (body or {}).get("labels", {}), "versions": []}
            return 200, {"name": full, "replication": {"automatic": {}}, "labels": self.secrets[name]["labels"]}
        if name not in self.secrets:
            return 404, {"error": {"code": 404, "message": f"Secret [{full}] not found.", "status": "NOT_FOUND"}}
        if method == "POST" and verb == ":addVersion":
            versions = self.secrets[name]["versions"]
            versions.append(base64.b64decode(body["payload"]["data"]).decode())
            return 200, {"name": f"{full}/versions/{len(versions)}", "state": "ENABLED"}
        if method == "GET" and verb == "/versions/latest:access":
            versions = self.secrets[name]["versions"]
            return 200, {"name": f"{full}/versions/{len(versions)}",
                         "payload": {"data": base64.b64encode(versions[-1].encode()).decode()}}
        if method == "DELETE" and verb is None:
            del self.secrets[name]
            return 200, {}
        if method == "POST" and verb == ":setIamPolicy":
            self.secrets[name]["policy"] = {**body["policy"], "etag": _etag(json.dumps(body["policy"]))}
            return 200, self.secrets[name]["policy"]
        if verb == ":getIamPolicy":
            return 200, self.secrets[name].get("policy", {})
        return 405, _error(405, "method not allowed", "badRequest")

    def _list_secrets(self, project: str, filter_: str) -> tuple[int, dict]:
        """Secret Manager's list, one page, with the one filter form elastic sends
        (`labels.KEY=VALUE`); any other filter is an error (the fake does not guess)."""
        if project != self.project:
            return 404, _error(404, f"project {project} not found", "notFound")
        m = re.fullmatch(r"labels\.([a-z0-9_-]+)=([a-z0-9_-]*)", filter_)
        if filter_ and not m:
            return 400, _error(400, f"fake: filter {filter_!r} not understood", "badRequest")
        return 200, {"secrets": [{"name": f"projects/{project}/secrets/{name}", "labels": sec["labels"]}
                                 for name, sec in sorted(self.secrets.items())
                                 if not m or sec["labels"].get(m[1]) == m[2]]}

    def _service_account(self, method: str, project: str, email: str | None, body) -> tuple[int, dict]:
        """IAM service accounts: create (409 when the id is taken), get, delete."""
        if project != self.project:
            return 404, _error(404, f"project {project} not found", "notFound")
        if method == "POST" and email is None:
            email = f"{body['accountId']}@{project}.iam.gserviceaccount.com"
            if email in self.service_accounts:
                return 409, {"error": {"code": 409, "status": "ALREADY_EXISTS",
                                       "message": f"Service account {body['accountId']} already exists"}}
            self.service_accounts[email] = {**body.get("serviceAccount", {}), "email": email,
                                            "name": f"projects/{project}/serviceAccounts/{email}",
                                            "projectId": project, "uniqueId": str(next(self._ids))}
            return 200, self.service_accounts[email]
        if email not in self.service_accounts:
            return 404, {"error": {"code": 404, "status": "NOT_FOUND", "message": f"{email} not found"}}
        if method == "GET":
            return 200, self.service_accounts[email]
        if method == "DELETE":
            del self.service_accounts[email]
            self._sa_tokens = {t: e for t, e in self._sa_tokens.items() if e != email}
            return 200, {}
        return 405, _error(405, "method not allowed", "badRequest")

    def _bucket_policy(self, method: str, bucket: str, body) -> tuple[int, dict]:
        """A bucket's IAM policy: get, and set (412 unless the etag is the current one)."""
        policy = self.bucket_policies.setdefault(bucket, {
            "kind": "storage#policy", "resourceId": f"projects/_/buckets/{bucket}", "version": 1,
            "etag": "CAE=", "bindings": []})
        if method == "GET":
            return 200, policy
        if method == "PUT":
            if body.get("etag") != policy["etag"]:
                return 412, _error(412, "Precondition Failed", "conditionNotMet")
            self.bucket_policies[bucket] = {**body, "etag": _etag(json.dumps(body, sort_keys=True))}
            return 200, self.bucket_policies[bucket]
        return 405, _error(405, "method not allowed", "badRequest")

    def _insert(self, base: str, zone: str, query: dict, body: dict) -> tuple[int, dict]:
        request_id = query.get("requestId")
        if request_id and request_id in self._by_request_id:
            return 200, self._by_request_id[request_id]   # a retried insert: the same operation, no new VM
        mode, code = self.insert_errors.get(zone, (None, None))
        if mode == "http":
            return 403, _error(403, f"Quota 'GPUS_ALL_REGIONS' exceeded. Limit: 0.0 globally ({code}).",
                               "quotaExceeded")
        name = body["name"]
        if name in self.instances:
            return 409, _error(409, f"The resource '{name}' already exists", "alreadyExists")
        if mode == "operation":
            op = self._operation(base, zone, "insert", name, error=code)
        else:
            n = next(self._ids)
            # Addresses as Compute Engine gives them: a private one on the VPC, a public one (here in
            # TEST-NET-3, never routed) for each access config; the lab's machine's where a lab runs.
            private, public = ((self.addresses(name, zone) if self.addresses is not None else None)
                               or (f"10.128.{n // 250}.{n % 250 + 2}", f"203.0.113.{n % 250 + 2}"))
            nics = [{**nic, "networkIP": private,
                     "accessConfigs": [{**ac, "natIP": public} for ac in nic.get("accessConfigs", [])]}
                    for nic in body.get("networkInterfaces", [])]
            self.instances[name] = {
                **body, "networkInterfaces": nics, "id": str(n), "kind": "compute#instance", "status": "RUNNING",
                "zone": f"{base}/zones/{zone}", "selfLink": f"{base}/zones/{zone}/instances/{name}",
                "creationTimestamp": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
                "labelFingerprint": _etag(json.dumps(body.get("labels") or {}, sort_keys=True))}
            op = self._operation(base, zone, "insert", name)
            self._hook(self.on_insert, name, body)
        if request_id:
            self._by_request_id[request_id] = op
        return 200, op

    @staticmethod
    def _hook(fn, *args) -> None:
        if fn is not None:
            threading.Thread(target=fn, args=args, daemon=True).start()

    def _firewall(self, method: str, base: str, name: str | None, body) -> tuple[int, dict]:
        """Firewall rules: insert (409 when the name exists), get, list, delete; a global
        operation, done at once, is the answer to a change."""
        if method == "GET":
            if name is None:
                return 200, {"items": list(self.firewalls.values())}
            rule = self.firewalls.get(name)
            return (200, rule) if rule else (404, _error(404, f"firewall {name} not found", "notFound"))
        if method == "POST" and name is None:
            if body["name"] in self.firewalls:
                return 409, _error(409, f"The resource 'firewalls/{body['name']}' already exists", "alreadyExists")
            self.firewalls[body["name"]] = {**body, "selfLink": f"{base}/global/firewalls/{body['name']}"}
            target = body["name"]
        elif method == "DELETE" and name is not None:
            if self.firewalls.pop(name, None) is None:
                return 404, _error(404, f"firewall {name} not found", "notFound")
            target = name
        else:
            return 400, _error(400, f"{method} on firewalls", "badRequest")
        op_name = f"operation-{next(self._ids)}"
        return 200, {"kind": "compute#operation", "name": op_name, "status": "DONE", "progress": 100,
                     "selfLink": f"{base}/global/operations/{op_name}", "targetLink": f"{base}/global/firewalls/{target}"}

    def _operation(self, base: str, zone: str, kind: str, target: str, error: str | None = None) -> dict:
        name = f"operation-{int(time.time() * 1000)}-{next(self._ids)}"
        op = {"kind": "compute#operation", "id": str(next(self._ids)), "name": name, "operationType": kind,
              "status": "RUNNING", "zone": f"{base}/zones/{zone}", "selfLink": f"{base}/zones/{zone}/operations/{name}",
              "targetLink": f"{base}/zones/{zone}/instances/{target}", "progress": 0}
        if error:
            http = (403, "FORBIDDEN") if "QUOTA" in error else (503, "SERVICE UNAVAILABLE")
            op.update({"error": {"errors": [{"code": error, "message": f"{error}: the zone '{zone}' cannot "
                                             f"fulfil this request now"}]},
                       "httpErrorStatusCode": http[0], "httpErrorMessage": http[1]})
        self.operations[name] = op
        return op

    def _metadata(self, path: str, query: dict, headers) -> tuple[int, object, dict]:
        if headers.get("Metadata-Flavor") != "Google":
            return 403, "Missing Metadata-Flavor:Google header", {}
        if path.removeprefix("/computeMetadata/v1/") in self.vm_metadata:   # project, zone, token
            return 200, self.vm_metadata[path.removeprefix("/computeMetadata/v1/")], {"Metadata-Flavor": "Google"}
        key = path.removeprefix("/computeMetadata/v1/instance/")
        if key not in self.metadata:
            return 404, "not found", {}
        deadline = time.monotonic() + float(query.get("timeout_sec") or 60)
        with self._lock:
            if query.get("wait_for_change") == "true":
                start = self.metadata[key]
                last = query.get("last_etag")
                if last is None or last == _etag(start):
                    while (self.metadata[key] == start and not self._closing
                           and (left := deadline - time.monotonic()) > 0):
                        self._changed.wait(left)
            value = self.metadata[key]
        return 200, value, {"ETag": _etag(value), "Metadata-Flavor": "Google"}


# Cloud Storage roles -> the object permissions they carry (the ones elastic grants).
_STORAGE_ROLES = {
    "roles/storage.objectViewer": {"storage.objects.get", "storage.objects.list"},
    "roles/storage.objectUser": {"storage.objects.get", "storage.objects.list", "storage.objects.create",
                                 "storage.objects.delete", "storage.objects.update"},
    "roles/storage.objectAdmin": {"storage.objects.get", "storage.objects.list", "storage.objects.create",
                                  "storage.objects.delete", "storage.objects.update"},
}
_RESOURCE_STARTS = re.compile(r'^resource\.name\.startsWith\("([^"]*)"\)$')
_LIST_STARTS = re.compile(r'^api\.getAttribute\("storage\.googleapis\.com/objectListPrefix", ""\)'
                          r'\.startsWith\("([^"]*)"\)$')


def _condition_holds(expression: str, resource: str, list_prefix: str | None) -> bool:
    """A condition of `||`-joined terms, each a `resource.name.startsWith(..)` or objectListPrefix
    test, or a parenthesized `&&` of such tests, each maybe negated with `!`: the CEL forms elastic
    writes; any other form is an error (the fake does not guess)."""
    for term in (t.strip() for t in expression.split("||")):
        if term.startswith("(") and term.endswith(")"):
            if all(_test_holds(f.strip(), resource, list_prefix) for f in term[1:-1].split("&&")):
                return True
        elif _test_holds(term, resource, list_prefix):
            return True
    return False


def _test_holds(test: str, resource: str, list_prefix: str | None) -> bool:
    if test.startswith("!"):
        return not _test_holds(test[1:].strip(), resource, list_prefix)
    if m := _RESOURCE_STARTS.match(test):
        return resource.startswith(m[1])
    if m := _LIST_STARTS.match(test):
        return list_prefix is not None and list_prefix.startswith(m[1])
    raise ValueError(f"fake: condition term {test!r} not understood")


def _etag(value: str) -> str:
    return hashlib.sha1(value.encode()).hexdigest()[:16]


def _error(code: int, message: str, reason: str) -> dict:
    return {"error": {"code": code, "message": message, "errors": [{"message": message, "domain": "global",
                                                                    "reason": reason}]}}


def _empty_scope() -> dict:
    return {"warning": {"code": "NO_RESULTS_ON_PAGE", "message": "There are no results for scope on this page."}}


def _machine_type(name: str, zone: str) -> dict:
    cpus, mem_gib, accel, gpus = MACHINE_TYPES[name]
    mt = {"name": name, "zone": zone, "guestCpus": cpus, "memoryMb": mem_gib * 1024}
    if accel:
        mt["accelerators"] = [{"guestAcceleratorType": accel, "guestAcceleratorCount": gpus}]
    return mt


class _Filter:
    """The filter forms the provider sends: `labels.K = "V"`, `name = "V"`, `name eq REGEX`."""

    def __init__(self, text: str | None):
        self.text = (text or "").strip()
        if not self.text:
            self.fn = lambda r: True
        elif m := re.fullmatch(r'labels\.([\w-]+)\s*=\s*"([^"]*)"', self.text):
            self.fn = lambda r, k=m[1], v=m[2]: (r.get("labels") or {}).get(k) == v
        elif m := re.fullmatch(r'name\s*=\s*"([^"]*)"', self.text):
            self.fn = lambda r, v=m[1]: r.get("name") == v
        elif m := re.fullmatch(r"name eq (.+)", self.text):
            self.fn = lambda r, rx=re.compile(m[1]): rx.fullmatch(r.get("name", "")) is not None
        else:
            raise ValueError(f"fake: filter {self.text!r} not understood")

    def match(self, resource: dict) -> bool:
        return self.fn(resource)


def main() -> None:
    p = argparse.ArgumentParser(description="Local fake of the GCP endpoints elastic's gcp provider uses.")
    p.add_argument("--port", type=int, default=8089)
    p.add_argument("--project", default="elastic-test")
    args = p.parse_args()
    fake = GCPFake(args.port, project=args.project).start()
    print(f"GCP fake at {fake.url}; point elastic at it with:", flush=True)
    for k, v in fake.env().items():
        print(f"export {k}={v}", flush=True)
    try:
        fake._thread.join()
    except KeyboardInterrupt:
        fake.stop()


if __name__ == "__main__":
    main()
