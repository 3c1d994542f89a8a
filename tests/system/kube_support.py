"""The shipped Kubernetes manifests (``kubernetes/``), read as data, and their podman copy.

The manifests are plain single-document YAML files listed by ``kustomization.yaml``. The tests
read them here, and ``podman kube play`` runs a copy adapted to a machine with no cluster:
what each change is for is said where ``play_copy`` makes it, so that nothing else about the
Deployment differs from what an operator applies.
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
KUBE = REPO / "kubernetes"
KUSTOMIZATION = "kustomization.yaml"
CONFIG_KEY = "sweepd.yaml"  # the ConfigMap's key, mounted as /etc/sweepd/sweepd.yaml
# The one container of the pod that runs sweepd.
CONTAINER = "sweepd"

Manifest = dict[str, Any]


def manifest_files() -> list[Path]:
    """Every manifest of the folder, the kustomization itself left out."""
    return sorted(p for p in KUBE.glob("*.yaml") if p.name != KUSTOMIZATION)


def load(path: Path) -> Manifest:
    documents = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert len(documents) == 1, f"{path.name}: one object per file, found {len(documents)}"
    found = documents[0]
    assert isinstance(found, dict), f"{path.name}: not a mapping"
    return found


def kustomization() -> Manifest:
    return load(KUBE / KUSTOMIZATION)


def by_kind(kind: str) -> Manifest:
    """The one object of ``kind`` among the manifests."""
    found = [m for m in map(load, manifest_files()) if m.get("kind") == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def pod_spec(deployment: Manifest) -> dict[str, Any]:
    spec: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return spec


def container(deployment: Manifest) -> dict[str, Any]:
    found = [c for c in pod_spec(deployment)["containers"] if c["name"] == CONTAINER]
    assert len(found) == 1, f"expected one container named {CONTAINER!r}"
    result: dict[str, Any] = found[0]
    return result


def config_text() -> str:
    """The config file as the ConfigMap holds it."""
    text = by_kind("ConfigMap")["data"][CONFIG_KEY]
    assert isinstance(text, str)
    return text


def literal_env(deployment: Manifest) -> dict[str, str]:
    """The container's environment variables that have a plain ``value``."""
    return {e["name"]: e["value"] for e in container(deployment).get("env", []) if "value" in e}


_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(m|Ki|Mi|Gi|Ti|k|M|G|T)?$")
_FACTORS = {
    None: 1.0,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "Ki": 2.0**10,
    "Mi": 2.0**20,
    "Gi": 2.0**30,
    "Ti": 2.0**40,
}


def quantity(value: str | int | float) -> float:
    """A Kubernetes resource quantity (``50m``, ``1``, ``128Mi``) as a number."""
    found = _QUANTITY.match(str(value))
    assert found is not None, f"not a quantity this test reads: {value!r}"
    return float(found.group(1)) * _FACTORS[found.group(2)]


class _Literal(str):
    """A string dumped in YAML's literal block style, as the file itself writes the config."""


def _literal(dumper: yaml.SafeDumper, value: _Literal) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|")


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(_Literal, _literal)


def play_copy(image: str, sweeps_every: str = "1s") -> str:
    """The ConfigMap and the Deployment as one YAML stream for ``podman kube play``.

    What differs from the shipped files, and why:

    - ``hostNetwork: true``: the pods reach the host's PostgreSQL on 127.0.0.1. podman still
      gives each pod its own UTS namespace and the pod's name as hostname, as a cluster does.
    - the image is ``image``, the one built from this checkout.
    - no ``ports``: podman refuses port mappings on the host's network.
    - ``SWEEPD_HEALTH_LISTEN=127.0.0.1:0``: three pods on one network cannot all bind 9464,
      so each picks a free port (the test finds it and asks /healthz and /readyz there).
    - no probes: podman 4.3 turns a liveness probe into ``curl -f http://localhost:PORT``
      inside the container (a named port becomes 0, and the image has no curl), restarting
      the container when it fails; it ignores readiness and startup probes.
    - the secret volume is ``optional: false`` already in the shipped file: podman 4.3
      dereferences the field without checking that it is set.
    - the sweeps with an ``every`` tick each ``sweeps_every``, so a test sees many ticks.
    """
    config_map = by_kind("ConfigMap")
    deployment = copy.deepcopy(by_kind("Deployment"))
    config = yaml.safe_load(config_map["data"][CONFIG_KEY])
    for item in config.get("sweeps", []):
        if "every" in item:
            item["every"] = sweeps_every
    config["sweeps"].append({"name": "reconcile", "every": sweeps_every})  # the @sweep's
    config_map = copy.deepcopy(config_map)
    config_map["data"][CONFIG_KEY] = _Literal(yaml.safe_dump(config, sort_keys=False))
    spec = pod_spec(deployment)
    spec["hostNetwork"] = True
    main = container(deployment)
    main["image"] = image
    main.pop("ports", None)
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        main.pop(probe, None)
    for variable in main["env"]:
        if variable["name"] == "SWEEPD_HEALTH_LISTEN":
            variable["value"] = "127.0.0.1:0"
    return yaml.dump_all([config_map, deployment], Dumper=_Dumper, sort_keys=False)


def podman_secret(secret: Manifest, **values: str) -> str:
    """The content of a podman secret that ``podman kube play`` 4.3 mounts as ``secret``.

    podman reads it as a Kubernetes Secret and writes each value of its ``data`` to a file as
    it stands, without decoding base64 (``pkg/specgen/generate/kube/volume.go``): so the
    values go in plain. A bare object of base64 values mounts no file at all.
    """
    data = {**secret.get("stringData", {}), **values}
    return json.dumps({"data": data})


def listening_ports(pid: int) -> list[int]:
    """TCP ports on which process ``pid`` listens, read from /proc (its network is the host's)."""
    inodes = set()
    fds = Path(f"/proc/{pid}/fd")
    for fd in fds.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                ports.append(int(local.rsplit(":", 1)[1], 16))
    return sorted(set(ports))
