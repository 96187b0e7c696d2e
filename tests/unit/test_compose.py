"""compose.yaml describes the same services as `make up` (four gRPC services and the
OpenAI-compatible HTTP front), with commands and settings that the services' own config
parsers accept (no container engine runs here)."""

import re
from pathlib import Path

import pytest
import yaml

from common.config import load_config
from services.gateway.config import GatewayConfig
from services.openai_api.config import OpenAIApiConfig
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {
    "services.worker": WorkerConfig,
    "services.scheduler": SchedulerConfig,
    "services.gateway": GatewayConfig,
    "services.openai_api": OpenAIApiConfig,
}
# How each service's healthcheck probes it: gRPC health, or the HTTP front's GET /health.
PROBE_FLAGS = {"services.openai_api": ["--http"]}


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def parsed(service: dict):
    command = service["command"]
    assert command[:2] == ["python", "-m"]
    # compose's `${VAR:-default}` with VAR unset: the default
    env = {
        k: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(v))
        for k, v in service.get("environment", {}).items()
    }
    return command[2], load_config(CONFIGS[command[2]], command[3:], env=env)


def test_five_services_plus_model_init(compose):
    services = compose["services"]
    assert set(services) == {
        "model-init", "prefill-0", "decode-0", "scheduler", "gateway", "openai-api"
    }  # fmt: skip
    modules = {name: parsed(s)[0] for name, s in services.items() if name != "model-init"}
    assert modules == {
        "prefill-0": "services.worker",
        "decode-0": "services.worker",
        "scheduler": "services.scheduler",
        "gateway": "services.gateway",
        "openai-api": "services.openai_api",
    }


def test_every_command_is_accepted_by_its_config_parser(compose):
    services = compose["services"]
    _, prefill = parsed(services["prefill-0"])
    _, decode = parsed(services["decode-0"])
    _, scheduler = parsed(services["scheduler"])
    _, gateway = parsed(services["gateway"])
    _, http = parsed(services["openai-api"])
    assert (prefill.role, decode.role) == ("prefill", "decode")
    assert set(scheduler.workers) == {f"prefill-0:{prefill.port}", f"decode-0:{decode.port}"}
    assert gateway.scheduler == (f"scheduler:{scheduler.port}",)
    assert http.gateway == f"gateway:{gateway.port}" and http.host == "0.0.0.0"
    assert services["openai-api"]["depends_on"] == {"gateway": {"condition": "service_healthy"}}
    assert prefill.model == decode.model == gateway.model == "/models/SmolLM2-135M-Instruct"
    init = services["model-init"]["command"]  # builds that folder in the volume
    assert init[:4] == ["python", "-m", "devtools.default_model", "build"]
    assert init[init.index("--models") + 1] == "/models"


def test_only_the_gateway_and_the_http_front_are_published_and_only_on_loopback(compose):
    published = {name: s.get("ports", []) for name, s in compose["services"].items()}
    assert published.pop("gateway") == ["127.0.0.1:50051:50051"]
    _, http = parsed(compose["services"]["openai-api"])
    assert published.pop("openai-api") == [f"127.0.0.1:{http.port}:{http.port}"]
    assert not any(published.values())


def test_healthchecks_probe_each_service_own_port(compose):
    for name, service in compose["services"].items():
        if name == "model-init":
            continue
        module, config = parsed(service)
        assert service["healthcheck"]["test"] == [
            "CMD",
            "python",
            "-m",
            "common.healthcheck",
            *PROBE_FLAGS.get(module, []),
            f"127.0.0.1:{config.port}",
        ]


def test_image_contains_every_package_the_services_import():
    dockerfile = (ROOT / "Dockerfile").read_text()
    for package in ("common", "kernels", "services"):
        assert f"COPY {package} ./{package}" in dockerfile
    assert "torch==2.13.0" in dockerfile
