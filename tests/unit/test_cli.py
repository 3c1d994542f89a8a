"""The CLI's contract with a shell: output streams and exit codes."""

import fnmatch
import json

import pytest

from sweepd import __version__
from sweepd.cli import main
from sweepd.redact import mask_in, mask_url

EXAMPLE = "config.example.yaml"


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"sweepd {__version__}\n"


def test_check_config_json_counts_from_the_given_instant(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert (
        main(
            [
                "check-config",
                "--config",
                EXAMPLE,
                "--format",
                "json",
                "--no-db",
                "--from",
                "2026-03-29T00:30:00+01:00",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["version"] == 1
    assert report["from"] == "2026-03-28T23:30:00Z"
    heartbeat = next(s for s in report["sweeps"] if s["name"] == "heartbeat")
    assert [t["utc"] for t in heartbeat["next_ticks"]] == [
        "2026-03-28T23:30:00Z",
        "2026-03-28T23:30:10Z",
        "2026-03-28T23:30:20Z",
    ]


def test_check_config_prefers_the_flag_database_and_masks_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SWEEPD_DATABASE_URL", "postgresql+psycopg://app:hunter2@db/app")
    assert main(["check-config", "--config", EXAMPLE, "--format", "json", "--no-db"]) == 0
    out = capsys.readouterr().out
    assert "hunter2" not in out
    assert json.loads(out)["database"]["url"] == "postgresql+psycopg://app:***@db/app"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["check-config"], "sweepd: no config given: pass --config PATH or set SWEEPD_CONFIG"),
        (
            ["check-config", "--config", EXAMPLE, "--from", "tomorrow"],
            "sweepd: --from: invalid datetime 'tomorrow' (expected ISO 8601, e.g. 2026-03-29T00:30:00Z)",
        ),
        (
            ["check-config", "--config", EXAMPLE, "--from", "2026-03-29T00:30:00"],
            "sweepd: --from: '2026-03-29T00:30:00' needs a UTC offset, e.g. 2026-03-29T00:30:00Z",
        ),
        (
            ["check-config", "--format", "yaml"],
            "sweepd check-config: Invalid value for '--format': 'yaml' is not one of 'text', 'json'.",
        ),
        # click words its own errors differently by version: only their shape is ours.
        (["check-config", "--bogus"], "sweepd check-config: No such option*--bogus*"),
        (["frobnicate"], "sweepd: No such command*frobnicate*"),
        (
            ["db", "sql"],
            "sweepd: no dialect given: pass --dialect postgresql|mysql|sqlite, or the database"
            " (--database URL, SWEEPD_DATABASE_URL or --config PATH)",
        ),
        (["status"], "sweepd: no config given: pass --config PATH or set SWEEPD_CONFIG"),
        (
            ["status", "--config", EXAMPLE, "--window", "5x"],
            "sweepd: --window: invalid duration '5x' (expected e.g. 500ms, 30s, 5m, 1h30m, 1d)",
        ),
        (["status", "--config", EXAMPLE, "--format", "yaml"], "sweepd status: Invalid value*"),
        (
            ["history"],
            "sweepd: no database given: pass --database URL, set SWEEPD_DATABASE_URL, or name a config with --config",
        ),
        # Checked before the database is opened.
        (
            ["history", "--database", "sqlite:///unused.db", "--since", "soon"],
            "sweepd: --since: invalid duration 'soon' (expected e.g. 500ms, 30s, 5m, 1h30m, 1d)",
        ),
        (
            ["history", "--database", "sqlite:///unused.db", "--since", "0s"],
            "sweepd: --since: must be longer than zero",
        ),
        (["history", "--status", "done"], "sweepd history: Invalid value for '--status': *"),
        (["history", "--limit", "0"], "sweepd history: Invalid value for '--limit': *"),
        (
            ["trigger", "nope", "--config", EXAMPLE],
            "sweepd: trigger: unknown sweep 'nope' (known: heartbeat, nightly-report, purge-sessions, reconcile)",
        ),
        (["trigger", "--config", EXAMPLE], "sweepd trigger: Missing argument 'NAME'*"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SWEEPD_CONFIG", raising=False)
    monkeypatch.delenv("SWEEPD_DATABASE_URL", raising=False)
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert fnmatch.fnmatchcase(line, message)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql+psycopg://u:p%40ss@h:5432/db", "postgresql+psycopg://u:***@h:5432/db"),
        ("postgresql://u:p@ss@h/db", "postgresql://u:***@h/db"),
        ("mysql+pymysql://root@127.0.0.1/test", "mysql+pymysql://root@127.0.0.1/test"),
        (
            "postgresql://h/db?sslmode=require&password=zz",
            "postgresql://h/db?sslmode=require&password=***",
        ),
        ("sqlite:///sweepd.db", "sqlite:///sweepd.db"),
    ],
)
def test_urls_are_shown_without_passwords(url: str, shown: str) -> None:
    assert mask_url(url) == shown


def test_driver_messages_lose_the_password() -> None:
    url = "postgresql://app:s3cret@db/app"
    assert mask_in(f"could not connect to {url} (password s3cret rejected)", url) == (
        "could not connect to postgresql://app:***@db/app (password *** rejected)"
    )
