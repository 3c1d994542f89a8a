"""The sync sweeps' threads count what is still running, so the exit knows
whether a sweep was left behind (sweepd.cli.entry)."""

import threading
import time
from collections.abc import Callable
from functools import partial

from sweepd.runner import _Threads

WAIT = 5.0  # a bound on each wait, never reached when the code is right


def settles(condition: Callable[[], bool]) -> bool:
    """Whether ``condition`` holds within WAIT: the count drops on the job's own
    thread, just after the job returns."""
    deadline = time.monotonic() + WAIT
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_busy_counts_jobs_until_their_code_returns() -> None:
    threads = _Threads()
    release = threading.Event()
    started = [threading.Event(), threading.Event()]

    def job(index: int) -> None:
        started[index].set()
        release.wait(WAIT)

    assert threads.busy() == 0
    for index in range(2):
        threads.run(partial(job, index))
    assert all(event.wait(WAIT) for event in started)
    assert threads.busy() == 2

    release.set()
    assert settles(lambda: threads.busy() == 0)


def test_a_reused_thread_counts_its_next_job() -> None:
    threads = _Threads()
    first = threading.Event()
    threads.run(first.set)
    assert first.wait(WAIT)
    assert settles(lambda: threads.busy() == 0)

    hold, running = threading.Event(), threading.Event()

    def blocked() -> None:
        running.set()
        hold.wait(WAIT)

    threads.run(blocked)
    assert running.wait(WAIT)
    assert threads.busy() == 1
    hold.set()
    assert settles(lambda: threads.busy() == 0)
