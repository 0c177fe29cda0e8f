"""What one run's nodes may touch on GCP, and nothing more: a service account of their own,
`elastic-run-<run>@PROJECT.iam.gserviceaccount.com`, created when the run first launches a node
(`gcp.run_service_accounts`), deleted when it ends (and by `elastic down RUN` / `--orphans` for a
run whose driver died).

- **Its secrets**: `roles/secretmanager.secretAccessor` on the run's own token secret and its
  nodes' overlay keys only (each secret's IAM policy), so a node of one run cannot read another
  run's token or keys.
- **Its checkpoints** (`checkpoint.uri` on gs://): `roles/storage.objectUser` (read, write, delete)
  on the bucket with an IAM condition, as Cloud Storage documents them, limiting it to objects whose
  name starts with the run's prefix, and listings of that prefix.
- **Its data** (`data.uri` on gs://): `roles/storage.objectViewer` on that prefix alone.
- **Autodown**: `elastic.nodeSelfDelete` (the custom role `infra/gcp/` makes) on each of its VMs'
  own IAM policy: a node may delete itself and no other VM.

The buckets it was granted on are written into the account's description, so `elastic down RUN`
(which has no recipe) removes those bindings too before deleting the account. Accounts and
bindings cost nothing; a failed removal is logged and left for `elastic down`.

Calls go through plain authorized REST (IAM and Cloud Storage JSON APIs;
`ELASTIC_GCP_IAM_ENDPOINT` / `ELASTIC_GCP_STORAGE_ENDPOINT` point them elsewhere, loopback or
googleapis.com only, without credentials on loopback) and the provider's Secret Manager and
Compute clients.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
from urllib.parse import quote, urlparse

from elastic.record.remote import RECORD
from providers.gcp.api import endpoint_override, is_local

log = logging.getLogger(__name__)

PREFIX = "elastic-run-"
IAM_ENDPOINT_ENV = "ELASTIC_GCP_IAM_ENDPOINT"
STORAGE_ENDPOINT_ENV = "ELASTIC_GCP_STORAGE_ENDPOINT"
SELF_DELETE_ROLE = "elastic.nodeSelfDelete"     # infra/gcp/main.tf
BUCKETS_MARK = "buckets: "
POLICY_ATTEMPTS = 5                              # read-modify-write of a bucket policy, on etag conflicts


def account_id(run: str) -> str:
    """`elastic-run-<run>` as a service account id (6-30 of `[a-z0-9-]`, a letter first, no `-`
    last); a digest keeps long or clashing names apart."""
    slug = re.sub(r"[^a-z0-9-]+", "-", run.lower()).strip("-") or "run"
    name = PREFIX + slug
    if len(name) <= 30 and slug == run:
        return name
    return f"{PREFIX}{slug[:5].strip('-') or 'r'}-{hashlib.sha256(run.encode()).hexdigest()[:12]}"


def object_prefix(uri: str | None) -> tuple[str, str] | None:
    """(bucket, object-name prefix ending in `/`, or "" for the whole bucket) of a gs:// URI."""
    if not uri or not uri.startswith("gs://"):
        return None
    parts = urlparse(uri)
    prefix = parts.path.strip("/")
    return parts.netloc, f"{prefix}/" if prefix else ""


def prefix_condition(bucket: str, prefix: str, title: str, but: str | None = None) -> dict:
    """An IAM condition limiting a bucket-level grant to objects under `prefix`, except those under
    `prefix` + `but` when given, and listings of it (Cloud Storage checks `objects.list` on the
    bucket, with the listing's prefix as an attribute)."""
    objects = f"projects/_/buckets/{bucket}/objects/"
    within = f'resource.name.startsWith("{objects}{prefix}")'
    if but:
        within = f'({within} && !resource.name.startsWith("{objects}{prefix}{but}"))'
    expression = (f'{within} || '
                  f'api.getAttribute("storage.googleapis.com/objectListPrefix", "").startsWith("{prefix}")')
    return {"title": title, "expression": expression}


class RunScope:
    """The run's service account and its grants, created on first use.

    Args:
        provider: the GCPProvider (project, credentials, clients, `_call`, `_retry`).
        run: the run's name.
    """

    def __init__(self, provider, run: str):
        self._p = provider
        self.run = run
        self.account_id = account_id(run)
        self._email: str | None = None
        self._token_granted = False
        self._lock = threading.Lock()
        self._session = None

    @property
    def email(self) -> str:
        return f"{self.account_id}@{self._p.project}.iam.gserviceaccount.com"

    # -- REST ---------------------------------------------------------------------------------------

    def _endpoints(self) -> tuple[str, str]:
        return ((endpoint_override(None, IAM_ENDPOINT_ENV) or "https://iam.googleapis.com").rstrip("/"),
                (endpoint_override(None, STORAGE_ENDPOINT_ENV) or "https://storage.googleapis.com").rstrip("/"))

    def _rest(self, what: str, method: str, url: str, body: dict | None = None) -> dict:
        """One REST call, retried like the clients' calls; an HTTP error raises the API exception it
        maps to (refusals as one line, through the provider's `_call`)."""
        from google.api_core import exceptions

        if self._session is None:
            if is_local(url):
                import requests
                self._session = requests.Session()
            else:
                from google.auth.transport.requests import AuthorizedSession
                self._session = AuthorizedSession(self._p._default_credentials())

        def once():
            resp = self._session.request(method, url, json=body, timeout=60)
            if resp.status_code >= 400:
                raise exceptions.from_http_response(resp)
            return resp.json() if resp.content else {}
        return self._p._call(what, lambda: self._p._retry()(once)())

    # -- creating -----------------------------------------------------------------------------------

    def service_account(self) -> str:
        """The run's service account email (account and bucket grants made on the first call)."""
        with self._lock:
            if self._email is None:
                self._create()
                self._email = self.email
            return self._email

    def _create(self) -> None:
        from google.api_core import exceptions

        iam, _ = self._endpoints()
        recipe = self._p.recipe
        grants = [(where, role, title) for where, role, title in (
            (object_prefix(recipe.checkpoint.uri), "roles/storage.objectUser", "its checkpoints"),
            (object_prefix(recipe.data.uri if recipe.data is not None else None), "roles/storage.objectViewer",
             "its data")) if where is not None]
        buckets = sorted({bucket for (bucket, _), _, _ in grants})
        try:
            self._rest("create service account", "POST", f"{iam}/v1/projects/{self._p.project}/serviceAccounts", {
                "accountId": self.account_id,
                "serviceAccount": {"displayName": f"elastic run {self.run}"[:100],
                                   "description": f"elastic: the nodes of run {self.run}; "
                                                  f"{BUCKETS_MARK}{','.join(buckets)}"[:256]}})
            log.info("gcp: created service account %s", self.email)
        except exceptions.Conflict:
            pass   # left by an earlier run of the same name: its grants are made again below
        member = f"serviceAccount:{self.email}"
        for (bucket, prefix), role, title in grants:
            self._edit_bucket_policy(bucket, lambda bindings: [*_without(bindings, member, role), {
                "role": role, "members": [member],
                # Not the run's record beside its checkpoints (elastic/record/remote.py): the driver writes it.
                "condition": prefix_condition(bucket, prefix, f"elastic run {self.run[:60]}: {title}",
                                              but=f"{RECORD}/" if role == "roles/storage.objectUser" else None)}])

    def grant_token(self, secret: str) -> None:
        """Let the run's account read the token secret `secret` (the run's own; its whole policy)."""
        with self._lock:
            if self._token_granted:
                return
            self.grant_secret(secret)
            self._token_granted = True

    def grant_secret(self, secret: str) -> None:
        """Let the run's account read `secret` (the run's own: its token, or a node's overlay key),
        by that secret's whole policy: no one else's account is on it."""
        client, name = self._p._client("secrets"), f"projects/{self._p.project}/secrets/{secret}"
        self._p._call("set a secret's policy", lambda: client.set_iam_policy(request={
            "resource": name, "policy": {"bindings": [{"role": "roles/secretmanager.secretAccessor",
                                                       "members": [f"serviceAccount:{self.email}"]}]}},
            retry=self._p._retry()))

    def grant_self_delete(self, zone: str, instance: str) -> None:
        """Let the run's account delete VM `instance` (autodown), through that VM's own policy."""
        client, project = self._p._client("instances"), self._p.project
        policy = {"bindings": [{"role": f"projects/{project}/roles/{SELF_DELETE_ROLE}",
                                "members": [f"serviceAccount:{self.email}"]}]}
        self._p._call("set the instance's policy", lambda: client.set_iam_policy(
            project=project, zone=zone, resource=instance,
            zone_set_policy_request_resource={"policy": policy}, retry=self._p._retry()))

    def _edit_bucket_policy(self, bucket: str, edit) -> None:
        """Read bucket `bucket`'s IAM policy (version 3: conditions), replace its bindings with
        `edit(bindings)`, write it back; again on an etag conflict (another run edited it)."""
        from google.api_core import exceptions

        _, storage = self._endpoints()
        url = f"{storage}/storage/v1/b/{quote(bucket, safe='')}/iam"
        for attempt in range(POLICY_ATTEMPTS):
            policy = self._rest("read the bucket's policy", "GET", f"{url}?optionsRequestedPolicyVersion=3")
            policy = {**policy, "version": 3, "bindings": edit(policy.get("bindings", []))}
            try:
                self._rest("set the bucket's policy", "PUT", url, policy)
                return
            except exceptions.PreconditionFailed:
                if attempt == POLICY_ATTEMPTS - 1:
                    raise

    # -- the end ------------------------------------------------------------------------------------

    def remove(self) -> list[str]:
        """Remove the account's bucket grants (the buckets its description names) and delete the
        account. Returns what could not be removed (one line each); never raises."""
        from google.api_core import exceptions

        iam, _ = self._endpoints()
        url = f"{iam}/v1/projects/{self._p.project}/serviceAccounts/{self.email}"
        left = []
        try:
            account = self._rest("read service account", "GET", url)
            description = account.get("description", "")
            buckets = description.partition(BUCKETS_MARK)[2].split(",") if BUCKETS_MARK in description else []
            member = f"serviceAccount:{self.email}"
            for bucket in filter(None, buckets):
                try:
                    self._edit_bucket_policy(bucket, lambda bindings: _without(bindings, member))
                except Exception as exc:
                    left.append(f"grants of {self.email} on bucket {bucket}: {exc}")
            self._rest("delete service account", "DELETE", url)
        except exceptions.NotFound:
            pass
        except Exception as exc:
            left.append(f"service account {self.email}: {exc}")
        with self._lock:
            self._email, self._token_granted = None, False
        return left


def _without(bindings: list[dict], member: str, role: str | None = None) -> list[dict]:
    """`bindings` without `member` (in `role` only, if given); bindings left empty are dropped."""
    out = []
    for b in bindings:
        if role is None or b.get("role") == role:
            b = {**b, "members": [m for m in b.get("members", []) if m != member]}
        if b["members"]:
            out.append(b)
    return out
