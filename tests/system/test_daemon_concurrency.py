"""`concurrency` (§5): at most that many different sweeps run at once in a replica,
and a replica with too few says so.

Two real replicas with two slots each and six sweeps of 0.4 s due at the same
instant every second: each replica must reach two runs at once (the slots
are really used) and never three, and every tick must still run exactly
once, across both, within its second.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from daemon_harness import (
    Replica,
    overlaps,
    read_runs,
    start_replicas,
    stop_all,
    sweep,
    write_config,
)

pytestmark = pytest.mark.slow

SLOTS = 2
SWEEPS = 6
RUN_SECONDS = 0.4
WINDOW_SECONDS = 6.0


def most_at_once(runs: list[dict[str, object]]) -> int:
    """The largest number of runs in progress at one instant, from start/end lines."""
    edges: list[tuple[float, int]] = []
    starts = {(r["sweep"], r["tick"]): r for r in runs if r["event"] == "start"}
    for run in runs:
        if run["event"] == "end":
            begin = starts[(run["sweep"], run["tick"])]
            edges += [(float(str(begin["at"])), 1), (float(str(run["at"])), -1)]
    current = peak = 0
    for _, step in sorted(edges):  # at a tie an end (-1) sorts before a start
        current += step
        peak = max(peak, current)
    return peak


def test_each_replica_runs_at_most_concurrency_sweeps_at_once(
    database_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "runs.jsonl"
    sweeps = [
        sweep(f"busy-{n}", out, args={"duration": RUN_SECONDS}, ttl="10s") for n in range(SWEEPS)
    ]
    config = write_config(tmp_path / "sweepd.yaml", database_url, sweeps, concurrency=SLOTS)
    replicas = start_replicas(config, 2, tmp_path)
    try:
        time.sleep(WINDOW_SECONDS)
    finally:
        assert stop_all(replicas) == [0, 0]

    runs = read_runs(out)
    ended = [r for r in runs if r["event"] == "end"]
    assert ended, "nothing ran"
    for replica in replicas:
        mine = [r for r in runs if r["pid"] == replica.pid]
        assert most_at_once(mine) == SLOTS, replica.pid
    assert overlaps(runs) == []
    ran = [(r["sweep"], r["tick"]) for r in runs if r["event"] == "start"]
    assert len(ran) == len(set(ran)), "a tick ran twice"
    # Four slots in all for six 0.4 s runs a second: every tick in the window
    # ran all six sweeps. The first tick may be cut off by the start, and the
    # last two by the drain, which drops the ticks still waiting for a slot.
    ticks: dict[str, set[str]] = {}
    for name, tick in ran:
        ticks.setdefault(str(tick), set()).add(str(name))
    inner = sorted(ticks)[1:-2]
    assert len(inner) >= 2, sorted(ticks)
    for tick in inner:
        assert len(ticks[tick]) == SWEEPS, (tick, sorted(ticks[tick]))


def test_a_replica_short_of_slots_says_so_and_one_behind_a_long_run_does_not(
    database_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "runs.jsonl"
    # One slot for five 0.4 s sweeps a second: the backlog grows, until a tick
    # comes while the one ahead of it still waits for the slot.
    short = write_config(
        tmp_path / "short.yaml",
        database_url,
        [sweep(f"busy-{n}", out, args={"duration": 0.4}, ttl="10s") for n in range(5)],
        concurrency=1,
    )
    # A 2.5 s sweep every second with slots to spare: its ticks fold behind a
    # claimed run, which is single-flight, not a shortage.
    long = write_config(
        tmp_path / "long.yaml",
        database_url,
        [sweep("long", out, args={"duration": 2.5}, ttl="10s")],
        namespace="long",
    )
    replicas = [
        Replica(short, tmp_path / "short.log").start(),
        Replica(long, tmp_path / "long.log").start(),
    ]
    try:
        warned = replicas[0].wait_for(lambda e: e.get("event") == "daemon.short_of_slots")
        replicas[1].wait_for(lambda e: e.get("reason") == "coalesced", timeout=10)
    finally:
        assert stop_all(replicas) == [0, 0]
    assert warned["level"] == "warning"
    assert warned["concurrency"] == 1 and warned["waiting"] >= 1, warned
    assert [e for e in replicas[1].events() if e.get("event") == "daemon.short_of_slots"] == []
