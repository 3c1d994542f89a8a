"""docs/python-api.md's recipes, run as written: the daemon embedded in a host, drained by it.

Each block the page marks ``<!-- tested: NAME -->`` is written to ``app.py`` beside a config
and started as a real process: the plain asyncio program with ``python app.py``, the ASGI app
under uvicorn. SIGTERM goes to the host, which owns the signals; what must follow is the
host's drain of the scheduler: the run in flight at the signal finishes and is recorded, the
leases are released, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from daemon_harness import (
    HERE,
    REPO,
    assert_each_tick_once_and_every_run_recorded,
    read_rows,
    read_runs,
    sweep,
    write_config,
)

from sweepd.db.engine import make_engine
from sweepd.embedded import Scheduler
from sweepd.errors import ConfigError
from sweepd.lease import LeaseStore

pytestmark = pytest.mark.slow

PAGE = REPO / "docs" / "python-api.md"
LONG_RUN = 1.5  # seconds: the run the SIGTERM lands in the middle of
TIMEOUT = 30.0


def recipe(name: str) -> str:
    """The python block that follows ``<!-- tested: name -->`` on the page."""
    found = re.search(
        rf"<!-- tested: {name} -->\n```python\n(.*?)```", PAGE.read_text(), flags=re.DOTALL
    )
    assert found, f"docs/python-api.md has no block marked tested: {name}"
    return found.group(1)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


COMMANDS = {
    "asyncio": lambda: [sys.executable, "app.py"],
    "asgi": lambda: [sys.executable, "-m", "uvicorn", "app:app", "--port", str(free_port())],
}
# uvicorn ends its graceful shutdown by raising the signal it caught again, so its process
# ends by SIGTERM after the lifespan's shutdown has completed.
CLEAN_EXIT = {"asyncio": 0, "asgi": -signal.SIGTERM}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_the_recipe_runs_the_sweeps_and_the_host_drains_them(name: str, tmp_path: Path) -> None:
    if name == "asgi":
        pytest.importorskip("uvicorn")
    out, url = tmp_path / "runs.jsonl", f"sqlite:///{tmp_path / 'sweepd.db'}"
    sweeps = [sweep("quick", out), sweep("long", out, every="2s", args={"duration": LONG_RUN})]
    write_config(tmp_path / "sweepd.yaml", url, sweeps)
    (tmp_path / "app.py").write_text(recipe(name))
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SWEEPD_")}
    environment["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(HERE), os.environ.get("PYTHONPATH")])
    )
    log = tmp_path / "host.log"
    with open(log, "wb") as output:
        host = subprocess.Popen(
            COMMANDS[name](), cwd=tmp_path, env=environment, stdout=output, stderr=subprocess.STDOUT
        )
        try:
            # Signalled in the middle of a long run, once the quick sweep has run a few times.
            deadline = time.monotonic() + TIMEOUT
            while True:
                runs = read_runs(out)
                ended = {(r["sweep"], r["tick"]) for r in runs if r["event"] == "end"}
                flying = [
                    r
                    for r in runs
                    if r["sweep"] == "long"
                    and r["event"] == "start"
                    and (r["sweep"], r["tick"]) not in ended
                    and time.time() - r["at"] < LONG_RUN / 3
                ]
                if flying and sum(r["sweep"] == "quick" for r in runs) >= 4:
                    break
                assert host.poll() is None, log.read_text()[-2000:]
                assert time.monotonic() < deadline, f"no run in flight: {log.read_text()[-2000:]}"
                time.sleep(0.02)
            signalled = time.time()
            host.send_signal(signal.SIGTERM)
            code = host.wait(TIMEOUT)
        finally:
            if host.poll() is None:
                host.kill()
                host.wait()
    took = time.time() - signalled
    print(f"\n[{name}] exit {code} {took:.2f}s after SIGTERM")

    assert code == CLEAN_EXIT[name], log.read_text()[-3000:]
    if name == "asgi":
        assert "Application shutdown complete" in log.read_text(), log.read_text()[-3000:]
    # The host drained the scheduler: the run in flight at the signal ran to its end, after it.
    (in_flight,) = flying
    runs, rows = read_runs(out), read_rows(url)
    (end,) = [
        r
        for r in runs
        if r["event"] == "end" and r["token"] == in_flight["token"] and r["sweep"] == "long"
    ]
    assert end["at"] > signalled, (signalled, end)
    assert took < LONG_RUN + 3.0, took
    (row,) = [r for r in rows if r["name"] == "long" and r["fencing_token"] == in_flight["token"]]
    assert row["status"] == "success", row
    assert_each_tick_once_and_every_run_recorded(runs, rows)
    # And released the leases: none outlives the drain by its ttl.
    engine = make_engine(url)
    try:
        store = LeaseStore(engine, "system")
        now = store.now()
        for name_ in ("quick", "long"):
            lease = store.read(name_)
            assert lease is not None and lease.expires_at <= now + timedelta(seconds=0.5), lease
    finally:
        engine.dispose()


def test_a_bad_config_raises_every_problem_located_before_anything_starts(tmp_path: Path) -> None:
    config = tmp_path / "sweepd.yaml"
    config.write_text("sweeps:\n  - name: a\n    every: soon\n  - name: b\n    every: 1s\n")
    with pytest.raises(ConfigError) as raised:
        Scheduler(config, database_url=f"sqlite:///{tmp_path / 'sweepd.db'}")
    where = sorted((p.location, p.path) for p in raised.value.problems)
    # Both sweeps lack a callable, and the first's interval is no duration.
    assert where == [
        (f"{config}:2:5", "sweeps[0]"),
        (f"{config}:3:12", "sweeps[0].every"),
        (f"{config}:4:5", "sweeps[1]"),
    ], where
    assert not (tmp_path / "sweepd.db").exists()


def test_reload_reads_the_file_again_on_the_hosts_loop(tmp_path: Path) -> None:
    out, url = tmp_path / "runs.jsonl", f"sqlite:///{tmp_path / 'sweepd.db'}"
    config = write_config(tmp_path / "sweepd.yaml", url, [sweep("first", out)])

    async def ran(name: str) -> None:
        while not any(r["sweep"] == name for r in read_runs(out)):
            await asyncio.sleep(0.02)

    async def host() -> None:
        async with Scheduler(config) as scheduler:
            await asyncio.wait_for(ran("first"), TIMEOUT)
            write_config(config, url, [sweep("first", out), sweep("added", out)])
            scheduler.reload()
            await asyncio.wait_for(ran("added"), TIMEOUT)

    asyncio.run(host())
    assert_each_tick_once_and_every_run_recorded(read_runs(out), read_rows(url))
