"""The planned ticks do not depend on the wall clock of the process that plans them.

`check-config --from` is given an explicit start, so a replica whose wall clock is off must
print exactly the ticks a correct one prints. We move one process's wall clock with an
LD_PRELOAD shim (fakeclock.c) and compare the two outputs.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 60.0  # seconds; bounds every subprocess so a hung clock cannot hang the suite
SLACK = 5.0  # seconds allowed for process start-up and a loaded machine

# Offsets in seconds: ahead by an odd amount that crosses hours, and behind.
OFFSETS = [
    pytest.param(3 * 3600 + 17 * 60, id="ahead-3h17m"),
    pytest.param(-45 * 60, id="behind-45m"),
]

CHECK_CONFIG = [
    sys.executable,
    "-m",
    "sweepd",
    "check-config",
    "--config",
    "config.example.yaml",
    "--format",
    "json",
    "--from",
    "2026-03-29T00:30:00Z",
    "--no-db",
]


def run(args: list[str], shim: Path | None = None, offset: float = 0.0) -> str:
    """Run args from the repository root, with the wall clock moved when a shim is given."""
    env = dict(os.environ)
    # A FAKECLOCK_OFFSET left over in our own environment must not leak into the plain run.
    env.pop("FAKECLOCK_OFFSET", None)
    if shim is not None:
        env["LD_PRELOAD"] = " ".join(filter(None, [str(shim), env.get("LD_PRELOAD")]))
        env["FAKECLOCK_OFFSET"] = repr(offset)
    result = subprocess.run(
        args, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT, check=False
    )
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    assert result.returncode == 0, result.stderr
    return result.stdout


# Prints the wall clock three ways (naive datetime.now() also passes through localtime) and the
# monotonic clock, as JSON.
PROBE = """
import datetime, json, time
print(json.dumps({
    "time": time.time(),
    "datetime": datetime.datetime.now(datetime.timezone.utc).timestamp(),
    "naive_datetime": datetime.datetime.now().timestamp(),
    "monotonic": time.monotonic(),
}))
"""


@pytest.mark.parametrize("offset", OFFSETS)
def test_shim_moves_the_wall_clock_only(fakeclock: Path, offset: float) -> None:
    """Without this the main test could pass because the shim silently did nothing."""
    wall_before, mono_before = time.time(), time.monotonic()
    probe: dict[str, Any] = json.loads(run([sys.executable, "-c", PROBE], fakeclock, offset))
    wall_after, mono_after = time.time(), time.monotonic()

    # The child's readings, taken back by the offset, fall between ours taken around it.
    for key in ("time", "datetime", "naive_datetime"):
        unshifted = probe[key] - offset
        assert wall_before - SLACK <= unshifted <= wall_after + SLACK, (key, probe[key])
    # CLOCK_MONOTONIC is system-wide, so an untouched one lies between our two readings.
    assert mono_before - SLACK <= probe["monotonic"] <= mono_after + SLACK, probe


def planned_ticks(output: str) -> list[tuple[str, list[Any]]]:
    sweeps: list[dict[str, Any]] = json.loads(output)["sweeps"]
    return [(sweep["name"], sweep["next_ticks"]) for sweep in sweeps]


@pytest.mark.parametrize("offset", OFFSETS)
def test_check_config_ticks_ignore_the_wall_clock(fakeclock: Path, offset: float) -> None:
    plain = planned_ticks(run(CHECK_CONFIG))
    shifted = planned_ticks(run(CHECK_CONFIG, fakeclock, offset))

    assert plain, "check-config planned no sweeps"
    assert all(ticks for _, ticks in plain), plain
    assert shifted == plain
