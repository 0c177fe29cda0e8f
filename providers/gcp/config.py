"""The recipe's `gcp:` section."""

from __future__ import annotations

from pydantic import Field, model_validator

from elastic.recipe.section import Section, endpoint_problem


class GCPSection(Section):
    """The `gcp` provider: Compute Engine Spot (or on-demand) VMs with GPUs. Credentials come from
    Application Default Credentials (`gcloud auth application-default login`, a service account
    key in `GOOGLE_APPLICATION_CREDENTIALS`, or the VM's service account), never from the recipe."""

    project: str | None = None
    """Project id to rent in. Empty: `GOOGLE_CLOUD_PROJECT`, else the credentials' project."""
    compute_endpoint: str | None = None
    """Compute Engine API endpoint override (e.g. `http://127.0.0.1:8089` for a local test
    endpoint). Only https on googleapis.com, or loopback. Empty: `ELASTIC_GCP_COMPUTE_ENDPOINT`,
    else Google's."""
    billing_endpoint: str | None = None
    """Cloud Billing Catalog API endpoint override (prices). Only https on googleapis.com, or
    loopback. Empty: `ELASTIC_GCP_BILLING_ENDPOINT`, else Google's."""
    secrets_endpoint: str | None = None
    """Secret Manager API endpoint override (where the run's Ray cluster token is kept for its
    nodes). Only https on googleapis.com, or loopback. Empty: `ELASTIC_GCP_SECRETS_ENDPOINT`, else
    Google's."""
    image: str = "projects/deeplearning-platform-release/global/images/family/common-cu124-debian-11-py310"
    """Boot image (a family or an image path). Default: Google's Deep Learning VM image with the
    NVIDIA driver and CUDA installed."""
    boot_disk_gb: int = Field(200, ge=10, le=65536)
    """Size of each node's boot disk, GB."""
    network: str = "global/networks/default"
    """VPC network of the nodes."""
    subnetwork: str | None = None
    """Subnetwork (`regions/REGION/subnetworks/NAME`); needed for custom-mode networks."""
    network_tags: list[str] = Field(default_factory=lambda: ["elastic-node"])
    """Network tags on every node besides the run's own tag `elastic-run-<run>` (whose firewall
    rule, created by the run, opens every port among the run's VMs only); e.g. the SSH rule of
    `infra/gcp/` targets `elastic-node`."""
    external_ip: bool = True
    """Give each node an ephemeral external IP (needed to install packages without Cloud NAT)."""
    run_service_accounts: bool = True
    """Each run's nodes run as a service account of their own, `elastic-run-<run>`, created when
    the run launches its first node and deleted when it ends (or by `elastic down RUN`): it may read
    only the run's token secret, read and write only objects under `checkpoint.uri`, read only
    objects under `data.uri` (IAM conditions on the bucket policies), and delete only its own VMs
    (autodown). The driver needs the permissions `infra/gcp/` gives `elastic-driver`. False: nodes
    run as `service_account`, shared by every run."""
    service_account: str | None = None
    """Service account email the nodes run as when `run_service_accounts` is false (`infra/gcp/`
    creates `elastic-node`, which may read and write the whole checkpoint bucket, read the buckets
    of `data_buckets`, read every run's cluster token and delete instances named elastic-*). Empty:
    none (the VM gets no Google credentials at all, and autodown can only stop it)."""
    price_cache_ttl_s: float = Field(86400.0, ge=0)
    """How long prices and the machine-type catalog read from the APIs are reused from the disk
    cache, in seconds (GCP changes spot prices at most about monthly)."""

    @model_validator(mode="after")
    def _endpoints(self) -> "GCPSection":
        for name in ("compute_endpoint", "billing_endpoint", "secrets_endpoint"):
            url = getattr(self, name)
            if url is not None and (why := endpoint_problem(url, "googleapis.com")):
                raise ValueError(f"@{name}: {why}")
        return self
    install: str = "pip install elastic"
    """Shell command the startup script runs to install this project on a node."""
    controller_machine_type: str = "e2-standard-2"
    """On-demand machine type of the controller VM (`resources.head: controller`)."""
    controller_zone: str | None = None
    """Zone of the controller VM. Empty: zone `-a` of the first GCP region in `resources.regions`,
    else `us-central1-a`."""
    controller_service_account: str | None = None
    """Service account email the controller VM runs as: the driver's permissions (`infra/gcp/`
    creates `elastic-driver`). Empty: none, and the driver there cannot rent anything."""
