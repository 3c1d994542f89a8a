"""Sweeps found through the entry-point group of installed packages."""

import sys
import textwrap
from pathlib import Path

import pytest

from sweepd import registry
from sweepd.config import settings_from_text
from sweepd.environment import Environment
from sweepd.errors import ConfigError


def install_fake_distribution(root: Path, entry_points: str) -> None:
    """A dist-info folder on sys.path is all importlib.metadata needs to see a package."""
    info = root / "fake_sweeps_dist-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-sweeps-dist\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "REGISTRY", registry.Registry())
    return tmp_path


def test_installed_packages_register_their_sweeps(site: Path) -> None:
    (site / "fake_plugin_sweeps.py").write_text(
        "from sweepd import sweep\n\n@sweep(cron='0 4 * * *')\ndef rotate_keys() -> None: ...\n"
    )
    sys.modules.pop("fake_plugin_sweeps", None)
    install_fake_distribution(site, "[sweepd.sweeps]\nplugin = fake_plugin_sweeps\n")
    assert ("plugin", "fake_plugin_sweeps") in registry.entry_point_modules()
    settings = settings_from_text("namespace: n\n", "c.yaml", Environment())
    assert [s.name for s in settings.sweeps] == ["rotate-keys"]


def test_a_broken_entry_point_is_a_located_problem(site: Path) -> None:
    (site / "fake_broken_plugin.py").write_text("raise RuntimeError('no credentials')\n")
    sys.modules.pop("fake_broken_plugin", None)
    install_fake_distribution(site, "[sweepd.sweeps]\nbroken = fake_broken_plugin:ignored\n")
    with pytest.raises(ConfigError) as caught:
        settings_from_text("namespace: n\n", "c.yaml", Environment())
    (problem,) = caught.value.problems
    assert problem.location == "entry point sweepd.sweeps:broken"
    assert problem.message.startswith(
        "importing 'fake_broken_plugin' failed: RuntimeError: no credentials ("
    )
    assert problem.message.endswith("fake_broken_plugin.py:1)")
