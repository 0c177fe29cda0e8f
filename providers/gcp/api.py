"""What every call to Google Cloud from the `gcp` provider shares, whichever module makes it (the
provider, its run scope, its object store and key store): where the call goes (endpoint overrides),
with which credentials, and how a name is written as a label value. No google SDK is imported
until credentials are asked for."""

from __future__ import annotations

import os
import re
from urllib.parse import urlparse

from elastic.errors import UserError
from elastic.recipe.section import LOOPBACK_HOSTS, endpoint_problem

COMPUTE_ENDPOINT_ENV = "ELASTIC_GCP_COMPUTE_ENDPOINT"
BILLING_ENDPOINT_ENV = "ELASTIC_GCP_BILLING_ENDPOINT"
SECRETS_ENDPOINT_ENV = "ELASTIC_GCP_SECRETS_ENDPOINT"


def is_local(endpoint: str | None) -> bool:
    """Whether `endpoint` (a URL or host[:port]) is on loopback (a test's fake: called without
    credentials)."""
    if not endpoint:
        return False
    host = urlparse(endpoint if "://" in endpoint else f"//{endpoint}").hostname
    return host in LOOPBACK_HOSTS


def endpoint_override(recipe_value: str | None, env: str) -> str | None:
    """The endpoint override in use: the recipe's (checked when it was validated), else the
    environment's, held to the same rule (UserError otherwise)."""
    if recipe_value:
        return recipe_value
    url = os.environ.get(env) or None
    if url is not None and (why := endpoint_problem(url, "googleapis.com")):
        raise UserError(f"{env}: {why}")
    return url


def credentials_or_line():
    """(credentials, project) from Application Default Credentials, or (None, one line why not,
    without a `gcp:` prefix: the caller says which cloud, once)."""
    import google.auth
    from google.auth.exceptions import DefaultCredentialsError
    try:
        return google.auth.default(scopes=["https://www.googleapis.com/auth/cloud-platform"])
    except DefaultCredentialsError:
        return None, ("no Google Cloud credentials found (run `gcloud auth application-default login`, "
                      "or set GOOGLE_APPLICATION_CREDENTIALS to a service account key file)")


def label_value(text: str) -> str:
    """A GCP label value: lowercase letters, digits, `_` and `-`, at most 63 characters."""
    return re.sub(r"[^a-z0-9_-]", "-", text.lower())[:63]
