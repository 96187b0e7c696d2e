"""The Helm chart (deploy/helm/tandem), rendered with the real `helm template` for several
value sets: `helm lint` is clean, every manifest validates against the Kubernetes schemas
(strict: unknown fields are errors), every flag and TANDEM_* variable a container gets is one
its service accepts (parsed by the service's own config loader), and the wiring holds: the
scheduler's --workers names exactly the worker pods, probes hit the listening ports, GPU
requests equal tensor x pipeline ranks, grace periods cover the drain timeouts, secrets are
mounted where the flags and TLS variables point."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from common import tls
from common.config import env_name, flag_name, load_config
from services.gateway.config import GatewayConfig
from services.openai_api.__main__ import SHUTDOWN_GRACE_S
from services.openai_api.config import OpenAIApiConfig
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from tests.helm_chart import (
    CHART,
    KUBERNETES_VERSION,
    NAMESPACE,
    Container,
    by_module,
    containers,
    find,
    helm,
    name,
    render,
    service_host,
)

CONFIGS = {
    "services.gateway": GatewayConfig,
    "services.scheduler": SchedulerConfig,
    "services.worker": WorkerConfig,
    "services.openai_api": OpenAIApiConfig,
}
TLS_ENV = {tls.CERT_ENV, tls.KEY_ENV, tls.CA_ENV, tls.CLIENT_AUTH_ENV, tls.SERVER_NAME_ENV}
DRAIN_MARGIN_S = 15  # values.yaml drainMarginSeconds

VALUE_SETS = {
    "defaults": {},
    "gpu-2p3d-tp2": {
        "gpu": {"enabled": True, "dtype": "bfloat16",
                "image": {"repository": "registry.example/tandem", "tag": "0.1.0-cu128"}},
        "workers": {
            "prefill": {"replicas": 2, "tensorParallelSize": 2, "drainTimeoutS": 20},
            "decode": {"replicas": 3, "tensorParallelSize": 2, "pipelineParallelSize": 2,
                       "drainTimeoutS": 120, "extraArgs": ["--max-model-len", "8192"]},
        },
        "model": {"source": "pvc", "folder": "llama-3.1-8b", "pvc": {"claimName": "models"}},
    },
    "both": {
        "workers": {"both": {"enabled": True, "replicas": 2, "pipelineParallelSize": 2}},
        "gateway": {"drainTimeoutS": 45.5},
    },
    "tls-apikey-metrics": {
        "tls": {"enabled": True, "secretName": "tandem-tls", "clientAuth": True,
                "serverName": "tandem.internal"},
        "apiKey": {"enabled": True, "value": "s3cret-key"},
        "metrics": {"enabled": True, "serviceMonitor": {"labels": {"release": "prom"}}},
        "podAnnotations": {"team": "llm"},
        "scheduler": {"extraArgs": ["--max-num-seqs", "64"], "podAnnotations": {"x": "y"}},
    },
    "no-http": {
        "openaiApi": {"enabled": False},
        "apiKey": {"enabled": True, "value": "another-key", "secretKey": "token"},
        "model": {"source": "hostPath", "hostPath": {"path": "/srv/models"}},
        "nodeSelector": {"pool": "llm"},
        "tolerations": [{"key": "llm", "operator": "Exists", "effect": "NoSchedule"}],
    },
}  # fmt: skip

# kubernetes-validate has no schema for the Prometheus Operator's CRD: this is a minimal
# one of exactly the ServiceMonitor fields the chart uses (unknown fields are errors).
_OBJ = {"type": "object", "additionalProperties": False}
_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
_SECRET_KEY = {
    **_OBJ,
    "required": ["name", "key"],
    "properties": {"name": {"type": "string"}, "key": {"type": "string"}},
}
SERVICE_MONITOR_SCHEMA = {
    **_OBJ,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {**_OBJ, "required": ["name"],
                     "properties": {"name": {"type": "string"}, "labels": _STRINGS}},
        "spec": {**_OBJ, "required": ["selector", "endpoints"], "properties": {
            "selector": {**_OBJ, "properties": {"matchLabels": _STRINGS}},
            "namespaceSelector": {**_OBJ, "properties": {
                "matchNames": {"type": "array", "items": {"type": "string"}}}},
            "endpoints": {"type": "array", "minItems": 1, "items": {
                **_OBJ, "required": ["port"], "properties": {
                    "port": {"type": "string"},
                    "path": {"type": "string"},
                    "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                    "scrapeTimeout": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                    "scheme": {"enum": ["http", "https"]},
                    "tlsConfig": {**_OBJ, "properties": {
                        "ca": {**_OBJ, "properties": {"secret": _SECRET_KEY}},
                        "cert": {**_OBJ, "properties": {"secret": _SECRET_KEY}},
                        "keySecret": _SECRET_KEY,
                        "serverName": {"type": "string"}}}}}}}},
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    return {key: render(values, tmp_path_factory.mktemp(key)) for key, values in VALUE_SETS.items()}


def values_of(key: str) -> dict:
    """The chart's defaults with the value set's overrides (what the templates saw)."""

    def merge(base: dict, over: dict) -> dict:
        out = dict(base)
        for k, v in over.items():
            nested = isinstance(v, dict) and isinstance(base.get(k), dict)
            out[k] = merge(base[k], v) if nested else v
        return out

    return merge(yaml.safe_load((CHART / "values.yaml").read_text()), VALUE_SETS[key])


def worker_sets(values: dict) -> list[str]:
    return ["both"] if values["workers"]["both"]["enabled"] else ["prefill", "decode"]


sets = pytest.mark.parametrize("key", list(VALUE_SETS))


@sets
def test_helm_lint_is_clean(key: str, tmp_path: Path) -> None:
    values_file = tmp_path / "values.json"
    values_file.write_text(json.dumps(VALUE_SETS[key]))
    result = helm("lint", "--strict", str(CHART), "--namespace", NAMESPACE,
                  "--kube-version", KUBERNETES_VERSION, "--values", str(values_file))  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


@sets
def test_every_manifest_validates_against_the_kubernetes_schemas(key, rendered) -> None:
    docs = rendered[key]
    for doc in docs:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] == "ServiceMonitor":
            jsonschema.validate(doc, SERVICE_MONITOR_SCHEMA)
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{where}: {'.'.join(map(str, exc.path))}: {exc.message}")
    values = values_of(key)
    expected = {("Deployment", name("gateway")), ("Service", name("gateway")),
                ("Deployment", name("scheduler")), ("Service", name("scheduler"))}  # fmt: skip
    for worker_set in worker_sets(values):
        expected |= {("StatefulSet", name(worker_set)), ("Service", name(worker_set))}
    if values["openaiApi"]["enabled"]:
        expected |= {("Deployment", name("openai-api")), ("Service", name("openai-api"))}
    if values["apiKey"]["enabled"]:
        expected.add(("Secret", name("api-key")))
    if values["metrics"]["enabled"]:
        expected.add(("ServiceMonitor", "demo-tandem"))
    assert {(d["kind"], d["metadata"]["name"]) for d in docs} == expected


def _mount_secrets(container: Container, docs: list[dict], root: Path) -> list[str]:
    """The container's flags with every path into a mounted Secret that the chart renders
    replaced by a real file under `root` holding what the Secret's item would hold: the
    config then reads the file exactly as the pod would."""
    flags = list(container.flags)
    for mount_path, volume in container.mounts().items():
        if "secret" not in volume:
            continue
        secrets = [d for d in docs if d["kind"] == "Secret"
                   and d["metadata"]["name"] == volume["secret"]["secretName"]]  # fmt: skip
        if not secrets:  # an existing Secret (TLS): its files are not read by the configs
            continue
        data = secrets[0]["stringData"]
        items = volume["secret"].get("items") or [{"key": k, "path": k} for k in data]
        local = root / mount_path.strip("/")
        for item in items:
            (local / item["path"]).parent.mkdir(parents=True, exist_ok=True)
            (local / item["path"]).write_text(data[item["key"]])
        flags = [str(local) + f[len(mount_path) :] if f.startswith(mount_path + "/") else f
                 for f in flags]  # fmt: skip
    return flags


@sets
def test_every_flag_and_variable_is_one_the_service_accepts(key, rendered, tmp_path) -> None:
    docs = rendered[key]
    assert {c.module for c in containers(docs)} <= set(CONFIGS)
    for container in containers(docs):
        config_cls = CONFIGS[container.module]
        fields = dataclasses.fields(config_cls)
        known_flags = {flag_name(f.name) for f in fields}
        unknown = [f for f in container.flags if f.startswith("--") and f not in known_flags]
        assert not unknown, f"python -m {container.module} does not accept {unknown}"
        known_env = {env_name(f) for f in fields} | TLS_ENV
        tandem_env = {n for n in container.env if n.startswith("TANDEM_")}
        assert tandem_env <= known_env, f"{container.module} reads none of {tandem_env - known_env}"
        # The values the pod would see (a worker's id is its pod's name).
        env = {n: e.get("value", f"{container.workload['metadata']['name']}-0")
               for n, e in container.env.items()}  # fmt: skip
        flags = _mount_secrets(container, docs, tmp_path / container.module)
        try:  # the service's own parser and checks, as at its start
            load_config(config_cls, flags, env=env, prog=container.module)
        except (ValueError, SystemExit) as exc:
            pytest.fail(f"python -m {container.module} {' '.join(flags)}: {exc!r}")


@sets
def test_scheduler_lists_exactly_the_worker_pods(key, rendered) -> None:
    docs, values = rendered[key], values_of(key)
    (scheduler,) = by_module(docs, "services.scheduler")
    expected = []
    for worker_set in worker_sets(values):
        statefulset = find(docs, "StatefulSet", name(worker_set))
        service = find(docs, "Service", name(worker_set))
        replicas = values["workers"][worker_set]["replicas"]
        assert statefulset["spec"]["replicas"] == replicas
        # Pod <sts>-<i> gets the DNS name <sts>-<i>.<serviceName>.<ns>.svc from its
        # headless Service, which selects exactly this set's pods.
        assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
        assert service["spec"]["clusterIP"] == "None"
        labels = statefulset["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()
        (worker,) = [c for c in containers(docs) if c.workload is statefulset]
        assert worker.flag("--role") == worker_set
        port = int(worker.flag("--port"))
        assert {p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc"} == {port}
        expected += [f"{name(worker_set)}-{i}.{service_host(worker_set)}:{port}"
                     for i in range(replicas)]  # fmt: skip
    assert scheduler.flag("--workers").split(",") == expected
    (gateway,) = by_module(docs, "services.gateway")
    scheduler_service = find(docs, "Service", name("scheduler"))
    assert gateway.flag("--scheduler") == (
        f"{service_host('scheduler')}:{scheduler_service['spec']['ports'][0]['port']}"
    )
    assert scheduler_service["spec"]["ports"][0]["port"] == int(scheduler.flag("--port"))
    for front in by_module(docs, "services.openai_api"):
        assert front.flag("--gateway") == f"{service_host('gateway')}:{gateway.flag('--port')}"


def _probe_port(probe: dict) -> int:
    if "grpc" in probe:
        return probe["grpc"]["port"]
    if "tcpSocket" in probe:
        return probe["tcpSocket"]["port"]
    if "httpGet" in probe:
        assert probe["httpGet"]["path"] == "/health"
        return probe["httpGet"]["port"]
    command = probe["exec"]["command"]
    assert command[:3] == ["python", "-m", "common.healthcheck"], command
    return int(command[-1].rpartition(":")[2])


@sets
def test_probes_target_the_port_each_service_listens_on(key, rendered) -> None:
    docs, values = rendered[key], values_of(key)
    for container in containers(docs):
        port = int(container.flag("--port"))
        assert container.flag("--host") == "0.0.0.0"
        probes = {k: container.spec[k] for k in ("readinessProbe", "livenessProbe", "startupProbe")}
        for probe in probes.values():
            assert _probe_port(probe) == port
        readiness = probes["readinessProbe"]
        if values["tls"]["enabled"]:  # the kubelet cannot speak TLS: probe from inside
            http = ["--http"] if container.module == "services.openai_api" else []
            assert readiness["exec"]["command"][3:-1] == http
        elif container.module == "services.openai_api":
            assert "httpGet" in readiness
        else:
            assert "grpc" in readiness
        # Every Service port's target is a container port this service listens on.
        for service in [d for d in docs if d["kind"] == "Service"]:
            labels = container.workload["spec"]["template"]["metadata"]["labels"]
            if service["spec"]["selector"].items() <= labels.items():
                for service_port in service["spec"]["ports"]:
                    container.port_named(service_port["targetPort"])
        assert container.port_named("http" if "openai" in container.module else "grpc") == port
    startup = values["probes"]["workerStartup"]
    window = startup["periodSeconds"] * startup["failureThreshold"]
    assert window >= 1800  # generous: loading (and on GPU profiling) a model
    for worker in by_module(docs, "services.worker"):
        probe = worker.spec["startupProbe"]
        assert probe["periodSeconds"] * probe["failureThreshold"] == window
    # Neither the scheduler nor the gateway gives up on the workers before Kubernetes would.
    (scheduler,) = by_module(docs, "services.scheduler")
    assert float(scheduler.flag("--worker-ready-timeout-s")) >= window
    (gateway,) = by_module(docs, "services.gateway")
    assert float(gateway.flag("--scheduler-ready-timeout-s")) >= window


@sets
def test_gpu_requests_equal_ranks_per_worker(key, rendered) -> None:
    docs, values = rendered[key], values_of(key)
    gpu = values["gpu"]["enabled"]
    for worker in by_module(docs, "services.worker"):
        ranks = int(worker.flag("--tensor-parallel-size")) * int(
            worker.flag("--pipeline-parallel-size")
        )
        worker_set = values["workers"][worker.flag("--role")]
        assert ranks == worker_set["tensorParallelSize"] * worker_set["pipelineParallelSize"]
        resources = worker.spec.get("resources", {})
        for part in ("limits", "requests"):
            assert resources.get(part, {}).get("nvidia.com/gpu") == (ranks if gpu else None)
        assert worker.flag("--device") == ("cuda" if gpu else "cpu")
        assert worker.flag("--dtype") == (values["gpu"]["dtype"] if gpu else "float32")
        if gpu:
            assert worker.spec["image"] == "registry.example/tandem:0.1.0-cu128"
    for container in containers(docs):
        if container.module != "services.worker":
            assert "nvidia.com/gpu" not in str(container.spec.get("resources"))
            assert container.spec["image"] == "tandem:0.1.0"


@sets
def test_grace_period_covers_the_drain_timeout(key, rendered) -> None:
    for container in containers(rendered[key]):
        grace = container.pod["terminationGracePeriodSeconds"]
        if container.module == "services.openai_api":  # no drain setting: its fixed grace
            assert grace == SHUTDOWN_GRACE_S + DRAIN_MARGIN_S
            continue
        drain = float(container.flag("--drain-timeout-s"))
        assert drain + DRAIN_MARGIN_S <= grace < drain + DRAIN_MARGIN_S + 1


@sets
def test_model_folder_is_mounted_where_the_services_read_it(key, rendered) -> None:
    docs, values = rendered[key], values_of(key)
    model = values["model"]
    folder = f"{model['mountPath']}/{model['folder']}"
    readers = by_module(docs, "services.worker") + by_module(docs, "services.gateway")
    for container in readers:
        assert container.flag("--model") == folder
        volume = container.mounts()[model["mountPath"]]
        source = {"builtin": "emptyDir", "pvc": "persistentVolumeClaim", "hostPath": "hostPath"}
        assert source[model["source"]] in volume
        inits = container.pod.get("initContainers", [])
        if model["source"] == "builtin":  # built into the volume before the service starts
            (init,) = inits
            builder = ["python", "-m", "devtools.checkpoint_builder", "--out", folder]
            assert init["command"] == builder
            assert init["volumeMounts"] == [{"name": "model", "mountPath": model["mountPath"]}]
        else:
            assert inits == []
            (mount,) = [m for m in container.spec["volumeMounts"] if m["name"] == "model"]
            assert mount["readOnly"]


@sets
def test_tls_and_api_key_are_wired_as_docs_security_md_says(key, rendered) -> None:
    docs, values = rendered[key], values_of(key)
    settings = values["tls"]
    for container in containers(docs):
        tls_env = {n: e["value"] for n, e in container.env.items() if n in TLS_ENV}
        if not settings["enabled"]:
            assert tls_env == {}
            continue
        # Every process: its certificate, key and CA from the mounted Secret.
        volume = container.mounts()[settings["mountPath"]]
        assert volume["secret"]["secretName"] == settings["secretName"]
        assert tls_env == {
            tls.CERT_ENV: f"{settings['mountPath']}/tls.crt",
            tls.KEY_ENV: f"{settings['mountPath']}/tls.key",
            tls.CA_ENV: f"{settings['mountPath']}/ca.crt",
            tls.CLIENT_AUTH_ENV: "1",
            tls.SERVER_NAME_ENV: settings["serverName"],
        }
    for container in containers(docs):  # the key reaches the gateway only, as a file
        flags = container.flags
        assert "--api-key" not in flags and "TANDEM_API_KEY" not in container.env
        wants_key = values["apiKey"]["enabled"] and container.module == "services.gateway"
        assert ("--api-key-file" in flags) == wants_key
    # (test_every_flag_and_variable_... reads that file through the mounted Secret.)


@sets
def test_metrics_ports_and_service_monitor(key, rendered) -> None:
    docs, values = rendered[key], values_of(key)
    enabled = values["metrics"]["enabled"]
    port = values["metrics"]["port"]
    services = [d for d in docs if d["kind"] == "Service"]
    for container in containers(docs):
        if container.module == "services.openai_api":  # /metrics on its own port
            assert "--metrics-port" not in container.flags
            continue
        if not enabled:
            assert "--metrics-port" not in container.flags
            continue
        assert int(container.flag("--metrics-port")) == container.port_named("metrics") == port
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert len(monitors) == int(enabled)
    for monitor in monitors:
        selector = monitor["spec"]["selector"]["matchLabels"]
        selected = [s for s in services if selector.items() <= s["metadata"]["labels"].items()]
        assert len(selected) == len(services)
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["path"] == "/metrics"
            names = {p["name"] for s in selected for p in s["spec"]["ports"]}
            assert endpoint["port"] in names
        metrics_services = {s["metadata"]["name"] for s in selected
                            if "metrics" in {p["name"] for p in s["spec"]["ports"]}}  # fmt: skip
        expected = {name("gateway"), name("scheduler")} | {name(s) for s in worker_sets(values)}
        assert metrics_services == expected
        http = [e for e in monitor["spec"]["endpoints"] if e["port"] == "http"]
        assert len(http) == int(values["openaiApi"]["enabled"])
        if values["tls"]["enabled"] and http:
            assert http[0]["scheme"] == "https"
            assert http[0]["tlsConfig"]["ca"]["secret"]["name"] == values["tls"]["secretName"]


def test_bad_values_fail_with_a_clear_message(tmp_path: Path) -> None:
    cases = {
        "workers.prefill.replicas and workers.decode.replicas must be >= 1":
            {"workers": {"decode": {"replicas": 0}}},
        "tls.enabled needs tls.secretName": {"tls": {"enabled": True}},
        "apiKey.enabled needs apiKey.existingSecret or apiKey.value": {"apiKey": {"enabled": True}},
        "model.source=pvc needs model.pvc.claimName": {"model": {"source": "pvc"}},
    }  # fmt: skip
    for message, values in cases.items():
        values_file = tmp_path / "bad.json"
        values_file.write_text(json.dumps(values))
        result = helm("template", "demo", str(CHART), "--values", str(values_file))
        assert result.returncode != 0 and message in result.stderr, (message, result.stderr)


@sets
def test_pod_annotations_and_placement_reach_every_pod(key, rendered) -> None:
    values = values_of(key)
    for container in containers(rendered[key]):
        template = container.workload["spec"]["template"]
        component = template["metadata"]["labels"]["app.kubernetes.io/component"]
        own = values["scheduler"]["podAnnotations"] if component == "scheduler" else {}
        annotations = {**values["podAnnotations"], **own}
        assert template["metadata"].get("annotations", {}) == annotations
        assert container.pod.get("nodeSelector", {}) == values["nodeSelector"]
        assert container.pod.get("tolerations", []) == values["tolerations"]
        # No Service links: under a release named "tandem" they would set
        # TANDEM_GATEWAY_PORT=tcp://..., a Tandem setting's variable.
        assert container.pod["enableServiceLinks"] is False
