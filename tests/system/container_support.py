"""The Dockerfile's image, built and run with podman on a machine that reaches no registry.

``built_image()`` is the name of sweepd's image built from this checkout; ``podman(...)`` runs
podman against the store that holds it. Both serve any test that needs the image (this
package's container tests, the Kubernetes manifests' ``podman kube play``).

No registry is reachable, so the Dockerfile's ``BASE`` is a Debian root made with debootstrap
(Debian's python3 and python3-venv) and imported with ``podman import``. That root is the slow
part (about a minute), so its tarball is cached under ``CACHE``, named by a hash of everything
that went into it; a later run only imports it (seconds). The root also trusts this machine's
own certificate authorities (``/usr/local/share/ca-certificates``), so pip in the build stage
reaches PyPI through the same TLS-inspecting egress that pip on the host does.

Each test process gets a podman store of its own (root, runroot, lock files and containers.conf
in a folder under ``STORES``), removed at exit, and a store left by a killed process is
removed by the next one. A store shared across processes would have to keep one runroot forever
(podman refuses a store whose runroot moved), and would need a collector for every image that a
run leaves behind; a fresh one costs an import and an uncached build, about half a minute.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

IN_CI = os.environ.get("CI") == "true"
REPO = Path(__file__).resolve().parents[2]
# Survives between test runs and CI runs on one machine (SWEEPD_TEST_CACHE names another
# folder); other tests keep their own caches beside this module's subfolder.
CACHE = Path(os.environ.get("SWEEPD_TEST_CACHE", "/var/cache/sweepd-tests")) / "container"
# Per-process podman stores; a short path, since podman refuses a runroot over 50 characters.
STORES = Path("/run/sweepd-podman")
IMAGE = "localhost/sweepd:test"
BASE_IMAGE = "localhost/sweepd-test-base"
SUITE = "bookworm"  # the suite of the Dockerfile's default base, python:3.11-slim-bookworm
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
DEFAULT_MIRROR = "http://deb.debian.org/debian"
LOCAL_AUTHORITIES = Path("/usr/local/share/ca-certificates")
# Bump to rebuild every cached root when the way it is made changes.
BASE_RECIPE = 1
TOOLS = ("podman", "runc", "debootstrap")
# TESTING.md: crun fails here on setrlimit and hybrid cgroups; runc with explicit ulimits works.
# No systemd runs as PID 1, hence cgroupfs and a file for the events; file locks in the store's
# own tmp_dir keep two stores from sharing (and resetting) one set of locks in /dev/shm.
CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
lock_type = "file"
tmp_dir = "{tmp}"
"""

Event = dict[str, Any]


class PodmanFailed(AssertionError):
    """A podman command exited non-zero."""


def missing_tools() -> list[str]:
    """What this machine lacks to build and run the image (empty when nothing)."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if os.geteuid() != 0:
        missing.append("root (debootstrap and rootful podman)")
    return missing


def require_tools() -> None:
    """Skip the calling test on a workstation without the tools; fail it in CI, which has them."""
    missing = missing_tools()
    if missing:
        reason = (
            f"container tests need {', '.join(missing)} (apt-get install podman runc debootstrap)"
        )
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)


class Store:
    """One process's podman storage, configuration and lock files, in one folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.root = folder / "root"
        self.runroot = folder / "run"
        self.conf = folder / "containers.conf"

    def create(self) -> Store:
        (self.folder / "tmp").mkdir(parents=True)
        self.conf.write_text(CONTAINERS_CONF.format(tmp=self.folder / "tmp"))
        return self

    def command(self, *args: str) -> list[str]:
        return ["podman", "--root", str(self.root), "--runroot", str(self.runroot), *args]

    def environment(self) -> dict[str, str]:
        return {**os.environ, "CONTAINERS_CONF": str(self.conf)}

    def remove(self) -> None:
        """Stop and remove what the store holds (pods, containers, volumes), then the folder."""
        if self.conf.exists():
            for args in (
                ("pod", "rm", "--all", "--force"),
                ("rm", "--all", "--force", "--time", "0"),
                ("volume", "rm", "--all", "--force"),
            ):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    subprocess.run(
                        self.command(*args),
                        env=self.environment(),
                        capture_output=True,
                        timeout=60,
                        check=False,
                    )
        shutil.rmtree(self.folder, ignore_errors=True)


def _boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@functools.cache
def _store() -> Store:
    STORES.mkdir(parents=True, exist_ok=True)
    boot = _boot_id()
    for folder in STORES.iterdir():
        pid, _, folder_boot = folder.name.partition("-")
        if not (pid.isdigit() and folder_boot == boot and _alive(int(pid))):
            Store(folder).remove()  # left by a process that died without its atexit
    store = Store(STORES / f"{os.getpid()}-{boot}").create()
    atexit.register(store.remove)
    return store


def podman(
    *args: str, check: bool = True, timeout: float = 120.0, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``podman ARGS`` on this process's store; raises PodmanFailed (with its output) if ``check``."""
    store = _store()
    completed = subprocess.run(
        store.command(*args),
        env=store.environment(),
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if check and completed.returncode != 0:
        raise PodmanFailed(
            f"podman {' '.join(args)} exited {completed.returncode}\n"
            f"stdout: {completed.stdout[-4000:]}\nstderr: {completed.stderr[-4000:]}"
        )
    return completed


def apt_mirror() -> str:
    """The first Debian mirror serving SUITE's main in this machine's apt sources."""
    sources = Path("/etc/apt/sources.list.d")
    stanzas: list[tuple[list[str], list[str], list[str]]] = []  # (uris, suites, components)
    one_line = [Path("/etc/apt/sources.list"), *sorted(sources.glob("*.list"))]
    for path in filter(Path.exists, one_line):
        for line in path.read_text().splitlines():
            words = re.sub(r"\[[^]]*\]", "", line.split("#", 1)[0]).split()
            if len(words) >= 4 and words[0] == "deb":
                stanzas.append(([words[1]], [words[2]], words[3:]))
    for path in sorted(sources.glob("*.sources")):
        for block in re.split(r"\n\s*\n", path.read_text()):
            fields = dict(re.findall(r"^([A-Za-z-]+):\s*(.*)$", block, flags=re.MULTILINE))
            if "deb" in fields.get("Types", "").split():
                stanzas.append(
                    (
                        fields.get("URIs", "").split(),
                        fields.get("Suites", "").split(),
                        fields.get("Components", "").split(),
                    )
                )
    for uris, suites, components in stanzas:
        if SUITE in suites and "main" in components and uris:
            return uris[0].rstrip("/")
    return DEFAULT_MIRROR


def _authorities() -> list[Path]:
    if not LOCAL_AUTHORITIES.is_dir():
        return []
    return sorted(p for p in LOCAL_AUTHORITIES.rglob("*.crt") if p.is_file())


def base_key() -> str:
    """A hash of everything the base root is made from: its recipe, mirror and authorities."""
    recipe = {
        "recipe": BASE_RECIPE,
        "suite": SUITE,
        "variant": "minbase",
        "packages": BASE_PACKAGES,
        "mirror": apt_mirror(),
        "authorities": {
            str(p.relative_to(LOCAL_AUTHORITIES)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in _authorities()
        },
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One process at a time builds what the cache holds, so two never write the same file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _run_logged(command: list[str], log: Path, timeout: float) -> None:
    with log.open("ab") as out:
        completed = subprocess.run(
            command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, check=False
        )
    if completed.returncode != 0:
        tail = log.read_text(errors="replace")[-4000:]
        raise AssertionError(f"{command[0]} exited {completed.returncode}; {log}:\n{tail}")


def base_root_tarball() -> Path:
    """The Debian root's tarball, made by debootstrap once per ``base_key()`` and kept in CACHE."""
    key = base_key()
    tarball = CACHE / f"base-{key}.tar"
    with _locked(CACHE / "base.lock"):
        if tarball.exists():
            return tarball
        work = CACHE / f"building-{key}"
        shutil.rmtree(work, ignore_errors=True)
        root = work / "root"
        root.mkdir(parents=True)
        log = work / "debootstrap.log"
        debootstrap = [
            "debootstrap",
            "--variant=minbase",
            f"--include={','.join(BASE_PACKAGES)}",
            SUITE,
            str(root),
            apt_mirror(),
        ]
        _run_logged(debootstrap, log, timeout=900)
        authorities = _authorities()
        if authorities:
            target = root / LOCAL_AUTHORITIES.relative_to("/")
            for authority in authorities:
                destination = target / authority.relative_to(LOCAL_AUTHORITIES)
                destination.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(authority, destination)
            _run_logged(["chroot", str(root), "update-ca-certificates"], log, timeout=120)
        # What an image does not need: the downloaded packages and the package lists.
        for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for entry in (root / leftover).glob("*"):
                if entry.is_file():
                    entry.unlink()
        partial = tarball.with_suffix(".partial")
        _run_logged(
            ["tar", "--numeric-owner", "-C", str(root), "-cf", str(partial), "."],
            log,
            timeout=300,
        )
        partial.rename(tarball)
        for stale in CACHE.glob("base-*.tar"):
            if stale != tarball:
                stale.unlink()  # made from an older recipe, mirror or set of authorities
        shutil.rmtree(work, ignore_errors=True)
    return tarball


@functools.cache
def base_image() -> str:
    """``localhost/sweepd-test-base:KEY`` in this process's store, imported from the cached root."""
    require_tools()
    tarball = base_root_tarball()
    name = f"{BASE_IMAGE}:{tarball.stem.removeprefix('base-')}"
    if podman("image", "exists", name, check=False).returncode != 0:
        podman("import", str(tarball), name, timeout=300)
    return name


@functools.cache
def built_image() -> str:
    """The image of this checkout's Dockerfile on the local base, built once per process.

    ``--format docker``: the OCI format has no HEALTHCHECK, and podman drops it with a warning.
    ``--pull=never``: the base is local; nothing may wait on a registry.
    """
    base = base_image()
    podman(
        "build",
        "--format",
        "docker",
        "--pull=never",
        "--build-arg",
        f"BASE={base}",
        "--tag",
        IMAGE,
        str(REPO),
        timeout=900,
    )
    return IMAGE


@contextlib.contextmanager
def running(*run_args: str) -> Iterator[str]:
    """A detached container of ``podman run ARGS``, its name yielded; removed on the way out."""
    name = f"sweepd-test-{secrets.token_hex(4)}"
    try:
        # A container that was created but failed to start is removed too.
        podman("run", "--detach", "--name", name, *run_args, timeout=120)
        yield name
    finally:
        podman("rm", "--force", "--time", "0", name, check=False, timeout=60)


def events(container: str) -> list[Event]:
    """The container's log (stdout and stderr), one JSON event per line; others as ``raw``."""
    logs = podman("logs", container, timeout=30)
    found: list[Event] = []
    for line in (logs.stdout + logs.stderr).splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            event = None
        found.append(event if isinstance(event, dict) else {"event": "raw", "line": line})
    return found


def state(container: str, field: str) -> str:
    """One field of ``podman inspect``'s State (``Status``, ``ExitCode``, ...), as text."""
    return podman("inspect", "--format", f"{{{{.State.{field}}}}}", container).stdout.strip()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, to publish a container's port on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Seconds until ``condition()`` held, polling; fails with ``what`` past ``timeout``."""
    began = time.monotonic()
    while not condition():
        if time.monotonic() - began > timeout:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.2)
    return time.monotonic() - began
