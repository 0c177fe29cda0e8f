"""Cloud providers behind one small interface (`providers.base.Provider`).

Adding a cloud is one new module here and one entry in `PROVIDERS`. Modules are imported only
when a recipe uses them, so no cloud SDK loads unless needed.
"""

from __future__ import annotations

import importlib
import importlib.util

PROVIDERS = {"local": "providers.local:LocalProvider", "aws": "providers.aws:AWSProvider",
             "gcp": "providers.gcp:GCPProvider"}


def provider_class(name: str):
    """The provider class registered under `name` (imports its module now)."""
    module, _, cls = PROVIDERS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def available(name: str) -> bool:
    """Whether provider `name` is registered and its module is present (without importing it)."""
    if name not in PROVIDERS:
        return False
    return importlib.util.find_spec(PROVIDERS[name].partition(":")[0]) is not None


def build(name: str, recipe, cluster, run_name: str):
    """The provider `name` for a run of `recipe`. `cluster` is the run's Ray cluster
    (`elastic.cluster.LocalCluster`), or None for commands that do not train (`elastic prices`,
    `elastic down`): offers, list_instances and terminate work without one."""
    cls = provider_class(name)
    if name == "local":
        return cls(recipe.local, cluster, recipe.world.ranks_per_replica)
    return cls(recipe, cluster, run_name)
