"""Log lines: those logged on the loop leave together; none is lost or reordered."""

import asyncio
import json
import sys
import threading
from collections.abc import Iterator

import pytest
import structlog

from sweepd import observe
from sweepd.observe import FLUSH_SECONDS, configure_logging, flush_logs, get_logger


class Recording:
    """A stream that keeps each write apart, so a test can count them."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def events(self) -> list[str]:
        return [json.loads(line)["event"] for line in "".join(self.writes).splitlines()]


@pytest.fixture
def stream() -> Iterator[Recording]:
    recording = Recording()
    configure_logging("json", "info", stream=recording)  # type: ignore[arg-type]
    yield recording
    flush_logs()
    structlog.reset_defaults()
    observe._LINES.point_at(sys.stderr)


def test_lines_logged_on_the_loop_wait_and_leave_in_one_write(stream: Recording) -> None:
    async def scenario() -> list[str]:
        log = get_logger()
        for n in range(3):
            log.info(f"loop.{n}")
        before = list(stream.writes)
        await asyncio.sleep(FLUSH_SECONDS * 3)
        return before

    before = asyncio.run(scenario())
    assert before == []
    assert len(stream.writes) == 1
    assert stream.events() == ["loop.0", "loop.1", "loop.2"]


def test_a_line_from_another_thread_is_written_at_once_after_the_waiting_ones(
    stream: Recording,
) -> None:
    async def scenario() -> list[str]:
        log = get_logger()
        log.info("loop.first")
        worker = threading.Thread(target=lambda: log.info("thread.second"))
        worker.start()
        worker.join()
        return stream.events()

    assert asyncio.run(scenario()) == ["loop.first", "thread.second"]


def test_flush_logs_writes_what_waits(stream: Recording) -> None:
    async def scenario() -> list[str]:
        get_logger().info("loop.only")
        flush_logs()
        return stream.events()

    assert asyncio.run(scenario()) == ["loop.only"]


def test_a_loop_that_closed_with_a_write_due_does_not_silence_the_next(
    stream: Recording,
) -> None:
    async def log_and_leave() -> None:
        get_logger().info("first.loop")

    async def log_and_wait() -> None:
        get_logger().info("second.loop")
        await asyncio.sleep(FLUSH_SECONDS * 3)

    asyncio.run(log_and_leave())  # closes before its write was due
    asyncio.run(log_and_wait())
    assert stream.events() == ["first.loop", "second.loop"]


@pytest.mark.parametrize(
    ("now", "written"),
    [
        (1_780_000_000.0, "2026-05-28T20:26:40.000000Z"),
        (1_780_000_000.638_25, "2026-05-28T20:26:40.638250Z"),
        (1_780_000_000.999_999, "2026-05-28T20:26:40.999999Z"),
        (1_780_000_001.000_001, "2026-05-28T20:26:41.000001Z"),  # the next second's own text
        (1_780_000_000.5, "2026-05-28T20:26:40.500000Z"),  # and back: a thread a second behind
    ],
)
def test_the_timestamp_is_utc_to_the_microsecond_each_second_its_own(
    stream: Recording, monkeypatch: pytest.MonkeyPatch, now: float, written: str
) -> None:
    get_logger().info("before")  # the second before, already formatted
    monkeypatch.setattr("sweepd.observe.time.time", lambda: now)
    get_logger().info("at")
    flush_logs()
    line = json.loads("".join(stream.writes).splitlines()[-1])
    assert (line["event"], line["timestamp"]) == ("at", written)


def test_a_value_json_cannot_hold_is_written_as_its_repr(stream: Recording) -> None:
    get_logger().info("odd", value={1, 2}, nested={"when": threading.Event})
    flush_logs()
    line = json.loads("".join(stream.writes))
    assert line["value"] == "{1, 2}"
    assert line["nested"] == {"when": repr(threading.Event)}


class Terminal(Recording):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("format", "on_terminal", "json_lines"),
    [("auto", False, True), ("auto", True, False), ("json", True, True), ("console", False, False)],
)
def test_configure_logging_says_whether_its_lines_are_json(
    stream: Recording, format: str, on_terminal: bool, json_lines: bool
) -> None:
    # `sweepd run` writes its fatal error as an event exactly when this is true.
    # (``stream`` is here for its teardown, which puts logging back as it was.)
    target = Terminal() if on_terminal else Recording()

    assert configure_logging(format, "info", stream=target) is json_lines  # type: ignore[arg-type]


def test_a_json_traceback_shows_frames_but_not_their_local_variables(stream: Recording) -> None:
    def connect() -> None:
        url = "postgresql://sweepd:hunter2@db/app"
        raise RuntimeError(f"cannot reach {url.split('@')[1]}")

    try:
        connect()
    except RuntimeError:
        get_logger().exception("daemon.flight_crashed")
    flush_logs()
    (line,) = [json.loads(text) for text in "".join(stream.writes).splitlines()]
    (exception,) = line["exception"]
    assert exception["exc_type"] == "RuntimeError"
    assert [frame["name"] for frame in exception["frames"]][-1] == "connect"
    assert "hunter2" not in json.dumps(line)
