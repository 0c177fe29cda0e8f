"""Errors the CLI prints as plain lines, never as tracebacks."""

from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix; printed as one line per entry, exit code 2."""

    exit_code = 2

    def __init__(self, lines: list[str] | str):
        self.lines = [lines] if isinstance(lines, str) else list(lines)
        super().__init__("\n".join(self.lines))


class RecipeError(UserError):
    """The recipe (or an override of it) is invalid: one line per problem."""
