"""What every recipe section is built on: the core's sections (elastic/recipe/model.py) and each
provider's own (`providers/<cloud>/config.py`), so a provider's section needs nothing of the recipe."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, model_validator

# No whole number in a recipe means anything beyond this (a token budget of 10^15 is already far past
# any run); larger ones are typos that would overflow or hang what sizes itself by them.
MAX_INT = 10**15


class Section(BaseModel):
    """A recipe section: unknown keys, NaN / infinite numbers and absurd whole numbers are refused."""

    # allow_inf_nan=False: a NaN or infinite budget, rate or timeout is refused at validation.
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=False,
                              allow_inf_nan=False)

    @model_validator(mode="after")
    def _sane_ints(self) -> "Section":
        for name in type(self).model_fields:
            value = getattr(self, name)
            if type(value) is int and abs(value) > MAX_INT:
                raise ValueError(f"@{name}: {value} is beyond any sane value (at most {MAX_INT:.0e})")
        return self


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def endpoint_problem(url: str, domain: str) -> str | None:
    """Why an API endpoint override may not be used, or None. Only https on the cloud's own
    `domain` (the user's credentials go with every call), or loopback (local test endpoints,
    called without credentials)."""
    from urllib.parse import urlparse

    try:
        parts = urlparse(url)
        host = parts.hostname
    except ValueError:
        return f"{url!r} is not a URL"
    if parts.scheme not in ("http", "https") or not host:
        return f"{url!r} is not an http(s) URL"
    if host in LOOPBACK_HOSTS:
        return None
    if parts.scheme == "https" and (host == domain or host.endswith("." + domain)):
        return None
    return f"{url!r}: only https on {domain} or a loopback address (credentials are sent there)"
