"""Cloud providers behind one small interface (`providers.base.Provider`).

Adding a cloud is one new module here and one entry in `PROVIDERS`. Modules are imported only
when a recipe uses them, so no cloud SDK loads unless needed.
"""

from __future__ import annotations

import importlib

PROVIDERS = {"local": "providers.local:LocalProvider"}


def provider_class(name: str):
    """The provider class registered under `name` (imports its module now)."""
    module, _, cls = PROVIDERS[name].partition(":")
    return getattr(importlib.import_module(module), cls)
