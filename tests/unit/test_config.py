"""Config loading in-process: merging, the environment, the database rules."""

import sys
import textwrap
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from sweepd import registry
from sweepd.config import Overrides, load_settings, settings_from_text
from sweepd.environment import Environment, read_environment
from sweepd.errors import ConfigError
from sweepd.schedule import Cron, Every, next_tick


@pytest.fixture
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[registry.Registry]:
    """A registry of this test's own, so decorated sweeps do not leak between tests."""
    fresh = registry.Registry()
    monkeypatch.setattr(registry, "REGISTRY", fresh)
    yield fresh
    # A module first imported under this registry declared its sweeps here alone:
    # forgotten, its next import declares them where the next test looks.
    for module in {declared.func.__module__ for declared in fresh.all()}:
        sys.modules.pop(module, None)


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
    assert tidy.ttl == timedelta(seconds=3)
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


# -- every problem in one run ------------------------------------------------------


def test_a_shape_error_elsewhere_does_not_stop_the_checks_against_code(
    fresh_registry: registry.Registry,
) -> None:
    text = """\
        concurency: 4
        database: {url: sqlite:///x.db, pool: 3}
        sweeps:
          - name: purge
            callable: sweepd.examples:nowhere
            every: 1m
    """
    assert problems(text) == [
        "c.yaml:2:33: database.pool: unknown key 'pool' (allowed: url, url_file, migrate)",
        "c.yaml:1:1: concurency: unknown key 'concurency' (did you mean 'concurrency'?)",
        "c.yaml:5:15: sweeps[0].callable: module 'sweepd.examples' has no attribute 'nowhere'",
    ]


def test_a_broken_key_is_reported_once_not_again_as_missing(
    fresh_registry: registry.Registry,
) -> None:
    # The bad 'every' is not also "needs one of every or cron", the bad
    # callable not also "missing callable", and the bad args not rebound.
    text = """\
        sweeps:
          - name: a
            callable: sweepd.examples:heartbeat
            every: ten
            ttl: 0s
          - name: b
            callable: not a target
            cron: "0 * * * *"
            args: {batch: 1}
          - name: c
            callable: sweepd.examples:heartbeat
            every: 1m
            args: [1]
    """
    assert problems(text) == [
        "c.yaml:4:12: sweeps[0].every: invalid duration 'ten' (expected e.g. 500ms, 30s, 5m, 1h30m, 1d)",
        "c.yaml:5:10: sweeps[0].ttl: must be longer than zero",
        "c.yaml:7:15: sweeps[1].callable: invalid callable 'not a target' (expected module:attribute, e.g. myapp.jobs:purge)",
        "c.yaml:13:11: sweeps[2].args: expected a mapping, got a list",
    ]


def test_a_decorator_with_a_bad_setting_still_has_its_arguments_checked(
    module_dir: Path, fresh_registry: registry.Registry
) -> None:
    write_module(
        module_dir,
        "app_sweeps_partial",
        """
        from sweepd import sweep

        @sweep(every="soon", args={"limit": 5})
        def tidy(batch: int) -> None:
            pass
        """,
    )
    assert problems("entrypoints: [app_sweeps_partial]\n") == [
        "app_sweeps_partial.py:4: @sweep(tidy).every: invalid duration 'soon' (expected e.g. 500ms, 30s, 5m, 1h30m, 1d)",
        "app_sweeps_partial.py:4: @sweep(tidy).args: args do not fit tidy(batch): missing a required argument: 'batch'",
    ]


def test_a_bad_database_url_is_not_also_a_missing_one_in_production(
    fresh_registry: registry.Registry,
) -> None:
    env = Environment(env="production")
    assert problems("database: {url: 'redis://cache'}\n" + YAML_SWEEP, env) == [
        "c.yaml:1:17: database.url: unsupported database URL (expected sqlite:///PATH, postgresql+psycopg://... or mysql+pymysql://...)",
    ]


def test_one_bad_entrypoint_name_does_not_stop_the_others_from_registering(
    module_dir: Path, fresh_registry: registry.Registry
) -> None:
    write_module(
        module_dir,
        "app_sweeps_listed",
        """
        from sweepd import sweep

        @sweep(every="1m")
        def tidy() -> None:
            pass
        """,
    )
    text = """\
        entrypoints: [app_sweeps_listed, "not-a-module"]
        sweeps:
          - {name: tidy, ttl: 2m}
    """
    assert problems(text) == [
        "c.yaml:1:34: entrypoints[1]: invalid module name 'not-a-module' (expected e.g. myapp.sweeps)",
    ]
    # With no module to import, a sweep without callable is not blamed for it.
    assert problems("entrypoints: app_sweeps_listed\nsweeps:\n  - {name: tidy, ttl: 2m}\n") == [
        "c.yaml:1:14: entrypoints: expected a list, got string 'app_sweeps_listed'",
    ]


def test_a_written_null_is_refused_where_it_has_no_meaning(
    fresh_registry: registry.Registry,
) -> None:
    # Only timeout has a meaning for null (no time limit); elsewhere a null
    # used to reach the daemon as None and fail there.
    text = """\
        sweeps:
          - name: tidy
            callable: sweepd.examples:heartbeat
            every: 1m
            timeout: null
            ttl: null
            misfire_grace: null
            enabled: null
    """
    assert problems(text) == [
        "c.yaml:6:10: sweeps[0].ttl: null is not a value here: leave the key out to take the default",
        "c.yaml:7:20: sweeps[0].misfire_grace: null is not a value here: leave the key out to take the default",
        "c.yaml:8:14: sweeps[0].enabled: null is not a value here: leave the key out to take the default",
    ]


# -- cron aliases ----------------------------------------------------------------------


def test_a_cron_alias_is_read_in_the_sweeps_time_zone(fresh_registry: registry.Registry) -> None:
    text = "sweeps:\n  - {name: n, callable: 'sweepd.examples:heartbeat', cron: '@daily', timezone: Europe/Berlin}\n"
    (sweep,) = settings_from_text(text, "c.yaml", Environment()).sweeps
    assert sweep.schedule == Cron("@daily", "Europe/Berlin")
    assert next_tick(sweep.schedule, datetime(2026, 6, 1, 12, tzinfo=UTC)) == datetime(
        2026, 6, 1, 22, tzinfo=UTC
    )


def test_an_unknown_cron_alias_lists_the_accepted_ones(fresh_registry: registry.Registry) -> None:
    text = "sweeps:\n  - {name: n, callable: 'sweepd.examples:heartbeat', cron: '@fortnightly'}\n"
    assert problems(text) == [
        "c.yaml:2:60: sweeps[0].cron: unknown cron alias '@fortnightly' (accepted: @yearly, @annually, @monthly, @weekly, @daily, @midnight, @hourly)",
    ]


# -- misfire_grace ------------------------------------------------------------------


def test_the_default_misfire_grace_fits_a_short_interval_without_a_warning(
    fresh_registry: registry.Registry,
) -> None:
    text = "sweeps:\n  - {name: n, callable: 'sweepd.examples:heartbeat', every: 1s}\n  - {name: c, callable: 'sweepd.examples:heartbeat', cron: '* * * * *'}\n"
    settings = settings_from_text(text, "c.yaml", Environment())
    assert [s.misfire_grace for s in settings.sweeps] == [
        timedelta(seconds=1),
        timedelta(seconds=30),
    ]
    assert settings.warnings == ()


@pytest.mark.parametrize(
    ("text", "warning"),
    [
        (
            "sweeps:\n  - {name: n, callable: 'sweepd.examples:heartbeat', every: 5s, misfire_grace: 10s}\n",
            "c.yaml:2:80: sweeps[0].misfire_grace: misfire_grace 10s is longer than the interval 5s: a late tick may still run after the next one is due",
        ),
        (
            "defaults: {misfire_grace: 10s}\nsweeps:\n  - {name: n, callable: 'sweepd.examples:heartbeat', every: 5s}\n",
            "c.yaml:3:5: sweeps[0]: misfire_grace 10s (from defaults.misfire_grace) is longer than the interval 5s: a late tick may still run after the next one is due",
        ),
    ],
    ids=["in-the-sweep", "in-defaults"],
)
def test_a_misfire_grace_the_user_wrote_still_warns(
    text: str, warning: str, fresh_registry: registry.Registry
) -> None:
    settings = settings_from_text(text, "c.yaml", Environment())
    assert settings.sweeps[0].misfire_grace == timedelta(seconds=10)
    assert [str(w) for w in settings.warnings] == [warning]


def test_a_decorators_misfire_grace_still_warns(
    module_dir: Path, fresh_registry: registry.Registry
) -> None:
    write_module(
        module_dir,
        "app_sweeps_grace",
        """
        from sweepd import sweep

        @sweep(every="5s", misfire_grace="10s")
        def tidy() -> None:
            pass
        """,
    )
    settings = settings_from_text("entrypoints: [app_sweeps_grace]\n", "c.yaml", Environment())
    assert [str(w) for w in settings.warnings] == [
        "app_sweeps_grace.py:4: @sweep(tidy).misfire_grace: misfire_grace 10s is longer than the interval 5s: a late tick may still run after the next one is due",
    ]
