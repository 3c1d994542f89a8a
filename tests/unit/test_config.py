"""Config loading in-process: merging, the environment, the database rules."""

import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest

from sweepd import registry
from sweepd.config import Overrides, load_settings, settings_from_text
from sweepd.environment import Environment, read_environment
from sweepd.errors import ConfigError
from sweepd.schedule import Cron, Every


@pytest.fixture
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> registry.Registry:
    """A registry of this test's own, so decorated sweeps do not leak between tests."""
    fresh = registry.Registry()
    monkeypatch.setattr(registry, "REGISTRY", fresh)
    return fresh


@pytest.fixture
def module_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write_module(folder: Path, name: str, body: str) -> str:
    (folder / f"{name}.py").write_text(textwrap.dedent(body))
    sys.modules.pop(name, None)
    return name


def problems(text: str, env: Environment | None = None) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        settings_from_text(textwrap.dedent(text), "c.yaml", env or Environment())
    return [str(p) for p in caught.value.problems]


YAML_SWEEP = """
sweeps:
  - name: tidy
    callable: sweepd.examples:heartbeat
    every: 1m
"""


def test_defaults_fill_what_the_file_leaves_out(fresh_registry: registry.Registry) -> None:
    settings = settings_from_text(YAML_SWEEP, "c.yaml", Environment())
    assert settings.database.url == "sqlite:///sweepd.db"
    assert settings.database.explicit is False
    assert settings.concurrency == 4
    assert settings.drain_timeout == timedelta(seconds=30)
    (tidy,) = settings.sweeps
    assert tidy.ttl == timedelta(seconds=30)
    assert tidy.timeout is None
    assert tidy.misfire_grace == timedelta(seconds=30)
    assert tidy.schedule == Every(timedelta(minutes=1))
    assert tidy.takes_context is True  # heartbeat(ctx: SweepContext)
    assert tidy.source == "c.yaml:3"


def test_environment_overrides_and_its_errors_point_at_the_variable(
    fresh_registry: registry.Registry,
) -> None:
    env = read_environment(
        {
            "SWEEPD_DATABASE_URL": "postgresql+psycopg://u:pw@db/app",
            "SWEEPD_NAMESPACE": "staging",
            "SWEEPD_HEALTH_LISTEN": "",
            "SWEEPD_LOG_FORMAT": "json",
            "SWEEPD_LOG_LEVEL": "debug",
            "UNRELATED": "x",
        }
    )
    settings = settings_from_text("database: {url: sqlite:///x.db}\n" + YAML_SWEEP, "c.yaml", env)
    assert settings.database.url == "postgresql+psycopg://u:pw@db/app"
    assert settings.database.explicit
    assert (settings.namespace, settings.health_listen) == ("staging", "")
    assert (settings.log_format, settings.log_level) == ("json", "debug")

    bad = read_environment({"SWEEPD_LOG_LEVEL": "loud", "SWEEPD_NAMESPACE": "Bad Name"})
    assert problems(YAML_SWEEP, bad) == [
        "$SWEEPD_NAMESPACE: namespace: invalid name 'Bad Name': use lowercase letters, digits, '.', '_' and '-', starting with a letter or digit, at most 128 characters",
        "$SWEEPD_LOG_LEVEL: logging.level: expected one of 'debug', 'info', 'warning' or 'error', got string 'loud'",
    ]


def test_command_line_database_beats_the_environment(fresh_registry: registry.Registry) -> None:
    env = Environment(database_url="sqlite:///from-env.db")
    settings = settings_from_text(
        YAML_SWEEP, "c.yaml", env, Overrides(database_url="sqlite:///from-flag.db")
    )
    assert settings.database.url == "sqlite:///from-flag.db"


def test_url_file_is_read_and_stripped(tmp_path: Path, fresh_registry: registry.Registry) -> None:
    secret = tmp_path / "db"
    secret.write_text("mysql+pymysql://root:s3cret@127.0.0.1/test\n")
    settings = settings_from_text(
        f"database: {{url_file: {secret}}}\n{YAML_SWEEP}", "c.yaml", Environment()
    )
    assert settings.database.url == "mysql+pymysql://root:s3cret@127.0.0.1/test"
    assert settings.database.explicit


def test_production_warns_that_sqlite_files_stay_on_one_host(
    fresh_registry: registry.Registry,
) -> None:
    env = Environment(env="production", database_url="sqlite:///var/lib/sweepd.db")
    settings = settings_from_text(YAML_SWEEP, "c.yaml", env)
    assert [str(w) for w in settings.warnings] == [
        "$SWEEPD_DATABASE_URL: database.url: a SQLite file coordinates only processes on one host; replicas on other hosts need PostgreSQL or MySQL"
    ]


def test_yaml_overrides_a_decorated_sweep_field_by_field(
    module_dir: Path, fresh_registry: registry.Registry
) -> None:
    write_module(
        module_dir,
        "app_sweeps_merge",
        """
        from sweepd import sweep, SweepContext

        @sweep(every="5m", ttl="10m", timeout="1m", args={"batch": 10})
        def expire_sessions(ctx: SweepContext, batch: int) -> None:
            pass
        """,
    )
    settings = settings_from_text(
        textwrap.dedent(
            """\
            entrypoints: [app_sweeps_merge]
            sweeps:
              - name: expire-sessions
                every: 30s
                timeout: null
            """
        ),
        "c.yaml",
        Environment(),
    )
    (merged,) = settings.sweeps
    assert merged.schedule == Every(timedelta(seconds=30))  # from YAML
    assert merged.timeout is None  # YAML's explicit null beats the decorator's 1m
    assert merged.ttl == timedelta(minutes=10)  # from the decorator
    assert dict(merged.args) == {"batch": 10}
    assert merged.target == "app_sweeps_merge:expire_sessions"
    assert merged.source == "c.yaml:3 over app_sweeps_merge.py:4"


def test_decorator_errors_are_located_at_the_decorator(
    module_dir: Path, fresh_registry: registry.Registry
) -> None:
    write_module(
        module_dir,
        "app_sweeps_bad",
        """
        from sweepd import sweep

        @sweep(every="soon")
        def tidy() -> None:
            pass

        @sweep(name="tidy", cron="0 * * * *")
        def tidy_again() -> None:
            pass
        """,
    )
    assert problems("entrypoints: [app_sweeps_bad]\n") == [
        "app_sweeps_bad.py:8: @sweep(tidy): sweep name 'tidy' is already declared at app_sweeps_bad.py:4",
        "app_sweeps_bad.py:4: @sweep(tidy).every: invalid duration 'soon' (expected e.g. 500ms, 30s, 5m, 1h30m, 1d)",
    ]


def test_context_is_detected_by_annotation_or_name(
    module_dir: Path, fresh_registry: registry.Registry
) -> None:
    write_module(
        module_dir,
        "app_ctx",
        """
        from __future__ import annotations
        import sweepd

        def by_name(ctx): ...
        def by_annotation(context: sweepd.SweepContext): ...
        def neither(batch: int = 1): ...
        """,
    )
    text = "sweeps:\n" + "".join(
        f"  - {{name: {n}, callable: 'app_ctx:{f}', every: 1m}}\n"
        for n, f in [("a", "by_name"), ("b", "by_annotation"), ("c", "neither")]
    )
    settings = settings_from_text(text, "c.yaml", Environment())
    assert [s.takes_context for s in settings.sweeps] == [True, True, False]


def test_cron_takes_the_default_time_zone(fresh_registry: registry.Registry) -> None:
    text = "defaults: {timezone: Europe/Berlin}\nsweeps:\n  - {name: n, callable: 'sweepd.examples:heartbeat', cron: '0 3 * * *'}\n"
    (sweep,) = settings_from_text(text, "c.yaml", Environment()).sweeps
    assert sweep.schedule == Cron("0 3 * * *", "Europe/Berlin")


def test_warnings_for_legal_but_suspicious_settings(fresh_registry: registry.Registry) -> None:
    text = textwrap.dedent(
        """\
        sweeps:
          - name: fast
            callable: sweepd.examples:heartbeat
            every: 200ms
            ttl: 1s
            misfire_grace: 5s
        """
    )
    settings = settings_from_text(text, "c.yaml", Environment())
    assert [str(w) for w in settings.warnings] == [
        "c.yaml:4:12: sweeps[0].every: an interval of 200ms is under a second: every tick is a database round trip on every replica",
        "c.yaml:6:20: sweeps[0].misfire_grace: misfire_grace 5s is longer than the interval 200ms: a late tick may still run after the next one is due",
        "c.yaml:5:10: sweeps[0].ttl: ttl 1s is under 3s: heartbeats every ttl/3 leave little room for a slow database",
    ]


def test_no_sweeps_is_a_warning_not_silence(fresh_registry: registry.Registry) -> None:
    settings = settings_from_text("namespace: quiet\n", "c.yaml", Environment())
    assert [str(w) for w in settings.warnings] == [
        "c.yaml:1:1: sweeps: no sweeps are defined: the daemon would do nothing"
    ]


def test_missing_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(str(tmp_path / "nope.yaml"), Environment())
    assert [str(p) for p in caught.value.problems] == [
        f"{tmp_path / 'nope.yaml'}: cannot read config: No such file or directory"
    ]


def test_a_yaml_schedule_replaces_the_decorators_whole_schedule(
    module_dir: Path, fresh_registry: registry.Registry
) -> None:
    write_module(
        module_dir,
        "app_sweeps_schedule",
        """
        from sweepd import sweep

        @sweep(every="1m", anchor="2026-01-01T00:00:30Z", ttl="2m")
        def rollup() -> None:
            pass
        """,
    )
    text = "entrypoints: [app_sweeps_schedule]\nsweeps:\n  - {name: rollup, cron: '*/5 * * * *', timezone: Europe/Berlin}\n"
    (rollup,) = settings_from_text(text, "c.yaml", Environment()).sweeps
    assert rollup.schedule == Cron("*/5 * * * *", "Europe/Berlin")
    assert rollup.ttl == timedelta(minutes=2)
