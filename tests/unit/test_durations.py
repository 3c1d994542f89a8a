import re
from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sweepd.durations import format_duration, parse_duration


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("500ms", timedelta(milliseconds=500)),
        ("30s", timedelta(seconds=30)),
        ("5m", timedelta(minutes=5)),
        ("2h", timedelta(hours=2)),
        ("1d", timedelta(days=1)),
        ("1h30m", timedelta(hours=1, minutes=30)),
        ("1d2h3m4s5ms", timedelta(days=1, hours=2, minutes=3, seconds=4, milliseconds=5)),
        (" 10s ", timedelta(seconds=10)),
        ("0s", timedelta(0)),
    ],
)
def test_parses_what_operators_write(text: str, expected: timedelta) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("30", "duration '30' needs a unit, e.g. '30s'"),
        ("ten", "invalid duration 'ten' (expected e.g. 500ms, 30s, 5m, 1h30m, 1d)"),
        ("5x", "invalid duration '5x' (expected e.g. 500ms, 30s, 5m, 1h30m, 1d)"),
        ("1m1m", "invalid duration '1m1m': a unit appears twice"),
        ("-5s", "invalid duration '-5s' (expected e.g. 500ms, 30s, 5m, 1h30m, 1d)"),
        ("", "invalid duration '' (expected e.g. 500ms, 30s, 5m, 1h30m, 1d)"),
    ],
)
def test_refuses_with_a_message(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message) + "$"):
        parse_duration(text)


@given(st.integers(min_value=0, max_value=10**14).map(lambda ms: timedelta(milliseconds=ms)))
def test_format_reads_back(value: timedelta) -> None:
    assert parse_duration(format_duration(value)) == value
