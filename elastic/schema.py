"""The recipe's JSON schema and Markdown reference, generated from the pydantic models."""

from __future__ import annotations

import json

from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from elastic.recipe import Recipe


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


def markdown_reference() -> str:
    """Every recipe field, its type, default and description, section by section."""
    lines = ["# Recipe reference", "",
             "Generated from `elastic/recipe.py` by `elastic schema --markdown`; do not edit by hand.", ""]

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
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                nested.append((ann, path))
                lines.append(f"| `{path}` | section | | {(f.description or '').strip()} |")
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
