"""The baseline of benchmarks/compare.py: every replica runs every schedule.

What a crontab line or a timer on every host does: nothing coordinates the
replicas, so each tick runs once per replica, and nothing stops a run that
outlives its interval from overlapping the next (cron starts the next one
regardless). A thread per run, started on the tick.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from datetime import UTC, datetime

sys.path.insert(0, os.path.dirname(__file__))
import record


def main() -> int:
    if "--setup" in sys.argv:
        return 0  # nothing is stored: every replica has its own schedule
    recorder = record.from_environment()
    sweeps = int(os.environ["COMPARE_SWEEPS"])
    interval = float(os.environ["COMPARE_INTERVAL"])
    body = float(os.environ["COMPARE_BODY"])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print("ready", flush=True)
    tick = (time.time() // interval + 1) * interval
    while not stop.wait(max(0.0, tick - time.time())):
        at = datetime.fromtimestamp(tick, UTC)
        for i in range(sweeps):
            run = threading.Thread(target=recorder.run, args=(f"sweep-{i}", at, body), daemon=True)
            run.start()
        tick += interval
    return 0


if __name__ == "__main__":
    sys.exit(main())
