"""sweepd in benchmarks/compare.py: a generated config, then ``sweepd run``.

Defaults throughout (ttl, misfire grace, coalescing) but one: ``concurrency``
is S, so a replica may run every sweep of a tick at once, as docs/performance.md
tells an operator to set it for sweeps that share a tick (and as procrastinate's
runner sets its worker's). At the default of 4, 20 half-second runs a second
queue through 12 slots on 3 replicas, and through 8 once one is killed. Health
off and JSON logs at info, as in benchmarks/replicas.py.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
from typing import Any

import record  # beside this file, on the daemon's PYTHONPATH too


@functools.cache
def _recorder() -> record.Recorder:
    return record.from_environment()  # one per daemon process


def run(ctx: Any, body: float) -> None:
    """The sweep, called by the daemon: the shared body, with the daemon's tick."""
    _recorder().run(ctx.name, ctx.tick, body)


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    url = os.environ["COMPARE_URL"].replace("postgresql://", "postgresql+psycopg://", 1)
    if "--setup" in sys.argv:  # the schema, once, before the replicas start
        os.execv(
            sys.executable, [sys.executable, "-m", "sweepd", "db", "upgrade", "--database", url]
        )
    config = {
        "database": {"url": url, "migrate": "never"},
        "logging": {"format": "json", "level": "info"},
        "health": {"listen": ""},
        "concurrency": int(os.environ["COMPARE_SWEEPS"]),
        "sweeps": [
            {
                "name": f"sweep-{i}",
                "callable": "sweepd_runner:run",
                "every": f"{float(os.environ['COMPARE_INTERVAL']):g}s",
                "args": {"body": float(os.environ["COMPARE_BODY"])},
            }
            for i in range(int(os.environ["COMPARE_SWEEPS"]))
        ],
    }
    folder = tempfile.mkdtemp(prefix="compare-sweepd-")
    path = os.path.join(folder, "sweepd.yaml")
    with open(path, "w") as file:
        json.dump(config, file)  # JSON is YAML
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    os.execv(sys.executable, [sys.executable, "-m", "sweepd", "run", "--config", path])


if __name__ == "__main__":
    sys.exit(main())
