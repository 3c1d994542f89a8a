"""The key tables of docs/configuration.md, rendered from the models in ``sweepd.config``.

Each key's meaning is the docstring next to its field, and its default the model's own (or its
``Shown``), so the page is regenerated rather than edited and a test can tell when it is stale.
"""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from annotated_types import Ge, Le
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from sweepd.config import ConfigFile, Shown, SweepFile
from sweepd.durations import format_duration

COMMAND = "python -m sweepd.reference docs/configuration.md"
BEGIN = f"<!-- generated from sweepd/config.py by {COMMAND}: do not edit -->"
END = "<!-- end generated -->"

_KINDS: dict[Any, str] = {
    bool: "boolean",
    int: "integer",
    str: "string",
    timedelta: "duration",
    datetime: "datetime",
    dict: "mapping",
}


def key_tables() -> str:
    """What the page holds between its markers: the top-level keys, then a sweep's."""
    return "\n".join(
        [
            f"_Generated from the models in `sweepd/config.py`; after changing them run `{COMMAND}`._",
            "",
            *_table(ConfigFile),
            "",
            "Each item of `sweeps:` (a key left out takes the value of the `@sweep` of the same name,"
            " if there is one, else the default below):",
            "",
            *_table(SweepFile),
        ]
    )


def generated(page: str) -> str:
    """The part of ``page`` between the markers."""
    return _split(page)[1]


def rewrite(page: str) -> str:
    """``page`` with the part between the markers replaced by today's tables."""
    head, _, tail = _split(page)
    return f"{head}{BEGIN}\n\n{key_tables()}\n\n{END}{tail}"


def _split(page: str) -> tuple[str, str, str]:
    head, begin, rest = page.partition(BEGIN)
    body, end, tail = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"the page lacks the markers {BEGIN!r} ... {END!r}")
    return head, body.strip("\n"), tail


def _table(model: type[BaseModel]) -> list[str]:
    head = ["| key | default | value | meaning |", "| --- | --- | --- | --- |"]
    return head + [_row(key, field) for key, field in _fields(model)]


def _fields(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """Every key, dotted; a mapping's keys follow it, a list of mappings has its own table."""
    for name, field in model.model_fields.items():
        yield prefix + name, field
        inner = _plain(field.annotation)
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            yield from _fields(inner, f"{prefix}{name}.")


def _row(key: str, field: FieldInfo) -> str:
    if not field.description:
        raise ValueError(f"{key} has no meaning: give its field a docstring in sweepd/config.py")
    # A docstring wraps at the code's line length; a table row is one line.
    cells = [f"`{key}`", _default(field), _value(field), " ".join(field.description.split())]
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    inner = _plain(field.annotation)
    if isinstance(inner, type) and issubclass(inner, BaseModel):
        return ""  # its keys have rows of their own
    written = f"`{_yaml(field.default)}`"
    shown = next((m for m in field.metadata if isinstance(m, Shown)), None)
    return written if shown is None else shown.default.replace("{default}", written)


def _yaml(value: Any) -> str:
    """A default as an operator writes it."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, timedelta):
        return format_duration(value)
    if isinstance(value, str) and value:
        return value
    if isinstance(value, int):
        return str(value)
    if value is None or isinstance(value, str | list | dict):
        return json.dumps(value)  # null, "", [], {}: JSON's spelling is YAML's
    raise TypeError(f"no YAML spelling for the default {value!r}")


def _value(field: FieldInfo) -> str:
    inner = _plain(field.annotation)
    if get_origin(inner) is Literal:
        return ", ".join(f"`{choice}`" for choice in get_args(inner))
    if isinstance(inner, type) and issubclass(inner, BaseModel):
        return "mapping"
    if get_origin(inner) is list:
        (item,) = get_args(inner)
        return f"list of {_value(FieldInfo.from_annotation(item))}s"
    kind = _KINDS[get_origin(inner) or inner]
    low = next((m.ge for m in field.metadata if isinstance(m, Ge)), None)
    high = next((m.le for m in field.metadata if isinstance(m, Le)), None)
    return kind if low is None or high is None else f"{kind}, {low} to {high}"


def _plain(annotation: Any) -> Any:
    """The type under ``Annotated`` and ``| None``; what a null means, where it means anything, is
    in the docstring."""
    if get_origin(annotation) is Annotated:
        return _plain(get_args(annotation)[0])
    if get_origin(annotation) in (Union, types.UnionType):
        (inner,) = (arg for arg in get_args(annotation) if arg is not type(None))
        return _plain(inner)
    return annotation


if __name__ == "__main__":
    page = Path(sys.argv[1])
    page.write_text(rewrite(page.read_text(encoding="utf-8")), encoding="utf-8")
