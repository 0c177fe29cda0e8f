# elastic on GCP: what a project owner applies once (review it first; `terraform plan` shows it all).
#
#   terraform init && terraform apply -var project=MY-PROJECT -var bucket=MY-CKPT-BUCKET
#
# Creates:
#   - service account elastic-driver: what `elastic` itself may do (custom roles elastic.run.driver and
#     elastic.driverInstances: list instances, and create/label/delete only instances named
#     elastic-*; read zones, regions, machine and accelerator types, operations; create and list
#     secrets, and write/read/delete only those named elastic-* (run tokens, checkpoint keys); create per-run
#     service accounts and delete / act as only those named elastic-run-* (and elastic-node); edit
#     the IAM policies of the checkpoint and data buckets, of elastic-* secrets and instances, to
#     grant those accounts their run's share), plus the checkpoint bucket. Run `elastic` as it (a
#     key, impersonation, or the controller VM).
#   - per run (made by elastic, not here; gcp.run_service_accounts, the default): service account
#     elastic-run-<run>, which may read its run's token secret, read/write objects under its run's
#     checkpoint.uri prefix, read under its data.uri prefix, and delete its own VMs. Nothing else.
#   - service account elastic-node, for gcp.run_service_accounts: false (shared by every run):
#     the checkpoint bucket, reading run token secrets (elastic-*-ray-token), deleting instances
#     named elastic-* (autodown deletes the VM itself).
#   - both may read (never write) the token-shard buckets in -var 'data_buckets=["B"]' (data.uri).
#   - custom role elastic.nodeSelfDelete, which the driver grants a run's account on each of its
#     VMs' own policy.
#   - custom role elastic.driverFirewalls: the driver creates and deletes only firewall rules named
#     elastic-run-*, one per run (UDP 51820, the run's overlay, to that run's VMs only; no shared rule).
#   - the checkpoint bucket (uniform access, no public access).
#   - the APIs elastic calls: Compute Engine, Cloud Billing (price catalog), Secret Manager, Storage.

terraform {
  required_providers {
    google = { source = "hashicorp/google", version = ">= 5.0" }
  }
}

variable "project" {
  description = "Project id elastic rents in."
  type        = string
}

variable "bucket" {
  description = "Name of the checkpoint bucket to create (checkpoint.uri: gs://BUCKET/...)."
  type        = string
}

variable "bucket_location" {
  description = "Location of the checkpoint bucket."
  type        = string
  default     = "US"
}

variable "data_buckets" {
  description = "Existing buckets of token shards (data.uri: gs://BUCKET/...) the driver and the nodes may read, never write."
  type        = list(string)
  default     = []
}

variable "network" {
  description = "VPC network the VMs use (gcp.network)."
  type        = string
  default     = "default"
}

variable "ssh_source_ranges" {
  description = "CIDRs allowed to SSH to elastic VMs (empty: no SSH rule; elastic needs none)."
  type        = list(string)
  default     = []
}

provider "google" {
  project = var.project
}

data "google_project" "this" {}

locals {
  node_tag      = "elastic-node"
  secret_prefix = "projects/${data.google_project.this.number}/secrets/elastic-"
}

resource "google_project_service" "apis" {
  for_each           = toset(["compute.googleapis.com", "cloudbilling.googleapis.com", "secretmanager.googleapis.com",
                              "storage.googleapis.com", "iam.googleapis.com"])
  service            = each.value
  disable_on_destroy = false
}

# -- identities -----------------------------------------------------------------------------------

resource "google_service_account" "driver" {
  account_id   = "elastic-driver"
  display_name = "elastic driver: rents, lists and deletes the run's VMs"
}

resource "google_service_account" "node" {
  account_id   = "elastic-node"
  display_name = "elastic training VM: checkpoint bucket and its run's Ray token only"
}

resource "google_project_iam_custom_role" "driver" {
  role_id     = "elastic.run.driver"
  title       = "elastic driver"
  description = "Rent, label, list and delete elastic's VMs; read the machine catalog."
  permissions = [
    # A service account is created on the project: no name condition can apply to creating one;
    # what can be done with accounts afterwards is limited to elastic-run-* below.
    "iam.serviceAccounts.create",
    # Instance permissions that change or delete a VM are in elastic.driverInstances below, limited
    # to the instances elastic names elastic-*; creating is conditioned the same way there.
    "compute.instances.get", "compute.instances.list", "compute.disks.create",
    "compute.instances.getSerialPortOutput",   # the boot log of a VM that never joined "compute.images.useReadOnly",
    "compute.subnetworks.use", "compute.subnetworks.useExternalIp", "compute.networks.use",
    "compute.networks.useExternalIp", "compute.zoneOperations.get", "compute.zones.list",
    "compute.regions.get",   # the region's GPU quotas, which validate / launch check first
    "compute.machineTypes.list", "compute.acceleratorTypes.list",
    # Creating a secret is authorised on the project (no name condition can apply to it); what can
    # be done with secrets afterwards is limited to elastic-* below. Listing (names and labels, no
    # values) finds the overlay keys of a dead run's booting nodes for `elastic down`.
    "secretmanager.secrets.create", "secretmanager.secrets.list",
  ]
}

resource "google_project_iam_custom_role" "driver_secrets" {
  role_id     = "elastic.driverSecrets"
  title       = "elastic driver: its run tokens"
  description = "Runs' Ray tokens and checkpoint keys: add and read versions, set who may read, delete."
  permissions = ["secretmanager.secrets.get", "secretmanager.secrets.delete", "secretmanager.versions.add",
                 "secretmanager.versions.access", "secretmanager.secrets.getIamPolicy",
                 "secretmanager.secrets.setIamPolicy"]
}

resource "google_project_iam_member" "driver_compute" {
  project = var.project
  role    = google_project_iam_custom_role.driver.id
  member  = "serviceAccount:${google_service_account.driver.email}"
}

# Only the instances elastic creates (every name starts elastic-): the driver cannot delete,
# relabel or re-point any other VM of the project.
resource "google_project_iam_custom_role" "driver_instances" {
  role_id     = "elastic.driverInstances"
  title       = "elastic driver: its own instances"
  description = "Create, label, tag and delete instances named elastic-*."
  permissions = ["compute.instances.create", "compute.instances.delete", "compute.instances.setLabels",
                 "compute.instances.setMetadata", "compute.instances.setTags", "compute.instances.setServiceAccount",
                 "compute.instances.setIamPolicy"]
}

resource "google_project_iam_member" "driver_instances" {
  project = var.project
  role    = google_project_iam_custom_role.driver_instances.id
  member  = "serviceAccount:${google_service_account.driver.email}"
  condition {
    title      = "elastic instances only"
    expression = "resource.type != \"compute.googleapis.com/Instance\" || resource.name.extract(\"instances/{name}\").startsWith(\"elastic-\")"
  }
}

# Runs' Ray tokens (elastic-<run>-ray-token) and checkpoint keys (elastic-ckpt-key-<run>): the
# driver creates, reads, shares (a token, with its run's account) and deletes secrets named
# elastic-*, and nothing else.
resource "google_project_iam_member" "driver_secrets" {
  project = var.project
  role    = google_project_iam_custom_role.driver_secrets.id
  member  = "serviceAccount:${google_service_account.driver.email}"
  condition {
    title      = "elastic secrets only"
    expression = "resource.name.startsWith(\"${local.secret_prefix}\")"
  }
}

# The shared elastic-node reads run tokens and nodes' overlay keys (elastic-<run>-wg-<ip>), never
# checkpoint keys (which authenticate manifests: a node that could read them could forge a
# checkpoint other runs load).
resource "google_project_iam_member" "node_secrets" {
  project = var.project
  role    = "roles/secretmanager.secretAccessor"
  member  = "serviceAccount:${google_service_account.node.email}"
  condition {
    title      = "elastic run tokens and overlay keys only"
    expression = "resource.name.startsWith(\"${local.secret_prefix}\") && !resource.name.startsWith(\"${local.secret_prefix}ckpt-key-\") && (resource.name.extract(\"secrets/{name}/\").endsWith(\"-ray-token\") || resource.name.extract(\"secrets/{name}/\").matches(\"-wg-[0-9-]+$\"))"
  }
}

# Autodown: a node whose driver is gone deletes itself (VM and boot disk) rather than only stopping
# (a stopped VM still pays for its disk). IAM cannot say "itself", so the grant covers instances
# named elastic-*; what a node could do with it is delete elastic's VMs, never create or read them.
resource "google_project_iam_custom_role" "node_self_delete" {
  role_id     = "elastic.nodeSelfDelete"
  title       = "elastic node: delete itself"
  description = "Autodown: a training VM whose driver is gone deletes its own instance."
  permissions = ["compute.instances.delete", "compute.zoneOperations.get"]
}

resource "google_project_iam_member" "node_self_delete" {
  project = var.project
  role    = google_project_iam_custom_role.node_self_delete.id
  member  = "serviceAccount:${google_service_account.node.email}"
  condition {
    title      = "elastic instances only"
    expression = "resource.type != \"compute.googleapis.com/Instance\" || resource.name.extract(\"instances/{name}\").startsWith(\"elastic-\")"
  }
}

# The driver starts VMs that run as elastic-node or as a run's own account, and may act as no
# other account.
resource "google_service_account_iam_member" "driver_acts_as_node" {
  service_account_id = google_service_account.node.name
  role               = "roles/iam.serviceAccountUser"
  member             = "serviceAccount:${google_service_account.driver.email}"
}

# Per-run accounts: the driver reads, deletes and acts as only accounts named elastic-run-* (IAM
# conditions match a service account by its resource name, which carries its email).
resource "google_project_iam_custom_role" "driver_run_accounts" {
  role_id     = "elastic.driverRunAccounts"
  title       = "elastic driver: its runs' service accounts"
  description = "Read, delete and act as the per-run service accounts elastic-run-*."
  permissions = ["iam.serviceAccounts.get", "iam.serviceAccounts.delete", "iam.serviceAccounts.actAs"]
}

resource "google_project_iam_member" "driver_run_accounts" {
  project = var.project
  role    = google_project_iam_custom_role.driver_run_accounts.id
  member  = "serviceAccount:${google_service_account.driver.email}"
  condition {
    title      = "elastic run accounts only"
    expression = "resource.type != \"iam.googleapis.com/ServiceAccount\" || resource.name.extract(\"serviceAccounts/{email}\").startsWith(\"elastic-run-\")"
  }
}

# The driver edits the policies of the checkpoint and data buckets to give a run's account its own
# prefixes (IAM conditions on resource.name, as Cloud Storage documents). IAM cannot bound what such
# an edit grants: this is the driver's most powerful permission, on these buckets only.
resource "google_project_iam_custom_role" "driver_bucket_policy" {
  role_id     = "elastic.driverBucketPolicy"
  title       = "elastic driver: grant runs their prefixes"
  description = "Read and set the IAM policy of elastic's buckets."
  permissions = ["storage.buckets.getIamPolicy", "storage.buckets.setIamPolicy"]
}

resource "google_storage_bucket_iam_member" "driver_bucket_policy" {
  for_each = toset(concat([google_storage_bucket.checkpoints.name], var.data_buckets))
  bucket   = each.value
  role     = google_project_iam_custom_role.driver_bucket_policy.id
  member   = "serviceAccount:${google_service_account.driver.email}"
}

# -- checkpoints ----------------------------------------------------------------------------------

resource "google_storage_bucket" "checkpoints" {
  name                        = var.bucket
  location                    = var.bucket_location
  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"
}

resource "google_storage_bucket_iam_member" "ckpt" {
  for_each = toset([google_service_account.driver.email, google_service_account.node.email])
  bucket   = google_storage_bucket.checkpoints.name
  role     = "roles/storage.objectAdmin"
  member   = "serviceAccount:${each.value}"
}

# The token shards of data.uri (written by `elastic prepare-data` with your own credentials): read
# only. Keyed by bucket and account name, both known at plan time (the emails are not).
resource "google_storage_bucket_iam_member" "data" {
  for_each = { for pair in setproduct(var.data_buckets, ["driver", "node"]) : "${pair[0]}/${pair[1]}" => pair }
  bucket   = each.value[0]
  role     = "roles/storage.objectViewer"
  member   = "serviceAccount:${each.value[1] == "driver" ? google_service_account.driver.email : google_service_account.node.email}"
}

# -- network --------------------------------------------------------------------------------------

# No project-wide rule opens ports among elastic's VMs: each run creates its own rule
# `elastic-run-<run>` (UDP 51820, the run's WireGuard overlay, to VMs tagged elastic-run-<run>,
# nothing else: Ray and torch.distributed run inside the overlay, whose keys the run's driver admits)
# and deletes it when it ends, so one run's VMs cannot reach another's.
resource "google_project_iam_custom_role" "driver_firewalls" {
  role_id     = "elastic.driverFirewalls"
  title       = "elastic driver: its runs' firewall rules"
  description = "Create and delete the per-run firewall rules elastic-run-*."
  permissions = ["compute.firewalls.create", "compute.firewalls.delete", "compute.firewalls.get",
                 "compute.networks.updatePolicy", "compute.globalOperations.get"]
}

resource "google_project_iam_member" "driver_firewalls" {
  project = var.project
  role    = google_project_iam_custom_role.driver_firewalls.id
  member  = "serviceAccount:${google_service_account.driver.email}"
  condition {
    title      = "elastic run rules only"
    expression = "resource.type != \"compute.googleapis.com/Firewall\" || resource.name.extract(\"firewalls/{name}\").startsWith(\"elastic-run-\")"
  }
}

resource "google_compute_firewall" "ssh" {
  count         = length(var.ssh_source_ranges) > 0 ? 1 : 0
  name          = "elastic-ssh"
  network       = var.network
  direction     = "INGRESS"
  source_ranges = var.ssh_source_ranges
  target_tags   = [local.node_tag]
  allow {
    protocol = "tcp"
    ports    = ["22"]
  }
}

# -- what to put in recipes -----------------------------------------------------------------------

output "recipe_gcp_section" {
  description = "The gcp: section of a recipe that uses what this created."
  value       = <<-EOT
    gcp:
      project: ${var.project}
      controller_service_account: ${google_service_account.driver.email}
      # nodes run as their run's own account; with run_service_accounts: false, set
      # service_account: ${google_service_account.node.email}
      network: global/networks/${var.network}
      network_tags: [${local.node_tag}]
    checkpoint:
      uri: gs://${var.bucket}/RUN-NAME
  EOT
}

output "driver_service_account" {
  description = "Run elastic as this account (gcloud auth application-default login --impersonate-service-account=...)."
  value       = google_service_account.driver.email
}
