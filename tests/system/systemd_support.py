"""A real systemd for tests/system/test_systemd_unit.py: a Debian container, booted per module.

What the shipped unit promises (Type=notify, reload, the drain, the watchdog,
the sandbox) is only shown by the systemd that enforces it, so the test boots
one: ``systemd-nspawn --boot`` of a Debian bookworm minbase root, the way
TESTING.md found to work on these machines. No part of the host's init is
used (the host's PID 1 is not systemd): ``--keep-unit --register=no``, and
the test drives the container by ``nsenter`` into its PID 1's namespaces.

Two layers are cached on the machine, outside the repository, each in a
folder named by a hash of what went into it, and shared by every run:

- the root (``debootstrap``, about a minute), keyed by the suite, the
  packages, the mirror and ``RECIPE``;
- the dependencies: a venv at /opt/sweepd holding sweepd's requirements at
  the versions this test's own environment runs (``pip freeze``), built from
  wheels ``pip download``-ed on the host (the container has no network),
  and kept as an overlayfs upper layer over the root.

Each module's container is an overlay of both with an empty upper layer in
the test's temp folder: it starts clean, changes nothing cached, and gets
this checkout's sweepd wheel installed on top (``pip install --no-deps``).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
UNIT = REPO / "systemd" / "sweepd.service"
FIXTURES = HERE / "systemd"
IN_CI = os.environ.get("CI") == "true"

# A fixed path on the machine, not of one session: CI runs on one machine
# share it. SWEEPD_TEST_CACHE moves it.
CACHE = Path(os.environ.get("SWEEPD_TEST_CACHE") or "/var/cache/sweepd-tests")
SUITE = "bookworm"
# procps: ExecReload's /bin/kill, which minbase leaves out (every standard
# Debian install has it; a missing one fails `systemctl reload` with 203/EXEC).
PACKAGES = ("python3", "python3-venv", "systemd", "systemd-sysv", "dbus", "procps")
# Bump when the way a layer is built changes in a way its key does not show.
RECIPE = 1
# A cached layer not used for this long is removed when another is built.
PRUNE_AFTER = 14 * 86400  # seconds
FALLBACK_MIRROR = "http://deb.debian.org/debian"
# The container's commands, whatever the test's environment holds.
CONTAINER_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    "SYSTEMD_PAGER": "",
    "SYSTEMD_COLORS": "0",
}

T = TypeVar("T")


def unavailable(reason: str) -> NoReturn:
    """Skip on a workstation without what the test needs; in CI, where it must run, fail."""
    if IN_CI:
        pytest.fail(reason)
    pytest.skip(reason)


def tool(name: str, package: str) -> str:
    found = shutil.which(name)
    if found is None:
        unavailable(f"{name} is not installed (Debian's {package} package)")
    return found


def exec_paths(unit_text: str) -> list[str]:
    """The programs a unit's Exec*= lines run, without systemd's prefixes (-, @, +, !, :)."""
    paths = []
    for line in unit_text.splitlines():
        found = re.match(r"\s*Exec\w+\s*=\s*[-@+!:]*(\S+)", line)
        if found:
            paths.append(found.group(1))
    return paths


def fake_root(where: Path, unit: Path) -> Path:
    """A root for ``systemd-analyze verify --root``: the system's units, the unit, and stubs
    for its programs (verify refuses a unit whose ExecStart= does not exist)."""
    (where / "usr/lib/systemd").mkdir(parents=True)
    shutil.copytree("/usr/lib/systemd/system", where / "usr/lib/systemd/system", symlinks=True)
    (where / "etc/systemd/system").mkdir(parents=True)
    shutil.copy(unit, where / "etc/systemd/system" / unit.name)
    for program in exec_paths(unit.read_text()):
        stub = where / program.lstrip("/")
        stub.parent.mkdir(parents=True, exist_ok=True)
        stub.write_text("#!/bin/sh\nexit 0\n")
        stub.chmod(0o755)
    return where


def debian_mirror() -> str:
    """The Debian archive this machine's apt uses (SWEEPD_TEST_DEBIAN_MIRROR overrides)."""
    if os.environ.get("SWEEPD_TEST_DEBIAN_MIRROR"):
        return os.environ["SWEEPD_TEST_DEBIAN_MIRROR"]
    sources = Path("/etc/apt")
    texts = [
        path.read_text(errors="replace")
        for path in [sources / "sources.list", *sorted(sources.glob("sources.list.d/*"))]
        if path.is_file()
    ]
    for text in texts:
        # deb822 (.sources): a stanza whose URIs serve this suite.
        for stanza in re.split(r"\n\s*\n", text):
            uris = re.search(r"^URIs:\s*(\S+)", stanza, re.MULTILINE)
            suites = re.search(r"^Suites:(.*)$", stanza, re.MULTILINE)
            if uris and suites and SUITE in suites.group(1).split() and "security" not in uris[1]:
                return uris.group(1)
        # One-line format.
        for line in text.splitlines():
            found = re.match(r"\s*deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+(\S+)", line)
            if found and found.group(2) == SUITE:
                return found.group(1)
    return FALLBACK_MIRROR


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


@contextlib.contextmanager
def _cache_lock() -> Iterator[None]:
    """One builder at a time across processes (two CI runs at once)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "nspawn.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _prune(folder: Path, keep: Path) -> None:
    for other in folder.iterdir():
        if other != keep and time.time() - other.stat().st_mtime > PRUNE_AFTER:
            shutil.rmtree(other, ignore_errors=True)


def _run(command: list[str], timeout: float, what: str, **options: Any) -> str:
    result: subprocess.CompletedProcess[str] = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, check=False, **options
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"{what} failed ({result.returncode}): {' '.join(command)}\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    return result.stdout


def base_root() -> tuple[str, Path]:
    """The cached Debian root (built on first use, about a minute); its key and path."""
    mirror = debian_mirror()
    key = _key("root", RECIPE, SUITE, "minbase", PACKAGES, mirror, os.uname().machine)
    folder = CACHE / "nspawn-root"
    path = folder / key
    with _cache_lock():
        if not path.is_dir():
            partial = folder / f".{key}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            partial.parent.mkdir(parents=True, exist_ok=True)
            command = [
                tool("debootstrap", "debootstrap"),
                "--variant=minbase",
                f"--include={','.join(PACKAGES)}",
                SUITE,
                str(partial),
                mirror,
            ]
            _run(command, 900, "debootstrap")
            # The downloaded packages: 50 MB the root never needs again.
            for deb in (partial / "var/cache/apt/archives").glob("*.deb"):
                deb.unlink()
            partial.rename(path)  # whole or absent: a run killed mid-build leaves .partial only
            _prune(folder, path)
        os.utime(path)
    return key, path


def build_wheel(dest: Path) -> Path:
    """This checkout's sweepd wheel, built from a copy so the tree gets no build/ folder."""
    files = _run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        60,
        "git ls-files",
        cwd=REPO,
    )
    source = dest / "source"
    for name in filter(None, files.split("\0")):
        origin = REPO / name
        if origin.is_file():
            target = source / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(origin, target)
    wheels = dest / "wheel"
    _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(source)],
        300,
        "pip wheel",
    )
    (wheel,) = wheels.glob("sweepd-*.whl")
    return wheel


def _requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(name).decode()
    return sorted(
        line.split(":", 1)[1].strip()
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    )


def _pins() -> list[str]:
    """The versions this test's own environment runs, as constraints for the container's."""
    frozen = _run(
        [sys.executable, "-m", "pip", "freeze", "--exclude-editable"], 120, "pip freeze"
    ).splitlines()
    return sorted(
        line
        for line in frozen
        if "==" in line and " @ " not in line and not line.lower().startswith("sweepd==")
    )


def _nspawn_run(root: Path, binds: dict[Path, str], *command: str, timeout: float) -> str:
    """One command in the root, not booted (a chroot with /proc and /dev), no network."""
    nspawn = tool("systemd-nspawn", "systemd-container")
    options = [f"--bind-ro={source}:{target}" for source, target in binds.items()]
    return _run(
        [
            nspawn,
            "--quiet",
            f"--directory={root}",
            f"--machine=sweepd-setup-{secrets.token_hex(4)}",
            "--keep-unit",
            "--register=no",
            "--private-network",
            "--pipe",
            *options,
            "--",
            *command,
        ],
        timeout,
        f"in the container: {command[0]}",
        stdin=subprocess.DEVNULL,
    )


def deps_layer(root_key: str, root: Path, wheel: Path, work: Path) -> Path:
    """The cached layer holding /opt/sweepd with sweepd's requirements (not sweepd)."""
    requirements, pins = _requirements(wheel), _pins()
    # Wheels for the root's Python (bookworm's 3.11), whichever runs the test.
    python = os.readlink(root / "usr/bin/python3").removeprefix("python")
    key = _key("deps", RECIPE, root_key, requirements, pins)
    folder = CACHE / "nspawn-deps"
    path = folder / key
    with _cache_lock():
        if not path.is_dir():
            wheels = work / "dependencies"
            constraints = work / "constraints.txt"
            constraints.write_text("".join(pin + "\n" for pin in pins))
            _run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "-q",
                    "--only-binary=:all:",
                    f"--python-version={python}",
                    "-c",
                    str(constraints),
                    "-d",
                    str(wheels),
                    str(wheel),
                ],
                600,
                "pip download",
            )
            for own in wheels.glob("sweepd-*.whl"):
                own.unlink()
            partial = folder / f".{key}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            with Overlay([root], partial) as merged:
                _nspawn_run(
                    merged,
                    {wheels: "/tmp/wheels"},
                    "/bin/sh",
                    "-c",
                    "python3 -m venv /opt/sweepd && /opt/sweepd/bin/pip install -q"
                    " --no-index --no-cache-dir --disable-pip-version-check /tmp/wheels/*.whl",
                    timeout=300,
                )
            shutil.rmtree(partial / "work")
            (partial / "upper").rename(path)
            shutil.rmtree(partial)
            _prune(folder, path)
        os.utime(path)
    return path


class Overlay:
    """An overlayfs of read-only layers (the first on top) with a writable one in ``where``."""

    def __init__(self, lowers: list[Path], where: Path) -> None:
        self.lowers = lowers
        self.upper, self.work, self.merged = where / "upper", where / "work", where / "merged"

    def __enter__(self) -> Path:
        for folder in (self.upper, self.work, self.merged):
            folder.mkdir(parents=True)
        lowerdir = ":".join(str(layer) for layer in self.lowers)
        options = f"lowerdir={lowerdir},upperdir={self.upper},workdir={self.work}"
        result = subprocess.run(
            ["mount", "-t", "overlay", "overlay", "-o", options, str(self.merged)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if result.returncode != 0:
            unavailable(f"cannot mount an overlayfs here: {result.stderr.strip()}")
        return self.merged

    def __exit__(self, *_exc: object) -> None:
        if subprocess.run(["umount", str(self.merged)], timeout=30, check=False).returncode:
            # Still busy (a process of the container not yet reaped): detach it.
            subprocess.run(["umount", "--lazy", str(self.merged)], timeout=30, check=False)


def _die_with_parent() -> None:
    # The container halts if the test process dies, instead of outliving it.
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class Machine:
    """A booted container, driven through nsenter into its PID 1's namespaces."""

    def __init__(self, root: Path, results: Path, console: Path) -> None:
        self.root = root
        self.results = results
        self.console_path = console
        self.name = f"sweepd-test-{secrets.token_hex(4)}"
        self.process: subprocess.Popen[bytes] | None = None
        self.pid = 0  # the container's PID 1, as the host sees it

    def boot(self, timeout: float = 120) -> None:
        nspawn = tool("systemd-nspawn", "systemd-container")
        with open(self.console_path, "wb") as console:
            self.process = subprocess.Popen(
                [
                    nspawn,
                    "--boot",
                    f"--directory={self.root}",
                    f"--machine={self.name}",
                    "--keep-unit",
                    "--register=no",
                    "--private-network",
                    "--console=pipe",
                    f"--bind={self.results}:/results",
                ],
                stdin=subprocess.DEVNULL,
                stdout=console,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,  # noqa: PLW1509  (no threads of ours yet matter)
            )
        deadline = time.monotonic() + timeout
        self.pid = within(self._init_pid, timeout, "the container's init to start")
        # systemctl cannot talk to PID 1 before it has made its socket.
        within(
            lambda: self.run("test", "-S", "/run/systemd/private", check=False).returncode == 0,
            deadline - time.monotonic(),
            "systemd's socket in the container",
        )
        # "degraded" is a booted system with a failed unit: the test says which.
        state = self.run(
            "systemctl", "is-system-running", "--wait", timeout=deadline - time.monotonic()
        ).stdout.strip()
        if state not in ("running", "degraded"):
            raise AssertionError(f"the container did not boot: {state}\n{self.console()}")

    def _init_pid(self) -> int | None:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"systemd-nspawn exited early:\n{self.console()}")
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        for child in children.read_text().split():
            with contextlib.suppress(OSError):
                if Path(f"/proc/{child}/comm").read_text().strip() == "systemd":
                    return int(child)
        return None

    def console(self) -> str:
        return self.console_path.read_text(errors="replace")[-4000:]

    def run(
        self, *command: str, timeout: float = 60, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            ["nsenter", f"--target={self.pid}", "--all", "--", *command],
            capture_output=True,
            text=True,
            timeout=max(timeout, 1),
            env=CONTAINER_ENV,
            check=False,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout}{result.stderr}"
            )
        return result

    def systemctl(
        self, *arguments: str, timeout: float = 60, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return self.run("systemctl", *arguments, timeout=timeout, check=check)

    def show(self, unit: str, *properties: str) -> dict[str, str]:
        output = self.systemctl("show", unit, f"--property={','.join(properties)}").stdout
        return dict(line.split("=", 1) for line in output.splitlines() if "=" in line)

    def journal(self, invocation: str) -> list[dict[str, Any]]:
        """The journal of one start of a unit: its processes' lines and systemd's about it."""
        output = self.run(
            "journalctl",
            "--no-pager",
            "--output=json",
            f"_SYSTEMD_INVOCATION_ID={invocation}",
            "+",
            f"INVOCATION_ID={invocation}",
        ).stdout
        entries = []
        for line in output.splitlines():
            entry = json.loads(line)
            message = entry.get("MESSAGE")
            entry["MESSAGE"] = message if isinstance(message, str) else ""
            with contextlib.suppress(ValueError):
                event = json.loads(entry["MESSAGE"])
                if isinstance(event, dict):
                    entry["sweepd"] = event
            entries.append(entry)
        return entries

    def close(self) -> None:
        if self.process is None:
            return
        if self.pid:
            # Kept for whoever reads a failure: the container's whole journal.
            self.run(
                "sh",
                "-c",
                "journalctl --no-pager -o short-precise > /results/journal.txt",
                check=False,
            )
            print(f"the container's journal: {self.results / 'journal.txt'}")
        # SIGTERM to nspawn --boot halts the container in order.
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)
        self.process = None


def within(probe: Callable[[], T | None], seconds: float, what: str) -> T:
    """``probe()``'s first truthy value, polled every 0.1 s for at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        found = probe()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds}s: {what}")
        time.sleep(0.1)


def install(root: Path, wheel: Path) -> None:
    """This checkout's sweepd into the container's venv, the shipped unit, and the test's sweeps."""
    _nspawn_run(
        root,
        {wheel.parent: "/tmp/wheel"},
        "/opt/sweepd/bin/pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--no-cache-dir",
        "--disable-pip-version-check",
        f"/tmp/wheel/{wheel.name}",
        timeout=120,
    )
    (site,) = root.glob("opt/sweepd/lib/python3.*/site-packages")
    shutil.copy(FIXTURES / "unit_sweeps.py", site / "unit_sweeps.py")
    shutil.copy(UNIT, root / "etc/systemd/system" / UNIT.name)
    (root / "etc/sweepd").mkdir(mode=0o755, exist_ok=True)


class Unit:
    """sweepd.service in a booted container: its config, drop-ins, state and journal."""

    name = "sweepd.service"
    state = "/var/lib/sweepd"  # StateDirectory=sweepd, as the service sees it
    runs_file = f"{state}/runs.jsonl"

    def __init__(self, machine: Machine) -> None:
        self.machine = machine
        # DynamicUser=yes keeps the state under private/, behind a symlink.
        self.host_state = machine.root / "var/lib/private/sweepd"

    def reset(self) -> None:
        """Stopped, forgotten, no drop-in and no state: as if just installed."""
        self.machine.systemctl("stop", self.name, timeout=90)
        self.machine.systemctl("reset-failed", self.name, check=False)
        self.machine.run(
            "rm",
            "-rf",
            f"/etc/systemd/system/{self.name}.d",
            "/var/lib/private/sweepd",
            "/var/lib/sweepd",
            "/etc/sweepd/sweepd.yaml",
        )
        self.machine.systemctl("daemon-reload")
        # Enabled, as installed: multi-user.target then holds it, and systemd
        # keeps an inactive unit's Result= and exit status instead of
        # unloading it (a garbage-collected unit shows Result=success).
        self.machine.systemctl("enable", self.name)

    def configure(self, config: dict[str, Any], dropin: str = "") -> None:
        """Write /etc/sweepd/sweepd.yaml (JSON is YAML) and the test's drop-in, if any."""
        path = self.machine.root / "etc/sweepd/sweepd.yaml"
        path.write_text(json.dumps(config, indent=2) + "\n")
        path.chmod(0o644)
        if dropin:
            folder = self.machine.root / f"etc/systemd/system/{self.name}.d"
            folder.mkdir(mode=0o755, exist_ok=True)
            (folder / "test.conf").write_text("[Service]\n" + dropin)
        self.machine.systemctl("daemon-reload")

    def show(self, *properties: str) -> dict[str, str]:
        return self.machine.show(self.name, *properties)

    def journal(self, invocation: str | None = None) -> list[dict[str, Any]]:
        return self.machine.journal(invocation or self.show("InvocationID")["InvocationID"])

    def events(self, name: str, invocation: str | None = None) -> list[dict[str, Any]]:
        """sweepd's own log events of this name (its JSON lines) in one start's journal."""
        return [
            entry["sweepd"]
            for entry in self.journal(invocation)
            if entry.get("sweepd", {}).get("event") == name
        ]

    def messages(self, invocation: str | None = None) -> str:
        return "\n".join(entry["MESSAGE"] for entry in self.journal(invocation))

    def every_message(self) -> str:
        """The unit's journal across its starts (each restart is an invocation of its own)."""
        return self.machine.run(
            "journalctl", "--no-pager", "--output=cat", f"--unit={self.name}"
        ).stdout

    def runs(self) -> list[dict[str, Any]]:
        """What the test's sweeps wrote, one dict per line."""
        path = self.host_state / "runs.jsonl"
        if not path.exists():
            return []
        lines = path.read_text().splitlines()
        # The last line may be half written when read.
        return [json.loads(line) for line in lines if line.endswith("}")]


def config(sweeps: list[dict[str, Any]], **top: Any) -> dict[str, Any]:
    """The test's config: the SQLite file in the state directory, the test's sweeps."""
    return {
        "database": {"url": f"sqlite:///{Unit.state}/sweepd.db"},
        "entrypoints": ["unit_sweeps"],
        "health": {"listen": ""},
        "logging": {"format": "json", "level": "info"},
        "drain_timeout": "30s",
        "defaults": {"misfire_grace": "1s"},
        "sweeps": sweeps,
        **top,
    }


def record(name: str, every: str = "1s", duration: float = 0.0) -> dict[str, Any]:
    return {
        "name": name,
        "callable": "unit_sweeps:record",
        "every": every,
        "args": {"out": Unit.runs_file, "duration": duration},
    }
