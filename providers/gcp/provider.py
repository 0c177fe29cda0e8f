"""The `gcp` provider: Compute Engine Spot VMs, priced from the Cloud Billing Catalog.

- **Prices**: Spot ("Preemptible" usage type) and on-demand SKUs of the Compute Engine service
  (`6F81-5844-456A`) for GPUs, vCPUs and memory per region, combined into a price per VM: machine
  types with bundled GPUs (a2, a3, g2) and n1 with attached GPUs. Cached on disk (spot prices on GCP
  change at most about monthly).
- **Catalog**: which machine types carry which GPU in which zone, from the `machineTypes` and
  `acceleratorTypes` aggregated lists (a shipped table when those cannot be read).
- **Launch**: `instances.insert` with SPOT provisioning, termination action DELETE, TERMINATE on
  host maintenance, labels `elastic-run` / `elastic-role`, and a startup script that installs the
  project, starts Ray and joins the head; waits on the zone operation, then for the node to join.
- **Errors**: stock-outs and quota (`ZONE_RESOURCE_POOL_EXHAUSTED`, `QUOTA_EXCEEDED`, ...) are a
  `CapacityError` (the driver cools the offer down and tries the next); rate limits and transient
  5xx are retried by google-api-core's `Retry`; missing credentials are one clear line.
- **Preemption**: each VM's watcher (`providers.watcher --cloud gcp`, its poller in
  providers/gcp/watcher.py) waits on the metadata server's `instance/preempted` and
  `instance/maintenance-event` and forwards the notice to the driver through the Ray cluster; the
  driver also polls instance status as a fallback.

- **Token and controller**: the run's Ray cluster token goes to Secret Manager (the node reads it
  with its service account), never into metadata; `resources.head: controller` starts an
  on-demand e2 VM running the head and the driver.

Endpoints: `gcp.compute_endpoint` / `gcp.billing_endpoint` / `gcp.secrets_endpoint` in the recipe,
or ELASTIC_GCP_COMPUTE_ENDPOINT / ELASTIC_GCP_BILLING_ENDPOINT / ELASTIC_GCP_SECRETS_ENDPOINT (the
recipe wins); endpoints on 127.0.0.1 are called without credentials (the tests' fake). The
metadata server base URL comes from ELASTIC_GCP_METADATA_URL. google-cloud SDKs are imported only
when used.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import threading
import time
import uuid
from dataclasses import dataclass

from elastic.errors import UserError, described
from elastic.net.overlay import OVERLAY_PORT
from providers.base import CapacityError, Instance, Offer
from providers.cloud import (CONSOLE_TAIL_LINES, CONTROLLER_TEMPLATE, CloudProvider, NodeJoin, cached_json, head_address,
                             heartbeat_time, join_values, labels_arg, quote, render_bootstrap, usable_price)
from providers.gcp.api import (BILLING_ENDPOINT_ENV, COMPUTE_ENDPOINT_ENV, SECRETS_ENDPOINT_ENV, credentials_or_line,
                              endpoint_override, is_local, label_value)
from providers.gcp.config import GCPSection
from providers.gcp.scope import RunScope

log = logging.getLogger(__name__)

COMPUTE_SERVICE = "services/6F81-5844-456A"      # Compute Engine in the Cloud Billing Catalog
METADATA_URL_ENV = "ELASTIC_GCP_METADATA_URL"
METADATA_URL = "http://metadata.google.internal/computeMetadata/v1"
PREEMPT_NOTICE_S = 30.0                           # GCP stops a preempted Spot VM ~30 s after notice
MAINTENANCE_NOTICE_S = 60.0                       # host maintenance with TERMINATE: at least 60 s
HEARTBEAT_LABEL = "elastic-heartbeat"            # the driver's newest heartbeat, unix seconds (down --orphans)
OPERATION_TIMEOUT_S = 600.0                       # longest we wait on a zone operation
OFFERS_MEMO_S = 30.0                              # offers reused in memory this long
RETRY_INITIAL_S = 0.5                             # google-api-core Retry backoff for 429 / 503
RETRY_MAXIMUM_S = 8.0
RETRY_TIMEOUT_S = 120.0

# Operation error codes that mean "not here, not now": the offer cools down, the next one is tried.
CAPACITY_CODES = {"ZONE_RESOURCE_POOL_EXHAUSTED", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS",
                  "QUOTA_EXCEEDED", "RESOURCE_EXHAUSTED", "STOCKOUT", "quotaExceeded",
                  "resourceExhausted", "zoneResourcePoolExhausted"}

# Accelerator type -> the GPU model name recipes and offers use.
GPU_NAMES = {
    "nvidia-tesla-a100": "A100", "nvidia-a100-80gb": "A100-80GB", "nvidia-h100-80gb": "H100",
    "nvidia-h100-mega-80gb": "H100-MEGA", "nvidia-h200-141gb": "H200", "nvidia-l4": "L4",
    "nvidia-tesla-t4": "T4", "nvidia-tesla-v100": "V100", "nvidia-tesla-p100": "P100", "nvidia-tesla-p4": "P4",
}
ACCELERATOR_TYPES = {v: k for k, v in GPU_NAMES.items()}
# GPUs attached to n1 machine types: accelerator type -> most cards per VM. n1-standard-(8 x cards).
N1_ATTACHABLE = {"nvidia-tesla-t4": 4, "nvidia-tesla-v100": 8, "nvidia-tesla-p100": 4, "nvidia-tesla-p4": 4}
N1_VCPUS_PER_GPU = 8
N1_GIB_PER_VCPU = 3.75
BUNDLED_FAMILIES = ("a2", "a3", "g2")
# On-demand list prices (us-central1) of controller machine types, when the catalog has no E2 SKUs.
CONTROLLER_USD_PER_HOUR = {"e2-standard-2": 0.067006, "e2-standard-4": 0.134012, "e2-standard-8": 0.268024}

# Shipped fallback (used when the machineTypes / acceleratorTypes lists cannot be read):
# machine type -> (vCPUs, memory GiB, accelerator type, GPUs).
FALLBACK_MACHINE_TYPES = {
    **{f"a2-highgpu-{n}g": (12 * n, 85 * n, "nvidia-tesla-a100", n) for n in (1, 2, 4, 8)},
    "a2-megagpu-16g": (96, 1360, "nvidia-tesla-a100", 16),
    **{f"a2-ultragpu-{n}g": (12 * n, 170 * n, "nvidia-a100-80gb", n) for n in (1, 2, 4, 8)},
    **{f"a3-highgpu-{n}g": (26 * n, 234 * n, "nvidia-h100-80gb", n) for n in (1, 2, 4, 8)},
    "g2-standard-4": (4, 16, "nvidia-l4", 1), "g2-standard-8": (8, 32, "nvidia-l4", 1),
    "g2-standard-12": (12, 48, "nvidia-l4", 1), "g2-standard-16": (16, 64, "nvidia-l4", 1),
    "g2-standard-24": (24, 96, "nvidia-l4", 2), "g2-standard-32": (32, 128, "nvidia-l4", 1),
    "g2-standard-48": (48, 192, "nvidia-l4", 4), "g2-standard-96": (96, 384, "nvidia-l4", 8),
}
# accelerator type -> zones offering it (a snapshot; the acceleratorTypes list wins when readable).
FALLBACK_ZONES = {
    "nvidia-tesla-a100": ["us-central1-a", "us-central1-b", "us-central1-c", "us-central1-f", "us-east1-b",
                          "us-west1-b", "us-west3-b", "us-west4-b", "europe-west4-a", "europe-west4-b",
                          "asia-northeast1-a", "asia-northeast1-c", "asia-northeast3-a", "asia-southeast1-b",
                          "asia-southeast1-c", "me-west1-b"],
    "nvidia-a100-80gb": ["us-central1-a", "us-central1-c", "us-east4-c", "us-east5-b", "europe-west4-a",
                         "asia-southeast1-c"],
    "nvidia-h100-80gb": ["us-central1-a", "us-central1-c", "us-east4-a", "us-east4-b", "us-east4-c", "us-east5-a",
                         "us-west1-a", "europe-west4-b", "europe-west4-c", "asia-northeast1-b",
                         "asia-southeast1-b", "asia-southeast1-c"],
    "nvidia-l4": ["us-central1-a", "us-central1-b", "us-central1-c", "us-east1-b", "us-east1-c", "us-east1-d",
                  "us-east4-a", "us-east4-c", "us-west1-a", "us-west1-b", "us-west1-c", "us-west4-a",
                  "europe-west1-b", "europe-west1-c", "europe-west4-a", "europe-west4-b", "europe-west4-c",
                  "asia-east1-a", "asia-east1-c", "asia-northeast1-a", "asia-northeast1-c", "asia-southeast1-a",
                  "asia-southeast1-b", "asia-southeast1-c"],
    "nvidia-tesla-t4": ["us-central1-a", "us-central1-b", "us-central1-c", "us-central1-f", "us-east1-c",
                        "us-east1-d", "us-east4-a", "us-east4-b", "us-west1-a", "us-west1-b", "europe-west1-b",
                        "europe-west1-c", "europe-west4-a", "europe-west4-b", "europe-west4-c", "asia-east1-a",
                        "asia-east1-c", "asia-southeast1-a", "asia-southeast1-b"],
    "nvidia-tesla-v100": ["us-central1-a", "us-central1-b", "us-central1-c", "us-central1-f", "us-west1-a",
                          "us-west1-b", "europe-west4-a", "europe-west4-b", "europe-west4-c", "asia-east1-c"],
}


@dataclass(frozen=True)
class VMShape:
    """A machine type carrying GPUs in one zone.

    Args:
        machine_type: e.g. `a2-highgpu-8g`, `n1-standard-8`.
        zone: the zone it is offered in.
        accelerator_type: e.g. `nvidia-tesla-a100`.
        gpus: GPUs per VM.
        cpus: vCPUs per VM.
        memory_gib: memory per VM, GiB.
        attached: GPUs are attached to an n1 VM (sent as guest accelerators) rather than bundled.
    """

    machine_type: str
    zone: str
    accelerator_type: str
    gpus: int
    cpus: int
    memory_gib: float
    attached: bool

    @property
    def region(self) -> str:
        return self.zone.rsplit("-", 1)[0]

    @property
    def family(self) -> str:
        return self.machine_type.split("-", 1)[0]


def gpu_matches(requested: str, gpu: str) -> bool:
    """`A100` asks for any A100 (40 GB or 80 GB); `A100-80GB` for that one only."""
    requested, gpu = requested.upper(), gpu.upper()
    return gpu == requested or gpu.startswith(requested + "-")


def run_network_tag(run: str) -> str:
    """The network tag (and firewall rule name) of run `run`'s VMs: `elastic-run-<slug>`, a valid
    tag (`[a-z]([-a-z0-9]{0,61}[a-z0-9])?`) kept distinct for long names by a digest."""
    slug = re.sub(r"[^a-z0-9-]+", "-", run.lower()).strip("-") or "run"
    tag = f"elastic-run-{slug}"
    if len(tag) > 63:
        import hashlib
        tag = f"elastic-run-{slug[:38].strip('-')}-{hashlib.sha256(run.encode()).hexdigest()[:12]}"
    return tag


def _instance_name(run: str, role: str) -> str:
    """A valid, unique instance name: `[a-z]([-a-z0-9]{0,61}[a-z0-9])?`."""
    slug = re.sub(r"[^a-z0-9-]+", "-", run.lower()).strip("-")[:36].strip("-") or "run"
    return f"elastic-{slug}-{role[:4]}-{secrets.token_hex(3)}"


def _usd(money) -> float:
    return int(money.units or 0) + int(money.nanos or 0) / 1e9


# -- prices --------------------------------------------------------------------------------------

_GPU_SKU = re.compile(r"\bNvidia (?:Tesla )?(?P<model>[A-Z]\d+)(?: (?P<mem>\d+GB))?(?: (?P<mega>Mega))? GPU\b")
_VM_SKU = re.compile(r"\b(?P<family>A2|A3|G2|E2|N1 Predefined) Instance (?P<kind>Core|Ram)\b")
_SKIP_SKU = re.compile(r"Commitment|Reserved|Workstation|DWS|Dynamic Workload|Calendar|Sole Tenancy|Custom")


def parse_skus(skus) -> dict[str, float]:
    """Billing Catalog SKUs -> {"KIND|KEY|REGION|spot|od": USD per unit-hour}, KIND gpu (KEY a GPU
    name), core or ram (KEY a machine family; ram per GiB). Only on-demand and Spot usage types."""
    out: dict[str, float] = {}
    for sku in skus:
        usage = sku.category.usage_type
        if usage not in ("OnDemand", "Preemptible") or sku.category.resource_family != "Compute":
            continue
        desc = sku.description
        if _SKIP_SKU.search(desc) or not sku.pricing_info:
            continue
        if m := _GPU_SKU.search(desc):
            name = m["model"] + ("-80GB" if m["model"] == "A100" and m["mem"] == "80GB" else "")
            name += "-MEGA" if m["mega"] else ""
            key = f"gpu|{name}"
        elif m := _VM_SKU.search(desc):
            key = f"{m['kind'].lower()}|{m['family'].split()[0].lower()}"
        else:
            continue
        rates = sku.pricing_info[0].pricing_expression.tiered_rates
        if not rates:
            continue
        usd = usable_price(_usd(rates[-1].unit_price), f"SKU {desc!r}")
        if usd is None:
            continue
        for region in sku.service_regions:
            k = f"{key}|{region}|{'spot' if usage == 'Preemptible' else 'od'}"
            # Several SKUs of one kind in a region: keep the cheapest (they are variants of one price).
            out[k] = min(usd, out.get(k, usd))
    return out


def vm_price(prices: dict[str, float], shape: VMShape, spot: bool) -> float | None:
    """USD per hour of one VM of `shape` (vCPUs + memory + GPUs), or None when a part is unpriced."""
    kind = "spot" if spot else "od"
    family = "n1" if shape.attached else shape.family
    parts = [(f"core|{family}|{shape.region}|{kind}", shape.cpus),
             (f"ram|{family}|{shape.region}|{kind}", shape.memory_gib)]
    if shape.gpus:
        parts.append((f"gpu|{GPU_NAMES.get(shape.accelerator_type, '?')}|{shape.region}|{kind}", shape.gpus))
    total = 0.0
    for key, amount in parts:
        if key not in prices:
            return None
        total += prices[key] * amount
    return round(total, 6)


# -- the provider --------------------------------------------------------------------------------

_GCP_REGION_RE = re.compile(r"^[a-z]+-[a-z]+\d+$")


class GCPProvider(CloudProvider):
    """Args:
        recipe: the run's recipe (its `gcp` section, `resources.join_timeout_s`).
        cluster: the run's Ray cluster (VMs join its head), or None for commands that do not
            train (`elastic prices`, `elastic down`): offers, list and terminate still work.
        run_name: the run's name (label `elastic-run` on every VM).
    """

    name = "gcp"
    section = GCPSection
    notice_s = PREEMPT_NOTICE_S
    storage_scheme = "gs"
    storage_usd_per_gb_month = 0.020   # Cloud Storage Standard, regional list price

    def __init__(self, recipe, cluster, run_name: str):
        super().__init__(recipe, cluster, run_name)
        self.config = section = recipe.gcp
        self.compute_endpoint = endpoint_override(section.compute_endpoint, COMPUTE_ENDPOINT_ENV)
        self.billing_endpoint = endpoint_override(section.billing_endpoint, BILLING_ENDPOINT_ENV)
        self._project = section.project
        self._credentials = None
        self._clients: dict[str, object] = {}
        self._client_lock = threading.Lock()
        self._memo: tuple[float, tuple, list[Offer]] | None = None
        self.secrets_endpoint = endpoint_override(section.secrets_endpoint, SECRETS_ENDPOINT_ENV)
        self._tokens: set[str] = set()        # runs whose token secret this provider created
        self._firewalls: set[str] = set()     # runs whose firewall rule this provider created
        self._firewall_lock = threading.Lock()
        self._token_lock = threading.Lock()
        self._scopes: dict[str, RunScope] = {}   # runs whose service account this provider made

    @classmethod
    def accelerator_models(cls) -> set[str]:
        return set(GPU_NAMES.values())

    @classmethod
    def open_storage(cls, uri: str, bucket: str, prefix: str, create: bool):
        """Cloud Storage (`gs://bucket/prefix`; providers/gcp/storage.py)."""
        from providers.gcp.storage import GCSStorage

        return GCSStorage(uri, bucket, prefix, create)

    @classmethod
    def open_keys(cls, uri: str, bucket: str):
        """Secret Manager of the project (providers/gcp/storage.py)."""
        from providers.gcp.storage import SecretKeys

        return SecretKeys(uri)

    @classmethod
    def configured(cls) -> str | None:
        if is_local(os.environ.get(COMPUTE_ENDPOINT_ENV)) and is_local(os.environ.get(BILLING_ENDPOINT_ENV)):
            return None
        creds, why = credentials_or_line()
        return None if creds is not None else why

    # -- clients ---------------------------------------------------------------------------------

    def _client_kwargs(self, endpoint: str | None) -> dict:
        kwargs: dict = {"transport": "rest"}
        if endpoint:
            kwargs["client_options"] = {"api_endpoint": endpoint}
        if is_local(endpoint):
            from google.auth.credentials import AnonymousCredentials
            kwargs["credentials"] = AnonymousCredentials()   # a local endpoint (tests) takes none
        else:
            kwargs["credentials"] = self._default_credentials()
        return kwargs

    def _default_credentials(self):
        if self._credentials is None:
            creds, project = credentials_or_line()
            if creds is None:
                raise UserError(f"gcp: {project}")
            self._credentials = creds
            self._project = self._project or project
        return self._credentials

    def _client(self, kind: str):
        with self._client_lock:
            if kind not in self._clients:
                if kind == "billing":
                    from google.cloud import billing_v1
                    self._clients[kind] = billing_v1.CloudCatalogClient(**self._client_kwargs(self.billing_endpoint))
                elif kind == "secrets":
                    from google.cloud import secretmanager_v1
                    self._clients[kind] = secretmanager_v1.SecretManagerServiceClient(
                        **self._client_kwargs(self.secrets_endpoint))
                else:
                    from google.cloud import compute_v1
                    cls = {"instances": compute_v1.InstancesClient, "zones": compute_v1.ZonesClient,
                           "machine_types": compute_v1.MachineTypesClient,
                           "zone_operations": compute_v1.ZoneOperationsClient,
                           "firewalls": compute_v1.FirewallsClient,
                           "accelerator_types": compute_v1.AcceleratorTypesClient}[kind]
                    self._clients[kind] = cls(**self._client_kwargs(self.compute_endpoint))
            return self._clients[kind]

    def cache_origin(self, endpoint: str | None) -> str:
        """Where answers from `endpoint` come from, for the price cache's key: the endpoint, the
        project and the identity of the credentials (an account's email or client id, no secret)."""
        if is_local(endpoint):
            who = "anonymous"
        else:
            creds = self._default_credentials()
            who = (getattr(creds, "service_account_email", None) or getattr(creds, "client_id", None)
                   or type(creds).__name__)
        project = (self._project or os.environ.get("GOOGLE_CLOUD_PROJECT")
                   or os.environ.get("CLOUDSDK_CORE_PROJECT") or "")
        return f"gcp|{endpoint or 'google'}|{project}|{who}"

    def preflight(self, resources) -> list[str]:
        """Credentials resolve (unless every endpoint is a local one), the project is known and
        answers, every GCP region of the recipe has zones that are up, the accelerator is one GCP
        offers, and the region's GPU quota covers `world.min_replicas` VMs where the regions API
        says."""
        from elastic.errors import UserError

        if not (is_local(self.compute_endpoint) and is_local(self.billing_endpoint)):
            creds, why = credentials_or_line()
            if creds is None:
                return [f"gcp: {why}"]
        model, _, count = (resources.accelerators or "").partition(":")
        if not model:
            return ["gcp: resources.accelerators: the gcp provider needs a GPU, e.g. L4:1"]
        accel = next((a for a, name in GPU_NAMES.items() if gpu_matches(model, name)), None)
        if accel is None:
            return [f"gcp: resources.accelerators: GCP offers no {model!r}; known: "
                    f"{', '.join(sorted(set(GPU_NAMES.values())))}"]
        try:
            project, retry = self.project, self._retry()
            zones = self._call("zones", lambda: list(self._client("zones").list(project=project, retry=retry)))
        except UserError as exc:
            return [line if line.startswith("gcp:") else f"gcp: {line}" for line in exc.lines]
        except Exception as exc:   # e.g. NotFound: the project does not exist or the API is off
            return [f"gcp: project {self._project!r}: cannot list zones ({described(exc, 160)})"]
        up = {z.name.rsplit("-", 1)[0] for z in zones if z.status == "UP"}
        known = {z.name.rsplit("-", 1)[0] for z in zones}
        mine = [r for r in resources.regions if _GCP_REGION_RE.match(r)]
        problems = []
        if resources.regions and not mine:
            problems.append(f"gcp: resources.regions names no GCP region ({', '.join(resources.regions)})")
        for region in mine:
            if region not in known:
                problems.append(f"gcp: region {region} does not exist (project {project})")
            elif region not in up:
                problems.append(f"gcp: region {region} has no zone up")
        gpus = int(count or 1) * self.recipe.world.min_replicas
        for region in [r for r in mine if r in up]:
            problems += self._quota_problems(project, region, accel, gpus, resources.spot)
        return problems

    def _quota_problems(self, project: str, region: str, accel: str, gpus: int, spot: bool) -> list[str]:
        """One line when the region's quota for the accelerator (`PREEMPTIBLE_NVIDIA_L4_GPUS`, ...)
        is below `gpus`. The regions API not answering is no problem (logged)."""
        metric = ("PREEMPTIBLE_" if spot else "") + accel.upper().replace("-", "_").replace(
            "NVIDIA_TESLA_", "NVIDIA_") + "_GPUS"
        try:
            from google.cloud import compute_v1
            client = compute_v1.RegionsClient(**self._client_kwargs(self.compute_endpoint))
            quotas = {q.metric: q.limit for q in client.get(project=project, region=region, retry=self._retry()).quotas}
        except Exception as exc:
            log.info("quota of %s in %s not read: %s", metric, region, exc)
            return []
        if metric in quotas and quotas[metric] < gpus:
            return [f"gcp: quota {metric} in {region} is {quotas[metric]:g}; world.min_replicas needs {gpus}: "
                    "ask for more in the console (IAM & Admin > Quotas), or lower world.min_replicas"]
        return []

    @property
    def project(self) -> str:
        if not self._project:
            self._project = os.environ.get("GOOGLE_CLOUD_PROJECT") or os.environ.get("CLOUDSDK_CORE_PROJECT")
        if not self._project and not is_local(self.compute_endpoint):
            self._default_credentials()   # Application Default Credentials may name the project
        if not self._project:
            raise UserError("gcp: no project: set gcp.project in the recipe, or GOOGLE_CLOUD_PROJECT")
        return self._project

    @staticmethod
    def _retry():
        """Rate limits (429, or 403 rateLimitExceeded) and transient 5xx are retried with backoff by
        google-api-core."""
        from google.api_core import retry
        return retry.Retry(predicate=_retryable, initial=RETRY_INITIAL_S, maximum=RETRY_MAXIMUM_S,
                           multiplier=2.0, timeout=RETRY_TIMEOUT_S)

    def _call(self, what: str, fn):
        """Run an API call. A refusal of our identity, an API out of reach or retries given up on
        become one clear line (UserError); other API errors propagate."""
        import requests
        from google.api_core import exceptions

        try:
            return fn()
        except (exceptions.Unauthorized, exceptions.Forbidden) as exc:
            if capacity_code(exc):
                raise   # a quota refusal: capacity, for the caller to handle
            raise UserError(f"gcp: {what}: access refused: {exc.message}") from None
        except exceptions.RetryError as exc:
            raise UserError(f"gcp: {what}: still failing after retries: {exc.cause or exc}") from None
        except requests.exceptions.RequestException as exc:
            raise UserError(f"gcp: {what}: cannot reach the API ({type(exc).__name__})") from None

    # -- prices and catalog ----------------------------------------------------------------------

    def sku_prices(self) -> tuple[dict[str, float], float]:
        """({"KIND|KEY|REGION|spot|od": USD per unit-hour}, read_at) from the Billing Catalog."""
        def fetch():
            client = self._client("billing")
            return self._call("Cloud Billing Catalog", lambda: parse_skus(client.list_skus(
                request={"parent": COMPUTE_SERVICE, "page_size": 5000}, retry=self._retry())))
        return cached_json("gcp-skus", fetch, self.config.price_cache_ttl_s,
                           origin=self.cache_origin(self.billing_endpoint))

    def catalog(self) -> list[VMShape]:
        """Every (machine type, zone) carrying GPUs: read from the API, the shipped table if the
        lists cannot be read (an identity without compute.machineTypes.list, say)."""
        def fetch():
            try:
                return [s.__dict__ for s in self._read_catalog()]
            except UserError as exc:
                if "access refused" not in str(exc):
                    raise
                log.warning("%s; using the shipped machine-type table", exc)
                return [s.__dict__ for s in fallback_catalog()]
        rows, _ = cached_json("gcp-catalog", fetch, self.config.price_cache_ttl_s,
                              origin=self.cache_origin(self.compute_endpoint))
        return [VMShape(**r) for r in rows]

    def _read_catalog(self) -> list[VMShape]:
        project, retry = self.project, self._retry()
        zones_up = {z.name for z in self._call("zones", lambda: list(self._client("zones").list(
            project=project, retry=retry))) if z.status == "UP"}
        shapes = []
        mt_filter = "name eq (" + "|".join(BUNDLED_FAMILIES) + ")-.*"
        pages = self._call("machine types", lambda: list(self._client("machine_types").aggregated_list(
            request={"project": project, "filter": mt_filter}, retry=retry)))
        for scope, scoped in pages:
            zone = scope.rsplit("/", 1)[-1]
            for mt in scoped.machine_types:
                if zone not in zones_up or not mt.accelerators or mt.name.split("-")[0] not in BUNDLED_FAMILIES:
                    continue
                acc = mt.accelerators[0]
                shapes.append(VMShape(mt.name, zone, acc.guest_accelerator_type, acc.guest_accelerator_count,
                                      mt.guest_cpus, round(mt.memory_mb / 1024, 3), attached=False))
        pages = self._call("accelerator types", lambda: list(self._client("accelerator_types").aggregated_list(
            request={"project": project}, retry=retry)))
        for scope, scoped in pages:
            zone = scope.rsplit("/", 1)[-1]
            for at in scoped.accelerator_types:
                if zone in zones_up and at.name in N1_ATTACHABLE:
                    shapes.extend(_n1_shapes(at.name, zone, min(at.maximum_cards_per_instance or 1,
                                                                 N1_ATTACHABLE[at.name])))
        return shapes

    def offers(self, resources) -> list[Offer]:
        """Offers for `resources.accelerators` (MODEL[:COUNT]) in `resources.regions`, cheapest per
        GPU-hour first. Without an accelerator, none: elastic rents GPU VMs on GCP."""
        if not resources.accelerators:
            return []
        model = resources.accelerators.partition(":")[0]
        if not any(gpu_matches(model, name) for name in GPU_NAMES.values()):
            from elastic.errors import UserError
            raise UserError(f"resources.accelerators: GCP offers no {model!r}; known: "
                            f"{', '.join(sorted(set(GPU_NAMES.values())))}")
        key = (resources.accelerators, tuple(resources.regions), resources.spot, resources.max_usd_per_hour)
        if self._memo and self._memo[1] == key and time.monotonic() - self._memo[0] < OFFERS_MEMO_S:
            return list(self._memo[2])   # the driver asks often; the disk caches change rarely
        out = self._offers(resources)
        self._memo = (time.monotonic(), key, out)
        return list(out)

    def _offers(self, resources) -> list[Offer]:
        model, _, count = resources.accelerators.partition(":")
        prices, read_at = self.sku_prices()
        regions = set(resources.regions)
        out = []
        for shape in self.catalog():
            gpu = GPU_NAMES.get(shape.accelerator_type)
            if gpu is None or not gpu_matches(model, gpu) or (count and shape.gpus != int(count)):
                continue
            if regions and shape.region not in regions:
                continue
            spot_usd, od_usd = vm_price(prices, shape, True), vm_price(prices, shape, False)
            usd = spot_usd if resources.spot else od_usd
            if usd is None:
                continue   # no SKU prices this shape here: it cannot be ranked
            if resources.max_usd_per_hour is not None and usd > resources.max_usd_per_hour:
                continue
            out.append(Offer(cloud="gcp", region=shape.region, zone=shape.zone, instance_type=shape.machine_type,
                             gpu=gpu, gpus=shape.gpus, cpus=shape.cpus, spot=resources.spot, usd_per_hour=usd,
                             on_demand_usd_per_hour=od_usd if od_usd is not None else usd, read_at=read_at))
        return sorted(out, key=lambda o: (o.usd_per_hour / max(o.gpus, 1), o.zone, o.instance_type))

    # -- renting ---------------------------------------------------------------------------------

    def instance_body(self, name: str, offer: Offer, run: str, role: str, startup_script: str,
                      service_account: str | None = None):
        """The `instances.insert` body for one VM of `offer` (no credentials anywhere in it); it runs
        as `service_account` (default `gcp.service_account`)."""
        from google.cloud import compute_v1

        s, zone = self.config, offer.zone
        scheduling = compute_v1.Scheduling(
            on_host_maintenance="TERMINATE" if offer.gpus or offer.spot else "MIGRATE",   # GPU VMs cannot migrate
            automatic_restart=not offer.spot,
            provisioning_model="SPOT" if offer.spot else "STANDARD")
        # A preempted VM, and a node at resources.max_vm_hours, is deleted: it leaves nothing to pay
        # for. (The controller lives as long as its run; its watcher ends it when the driver stops.)
        scheduling.instance_termination_action = "DELETE"
        if role != "controller":
            scheduling.max_run_duration = compute_v1.Duration(seconds=round(self.recipe.resources.max_vm_hours * 3600))
        nic = compute_v1.NetworkInterface(network=s.network)
        if s.subnetwork:
            nic.subnetwork = s.subnetwork
        if s.external_ip:
            nic.access_configs = [compute_v1.AccessConfig(name="External NAT", type_="ONE_TO_ONE_NAT")]
        body = compute_v1.Instance(
            name=name,
            machine_type=f"zones/{zone}/machineTypes/{offer.instance_type}",
            scheduling=scheduling,
            labels={"elastic-run": label_value(run), "elastic-role": label_value(role), "elastic-managed": "true"},
            # The run's own tag: its firewall rule opens the overlay's UDP port, nothing else.
            tags=compute_v1.Tags(items=[*s.network_tags, run_network_tag(run)]),
            network_interfaces=[nic],
            disks=[compute_v1.AttachedDisk(
                boot=True, auto_delete=True,
                initialize_params=compute_v1.AttachedDiskInitializeParams(source_image=s.image,
                                                                          disk_size_gb=s.boot_disk_gb))],
            metadata=compute_v1.Metadata(items=[
                compute_v1.Items(key="startup-script", value=startup_script),
                compute_v1.Items(key="elastic-run", value=run),   # the exact name (labels are lowercased)
                compute_v1.Items(key="elastic-offer", value=json.dumps(offer.to_dict(), sort_keys=True)),
            ]),
        )
        accel = ACCELERATOR_TYPES.get(offer.gpu)
        if offer.instance_type.startswith("n1-") and accel:
            body.guest_accelerators = [compute_v1.AcceleratorConfig(
                accelerator_type=f"zones/{zone}/acceleratorTypes/{accel}", accelerator_count=offer.gpus)]
        email = service_account or s.service_account
        if email:
            body.service_accounts = [compute_v1.ServiceAccount(
                email=email, scopes=["https://www.googleapis.com/auth/cloud-platform"])]
        return body

    def startup_script(self, offer: Offer, run: str, role: str, join: NodeJoin | None = None) -> str:
        """The node bootstrap (`infra/bootstrap.sh.tmpl`) for one VM: install the project, join the
        run's overlay (with `join`), join the run's Ray head labelled with the instance name, start
        the notice watcher."""
        labels = {"elastic.cloud": "gcp", "elastic.region": offer.region, "elastic.zone": offer.zone,
                  "elastic.instance_type": offer.instance_type, "elastic.run": run, "elastic.role": role}
        return render_bootstrap(
            run=quote(run), cloud="gcp", install=self.config.install,
            instance_id_cmd=f"curl -sf -H 'Metadata-Flavor: Google' {METADATA_URL}/instance/name",
            token_cmd=self._token_cmd(run), token_source="Secret Manager, with the VM's service account",
            head_address=quote(head_address(self.cluster)) if self.cluster is not None else "''",
            gpus=str(offer.gpus), labels=labels_arg(labels), **join_values(join, "Secret Manager"),
            **self.autodown_values())

    def node_key_secret(self, run: str, name: str) -> str:
        """The Secret Manager secret holding a node's overlay private key."""
        return f"elastic-{label_value(run)}-{name}"

    def _put_node_key(self, offer: Offer, run: str, name: str, private_key: str) -> str:
        secret = self.node_key_secret(run, name)
        self._put_secret(secret, private_key, run)
        return (f"gcloud secrets versions access latest --secret={quote(secret)} "
                f"--project={quote(self.project)}")

    def _node_key_secrets(self, run: str) -> list[str]:
        """Names of the overlay key secrets of run `run`'s nodes still stored (by the run's label
        and the node-key name form: never its token or checkpoint key)."""
        client, prefix = self._client("secrets"), self.node_key_secret(run, "wg-")
        listed = self._call("list secrets", lambda: client.list_secrets(request={
            "parent": f"projects/{self.project}", "filter": f"labels.elastic-run={label_value(run)}"},
            retry=self._retry()))
        return [n for n in (sec.name.rsplit("/", 1)[-1] for sec in listed) if n.startswith(prefix)]

    def _drop_node_key(self, offer: Offer, run: str, name: str) -> None:
        from google.api_core import exceptions

        secret = f"projects/{self.project}/secrets/{self.node_key_secret(run, name)}"
        try:
            self._call("delete secret", lambda: self._client("secrets").delete_secret(name=secret, retry=self._retry()))
        except exceptions.NotFound:
            pass

    def _addresses(self, instance: Instance) -> tuple[str | None, str | None]:
        vm = self._call("get instance", lambda: self._client("instances").get(
            project=self.project, zone=instance.offer.zone, instance=instance.instance_id, retry=self._retry()))
        nic = vm.network_interfaces[0] if vm.network_interfaces else None
        if nic is None:
            return None, None
        public = next((a.nat_i_p for a in nic.access_configs if a.nat_i_p), None)
        return public, nic.network_i_p or None

    def site(self, offer: Offer) -> str:
        """The run's VPC network: a GCP VPC spans every region, so all its VMs reach each other privately."""
        return f"gcp/{self.config.network.rsplit('/', 1)[-1]}"

    def token_secret(self, run: str) -> str:
        """The Secret Manager secret holding the run's Ray cluster token."""
        return f"elastic-{label_value(run)}-ray-token"

    def _token_cmd(self, run: str) -> str:
        """Shell lines that fetch the cluster token on the node with its service account. The token
        itself goes to Secret Manager (created once per run, deleted at close), never into metadata."""
        token = os.environ.get("RAY_AUTH_TOKEN")
        if not token:
            return "# The head does not use Ray token authentication (RAY_AUTH_TOKEN unset)."
        name, project = self.token_secret(run), self.project
        with self._token_lock:
            if run not in self._tokens:
                self._put_secret(name, token, run)
                self._tokens.add(run)
        return ("export RAY_AUTH_MODE=token\n"
                f"RAY_AUTH_TOKEN=\"$(gcloud secrets versions access latest --secret={quote(name)} "
                f"--project={quote(project)})\"\nexport RAY_AUTH_TOKEN")

    def _put_secret(self, name: str, value: str, run: str) -> None:
        from google.api_core import exceptions

        client, project = self._client("secrets"), self.project
        try:
            self._call("create secret", lambda: client.create_secret(request={
                "parent": f"projects/{project}", "secret_id": name,
                "secret": {"replication": {"automatic": {}},
                           "labels": {"elastic-run": label_value(run), "elastic-managed": "true"}}},
                retry=self._retry()))
        except exceptions.AlreadyExists:
            pass   # a resumed run, or a second launch racing ours: a new version below either way
        self._call("add secret version", lambda: client.add_secret_version(request={
            "parent": f"projects/{project}/secrets/{name}", "payload": {"data": value.encode()}},
            retry=self._retry()))

    def _ensure_firewall(self, run: str) -> None:
        """Create the run's firewall rule (once): ingress on the overlay's UDP port (51820) only, from
        anywhere, to VMs tagged with the run's tag. Everything between the run's nodes (Ray,
        torch.distributed) runs inside the WireGuard overlay, which answers only keys the run's
        driver admitted: another run's VMs reach nothing, and no VPC peering is needed."""
        from google.api_core import exceptions
        from google.cloud import compute_v1

        tag = run_network_tag(run)
        with self._firewall_lock:
            if run in self._firewalls:
                return
            rule = compute_v1.Firewall(
                name=tag, network=self.config.network, direction="INGRESS", priority=1000,
                source_ranges=["0.0.0.0/0"], target_tags=[tag],
                allowed=[compute_v1.Allowed(I_p_protocol="udp", ports=[str(OVERLAY_PORT)])],
                description=f"elastic: the overlay's UDP port of run {run}'s VMs")
            client = self._client("firewalls")
            try:
                self._call("insert firewall rule", lambda: client.insert(
                    project=self.project, firewall_resource=rule, retry=self._retry()))
                log.info("gcp: created firewall rule %s", tag)
            except exceptions.Conflict:
                pass   # left by an earlier run of the same name: the same rule
            self._firewalls.add(run)

    def _scope(self, run: str) -> RunScope:
        with self._token_lock:
            return self._scopes.setdefault(run, RunScope(self, run))

    def remove_run_resources(self, run: str, wait_s: float = 0.0) -> list[str]:
        """Delete what run `run` owned besides VMs: its service account (and its grants), token
        secret, the overlay keys of nodes that never joined (a driver killed mid-launch) and its
        firewall rule. Its checkpoint key stays (its checkpoints need it). Returns what was left
        (one line each)."""
        from google.api_core import exceptions

        with self._token_lock:
            scope = self._scopes.pop(run, None) or RunScope(self, run)
        left = scope.remove() if self.config.run_service_accounts else []
        secrets = self._client("secrets")

        def secret(name):
            return ("secret " + name, lambda: secrets.delete_secret(
                name=f"projects/{self.project}/secrets/{name}", retry=self._retry()))
        try:
            node_keys = self._node_key_secrets(run)
        except Exception as exc:   # teardown goes on without them
            node_keys = []
            left.append(f"node key secrets of {run}: {exc}")
        for what, fn in (secret(self.token_secret(run)), *map(secret, node_keys),
                         ("firewall rule " + run_network_tag(run), lambda: self._client("firewalls").delete(
                             project=self.project, firewall=run_network_tag(run), retry=self._retry()))):
            try:
                self._call("delete " + what, fn)
            except exceptions.NotFound:
                pass
            except Exception as exc:   # teardown goes on; what is left is named to delete by hand
                left.append(f"{what}: {exc}")
        with self._firewall_lock:
            self._firewalls.discard(run)
        self._tokens.discard(run)
        for line in left:
            log.warning("gcp: left %s", line)
        return left

    def close(self) -> None:
        """Stop launches waiting for their node, and delete what the run owned besides VMs
        (`remove_run_resources`)."""
        super().close()
        for run in sorted(self._tokens | self._firewalls | set(self._scopes)):
            self.remove_run_resources(run)

    def controller_offer(self) -> Offer:
        """The on-demand CPU VM that runs the Ray head and the driver (`resources.head: controller`),
        priced from the Billing Catalog (its E2 SKUs) where listed, else the shipped list price."""
        s = self.config
        zone = s.controller_zone or next((f"{r}-a" for r in self.recipe.resources.regions
                                          if re.fullmatch(r"[a-z]+-[a-z]+\d+", r)), "us-central1-a")
        region = zone.rsplit("-", 1)[0]
        m = re.fullmatch(r"e2-standard-(\d+)", s.controller_machine_type)
        usd, read_at = None, time.time()
        if m:
            cpus = int(m[1])
            prices, read_at = self.sku_prices()
            usd = vm_price(prices, VMShape(s.controller_machine_type, zone, "", 0, cpus, 4.0 * cpus, False), False)
        if usd is None:
            usd = CONTROLLER_USD_PER_HOUR.get(s.controller_machine_type, 0.0)
        return Offer(cloud="gcp", region=region, zone=zone, instance_type=s.controller_machine_type, gpu="", gpus=0,
                     cpus=int(m[1]) if m else 0, spot=False, usd_per_hour=usd, on_demand_usd_per_hour=usd,
                     read_at=read_at)

    def launch_controller(self, run: str, recipe_text: str) -> Instance:
        """Start the controller VM (does not wait for it: it is not a node of this machine's
        cluster). Its startup script carries the recipe (recipes hold no secrets) and no
        credentials: the driver there uses the VM's service account (`gcp.controller_service_account`)."""
        import base64

        s = self.config
        offer = self.controller_offer()
        script = render_bootstrap(
            CONTROLLER_TEMPLATE, run=run, install=s.install,
            public_ip_cmd=f"curl -sf -H 'Metadata-Flavor: Google' "
                          f"{METADATA_URL}/instance/network-interfaces/0/access-configs/0/external-ip",
            cloud="gcp", instance_id_cmd=f"curl -sf -H 'Metadata-Flavor: Google' {METADATA_URL}/instance/name",
            **self.autodown_values(),
            instance_profile=f"service account {s.controller_service_account or 'none set: gcp.controller_service_account'}",
            recipe_b64=base64.b64encode(recipe_text.encode()).decode())
        return self._create(offer, run, "controller", script, service_account=s.controller_service_account)

    def _create(self, offer: Offer, run: str, role: str, startup_script: str | None = None,
                service_account: str | None = None, join: NodeJoin | None = None) -> Instance:
        from google.api_core import exceptions

        self._ensure_firewall(run)
        scope = self._scope(run) if role != "controller" and self.config.run_service_accounts else None
        if scope is not None:
            service_account = scope.service_account()
        name = _instance_name(run, role)
        body = self.instance_body(name, offer, run, role, startup_script or self.startup_script(offer, run, role, join),
                                  service_account=service_account)
        if scope is not None and run in self._tokens:   # before the VM boots and reads it
            scope.grant_token(self.token_secret(run))
        if scope is not None and join is not None:      # its overlay key, the same way
            scope.grant_secret(self.node_key_secret(run, join.key_name))
        client, project = self._client("instances"), self.project
        try:
            # request_id makes a retried insert idempotent: the API creates the VM once.
            request = {"project": project, "zone": offer.zone, "instance_resource": body,
                       "request_id": str(uuid.uuid4())}
            op = self._call("insert instance", lambda: client.insert(request=request, retry=self._retry()))
            self._wait_operation(offer.zone, op.name)
        except exceptions.GoogleAPICallError as exc:
            code = capacity_code(exc)
            if code:
                raise CapacityError(f"{offer.instance_type} in {offer.zone}: {code}") from None
            raise
        if scope is not None:
            try:
                scope.grant_self_delete(offer.zone, name)
            except UserError as exc:   # the VM runs all the same; its autodown can only stop it
                log.warning("gcp: %s may not delete itself: %s", name, exc)
        log.info("gcp: %s created in %s (%s, $%.4f/h)", name, offer.zone, offer.instance_type, offer.usd_per_hour)
        return Instance(instance_id=name, offer=offer, run=run, role=role, launched_at=time.time(),
                        labels=dict(body.labels))

    def _wait_operation(self, zone: str, name: str) -> None:
        """Block on zone operation `name` (`zoneOperations.wait` answers when it is done, or after
        about two minutes); raise its error as the API exception it maps to. (Our own operations
        client: the one behind the client's extended operation ignores the endpoint override.)"""
        from google.api_core import exceptions
        from google.cloud import compute_v1

        ops, project = self._client("zone_operations"), self.project
        deadline = time.monotonic() + OPERATION_TIMEOUT_S
        while True:
            op = self._call("wait on operation", lambda: ops.wait(project=project, zone=zone, operation=name,
                                                                  retry=self._retry()))
            if op.status == compute_v1.Operation.Status.DONE:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"gcp: operation {name} in {zone} not done after {OPERATION_TIMEOUT_S:g} s")
        if op.error.errors:
            raise exceptions.from_http_status(op.http_error_status_code or 500,
                                              op.http_error_message or op.error.errors[0].message,
                                              errors=list(op.error.errors))

    def console_tail(self, instance: Instance, lines: int = CONSOLE_TAIL_LINES) -> str:
        """instances.getSerialPortOutput of port 1 (`contents`)."""
        out = self._call("read serial port", lambda: self._client("instances").get_serial_port_output(
            project=self.project, zone=instance.offer.zone, instance=instance.instance_id, retry=self._retry()))
        return "\n".join((out.contents or "").splitlines()[-lines:])

    def _terminate_vm(self, instance: Instance) -> None:
        """Delete the VM and wait for the zone operation (a VM already gone is fine)."""
        from google.api_core import exceptions

        client, project = self._client("instances"), self.project
        try:
            request = {"project": project, "zone": instance.offer.zone, "instance": instance.instance_id,
                       "request_id": str(uuid.uuid4())}
            op = self._call("delete instance", lambda: client.delete(request=request, retry=self._retry()))
            self._wait_operation(instance.offer.zone, op.name)
        except exceptions.NotFound:
            pass
        log.info("gcp: %s deleted", instance.instance_id)

    def _tag_heartbeat(self, instances: list[Instance], now_s: float) -> None:
        """setLabels on each VM (GCP has no batch form); it needs the VM's current label
        fingerprint, so each is read first. A VM gone meanwhile is skipped."""
        from google.api_core import exceptions
        from google.cloud import compute_v1

        client, project = self._client("instances"), self.project
        for inst in instances:
            try:
                vm = self._call("get instance", lambda: client.get(
                    project=project, zone=inst.offer.zone, instance=inst.instance_id, retry=self._retry()))
                body = compute_v1.InstancesSetLabelsRequest(
                    label_fingerprint=vm.label_fingerprint,
                    labels={**dict(vm.labels), HEARTBEAT_LABEL: str(int(now_s))})
                self._call("set labels", lambda: client.set_labels(
                    project=project, zone=inst.offer.zone, instance=inst.instance_id,
                    instances_set_labels_request_resource=body, retry=self._retry()))
            except exceptions.NotFound:
                continue

    # -- what the cloud says ---------------------------------------------------------------------

    def _listed(self, flt: str):
        """(zone, compute_v1.Instance) for every instance matching `flt`, across every zone."""
        client, project = self._client("instances"), self.project
        pages = self._call("list instances", lambda: list(client.aggregated_list(
            request={"project": project, "filter": flt}, retry=self._retry())))
        return [(scope.rsplit("/", 1)[-1], vm) for scope, scoped in pages for vm in scoped.instances]

    def _vms_of(self, run: str | None):
        flt = f'labels.elastic-run = "{label_value(run)}"' if run else 'labels.elastic-managed = "true"'
        for zone, vm in self._listed(flt):
            meta = {i.key: i.value for i in vm.metadata.items}
            if run is not None and meta.get("elastic-run", run) != run:
                continue   # another run whose name maps to the same label value
            yield zone, vm, meta

    def _vm_states(self, instances: list[Instance]) -> dict[str, str]:
        states: dict[str, str] = {i.instance_id: "gone" for i in instances}
        for run in {i.run for i in instances}:
            for _, vm, _ in self._vms_of(run):
                if vm.name in states:
                    states[vm.name] = VM_STATES.get(vm.status, "pending")
        return states

    def _find_vms(self, run: str | None) -> list[Instance]:
        out = []
        for zone, vm, meta in self._vms_of(run):
            if VM_STATES.get(vm.status) == "gone":
                continue
            try:
                offer = Offer(**json.loads(meta["elastic-offer"]))
            except (KeyError, TypeError, ValueError):   # not launched by elastic's own code: price unknown
                offer = Offer(cloud="gcp", region=zone.rsplit("-", 1)[0], zone=zone,
                              instance_type=vm.machine_type.rsplit("/", 1)[-1], gpu="", gpus=0, cpus=0,
                              spot=vm.scheduling.provisioning_model == "SPOT", usd_per_hour=0.0,
                              on_demand_usd_per_hour=0.0, read_at=0.0)
            created = _rfc3339(vm.creation_timestamp) if vm.creation_timestamp else time.time()
            out.append(Instance(instance_id=vm.name, offer=offer, run=meta.get("elastic-run", vm.labels.get(
                "elastic-run", "")), role=vm.labels.get("elastic-role", ""), launched_at=created,
                labels=dict(vm.labels), heartbeat_at=heartbeat_time(vm.labels.get(HEARTBEAT_LABEL))))
        return out


# Compute Engine instance status -> what the shared provider code needs to know.
VM_STATES = {"PROVISIONING": "pending", "STAGING": "pending", "RUNNING": "running", "REPAIRING": "running",
             "STOPPING": "gone", "STOPPED": "gone", "TERMINATED": "gone", "SUSPENDING": "gone",
             "SUSPENDED": "gone"}


RATE_LIMIT_REASONS = {"rateLimitExceeded", "userRateLimitExceeded", "RATE_LIMIT_EXCEEDED"}


def _reasons(exc) -> list[str]:
    out = []
    for err in getattr(exc, "errors", None) or ():
        if isinstance(err, dict):
            out += [err.get("reason"), err.get("code")]
        else:
            out.append(getattr(err, "code", None))
    return [r for r in out if r]


def _retryable(exc) -> bool:
    """What google-api-core's Retry repeats: rate limits and transient server errors."""
    from google.api_core import exceptions
    if isinstance(exc, (exceptions.TooManyRequests, exceptions.ServiceUnavailable, exceptions.InternalServerError,
                        exceptions.BadGateway, exceptions.GatewayTimeout)):
        return True
    return isinstance(exc, exceptions.Forbidden) and bool(RATE_LIMIT_REASONS & set(_reasons(exc)))


def capacity_code(exc) -> str | None:
    """The stock-out / quota code of a failed insert, or None for any other failure."""
    code = next((r for r in _reasons(exc) if r in CAPACITY_CODES), None)
    if code:
        return code
    text = str(getattr(exc, "message", "") or exc)
    return next((c for c in sorted(CAPACITY_CODES) if c in text), None)


def _n1_shapes(accelerator_type: str, zone: str, max_cards: int) -> list[VMShape]:
    out, n = [], 1
    while n <= max_cards:
        cpus = N1_VCPUS_PER_GPU * n
        out.append(VMShape(f"n1-standard-{cpus}", zone, accelerator_type, n, cpus, cpus * N1_GIB_PER_VCPU,
                           attached=True))
        n *= 2
    return out


def fallback_catalog() -> list[VMShape]:
    """The shipped snapshot of GPU machine types and the zones offering them."""
    shapes = []
    for mt, (cpus, mem, accel, gpus) in FALLBACK_MACHINE_TYPES.items():
        shapes.extend(VMShape(mt, z, accel, gpus, cpus, float(mem), attached=False)
                      for z in FALLBACK_ZONES.get(accel, ()))
    for accel, cards in N1_ATTACHABLE.items():
        for z in FALLBACK_ZONES.get(accel, ()):
            shapes.extend(_n1_shapes(accel, z, cards))
    return shapes


def _rfc3339(text: str) -> float:
    from datetime import datetime
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
