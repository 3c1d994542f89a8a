"""YAML read the way ``yaml.safe_load`` reads it, remembering where each value was.

Config errors must point at a line and column, and pydantic only knows key
paths. So the document is composed into nodes (which carry their marks),
built into plain Python values with PyYAML's own safe constructor, and every
key path is recorded with the position of its key and of its value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

Path = tuple[str | int, ...]


@dataclass(frozen=True)
class Position:
    line: int  # 1-based, as editors count
    column: int

    @classmethod
    def of(cls, mark: yaml.Mark) -> Position:
        return cls(mark.line + 1, mark.column + 1)


@dataclass
class Located:
    """A loaded document and the positions of its keys and values."""

    data: Any
    source: str
    values: dict[Path, Position] = field(default_factory=dict)
    keys: dict[Path, Position] = field(default_factory=dict)
    duplicates: list[Path] = field(default_factory=list)
    # Values that came from elsewhere (an environment variable) say so instead.
    overrides: dict[Path, str] = field(default_factory=dict)

    def where(self, path: Path, *, key: bool = False) -> str:
        """``FILE:LINE:COL`` of the nearest recorded ancestor of ``path``."""
        table = self.keys if key else self.values
        for end in range(len(path), -1, -1):
            prefix = path[:end]
            if prefix in self.overrides:
                return self.overrides[prefix]
            position = table.get(prefix) or self.values.get(prefix)
            if position is not None:
                return f"{self.source}:{position.line}:{position.column}"
        return self.source


class YamlSyntaxError(Exception):
    def __init__(self, location: str, message: str) -> None:
        super().__init__(message)
        self.location = location
        self.message = message


def spell_path(path: Path) -> str:
    """``("sweeps", 2, "every")`` -> ``sweeps[2].every``."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def load(text: str, source: str) -> Located:
    """Parse ``text``; raise ``YamlSyntaxError`` located at the offending mark."""
    try:
        loader = yaml.SafeLoader(text)
    except yaml.reader.ReaderError as exc:  # a character YAML refuses, found before parsing
        line = text.count("\n", 0, exc.position) + 1
        column = exc.position - text.rfind("\n", 0, exc.position)
        raise YamlSyntaxError(
            f"{source}:{line}:{column}",
            f"invalid YAML: unacceptable character #x{exc.character:04x}: {exc.reason}",
        ) from exc
    try:
        root = loader.get_single_node()
        located = Located(data=None, source=source)
        if root is not None:
            located.values[()] = Position.of(root.start_mark)
            located.data = _build(loader, root, (), located)
        return located
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        problem = exc.problem or "invalid YAML"
        if exc.context and exc.problem:
            problem = f"{exc.context}: {problem}"
        if exc.context == "while scanning an alias":
            # "cron: */5 * * * *" unquoted: YAML reads the leading * as an alias.
            problem += " (a value starting with * must be quoted)"
        elif exc.problem and "'@' that cannot start any token" in exc.problem:
            # "cron: @daily" unquoted: YAML reserves @ at the start of a value.
            problem += " (a value starting with @ must be quoted)"
        raise YamlSyntaxError(where, f"invalid YAML: {problem}") from exc
    except yaml.YAMLError as exc:
        raise YamlSyntaxError(source, f"invalid YAML: {exc}") from exc
    finally:
        loader.dispose()


def _build(loader: yaml.SafeLoader, node: yaml.Node, path: Path, located: Located) -> Any:
    if isinstance(node, yaml.MappingNode):
        loader.flatten_mapping(node)  # applies "<<" merge keys, as safe_load does
        mapping: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            if not isinstance(key, str | int | float | bool) and key is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, "a mapping key must be a plain value", key_node.start_mark
                )
            child = (*path, str(key))
            if key in mapping:
                located.duplicates.append(child)
            located.keys[child] = Position.of(key_node.start_mark)
            located.values[child] = Position.of(value_node.start_mark)
            mapping[key] = _build(loader, value_node, child, located)
        return mapping
    if isinstance(node, yaml.SequenceNode):
        items: list[Any] = []
        for index, item_node in enumerate(node.value):
            child = (*path, index)
            located.values[child] = Position.of(item_node.start_mark)
            items.append(_build(loader, item_node, child, located))
        return items
    return loader.construct_object(node, deep=True)
