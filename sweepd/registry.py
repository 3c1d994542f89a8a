"""Sweeps declared in Python: ``@sweep``, entrypoint modules, the entry-point group.

Importing a module is what registers its sweeps, as with any decorator
registry. The decorator only records what it was given; the values are
validated with the YAML's rules when the config is loaded, so a bad
``every=`` in code is reported, located, the same way as one in the file.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import sysconfig
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from importlib.metadata import entry_points
from typing import Any, TypeVar, overload

from sweepd.context import SweepContext

ENTRY_POINT_GROUP = "sweepd.sweeps"

F = TypeVar("F", bound=Callable[..., Any])
DurationLike = str | timedelta


@dataclass(frozen=True)
class Declared:
    """One ``@sweep`` as written: its function, raw settings and place."""

    name: str
    func: Callable[..., Any]
    settings: dict[str, Any]
    source: str  # "path/to/module.py:LINE"


class ResolveError(Exception):
    """A module, attribute or signature the config names cannot be used."""


class Registry:
    def __init__(self) -> None:
        self._declared: dict[str, Declared] = {}
        self.conflicts: list[tuple[Declared, Declared]] = []

    def add(self, declared: Declared) -> None:
        first = self._declared.get(declared.name)
        if first is not None and first.func is not declared.func:
            self.conflicts.append((first, declared))
            return
        self._declared[declared.name] = declared

    def get(self, name: str) -> Declared | None:
        return self._declared.get(name)

    def all(self) -> list[Declared]:
        return list(self._declared.values())


REGISTRY = Registry()


@overload
def sweep(func: F, /) -> F: ...
@overload
def sweep(
    *,
    name: str | None = None,
    every: DurationLike | None = None,
    cron: str | None = None,
    anchor: datetime | str | None = None,
    timezone: str | None = None,
    jitter: DurationLike | None = None,
    ttl: DurationLike | None = None,
    timeout: DurationLike | None = ...,
    misfire_grace: DurationLike | None = None,
    retries: dict[str, Any] | None = None,
    args: dict[str, Any] | None = None,
    enabled: bool | None = None,
    coalesce: str | None = None,
    catch_up: str | None = None,
) -> Callable[[F], F]: ...
def sweep(func: Any = None, /, **settings: Any) -> Any:
    """Register a function as a sweep: ``@sweep(every="30s", ttl="10m")``.

    The name defaults to the function's with ``_`` turned to ``-``. Only the
    settings actually passed are recorded, so a YAML entry of the same name
    overrides them field by field and ``timeout=None`` stays distinguishable
    from "not given".
    """
    caller = sys._getframe(1)
    source = f"{_relative(caller.f_code.co_filename)}:{caller.f_lineno}"

    def register(target: F) -> F:
        name = settings.pop("name", None) or target.__name__.replace("_", "-")
        REGISTRY.add(Declared(name=name, func=target, settings=dict(settings), source=source))
        return target

    if func is not None:
        return register(func)
    return register


def _relative(filename: str) -> str:
    try:
        relative = os.path.relpath(filename)
    except ValueError:
        return filename
    return filename if relative.startswith("..") else relative


def entry_point_modules() -> list[tuple[str, str]]:
    """(entry point name, module) for each installed package's ``sweepd.sweeps``."""
    return [(ep.name, ep.value.partition(":")[0]) for ep in entry_points(group=ENTRY_POINT_GROUP)]


def import_module(module: str) -> None:
    """Import a module that declares sweeps; raise ``ResolveError`` saying why not.

    The working directory is put on the import path first, as gunicorn and
    celery do, so ``entrypoints: [myapp.sweeps]`` finds the operator's code
    when sweepd runs from the project's folder.
    """
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module == exc.name or module.startswith(exc.name + ".")):
            raise ResolveError(f"module {module!r} not found") from exc
        raise ResolveError(f"importing {module!r} failed: {_describe(exc, module)}") from exc
    except (Exception, SystemExit) as exc:
        raise ResolveError(f"importing {module!r} failed: {_describe(exc, module)}") from exc


def _describe(exc: BaseException, module: str) -> str:
    """``Type: message (file.py:LINE)``, naming the user's line, never a traceback."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"SyntaxError: {exc.msg} ({_relative(exc.filename)}:{exc.lineno})"
    frame = _user_frame(traceback.extract_tb(exc.__traceback__), module)
    if frame is not None:
        return f"{text} ({_relative(frame.filename)}:{frame.lineno})"
    return text


# Where the interpreter and installed packages live, longest first so that a
# venv's site-packages wins over the lib folder that holds it.
_LIBRARY_DIRS = sorted(
    {
        os.path.join(os.path.normpath(sysconfig.get_path(name)), "")
        for name in ("stdlib", "platstdlib", "purelib", "platlib")
    },
    key=len,
    reverse=True,
)


def _user_frame(frames: traceback.StackSummary, module: str) -> traceback.FrameSummary | None:
    """The line to fix, as a compiler would name it.

    An import fails as often in the standard library (``os.environ["DSN"]``
    raises in ``<frozen os>``) as in the module itself, so the deepest frame
    in the module's own file wins, then the deepest in the operator's code
    (anything but sweepd, the standard library and other installed packages),
    then the deepest outside importlib's machinery.
    """
    parts = module.split(".")

    def own(path: str) -> bool:
        stem = os.path.splitext(path)[0].split(os.sep)
        return stem[-len(parts) :] == parts or stem[-len(parts) - 1 :] == [*parts, "__init__"]

    def operators(path: str) -> bool:
        if path.startswith("<") or os.path.dirname(path) == os.path.dirname(__file__):
            return False
        for root in _LIBRARY_DIRS:
            if path.startswith(root):
                # An installed package is the operator's code when it is the one imported.
                return path[len(root) :].split(os.sep, maxsplit=1)[0] == parts[0]
        return True

    for wanted in (own, operators):
        found = [frame for frame in frames if wanted(os.path.normpath(frame.filename))]
        if found:
            return found[-1]
    rest = [frame for frame in frames if "importlib" not in frame.filename]
    return rest[-1] if rest else None


def resolve_callable(target: str) -> Callable[..., Any]:
    """``"package.module:attr.attr"`` -> the callable it names."""
    module, _, attribute = target.partition(":")
    import_module(module)
    value: Any = sys.modules[module]
    for part in attribute.split("."):
        try:
            value = getattr(value, part)
        except AttributeError:
            raise ResolveError(f"module {module!r} has no attribute {attribute!r}") from None
    if not callable(value):
        kind = type(value).__name__
        article = "an" if kind[:1].lower() in "aeiou" else "a"
        raise ResolveError(f"{target!r} is not callable (it is {article} {kind})")
    return value  # type: ignore[no-any-return]


def takes_context(func: Callable[..., Any]) -> bool:
    """Whether ``func``'s first parameter asks for the ``SweepContext``."""
    try:
        parameters = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return False
    if not parameters:
        return False
    first = parameters[0]
    if first.kind not in (first.POSITIONAL_ONLY, first.POSITIONAL_OR_KEYWORD):
        return False
    annotation = first.annotation
    if annotation is SweepContext:
        return True
    if isinstance(annotation, str) and annotation.rsplit(".", 1)[-1] == "SweepContext":
        return True
    return first.name == "ctx"


def check_arguments(func: Callable[..., Any], args: dict[str, Any]) -> bool:
    """Check that ``func(ctx?, **args)`` binds; return whether ctx is passed."""
    wants_ctx = takes_context(func)
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return wants_ctx  # builtins without a signature: trust the operator
    try:
        signature.bind(*([None] if wants_ctx else []), **args)
    except TypeError as exc:
        # Shown without annotations: under "from __future__ import annotations"
        # they are strings, and quoted types read like values.
        bare = signature.replace(
            parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
            return_annotation=signature.empty,
        )
        raise ResolveError(f"args do not fit {_name(func)}{bare}: {exc}") from None
    return wants_ctx


def _name(func: Callable[..., Any]) -> str:
    return getattr(func, "__qualname__", None) or repr(func)
