"""/healthz, /readyz and /metrics of real `sweepd run` processes (issue 23; SPEC §10).

Each replica listens on a port of its own (``health.listen: 127.0.0.1:0``) and logs it. The
tests read the endpoints as a load balancer, Kubernetes and Prometheus would: while the daemon
runs, when the database goes away (a TCP proxy that the test stops) and comes back, when a
drain begins, and when a sweep blocks the event loop.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import IN_CI
from daemon_harness import Cluster, Replica, read_rows, read_runs, sweep, write_config
from prometheus_client.parser import text_string_to_metric_families
from tcp_proxy import port_below_ephemeral, proxy_for

from sweepd.db import migrate

pytestmark = pytest.mark.slow

Event = dict[str, Any]
TIMEOUT = 20.0  # bounds every wait


def health_config(tmp: Path, url: str, sweeps: list[dict[str, Any]], **top: Any) -> Path:
    return write_config(tmp / "sweepd.yaml", url, sweeps, health={"listen": "127.0.0.1:0"}, **top)


def address(replica: Replica) -> str:
    listening = replica.wait_for(lambda e: e.get("event") == "health.listening", timeout=TIMEOUT)
    return f"http://{listening['address']}"


def get(base: str, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(base + path, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def within(condition: Callable[[], bool], seconds: float = TIMEOUT) -> float:
    """Seconds until ``condition`` held (a bounded poll); fails past the bound."""
    began = time.monotonic()
    while not condition():
        assert time.monotonic() - began < seconds, "not within the bound"
        time.sleep(0.05)
    return time.monotonic() - began


def test_healthz_and_readyz_answer_200_while_running_and_readyz_503_from_the_drain(
    cluster: Cluster, tmp_path: Path
) -> None:
    out = tmp_path / "runs.jsonl"
    long = sweep("long", out, every="1s", args={"duration": 3.0})
    (replica,) = cluster.start(health_config(tmp_path, cluster.url, [long]))
    base = address(replica)
    within(lambda: get(base, "/readyz")[0] == 200)
    assert get(base, "/healthz") == (200, "ok\n")
    assert get(base, "/nothing")[0] == 404
    replica.wait_for(lambda e: e.get("event") == "tick.claimed", timeout=TIMEOUT)

    replica.signal(signal.SIGTERM)  # a run is in flight: the drain waits for it
    waited = within(lambda: get(base, "/readyz")[0] == 503, seconds=2.0)
    assert get(base, "/readyz") == (503, "not ready: draining\n")
    assert get(base, "/healthz")[0] == 200  # draining, but alive
    assert replica.wait(TIMEOUT) == 0
    print(f"MEASURE readyz 503 {waited:.2f}s after SIGTERM")


def test_healthz_turns_503_while_a_sweep_blocks_the_loop(
    make_database: Callable[[str], str], tmp_path: Path
) -> None:
    url = make_database("sqlite")
    out = tmp_path / "runs.jsonl"
    # Not at once: the daemon's first lines (the port among them) are out by the first tick.
    blocker = sweep("blocker", out, every="4s", callable="daemon_sweeps:block_loop")
    blocker["args"]["seconds"] = 8.0
    cluster = Cluster(url, tmp_path)
    try:
        (replica,) = cluster.start(health_config(tmp_path, url, [blocker]))
        base = address(replica)
        # The sweep's own line, not the log's: the loop's lines wait for the loop.
        within(lambda: any(r["event"] == "start" for r in read_runs(out)))
        # The server's thread answers while the loop is stuck: 503 within the bound.
        waited = within(lambda: get(base, "/healthz")[0] == 503, seconds=8.0)
        assert "has not turned" in get(base, "/healthz")[1]
        within(lambda: get(base, "/healthz")[0] == 200, seconds=10.0)  # the sweep returned
        print(f"MEASURE healthz 503 {waited:.2f}s into the block")
    finally:
        cluster.stop()
        cluster.close()


class Proxied(Cluster):
    """Replicas that reach the database through a proxy the test stops and starts."""

    def __init__(self, url: str, tmp: Path) -> None:
        super().__init__(url, tmp)
        self.proxy, self.proxied = proxy_for(url, port_below_ephemeral())

    def close(self) -> None:
        super().close()
        self.proxy.stop()


@pytest.fixture(params=["postgresql", "mariadb"])
def proxied(
    request: pytest.FixtureRequest, make_database: Callable[[str], str], tmp_path: Path
) -> Iterator[Proxied]:
    url = make_database(str(request.param))
    migrate.upgrade(url)
    rig = Proxied(url, tmp_path)
    try:
        yield rig
    finally:
        rig.close()


def test_readyz_turns_503_within_5s_when_the_database_goes_and_200_when_it_returns(
    proxied: Proxied, tmp_path: Path
) -> None:
    out = tmp_path / "runs.jsonl"
    config = health_config(tmp_path, proxied.proxied, [sweep("quick", out)])
    (replica,) = proxied.start(config)
    base = address(replica)
    within(lambda: get(base, "/readyz")[0] == 200)

    proxied.proxy.stop()
    gone = within(lambda: get(base, "/readyz")[0] == 503, seconds=6.0)
    status, body = get(base, "/readyz")
    assert (status, body) == (503, "not ready: the database has not answered lately\n")
    assert get(base, "/healthz")[0] == 200  # the loop still turns: only not ready
    proxied.proxy.start()
    back = within(lambda: get(base, "/readyz")[0] == 200, seconds=10.0)
    proxied.stop()
    print(f"MEASURE readyz 503 {gone:.2f}s after the database went, 200 {back:.2f}s after")
    assert gone < 5.5


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def promtool_or_skip() -> str:
    found = shutil.which("promtool")
    if found is None:
        message = "promtool is not installed (Debian's prometheus package)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    return found


def test_metrics_count_what_really_happened_and_pass_promtool(
    cluster: Cluster, tmp_path: Path
) -> None:
    promtool = promtool_or_skip()
    out = tmp_path / "runs.jsonl"

    def once(name: str, **settings: Any) -> dict[str, Any]:
        # Hourly, with the last tick caught up at start: each runs its one tick, and then
        # nothing moves while the test reads the counters.
        return {**sweep(name, out, every="1h", **settings), "catch_up": "latest"}

    sweeps = [
        once("ok"),
        once("broken", args={"fail_times": 99}),
        once("slow", timeout="200ms", args={"duration": 0.5}),
        once("retried", retries={"max": 1, "backoff": "0s"}, args={"fail_times": 1}),
    ]
    (replica,) = cluster.start(health_config(tmp_path, cluster.url, sweeps))
    base = address(replica)
    within(lambda: len(read_rows(cluster.url)) == 5 and get(base, "/readyz")[0] == 200)
    # Every row is finished, and its run.finished said so: the counters have moved too.
    within(lambda: sum(e.get("event") == "run.finished" for e in replica.events()) == 5)
    text = get(base, "/metrics")[1]
    replica.signal(signal.SIGTERM)
    assert replica.wait(TIMEOUT) == 0

    checked = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, check=False
    )
    assert checked.returncode == 0 and not checked.stdout.strip(), checked.stdout + checked.stderr

    samples = metric_samples(text)
    outcomes = Counter((r["name"], r["status"]) for r in read_rows(cluster.url))
    assert outcomes == {
        ("ok", "success"): 1,
        ("broken", "failed"): 1,
        ("slow", "timeout"): 1,
        ("retried", "failed"): 1,
        ("retried", "success"): 1,
    }
    counted = {
        (dict(labels)["sweep"], dict(labels)["status"]): value
        for (name, labels), value in samples.items()
        if name == "sweepd_runs_total"
    }
    assert counted == outcomes  # one per attempt, by what its row says
    for name in ("ok", "broken", "slow", "retried"):
        attempts = sum(n for (sweep_name, _), n in outcomes.items() if sweep_name == name)
        assert samples[("sweepd_run_duration_seconds_count", (("sweep", name),))] == attempts
        assert samples[("sweepd_tick_lateness_seconds_count", (("sweep", name),))] == 1
        # Two hourly intervals and the default 3 s ttl.
        assert samples[("sweepd_sweep_stale_after_seconds", (("sweep", name),))] == 7203
    assert samples[("sweepd_last_success_timestamp_seconds", (("sweep", "ok"),))] > 0
    assert ("sweepd_last_success_timestamp_seconds", (("sweep", "broken"),)) not in samples
    assert not [key for key in samples if key[0] == "sweepd_ticks_skipped_total"]
    assert not [key for key in samples if key[0] == "sweepd_store_errors_total"]
    assert samples[("sweepd_runs_in_flight", ())] == 0
    assert samples[("sweepd_build_info", (("version", "0.1.0"),))] == 1
    assert samples[("sweepd_ready", ())] == 1
    assert abs(samples[("sweepd_clock_skew_seconds", ())]) < 1.0


def test_the_shipped_alert_rules_pass_promtool() -> None:
    rules = Path(__file__).resolve().parents[2] / "prometheus" / "sweepd-alerts.yml"
    checked = subprocess.run(
        [promtool_or_skip(), "check", "rules", str(rules)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 4 rules found" in checked.stdout
