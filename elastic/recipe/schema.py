"""The recipe's JSON schema and Markdown reference, generated from the pydantic models."""

from __future__ import annotations

import json
import types
import typing

from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from elastic.recipe.model import Recipe


def json_schema() -> str:
    return json.dumps(Recipe.model_json_schema(), indent=2) + "\n"


def _default(field) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        value = field.default_factory()
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section)"
    return f"`{json.dumps(to_jsonable_python(value))}`"


def _nested(ann) -> tuple[type[BaseModel], str, str] | None:
    """(section model, path suffix, how it appears) when a field holds a section: itself, optional,
    a list of them or a mapping of names to them."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann, "", "section"
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1 and (found := _nested(inner[0])) and found[2] == "section":
            return found[0], "", "section, optional (empty: off)"
    if origin is list and args and (found := _nested(args[0])) and found[2] == "section":
        return found[0], "[]", "list of sections"
    if origin is dict and len(args) == 2 and (found := _nested(args[1])) and found[2] == "section":
        return found[0], ".<name>", "sections by name"
    return None


def markdown_reference() -> str:
    """Every recipe field, its type, default and description, section by section."""
    lines = ["# Recipe reference", "",
             "Generated from `elastic/recipe/model.py` and each provider's `providers/<cloud>/config.py` by "
             "`elastic schema --markdown`; do not edit by hand.", ""]

    def section(model: type[BaseModel], prefix: str) -> None:
        lines.append(f"## `{prefix or 'top level'}`")
        lines.append("")
        lines.append((model.__doc__ or "").strip().replace("\n", " "))
        lines.append("")
        lines.append("| field | type | default | meaning |")
        lines.append("| --- | --- | --- | --- |")
        nested = []
        for name, f in model.model_fields.items():
            ann = f.annotation
            path = f"{prefix}.{name}" if prefix else name
            if found := _nested(ann):
                model_, suffix, kind = found
                nested.append((model_, path + suffix))
                desc = " ".join((f.description or "").split()).replace("|", "\\|")
                lines.append(f"| `{path}` | {kind} | | {desc} |")
                continue
            tname = getattr(ann, "__name__", None) or str(ann).replace("typing.", "")
            desc = " ".join((f.description or "").split()).replace("|", "\\|")
            tname = tname.replace("|", "\\|")
            lines.append(f"| `{path}` | {tname} | {_default(f)} | {desc} |")
        lines.append("")
        for model_, path in nested:
            section(model_, path)

    section(Recipe, "")
    return "\n".join(lines)
