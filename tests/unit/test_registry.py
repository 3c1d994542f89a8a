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


def test_an_import_that_raises_in_the_stdlib_names_the_users_line(
    site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # os.environ["X"] raises inside <frozen os>; the line to fix is the module's own.
    monkeypatch.chdir(site)
    monkeypatch.delenv("SWEEPD_TEST_UNSET_DSN", raising=False)
    (site / "fake_settings_env.py").write_text(
        'import os\n\n\nDSN = os.environ["SWEEPD_TEST_UNSET_DSN"]\n'
    )
    sys.modules.pop("fake_settings_env", None)
    with pytest.raises(registry.ResolveError) as caught:
        registry.import_module("fake_settings_env")
    assert str(caught.value) == (
        "importing 'fake_settings_env' failed: KeyError: 'SWEEPD_TEST_UNSET_DSN' (fake_settings_env.py:4)"
    )


def test_an_import_failing_in_its_package_names_the_packages_line(
    site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Importing fake_app_pkg.jobs runs fake_app_pkg/__init__.py first: no frame
    # is in jobs.py, so the deepest line of the package's own code is named.
    monkeypatch.chdir(site)
    monkeypatch.delenv("SWEEPD_TEST_UNSET_DSN", raising=False)
    package = site / "fake_app_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from fake_app_pkg.settings import DSN\n")
    (package / "settings.py").write_text('import os\n\nDSN = os.environ["SWEEPD_TEST_UNSET_DSN"]\n')
    (package / "jobs.py").write_text("def purge() -> None: ...\n")
    for name in ("fake_app_pkg", "fake_app_pkg.settings", "fake_app_pkg.jobs"):
        sys.modules.pop(name, None)
    with pytest.raises(registry.ResolveError) as caught:
        registry.import_module("fake_app_pkg.jobs")
    assert str(caught.value) == (
        "importing 'fake_app_pkg.jobs' failed: KeyError: 'SWEEPD_TEST_UNSET_DSN' "
        f"({Path('fake_app_pkg', 'settings.py')}:3)"
    )
