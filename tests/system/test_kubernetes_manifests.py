"""The Kubernetes manifests (issue 24; SPEC §3, §6, §8, §10): valid, consistent, and run.

Schemas first (``kubernetes-validate --strict``), then what a schema cannot see: selectors
that select the pods, probes on a port the container has, a grace period that outlasts the
drain, the holder id taken from the pod's name, the restricted security context, a
kustomization that lists every file, and a config that sweepd itself accepts. Last, the
Deployment runs: ``podman kube play`` starts its three replicas from the image built from this
checkout, against PostgreSQL, and they run each tick once between them.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import IN_CI, MakeDatabase
from container_support import built_image, podman, require_tools, wait_until
from daemon_harness import read_rows, wait_for_backends_gone
from kube_support import (
    CONFIG_KEY,
    KUBE,
    KUSTOMIZATION,
    by_kind,
    config_text,
    container,
    kustomization,
    listening_ports,
    literal_env,
    load,
    manifest_files,
    play_copy,
    pod_spec,
    podman_secret,
    quantity,
)
from sqlalchemy.exc import ProgrammingError

from sweepd.daemon import CANCEL_GRACE_SECONDS
from sweepd.durations import parse_duration
from sweepd.lease import make_holder

# The oldest Kubernetes the manifests claim: Pod Security admission (whose "restricted" level
# the pod meets) is GA from 1.25. The newest is the newest schema kubernetes-validate bundles.
KUBERNETES_VERSIONS = ("1.25.0", "1.37.0")
# What the grace period must leave beyond drain_timeout and the cancelled runs' grace: time
# to record the cancellations, release the leases and exit, on a database that answers.
RELEASE_MARGIN = timedelta(seconds=5)
UID = 10001
CHECK_CONFIG = (
    sys.executable,
    "-m",
    "sweepd",
    "check-config",
    "--no-db",
    "--format",
    "json",
    "--config",
)
REPLICAS = 3
TICKS_AFTER_ALL_UP = 8  # one-second ticks of every sweep, once all three pods run sweeps
# The sweeps of the played config that tick every second (nightly-report is a cron).
EVERY_SECOND = {"heartbeat", "purge-sessions", "reconcile"}


def _tool(name: str, install: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        reason = f"{name} is needed ({install})"
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)
    return found


def _validate(version: str, *paths: Path) -> subprocess.CompletedProcess[str]:
    tool = _tool("kubernetes-validate", "pip install kubernetes-validate")
    return subprocess.run(
        [tool, "--strict", "--kubernetes-version", version, "--quiet", *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


# -- schemas -----------------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_passes_strict_validation(version: str) -> None:
    files = manifest_files()
    assert {load(p)["kind"] for p in files} >= {
        "Deployment",
        "ConfigMap",
        "Secret",
        "PodDisruptionBudget",
    }
    validated = _validate(version, *files)
    assert (validated.returncode, validated.stdout, validated.stderr) == (0, "", "")


def test_strict_validation_rejects_a_misspelt_field(tmp_path: Path) -> None:
    # Without --strict, an unknown field passes: the check above would prove nothing.
    text = (KUBE / "deployment.yaml").read_text()
    assert "readOnlyRootFilesystem" in text
    misspelt = tmp_path / "deployment.yaml"
    misspelt.write_text(text.replace("readOnlyRootFilesystem", "readOnlyRootFileSystem"))
    validated = _validate(KUBERNETES_VERSIONS[-1], misspelt)
    assert validated.returncode == 1
    assert "readOnlyRootFileSystem" in validated.stdout + validated.stderr


# -- what the schemas cannot see ----------------------------------------------------------------


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) == {"matchLabels"}, "only matchLabels is read here"
    match = selector["matchLabels"]
    return bool(match) and all(labels.get(k) == v for k, v in match.items())


def test_the_selectors_select_the_pods() -> None:
    deployment, budget = by_kind("Deployment"), by_kind("PodDisruptionBudget")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert _selects(deployment["spec"]["selector"], labels)
    assert _selects(budget["spec"]["selector"], labels)
    for constraint in pod_spec(deployment).get("topologySpreadConstraints", []):
        assert _selects(constraint["labelSelector"], labels)
    # One replica at a time, and never more: with three replicas two keep claiming.
    assert budget["spec"] == {"maxUnavailable": 1, "selector": budget["spec"]["selector"]}
    assert deployment["spec"]["replicas"] == REPLICAS


def test_every_probe_asks_a_port_of_the_container_on_the_health_paths() -> None:
    deployment = by_kind("Deployment")
    main = container(deployment)
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    assert not any("hostPort" in p for p in main["ports"]), "the restricted level has none"
    paths = {}
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        probe = main[kind]["httpGet"]
        port = probe["port"]
        assert port in ports or port in ports.values(), f"{kind}: no port {port!r}"
        number = ports.get(port, port)
        paths[kind] = (number, probe["path"])
    listen = literal_env(deployment)["SWEEPD_HEALTH_LISTEN"]
    host, _, port_text = listen.rpartition(":")
    assert host == "0.0.0.0", "a probe comes from the node, not the pod's loopback"
    assert paths == {
        "startupProbe": (int(port_text), "/healthz"),
        "livenessProbe": (int(port_text), "/healthz"),
        "readinessProbe": (int(port_text), "/readyz"),
    }


def test_the_grace_period_outlasts_the_drain() -> None:
    config = yaml.safe_load(config_text())
    assert "drain_timeout" in config, "the grace period is set against an explicit drain_timeout"
    drain = parse_duration(config["drain_timeout"])
    grace = timedelta(seconds=pod_spec(by_kind("Deployment"))["terminationGracePeriodSeconds"])
    needed = drain + timedelta(seconds=CANCEL_GRACE_SECONDS) + RELEASE_MARGIN
    assert grace >= needed, f"terminationGracePeriodSeconds {grace} < {needed}"


def test_the_holder_is_the_pod_name(monkeypatch: pytest.MonkeyPatch) -> None:
    deployment = by_kind("Deployment")
    spec = pod_spec(deployment)
    # A pod's hostname is its name unless one of these says otherwise (hostNetwork: the node's).
    assert "hostname" not in spec
    assert "subdomain" not in spec
    assert not spec.get("setHostnameAsFQDN", False)
    assert not spec.get("hostNetwork", False)
    (pod_name,) = (e for e in container(deployment)["env"] if e["name"] == "POD_NAME")
    assert pod_name["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    # And sweepd takes its holder from the hostname, first of its three parts.
    monkeypatch.setattr(socket, "gethostname", lambda: "sweepd-7c9f8d6b5-x2k4q")
    host, pid, random = make_holder().split(":")
    assert host == "sweepd-7c9f8d6b5-x2k4q"
    assert pid.isdigit() and len(random) == 8


def test_the_security_context_is_restricted() -> None:
    deployment = by_kind("Deployment")
    spec = pod_spec(deployment)
    pod = spec["securityContext"]
    for name in ("hostNetwork", "hostPID", "hostIPC"):
        assert not spec.get(name, False)
    assert spec["automountServiceAccountToken"] is False
    for item in spec["containers"] + spec.get("initContainers", []):
        own = item["securityContext"]

        def effective(key: str, own: dict[str, Any] = own) -> Any:
            return own.get(key, pod.get(key))

        assert effective("runAsNonRoot") is True
        assert effective("runAsUser") == UID
        assert effective("seccompProfile") == {"type": "RuntimeDefault"}
        assert own["allowPrivilegeEscalation"] is False
        assert own["readOnlyRootFilesystem"] is True
        assert own["capabilities"] == {"drop": ["ALL"]}
        assert not own.get("privileged", False)
        # Nothing is writable but an emptyDir: the root is read-only, the rest mounted so.
        kinds = {v["name"]: set(v) - {"name"} for v in spec["volumes"]}
        for mount in item["volumeMounts"]:
            if not mount.get("readOnly", False):
                assert kinds[mount["name"]] == {"emptyDir"}, mount
    # The Secret's file is readable by its group, which fsGroup makes sweepd's.
    (database,) = (v for v in spec["volumes"] if "secret" in v)
    assert database["secret"]["defaultMode"] == 0o440
    assert pod["fsGroup"] == UID


def test_resources_are_requested_and_limited() -> None:
    resources = container(by_kind("Deployment"))["resources"]
    for name in ("cpu", "memory"):
        request, limit = resources["requests"][name], resources["limits"][name]
        assert 0 < quantity(request) <= quantity(limit), name


def test_the_config_and_secret_are_mounted_where_the_command_and_config_look() -> None:
    deployment = by_kind("Deployment")
    main, spec = container(deployment), pod_spec(deployment)
    mounts = {m["name"]: m["mountPath"] for m in main["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    (config_volume,) = (n for n, v in volumes.items() if "configMap" in v)
    (secret_volume,) = (n for n, v in volumes.items() if "secret" in v)
    assert volumes[config_volume]["configMap"]["name"] == by_kind("ConfigMap")["metadata"]["name"]
    assert volumes[secret_volume]["secret"]["secretName"] == by_kind("Secret")["metadata"]["name"]
    config_path = f"{mounts[config_volume]}/{CONFIG_KEY}"
    assert main["command"] + main["args"] == ["sweepd", "run", "--config", config_path]
    assert literal_env(deployment)["SWEEPD_CONFIG"] == config_path
    url_file = yaml.safe_load(config_text())["database"]["url_file"]
    folder, _, key = url_file.rpartition("/")
    assert folder == mounts[secret_volume]
    assert key in by_kind("Secret")["stringData"]


def test_the_kustomization_lists_every_manifest_and_can_set_the_image() -> None:
    found = kustomization()
    assert sorted(found["resources"]) == sorted(p.name for p in manifest_files())
    assert {p.name for p in KUBE.iterdir()} == {KUSTOMIZATION, *found["resources"]}
    image = container(by_kind("Deployment"))["image"]
    name, _, tag = image.rpartition(":")
    assert tag, "the placeholder image has a tag"
    assert [i["name"] for i in found["images"]] == [name]


def test_kubectl_kustomize_builds_the_objects(tmp_path: Path) -> None:
    # kubectl is not in Debian's archive (the one source of tools here besides PyPI and npm),
    # so CI may lack it too: a skip, never a failure. kustomize only reads the folder.
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    built = subprocess.run(
        [kubectl, "kustomize", str(KUBE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "none")},
    )
    assert built.returncode == 0, built.stderr
    objects = [d for d in yaml.safe_load_all(built.stdout) if d]
    assert sorted(o["kind"] for o in objects) == sorted(load(p)["kind"] for p in manifest_files())
    (deployment,) = (o for o in objects if o["kind"] == "Deployment")
    # kustomize's labels reach the objects and the pods, never the immutable selector.
    assert deployment["spec"]["selector"] == by_kind("Deployment")["spec"]["selector"]
    assert container(deployment)["image"] == container(by_kind("Deployment"))["image"]


def test_the_config_map_passes_check_config(tmp_path: Path) -> None:
    # check-config reads database.url_file even with --no-db, so the Secret's file is played
    # by a temporary one; the environment is the Deployment's own (SWEEPD_ENV=production...).
    url_file = tmp_path / "url"
    url_file.write_text("postgresql+psycopg://sweepd:s3cret@postgres:5432/sweepd\n")
    config = yaml.safe_load(config_text())
    original = config["database"]["url_file"]
    text = config_text().replace(original, str(url_file))
    assert text != config_text()
    path = tmp_path / CONFIG_KEY
    path.write_text(text)
    environment = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SWEEPD_")},
        **literal_env(by_kind("Deployment")),
    }
    checked = subprocess.run(
        [*CHECK_CONFIG, str(path)],
        capture_output=True,
        text=True,
        env=environment,
        timeout=60,
        check=False,
    )
    assert (checked.returncode, checked.stderr) == (0, "")  # no problem, not one warning
    report = json.loads(checked.stdout)
    assert "s3cret" not in checked.stdout
    declared = {s["name"] for s in config["sweeps"]} | {"reconcile"}  # sweepd.examples' @sweep
    assert {s["name"] for s in report["sweeps"]} == declared
    assert report["database"]["url"] == "postgresql+psycopg://sweepd:***@postgres:5432/sweepd"


# -- podman kube play ---------------------------------------------------------------------------


def _require_pause_binary() -> None:
    # podman builds the pods' infra image from catatonit; without it kube play fails at once.
    if shutil.which("catatonit") is None and not Path("/usr/libexec/podman/catatonit").exists():
        reason = "podman kube play needs catatonit (apt-get install catatonit)"
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)


def _status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


def _pods_with_rows(url: str) -> set[str]:
    """The pods that wrote a run row; none before the first pod has migrated the schema."""
    try:
        rows = read_rows(url)
    except ProgrammingError:  # no sweep_runs table yet
        return set()
    return {str(row["holder"]).split(":")[0] for row in rows}


@pytest.mark.slow
@pytest.mark.timeout(1200)  # a cold cache builds the image's Debian root first
def test_three_pods_run_each_tick_once_and_stop_cleanly(
    make_database: MakeDatabase, tmp_path: Path
) -> None:
    require_tools()
    _require_pause_binary()
    url = make_database("postgresql")
    began = time.monotonic()
    image = built_image()
    print(f"MEASURE image ready in {time.monotonic() - began:.1f}s")

    # TESTING.md: a Secret in the played YAML fails; it is a podman secret made first.
    secret = by_kind("Secret")
    name = secret["metadata"]["name"]
    podman("secret", "rm", name, check=False)
    podman("secret", "create", name, "-", input=podman_secret(secret, url=url))
    played = tmp_path / "play.yaml"
    played.write_text(play_copy(image))
    pods = [f"{by_kind('Deployment')['metadata']['name']}-pod-{i}" for i in range(REPLICAS)]
    containers = [f"{pod}-{container(by_kind('Deployment'))['name']}" for pod in pods]
    try:
        began = time.monotonic()
        podman("kube", "play", str(played), timeout=300)
        print(f"MEASURE kube play took {time.monotonic() - began:.1f}s")

        # Each pod's hostname, and so its holder's first part, is its name (the Downward API's).
        for pod, item in zip(pods, containers, strict=True):
            probe = "import os, socket; print(socket.gethostname(), os.environ['POD_NAME'])"
            looked = podman("exec", item, "python", "-c", probe, timeout=60)
            assert looked.stdout.split() == [pod, pod]

        up = wait_until(lambda: _pods_with_rows(url) == set(pods), 90, "a run by every pod")
        print(f"MEASURE every pod had run a sweep {up:.1f}s after kube play returned")
        all_up = max(r["tick"] for r in read_rows(url))

        # The probes' paths answer on each pod's health port (a free one each, on one network).
        for item in containers:
            pid = int(podman("inspect", "--format", "{{.State.Pid}}", item).stdout)
            (port,) = listening_ports(pid)
            assert (_status(port, "/healthz"), _status(port, "/readyz")) == (200, 200)

        def ticked_since_all_up() -> bool:
            later = Counter(r["name"] for r in read_rows(url) if r["tick"] > all_up)
            return set(later) == EVERY_SECOND and min(later.values()) >= TICKS_AFTER_ALL_UP

        wait_until(ticked_since_all_up, 60, f"{TICKS_AFTER_ALL_UP} ticks of each sweep more")

        # podman 4.3's `kube down` stops a pod with no grace at all (SIGTERM, then SIGKILL at
        # once: exit 137), so the pods are stopped first as a kubelet stops them, with the
        # grace period, and `kube down` then removes them.
        grace = pod_spec(by_kind("Deployment"))["terminationGracePeriodSeconds"]
        began = time.monotonic()
        podman("pod", "stop", "--time", str(grace), *pods, timeout=grace * REPLICAS + 60)
        stopped = time.monotonic() - began
        print(f"MEASURE three pods drained and stopped in {stopped:.1f}s")
        for item in containers:
            assert podman("inspect", "--format", "{{.State.ExitCode}}", item).stdout.strip() == "0"
            logs = podman("logs", item)
            events = [json.loads(line) for line in (logs.stdout + logs.stderr).splitlines()]
            assert events[-1]["event"] == "daemon.stopped", events[-3:]
        assert stopped < grace, "no pod needed its SIGKILL"
    finally:
        down = podman("kube", "down", str(played), check=False, timeout=120)
        podman("secret", "rm", name, check=False)
    assert down.returncode == 0, down.stderr
    assert podman("pod", "ps", "--quiet").stdout.strip() == ""
    wait_for_backends_gone(url)

    rows = [r for r in read_rows(url) if r["trigger"] == "schedule"]
    assert {r["status"] for r in rows} == {"success"}
    ticks = Counter((r["name"], r["tick"]) for r in rows)
    assert [key for key, count in ticks.items() if count > 1] == [], "a tick ran twice"
    holders = {str(r["holder"]).split(":")[0] for r in rows}
    assert holders == set(pods)
    assert {r["name"] for r in rows} == EVERY_SECOND
    # No tick was dropped between a sweep's first and its last: one second apart each.
    for sweep in EVERY_SECOND:
        mine = sorted(r["tick"] for r in rows if r["name"] == sweep)
        assert len(mine) >= TICKS_AFTER_ALL_UP
        gaps = [b - a for a, b in itertools.pairwise(mine) if b - a != timedelta(seconds=1)]
        assert gaps == [], f"{sweep}: ticks not one second apart: {gaps}"
    print(f"MEASURE {len(rows)} runs of {len(ticks)} ticks, holders {sorted(holders)}")
