"""Cloud providers behind one interface (`providers.base.Provider`), one directory each.

`providers/<cloud>/` owns everything about its cloud: `facts.py` (what the cloud is, as data: its
billing terms), `provider.py` (what it does: offers and prices, launch and release, notices,
controller), `config.py` (its recipe section), `storage.py` (its object store), and whatever else it needs (the node watcher's poller, a network lab). Adding a cloud is
one new directory and one entry in `PROVIDERS`. Modules are imported only when asked for, and
cloud SDKs only inside them when used, so nothing of a cloud loads unless a recipe uses it.
"""

from __future__ import annotations

import importlib
import importlib.util

PROVIDERS = {"local": "providers.local.provider:LocalProvider",
             "aws": "providers.aws.provider:AWSProvider",
             "gcp": "providers.gcp.provider:GCPProvider"}


def provider_class(name: str):
    """The provider class registered under `name` (imports its module now; no cloud SDK)."""
    module, _, cls = PROVIDERS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def available(name: str) -> bool:
    """Whether provider `name` is registered and its module is present (without importing it)."""
    if name not in PROVIDERS:
        return False
    return importlib.util.find_spec(PROVIDERS[name].partition(":")[0]) is not None


def build(name: str, recipe, cluster, run_name: str):
    """The provider `name` for a run of `recipe`. `cluster` is the run's Ray cluster
    (`elastic.run.cluster.LocalCluster`), or None for commands that do not train (`elastic prices`,
    `elastic down`): offers, list_instances and terminate work without one."""
    return provider_class(name)(recipe, cluster, run_name)


def billing_terms(cloud: str):
    """The `BillingTerms` of `cloud` (its `providers/<cloud>/facts.py`, data: the provider class is
    not imported), or None for a cloud no provider is registered for (a trace may name any)."""
    if cloud not in PROVIDERS:
        return None
    return importlib.import_module(f"providers.{cloud}.facts").BILLING


def notice_s(cloud: str) -> float:
    """Seconds between a spot VM's interruption notice and its end on `cloud` (its provider's
    `notice_s`); 0 for a cloud no provider is registered for (a trace may name any)."""
    return provider_class(cloud).notice_s if cloud in PROVIDERS else 0.0


def storage_usd_per_gb_month() -> dict[str, float]:
    """URI scheme -> its object store's list price, USD per GB-month (each provider's
    `storage_usd_per_gb_month`), for every provider with an object store."""
    return {scheme: provider_class(name).storage_usd_per_gb_month for scheme, name in storage_schemes().items()}


def storage_schemes() -> dict[str, str]:
    """URI scheme -> provider name, for every provider with an object store (`s3` -> `aws`, …)."""
    out = {}
    for name in PROVIDERS:
        scheme = provider_class(name).storage_scheme
        if scheme is not None:
            out[scheme] = name
    return out
