"""compose.yaml describes the same four services as `make up`, with commands and settings
that the services' own config parsers accept (no container engine runs here)."""

from pathlib import Path

import pytest
import yaml

from common.config import load_config
from services.gateway.config import GatewayConfig
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    "services.worker": WorkerConfig,
    "services.scheduler": SchedulerConfig,
    "services.gateway": GatewayConfig,
}


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def parsed(service: dict):
    command = service["command"]
    assert command[:2] == ["python", "-m"]
    env = {k: str(v) for k, v in service.get("environment", {}).items()}
    return command[2], load_config(CONFIGS[command[2]], command[3:], env=env)


def test_four_services_plus_model_init(compose):
    services = compose["services"]
    assert set(services) == {"model-init", "prefill-0", "decode-0", "scheduler", "gateway"}
    modules = {name: parsed(s)[0] for name, s in services.items() if name != "model-init"}
    assert modules == {
        "prefill-0": "services.worker",
        "decode-0": "services.worker",
        "scheduler": "services.scheduler",
        "gateway": "services.gateway",
    }


def test_every_command_is_accepted_by_its_config_parser(compose):
    services = compose["services"]
    _, prefill = parsed(services["prefill-0"])
    _, decode = parsed(services["decode-0"])
    _, scheduler = parsed(services["scheduler"])
    _, gateway = parsed(services["gateway"])
    assert (prefill.role, decode.role) == ("prefill", "decode")
    assert set(scheduler.workers) == {f"prefill-0:{prefill.port}", f"decode-0:{decode.port}"}
    assert gateway.scheduler == f"scheduler:{scheduler.port}"
    assert prefill.model == decode.model == gateway.model == "/models/tandem-tiny-llama"


def test_only_the_gateway_is_published_and_only_on_loopback(compose):
    published = {name: s.get("ports", []) for name, s in compose["services"].items()}
    assert published.pop("gateway") == ["127.0.0.1:50051:50051"]
    assert not any(published.values())


def test_healthchecks_probe_each_service_own_port(compose):
    for name, service in compose["services"].items():
        if name == "model-init":
            continue
        _, config = parsed(service)
        assert service["healthcheck"]["test"] == [
            "CMD",
            "python",
            "-m",
            "common.healthcheck",
            f"127.0.0.1:{config.port}",
        ]


def test_image_contains_every_package_the_services_import():
    dockerfile = (ROOT / "Dockerfile").read_text()
    for package in ("common", "kernels", "services"):
        assert f"COPY {package} ./{package}" in dockerfile
    assert "torch==2.13.0" in dockerfile
