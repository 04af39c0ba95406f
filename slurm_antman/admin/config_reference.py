"""The configuration reference of docs/admin.md, generated from the pydantic model so it cannot drift.

``python -m slurm_antman.admin.config_reference`` prints it; tests/test_config_reference.py checks that
docs/admin.md holds exactly this text between the BEGIN/END markers.
"""

from __future__ import annotations

import enum
import sys
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from slurm_antman.config import AntmanConfig

BEGIN = "<!-- BEGIN GENERATED CONFIG REFERENCE (python -m slurm_antman.admin.config_reference) -->"
END = "<!-- END GENERATED CONFIG REFERENCE -->"


def _submodel(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Union and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return _submodel(rest[0]) if len(rest) == 1 else None
    if typing.get_origin(annotation) is list and args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return args[0]
    return None


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " \\| ".join(m.value for m in annotation)
    if isinstance(annotation, type):
        return annotation.__name__
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(map(str, args))
    if origin is typing.Union and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return f"{_type_name(rest[0])} or null"
    if origin is list:
        return f"list of {_type_name(args[0])}"
    return str(annotation)


def _default(field: Any) -> str:
    if field.is_required():
        return "**required**"
    value = field.get_default(call_default_factory=True)
    if value is PydanticUndefined:
        return ""
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None:
        return "null"
    if value == []:
        return "[]"
    return f"`{value}`"


def _constraints(field: Any) -> str:
    parts = []
    for m in field.metadata:
        for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"), ("min_length", "min items")):
            v = getattr(m, attr, None)
            if v is not None:
                parts.append(f"{sym} {v}")
        pattern = getattr(m, "pattern", None)
        if pattern:
            parts.append(f"matches `{pattern}`")
    return "; ".join(parts)


def _rows(model: type[BaseModel], prefix: str) -> list[tuple[str, str, str, str]]:
    rows = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        sub = _submodel(field.annotation)
        desc = (field.description or "").replace("\n", " ")
        limits = _constraints(field)
        if limits:
            desc = f"{desc} ({limits})" if desc else f"({limits})"
        desc = desc.replace("|", "\\|")  # a bare | would split the table cell
        if sub is not None:
            is_list = typing.get_origin(field.annotation) is list
            rows.append((path, "list of entries" if is_list else "section", _default(field), desc or sub.__doc__
                         and sub.__doc__.strip().splitlines()[0] or ""))
            rows += _rows(sub, f"{path}[]." if is_list else f"{path}.")
        else:
            rows.append((path, _type_name(field.annotation), _default(field), desc))
    return rows


def reference_markdown() -> str:
    lines = [BEGIN, "", "| field | type | default | meaning |", "| --- | --- | --- | --- |"]
    for path, typ, default, desc in _rows(AntmanConfig, ""):
        lines.append(f"| `{path}` | {typ} | {default} | {desc} |")
    lines += ["", END]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(reference_markdown())
