"""Errors the CLI prints as plain lines, never as tracebacks."""

from __future__ import annotations


def first_line(exc: BaseException, limit: int = 200) -> str:
    """An exception's first line, cut at `limit` characters; its type's name if it has no message."""
    lines = str(exc).strip().splitlines()
    return lines[0][:limit] if lines else type(exc).__name__


def described(exc: BaseException, limit: int = 200) -> str:
    """`Type: first line` of an exception (just `Type` if it has no message)."""
    return f"{type(exc).__name__}: {first_line(exc, limit)}" if str(exc).strip() else type(exc).__name__


class UserError(Exception):
    """A problem the user can fix; printed as one line per entry, exit code 2."""

    exit_code = 2

    def __init__(self, lines: list[str] | str):
        self.lines = [lines] if isinstance(lines, str) else list(lines)
        super().__init__("\n".join(self.lines))


class RecipeError(UserError):
    """The recipe (or an override of it) is invalid: one line per problem."""
