"""SIGHUP reloads the config of a running `sweepd run`, on every dialect (SPEC §4, §8).

One real replica runs quick sweeps every second; the test rewrites its
config file, sends SIGHUP half-way between two ticks, and reads what really
ran from the side-effect lines the sweeps wrote (each names its sweep and
tick): which sweeps ran for which ticks after the reload, whether any tick
ran twice or went missing, and what the daemon logged about the reload.
"""

from __future__ import annotations

import itertools
import math
import re
import signal
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import Cluster, Replica, overlaps, read_rows, read_runs, sweep, write_config

pytestmark = pytest.mark.slow

Event = dict[str, Any]


def is_event(name: str) -> Callable[[Event], bool]:
    return lambda e: e.get("event") == name


def epoch(value: str) -> float:
    return datetime.fromisoformat(value).timestamp()


def ticks(out: Path, name: str) -> list[float]:
    """Scheduled times (epoch seconds) of ``name``'s runs, in the order they started."""
    return [
        epoch(r["tick"]) for r in read_runs(out) if r["event"] == "start" and r["sweep"] == name
    ]


def wait_for_runs(out: Path, name: str, after: float, count: int, timeout: float) -> list[float]:
    """Wait until ``name`` has ``count`` runs of ticks later than ``after``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        later = [t for t in ticks(out, name) if t > after]
        if len(later) >= count:
            return later
        time.sleep(0.05)
    raise AssertionError(f"{name}: fewer than {count} runs after {after} within {timeout}s")


def sleep_to_mid_second() -> None:
    """Signal half-way between two whole seconds, as far from any tick as can be."""
    time.sleep((0.5 - time.time() % 1.0) % 1.0)


def reload(replica: Replica, name: str) -> tuple[Event, float]:
    """SIGHUP at mid-second; the reload's outcome event and when it was logged."""
    sleep_to_mid_second()
    replica.signal(signal.SIGHUP)
    event = replica.wait_for(is_event(name), timeout=10)
    return event, epoch(event["timestamp"])


def assert_every_second(found: list[float], name: str) -> None:
    """Whole seconds, each once, none missing between the first and the last."""
    assert found, f"{name} never ran"
    assert all(t == int(t) for t in found), f"{name}: off-grid ticks {found}"
    duplicates = [t for t, n in Counter(found).items() if n > 1]
    assert not duplicates, f"{name}: ticks run twice: {duplicates}"
    expected = list(range(int(min(found)), int(max(found)) + 1))
    assert sorted(int(t) for t in found) == expected, f"{name}: gaps in {found}"


def stop(replica: Replica) -> None:
    replica.signal(signal.SIGTERM)
    assert replica.wait(15) == 0


def configure(tmp: Path, url: str, sweeps: list[dict[str, Any]]) -> Path:
    return write_config(tmp / "sweepd.yaml", url, sweeps)


def test_sighup_adds_and_removes_sweeps(cluster: Cluster, tmp_path: Path) -> None:
    out = tmp_path / "runs.jsonl"
    # b outlasts its interval, so it is always in flight (its next tick queued)
    # when the reload removes it: that run must finish, the queued tick must not.
    b = sweep("b", out, args={"duration": 1.5})
    config = configure(tmp_path, cluster.url, [sweep("a", out), b])
    (replica,) = cluster.start(config)
    wait_for_runs(out, "b", after=0, count=2, timeout=10)
    configure(tmp_path, cluster.url, [sweep("a", out), sweep("c", out)])

    reloaded, at = reload(replica, "config.reloaded")
    wait_for_runs(out, "c", after=at, count=3, timeout=10)
    stop(replica)

    assert (reloaded["added"], reloaded["removed"], reloaded["changed"]) == (["c"], ["b"], [])
    runs = read_runs(out)
    a_ticks, c_ticks = ticks(out, "a"), ticks(out, "c")
    assert_every_second(a_ticks, "a")
    assert max(a_ticks) > at + 2, "a stopped running after the reload"
    assert min(a_ticks) < at, "a did not run before the reload"
    b_starts = [r for r in runs if r["sweep"] == "b" and r["event"] == "start"]
    assert all(r["at"] < at for r in b_starts), f"b started after the reload at {at}: {b_starts}"
    b_last = b_starts[-1]
    b_ends = [r for r in runs if r["sweep"] == "b" and r["event"] == "end"]
    assert b_ends and b_ends[-1]["tick"] == b_last["tick"], "b's last run did not finish"
    assert b_ends[-1]["at"] > at, "b was not in flight at the reload: the test proved nothing"
    assert_every_second(c_ticks, "c")
    # No catch-up for the new sweep: its first tick is the first whole second after the reload.
    assert min(c_ticks) == math.ceil(at)
    assert not overlaps(runs)
    assert {row["status"] for row in read_rows(cluster.url)} == {"success"}


def test_sighup_with_an_invalid_file_keeps_the_running_config(
    cluster: Cluster, tmp_path: Path
) -> None:
    out = tmp_path / "runs.jsonl"
    config = configure(tmp_path, cluster.url, [sweep("a", out), sweep("b", out)])
    (replica,) = cluster.start(config)
    wait_for_runs(out, "b", after=0, count=2, timeout=10)
    configure(tmp_path, cluster.url, [sweep("a", out), sweep("b", out, every="soon")])
    lines = config.read_text().splitlines()
    line = next(i for i, text_ in enumerate(lines, 1) if text_.strip() == "every: soon")
    column = lines[line - 1].index("soon") + 1

    failed, at = reload(replica, "config.reload_failed")
    for name in ("a", "b"):
        wait_for_runs(out, name, after=at, count=2, timeout=10)
    assert replica.process is not None and replica.process.poll() is None, "the daemon died"
    stop(replica)

    problems = failed["problems"]
    assert isinstance(problems, list)
    located = re.compile(rf"{re.escape(str(config))}:{line}:{column}: sweeps\[1\]\.every: .*soon")
    assert any(located.match(p) for p in problems), problems
    assert not [e for e in replica.events() if e.get("event") == "config.reloaded"]
    for name in ("a", "b"):
        assert_every_second(ticks(out, name), name)


def test_sighup_with_an_edited_schedule_makes_no_surprise_runs(
    cluster: Cluster, tmp_path: Path
) -> None:
    out = tmp_path / "runs.jsonl"
    config = configure(tmp_path, cluster.url, [sweep("a", out)])
    (replica,) = cluster.start(config)
    wait_for_runs(out, "a", after=0, count=2, timeout=10)
    configure(tmp_path, cluster.url, [sweep("a", out, every="3s")])

    reloaded, at = reload(replica, "config.reloaded")
    wait_for_runs(out, "a", after=at, count=2, timeout=10)
    stop(replica)

    assert (reloaded["added"], reloaded["removed"], reloaded["changed"]) == ([], [], ["a"])
    found = ticks(out, "a")
    before = [t for t in found if t <= at]
    after = [t for t in found if t > at]
    assert_every_second(before, "a before the reload")
    assert all(t % 3 == 0 for t in after), f"ticks off the 3 s grid after the reload: {after}"
    # The new schedule's next tick from now, not a catch-up of one it "missed".
    assert after[0] == 3 * math.ceil(at / 3)
    assert [b - a for a, b in itertools.pairwise(after)] == [3.0] * (len(after) - 1)
    # Nothing scheduled before the reload started after it.
    late = [r for r in read_runs(out) if r["event"] == "start" and epoch(r["tick"]) <= at]
    assert all(r["at"] < at for r in late), late


def test_a_sweep_removed_and_added_back_while_its_tick_waits_for_a_slot_never_overlaps(
    cluster: Cluster, tmp_path: Path
) -> None:
    # One slot, held by hog for 4 s: b's tick waits for it. The first SIGHUP
    # removes b while that tick waits, the second adds b back before the slot
    # frees. The old and the new flight of b must not both claim b.
    out = tmp_path / "runs.jsonl"
    hog = sweep("hog", out, every="10s", args={"duration": 4.0})
    with_b = [hog, sweep("b", out)]
    config = write_config(tmp_path / "sweepd.yaml", cluster.url, with_b, concurrency=1)
    (replica,) = cluster.start(config)
    wait_for_runs(out, "hog", after=0, count=1, timeout=15)
    hog_start = next(r for r in read_runs(out) if r["sweep"] == "hog" and r["event"] == "start")
    # Both reloads while hog runs (from a whole second, for 4 s), after b's
    # next tick began to wait: at 1.5 s and 2.5 s into hog's run.
    assert time.time() < hog_start["at"] + 1.0, "hog's run began too long ago to test with"
    time.sleep(hog_start["at"] + 1.0 - time.time())
    write_config(tmp_path / "sweepd.yaml", cluster.url, [hog], concurrency=1)
    reload(replica, "config.reloaded")
    write_config(tmp_path / "sweepd.yaml", cluster.url, with_b, concurrency=1)
    _, back = reload(replica, "config.reloaded")
    assert back < hog_start["at"] + 4.0, "the slot freed before b was added back"
    wait_for_runs(out, "b", after=back, count=3, timeout=15)
    stop(replica)

    runs = read_runs(out)
    assert not overlaps(runs)
    b_starts = [r for r in runs if r["sweep"] == "b" and r["event"] == "start"]
    tokens = [r["token"] for r in b_starts]
    assert len(tokens) == len(set(tokens)), f"one claim ran twice: {b_starts}"
    assert len({r["tick"] for r in b_starts}) == len(b_starts), "a tick of b ran twice"
    assert {row["status"] for row in read_rows(cluster.url)} == {"success"}
