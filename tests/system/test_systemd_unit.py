"""The shipped systemd/sweepd.service, checked offline and run by a real systemd (SPEC §8, §10).

Offline: ``systemd-analyze verify`` finds nothing to say about the unit,
``systemd-analyze security`` scores its sandbox 2.5 or better, and the config
shipped beside it passes check-config. Live: one Debian container per module
(tests/system/systemd_support.py), booted by ``systemd-nspawn``, where the
unit, installed as its header says, goes active only at READY=1; stays
failed on a bad config but retries a fault at start; reloads on
``systemctl reload`` and refuses a bad file there; drains on ``systemctl
stop``; is killed by its watchdog when the daemon stops answering, and
started again; writes only its state directory; and reads its database URL
from a credential. The first run on a machine builds the cached root and
dependencies (one to two minutes); with them cached the module takes under
a minute.
"""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from systemd_support import (
    REPO,
    UNIT,
    Machine,
    Overlay,
    Unit,
    base_root,
    build_wheel,
    config,
    deps_layer,
    exec_paths,
    fake_root,
    install,
    record,
    tool,
    unavailable,
    within,
)

# The first test to boot the container may build the cached layers (debootstrap,
# one to two minutes); every wait inside a test is bounded on its own.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SHIPPED_CONFIG = REPO / "systemd" / "sweepd.yaml"
IMPORT_DELAY = 3.0  # seconds unit_sweeps sleeps at import, in the READY test


def unit_settings() -> dict[str, list[str]]:
    """The unit's [Service] and [Unit] keys, each with its values in order."""
    found: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";")):
            key, value = line.split("=", 1)
            found.setdefault(key.strip(), []).append(value.strip())
    return found


def seconds(value: str) -> float:
    units = {"ms": 0.001, "s": 1, "min": 60, "m": 60}
    found = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|min|m)?", value)
    assert found, f"not a plain time span: {value}"
    return float(found[1]) * units[found[2] or "s"]


# ---------------------------------------------------------------- offline


def test_systemd_analyze_verify_has_nothing_to_say(tmp_path: Path) -> None:
    analyze = tool("systemd-analyze", "systemd")
    root = fake_root(tmp_path / "root", UNIT)

    def verify(where: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [analyze, "verify", "--man=no", "--recursive-errors=yes", f"--root={where}", UNIT.name],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    result = verify(root)
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    # The check is not vacuous: a misspelt key in this same setup is an error.
    broken = fake_root(tmp_path / "broken", UNIT)
    copy = broken / "etc/systemd/system" / UNIT.name
    copy.write_text(copy.read_text().replace("ProtectSystem=", "ProtectSystm="))
    result = verify(broken)
    assert result.returncode != 0 and "ProtectSystm" in result.stderr


def test_the_sandbox_scores_2_5_or_better(tmp_path: Path) -> None:
    analyze = tool("systemd-analyze", "systemd")
    result = subprocess.run(
        [analyze, "security", "--offline=yes", "--threshold=25", "--no-pager", str(UNIT)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    score = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", result.stdout)
    assert result.returncode == 0 and score, result.stdout + result.stderr
    assert float(score[1]) <= 2.5


def test_the_unit_and_the_shipped_config_agree() -> None:
    """The config shipped for /etc/sweepd passes check-config, keeps its SQLite file in the
    state directory, and drains well inside TimeoutStopSec; the unit runs the documented venv."""
    settings = unit_settings()
    assert {path for path in exec_paths(UNIT.read_text()) if "sweepd" in path} == {
        "/opt/sweepd/bin/sweepd"
    }
    assert all(
        "--config /etc/sweepd/sweepd.yaml" in line
        for line in settings["ExecStart"] + settings["ExecStartPre"]
    )
    shipped = yaml.safe_load(SHIPPED_CONFIG.read_text())
    state = settings["StateDirectory"][0]
    assert shipped["database"]["url"].startswith(f"sqlite:////var/lib/{state}/")
    drain = seconds(shipped["drain_timeout"])
    assert seconds(settings["TimeoutStopSec"][0]) >= drain + 2 + 5  # grace, and room to release
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "sweepd",
            "check-config",
            "--no-db",
            "--config",
            str(SHIPPED_CONFIG),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------- in a container


@pytest.fixture(scope="module")
def machine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Machine]:
    if os.geteuid() != 0:
        unavailable("systemd-nspawn and overlayfs need root")
    tool("systemd-nspawn", "systemd-container")
    tool("debootstrap", "debootstrap")
    tool("nsenter", "util-linux")
    work = tmp_path_factory.mktemp("systemd-unit")
    started = time.monotonic()
    key, root = base_root()
    wheel = build_wheel(work / "build")
    deps = deps_layer(key, root, wheel, work)
    with Overlay([deps, root], work / "container") as merged:
        install(merged, wheel)
        results = work / "results"
        results.mkdir()
        found = Machine(merged, results, work / "console.log")
        try:
            found.boot()
            print(f"container ready in {time.monotonic() - started:.1f}s: {merged}")
            yield found
        finally:
            found.close()


@pytest.fixture
def unit(machine: Machine) -> Unit:
    found = Unit(machine)
    found.reset()
    return found


def test_the_unit_goes_active_only_once_the_daemon_says_ready(unit: Unit) -> None:
    # The sweeps' module takes IMPORT_DELAY to import, in ExecStartPre's
    # check-config and again in the daemon, before READY=1.
    unit.configure(
        config([record("tick")]), dropin=f"Environment=UNIT_SWEEPS_IMPORT_DELAY={IMPORT_DELAY}\n"
    )
    unit.machine.systemctl("start", "--no-block", unit.name)
    seen: list[tuple[str, str, bool]] = []

    def active() -> bool:
        shown = unit.show("ActiveState", "SubState", "MainPID")
        seen.append((shown["ActiveState"], shown["SubState"], shown["MainPID"] != "0"))
        return shown["ActiveState"] not in ("activating", "inactive")

    within(active, 60, "the unit to leave activating")
    shown = unit.show(
        "ActiveState", "ExecMainStartTimestampMonotonic", "ActiveEnterTimestampMonotonic"
    )
    assert shown["ActiveState"] == "active", seen
    # The daemon ran, and was not yet ready, for the length of the import at least.
    assert ("activating", "start", True) in seen, seen
    waited = (
        int(shown["ActiveEnterTimestampMonotonic"]) - int(shown["ExecMainStartTimestampMonotonic"])
    ) / 1e6
    assert waited >= IMPORT_DELAY - 0.1, (waited, seen)
    # STATUS= reached systemd, and the sweeps run.
    within(lambda: "running" in unit.show("StatusText")["StatusText"], 10, "a STATUS= line")
    assert re.fullmatch(
        r"1 sweep, \d running, (last tick \S+ UTC|no tick yet)",
        unit.show("StatusText")["StatusText"],
    )
    within(lambda: any(run["event"] == "end" for run in unit.runs()), 10, "a run")


def test_a_bad_config_leaves_the_unit_failed_and_a_database_fault_is_retried(unit: Unit) -> None:
    bad = config([record("tick")])
    bad["sweeps"][0]["evrey"] = bad["sweeps"][0].pop("every")
    unit.configure(bad, dropin="RestartSec=1s\n")
    assert unit.machine.systemctl("start", unit.name, check=False).returncode != 0
    invocation = unit.show("InvocationID")["InvocationID"]
    time.sleep(3)  # three times RestartSec: a restart would have begun
    shown = unit.show("ActiveState", "Result", "NRestarts", "ExecMainStatus")
    assert shown == {
        "ActiveState": "failed",
        "Result": "exit-code",
        "NRestarts": "0",
        "ExecMainStatus": "2",
    }
    assert "unknown key 'evrey'" in unit.messages(invocation)
    # A database file that cannot be opened: a fault at start (exit 1), tried
    # again every RestartSec, until it can be.
    unit.machine.systemctl("reset-failed", unit.name)
    database = unit.host_state / "sweepd.db"
    database.write_bytes(b"not a database" * 512)
    owner = unit.host_state.stat()
    os.chown(database, owner.st_uid, owner.st_gid)
    unit.configure(config([record("tick")]), dropin="RestartSec=1s\n")
    unit.machine.systemctl("start", "--no-block", unit.name)
    within(lambda: int(unit.show("NRestarts")["NRestarts"]) >= 1, 30, "a restart")
    assert "file is not a database" in unit.every_message()
    database.unlink()
    within(lambda: unit.show("ActiveState")["ActiveState"] == "active", 30, "the unit to start")
    within(lambda: any(run["event"] == "end" for run in unit.runs()), 10, "a run")


def test_systemctl_reload_takes_a_new_config_and_refuses_a_bad_one(unit: Unit) -> None:
    unit.configure(config([record("first")]))
    unit.machine.systemctl("start", unit.name)
    before = unit.show("MainPID", "InvocationID")
    unit.configure(config([record("first"), record("second")]))
    unit.machine.systemctl("reload", unit.name)
    within(lambda: unit.events("config.reloaded"), 15, "config.reloaded in the journal")
    within(lambda: unit.show("ActiveState")["ActiveState"] == "active", 15, "active again")
    within(lambda: any(run["sweep"] == "second" for run in unit.runs()), 10, "the new sweep's run")
    # A file that does not validate: ExecReload's check-config fails the
    # reload, so the operator hears it; the daemon goes on with the old one.
    bad = config([record("first"), record("second")])
    bad["sweeps"][1]["evrey"] = bad["sweeps"][1].pop("every")
    unit.configure(bad)
    result = unit.machine.systemctl("reload", unit.name, check=False)
    assert result.returncode != 0
    assert "evrey" in unit.messages()
    after = unit.show("MainPID", "InvocationID", "ActiveState", "NRestarts")
    assert after == {**before, "ActiveState": "active", "NRestarts": "0"}
    assert len(unit.events("config.reloaded")) == 1
    count = len([run for run in unit.runs() if run["sweep"] == "second"])
    within(
        lambda: len([run for run in unit.runs() if run["sweep"] == "second"]) > count,
        10,
        "the old config's sweeps still running",
    )


def test_systemctl_stop_drains_the_running_sweep_and_ends_in_success(unit: Unit) -> None:
    unit.configure(config([record("slow", every="2s", duration=5.0)]))
    unit.machine.systemctl("start", unit.name)
    invocation = unit.show("InvocationID")["InvocationID"]
    first = within(
        lambda: next((run for run in unit.runs() if run["event"] == "start"), None),
        15,
        "the slow sweep to start",
    )
    asked = time.time()
    unit.machine.systemctl("stop", "--no-block", unit.name)
    states: set[str] = set()

    def stopped() -> bool:
        state = unit.show("ActiveState")["ActiveState"]
        states.add(state)
        return state in ("inactive", "failed")

    within(stopped, 45, "the unit to stop")
    took = time.time() - asked
    shown = unit.show("ActiveState", "Result", "ExecMainCode", "ExecMainStatus")
    assert shown == {
        "ActiveState": "inactive",
        "Result": "success",
        "ExecMainCode": "1",  # CLD_EXITED
        "ExecMainStatus": "0",
    }
    assert "deactivating" in states
    assert "Deactivated successfully" in unit.messages(invocation)
    # The run in flight finished (it was not cancelled), and the stop waited for it.
    ends = [run for run in unit.runs() if run["tick"] == first["tick"] and run["event"] != "start"]
    assert [run["event"] for run in ends] == ["end"]
    assert ends[0]["at"] >= first["at"] + 5.0 and took < 45
    names = {entry.get("sweepd", {}).get("event") for entry in unit.journal(invocation)}
    assert {"daemon.draining", "daemon.stopped"} <= names
    # Its row says so too, in the SQLite file the daemon left in its state directory.
    with sqlite3.connect(f"file:{unit.host_state / 'sweepd.db'}?immutable=1", uri=True) as db:
        statuses = db.execute(
            "SELECT status FROM sweep_runs WHERE name = 'slow' ORDER BY id"
        ).fetchall()
    assert statuses and statuses[-1] == ("success",), statuses


def test_a_daemon_that_stops_answering_is_killed_by_the_watchdog_and_restarted(
    unit: Unit,
) -> None:
    # A short ttl: the lease of a tick the frozen daemon had claimed outlives
    # it by that much, and the new daemon waits it out.
    unit.configure(
        config([{**record("tick"), "ttl": "2s"}]), dropin="WatchdogSec=3s\nRestartSec=2s\n"
    )
    unit.machine.systemctl("start", unit.name)
    before = unit.show("MainPID", "InvocationID", "WatchdogUSec", "NRestarts")
    assert before["WatchdogUSec"] == "3s" and before["NRestarts"] == "0"
    within(lambda: any(run["event"] == "end" for run in unit.runs()), 10, "a first run")
    unit.machine.systemctl("kill", "--kill-whom=main", "--signal=SIGSTOP", unit.name)
    # Between the kill and the restart (RestartSec), the unit says why it died.
    within(lambda: unit.show("Result")["Result"] == "watchdog", 15, "Result=watchdog")

    def restarted() -> dict[str, str] | None:
        shown = unit.show("ActiveState", "MainPID", "NRestarts")
        return shown if shown["ActiveState"] == "active" and shown["NRestarts"] == "1" else None

    after = within(restarted, 30, "the unit to be restarted")
    assert after["MainPID"] != before["MainPID"]
    old = unit.messages(before["InvocationID"])
    assert "Watchdog timeout" in old
    # SIGABRT, and faulthandler left the stuck daemon's stacks in the journal.
    assert "Fatal Python error: Aborted" in old
    pid = int(after["MainPID"])
    within(
        lambda: any(run["pid"] == pid and run["event"] == "end" for run in unit.runs()),
        15,
        "a run of the new daemon",
    )


def test_the_sandbox_lets_the_daemon_write_its_state_directory_and_nothing_else(
    unit: Unit,
) -> None:
    # Folders anyone may write to, were it not for the sandbox: a refusal there
    # is the unit's doing, not the files' modes.
    for folder in ("srv/shared", "home/shared"):
        shared = unit.machine.root / folder
        shared.mkdir(exist_ok=True)
        shared.chmod(0o1777)
    read_only = ["/srv/shared/probe", "/etc/probe", "/opt/sweepd/probe", "/var/lib/probe"]
    refused = ["/etc/sweepd/probe", "/run/probe", "/root/probe"]  # EROFS, or EACCES first
    private = ["/tmp/probe", "/var/tmp/probe"]  # PrivateTmp: writable, and the host's stay clean
    homes = ["/home/shared/probe"]  # ProtectHome: not there at all
    inside = f"{Unit.state}/probe"
    probe = {
        "name": "probe",
        "callable": "unit_sweeps:probe",
        "every": "1h",
        "catch_up": "latest",
        "args": {"out": Unit.runs_file, "paths": [inside, *read_only, *refused, *private, *homes]},
    }
    unit.configure(config([probe]))
    unit.machine.systemctl("start", unit.name)
    found = within(
        lambda: next((run for run in unit.runs() if run["event"] == "probe"), None),
        20,
        "the probe's report",
    )
    files = found["files"]
    assert files[inside] == {"outcome": "ok", "mode": "0o600"}  # UMask=0077
    outcomes = {path: files[path]["outcome"] for path in files}
    assert {path: outcomes[path] for path in read_only} == dict.fromkeys(read_only, "EROFS")
    assert all(outcomes[path] in ("EROFS", "EACCES") for path in refused), outcomes
    assert {path: outcomes[path] for path in private} == dict.fromkeys(private, "ok")
    assert all(outcomes[path] in ("ENOENT", "EACCES") for path in homes), outcomes
    for path in [*read_only, *refused, *private, *homes]:
        assert unit.machine.run("test", "-e", path, check=False).returncode == 1, path
    assert found["netlink"] == "EAFNOSUPPORT"  # RestrictAddressFamilies
    assert found["uid"] != 0 and found["cap_eff"] == "0000000000000000"
    assert (found["no_new_privs"], found["seccomp"], found["sees_pid_1"]) == ("1", "2", False)
    # The SQLite file is the daemon's, made by its dynamic user in its state directory.
    database = unit.host_state / "sweepd.db"
    assert database.stat().st_uid == found["uid"]
    assert database.stat().st_mode & 0o777 == 0o600
    unit.machine.systemctl("stop", unit.name, timeout=90)
    with sqlite3.connect(f"file:{database}?immutable=1", uri=True) as db:
        rows = db.execute("SELECT status FROM sweep_runs WHERE name = 'probe'").fetchall()
    assert rows == [("success",)]


def test_the_database_url_can_come_from_a_credential_only_root_can_read(unit: Unit) -> None:
    """The unit's commented LoadCredential= with database.url_file, as sweepd.yaml suggests."""
    secret = unit.machine.root / "etc/sweepd/database-url"
    secret.write_text(f"sqlite:///{Unit.state}/from-credential.db\n")
    secret.chmod(0o600)
    try:
        settings = config([record("tick")])
        settings["database"] = {"url_file": "/run/credentials/sweepd.service/database-url"}
        unit.configure(settings, dropin="LoadCredential=database-url:/etc/sweepd/database-url\n")
        unit.machine.systemctl("start", unit.name)
        within(lambda: any(run["event"] == "end" for run in unit.runs()), 10, "a run")
        assert (unit.host_state / "from-credential.db").exists()
    finally:
        secret.unlink()
