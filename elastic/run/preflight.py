"""Preflight: what a run needs from the clouds, checked before anything starts.

`elastic validate` and the first second of `elastic launch` ask every cloud of the recipe
(`Provider.preflight`: credentials, account or project, regions, accelerator, quota) and probe the
checkpoint destination (reachable and writable), then report every problem, one line each. Nothing
is rented, no run directory is made and no Ray starts before this passes. `--offline` skips it (CI,
or a machine without the clouds' endpoints)."""

from __future__ import annotations

import logging
import secrets

from elastic.errors import UserError, described

log = logging.getLogger(__name__)


def preflight(recipe) -> list[str]:
    """Every problem a run of `recipe` would hit at its start, one line each; [] when none.

    Args:
        recipe: the validated recipe.
    """
    from providers import build

    problems: list[str] = []
    for name in dict.fromkeys(recipe.resources.clouds):
        try:
            provider = build(name, recipe, None, recipe.name)
        except UserError as exc:
            problems += exc.lines
            continue
        try:
            problems += provider.preflight(recipe.resources)
        except UserError as exc:
            problems += exc.lines
        except Exception as exc:  # one line for the user; the traceback to the log
            log.exception("%s preflight", name)
            problems.append(f"{name}: preflight failed: {described(exc)}")
        finally:
            provider.close()
    if recipe.checkpoint.uri and not problems:   # without credentials the probe can only repeat them
        problems += checkpoint_problems(recipe.checkpoint.uri)
    return problems


def checkpoint_problems(uri: str) -> list[str]:
    """`checkpoint.uri` is reachable and writable: a small object is written there and deleted. A
    bucket or directory that does not exist yet is no problem (the run creates it)."""
    from elastic.storage.stores import open_storage

    try:
        store = open_storage(uri)
    except UserError as exc:
        lines = [ln for ln in exc.lines if not ln.endswith(("bucket does not exist", "no such checkpoint directory"))]
        return [f"checkpoint.uri: {ln}" for ln in lines]
    probe = f".elastic-preflight-{secrets.token_hex(4)}"
    try:
        store.write_bytes(probe, b"")
        store.delete([probe])
    except Exception as exc:
        return [f"checkpoint.uri: {uri}: not writable ({described(exc, 160)})"]
    finally:
        store.close()
    return []


def check(recipe) -> None:
    """Raise UserError with every preflight problem (exit 2), or return when there is none."""
    problems = preflight(recipe)
    if problems:
        raise UserError(problems)
