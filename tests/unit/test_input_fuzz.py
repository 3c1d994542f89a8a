"""Fuzzed input: generated configs and command lines never meet a traceback.

``check-config`` answers 0 (valid) or 2 (bad input), and a 2 says, on every
line, where the problem is (``file:line:col:``, ``$VARIABLE:``, or the
command's name for an argument). The CLI runs in this process, through
``sweepd.cli.main``, so a bug that raises shows up as the exception itself.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml
from config_strategies import PLAUSIBLE, configs, raw_text
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sweepd.cli import main

# A problem's location, then its message: "sweepd.yaml:4:15: sweeps[0]...",
# "$SWEEPD_LOG_LEVEL: ...", "sweepd check-config: ..." or "warning: ...".
LOCATED = re.compile(r"^(warning: |\$?[\w./ -]+(:\d+){0,2}: \S)")
FUZZ = settings(
    max_examples=150,
    deadline=None,  # the first example imports sweepd.examples and pydantic's models
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for name in [n for n in os.environ if n.startswith("SWEEPD_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def check(argv: list[str], capfd: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """The exit code and stderr of ``sweepd ARGV``; a traceback fails the test."""
    code = main(argv)
    captured = capfd.readouterr()
    assert "Traceback" not in captured.out + captured.err
    assert code in (0, 2), (argv, code, captured.err)
    if code == 2:
        lines = captured.err.splitlines()
        assert lines, "exit 2 with nothing said"
        unlocated = [line for line in lines if not LOCATED.match(line)]
        assert not unlocated, unlocated
    return code, captured.err


@FUZZ
@given(config=configs)
def test_generated_configs_are_accepted_or_refused_with_located_lines(
    config: dict[str, object], clean_environment: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    path = clean_environment / "sweepd.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    check(["check-config", "--no-db", "--config", str(path.name)], capfd)


@FUZZ
@given(text=raw_text)
def test_text_that_is_no_config_is_refused_with_located_lines(
    text: str, clean_environment: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    path = clean_environment / "sweepd.yaml"
    path.write_text(text, encoding="utf-8")
    check(["check-config", "--no-db", "--config", path.name], capfd)


OPTIONS = [
    *("--config", "--database", "--no-db", "--format", "--json", "--dry-run", "--since"),
    *("--ttl", "--tick", "--namespace", "--", "-x", "--help=no", "--version=1", "-h"),
]


@FUZZ
@given(
    command=st.sampled_from(["check-config", "run"]),
    rest=st.lists(st.sampled_from(OPTIONS) | st.sampled_from(PLAUSIBLE) | st.text(max_size=10)),
)
def test_generated_command_lines_get_a_usage_line_not_a_traceback(
    command: str, rest: list[str], clean_environment: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # The config given last cannot exist: whatever else parses, no daemon starts.
    check([command, *rest, "--config", "no/such/sweepd.yaml"], capfd)


def test_a_line_break_in_an_argument_stays_inside_its_one_line(
    clean_environment: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # U+0085 is a line break to str.splitlines: written as is, it split click's message.
    _, err = check(["check-config", "a\x85b", "--config", "no/such/sweepd.yaml"], capfd)
    assert len(err.splitlines()) == 1 and "a\\x85b" in err, err
