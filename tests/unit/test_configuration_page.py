"""docs/configuration.md's key tables are the models' own, so the page cannot drift from them."""

import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from sweepd import config, reference, registry
from sweepd.environment import Environment
from sweepd.model import SweepDef

PAGE = Path(__file__).parents[2] / "docs" / "configuration.md"
_ROW = re.compile(r"^\| `([^`]+)` \| ([^|]*) \|", re.MULTILINE)


def _page() -> str:
    return reference.generated(PAGE.read_text(encoding="utf-8"))


def test_the_page_holds_the_tables_the_models_give() -> None:
    assert _page() == reference.key_tables(), (
        f"docs/configuration.md is stale: run {reference.COMMAND}"
    )


def test_every_field_of_every_model_has_a_meaning_and_a_row() -> None:
    # Found from the module, not from the generator's walk, so a model the walk
    # misses (a new list of mappings, say) fails here too.
    models = [
        model
        for model in vars(config).values()
        if isinstance(model, type)
        and issubclass(model, BaseModel)
        and model.__module__ == config.__name__
        and model.model_fields
    ]
    fields = [
        (model.__name__, name, field)
        for model in models
        for name, field in model.model_fields.items()
    ]
    keys = [key for key, _ in _ROW.findall(_page())]
    undescribed = [f"{m}.{n}" for m, n, field in fields if not field.description]
    assert undescribed == [], "give these fields a docstring in sweepd/config.py"
    missing = [
        f"{m}.{n}" for m, n, _ in fields if not any(k == n or k.endswith(f".{n}") for k in keys)
    ]
    assert missing == [], f"not on the page: run {reference.COMMAND}"
    assert len(keys) == len(fields)


def _sweep(extra: str) -> SweepDef:
    text = (
        f"sweeps:\n  - name: probe\n    callable: sweepd.examples:heartbeat\n    every: 1m\n{extra}"
    )
    settings = config.settings_from_text(text, "c.yaml", Environment(), sweeps=registry.Registry())
    (sweep,) = settings.sweeps
    return sweep


def _literal_sweep_defaults() -> list[tuple[str, str]]:
    # The sweep table's defaults are Shown text the resolver does not read:
    # where one is a value, writing it out must change nothing.
    sweep_table = _page().split("Each item of `sweeps:`", 1)[1]
    return [
        (key, cell.strip()[1:-1])
        for key, cell in _ROW.findall(sweep_table)
        if re.fullmatch(r"`[^`]*`", cell.strip())
    ]


@pytest.mark.parametrize(("key", "written"), _literal_sweep_defaults())
def test_a_sweep_default_the_page_gives_is_what_leaving_the_key_out_gives(
    key: str, written: str
) -> None:
    parent, _, child = key.rpartition(".")
    line = f"{parent}: {{{child}: {written}}}" if parent else f"{key}: {written}"
    assert _sweep(f"    {line}\n") == _sweep("")
