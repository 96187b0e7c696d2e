"""Metrics plumbing without a stack: the --metrics-port setting, the stack's metrics ports,
the endpoint, scrape-time collection on the owning loop, the HTTP route labels and the
scheduler's per-request times."""

from __future__ import annotations

import argparse
import asyncio
import socket
import threading
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from common.config import load_config
from common.lifecycle import StartupError
from common.metrics import REGISTRY, LoopCollector, start_metrics_server
from services.gateway.config import GatewayConfig
from services.openai_api.metrics import handler_label
from services.scheduler.config import SchedulerConfig
from services.scheduler.metrics import RequestTimes
from services.scheduler.request import Request
from services.stack.__main__ import metrics_ports
from services.stack.commands import service_commands as _commands
from services.stack.launcher import StackSpec
from services.worker.config import WorkerConfig

REQUIRED = {
    GatewayConfig: ["--model", "m"],
    SchedulerConfig: ["--workers", "127.0.0.1:1"],
    WorkerConfig: ["--model", "m"],
}
ENV = {
    GatewayConfig: "TANDEM_GATEWAY_METRICS_PORT",
    SchedulerConfig: "TANDEM_SCHEDULER_METRICS_PORT",
    WorkerConfig: "TANDEM_WORKER_METRICS_PORT",
}


@pytest.mark.parametrize("cls", list(REQUIRED))
def test_metrics_port_is_off_by_default_and_read_from_flag_or_env(cls):
    assert load_config(cls, REQUIRED[cls], env={}).metrics_port == 0
    assert load_config(cls, REQUIRED[cls], env={ENV[cls]: "9100"}).metrics_port == 9100
    flagged = load_config(cls, [*REQUIRED[cls], "--metrics-port", "9101"], env={ENV[cls]: "1"})
    assert flagged.metrics_port == 9101


@pytest.mark.parametrize("cls", list(REQUIRED))
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--metrics-port", "70000"], r"metrics_port must be in 0..65535 .*got 70000"),
        (["--metrics-port", "-1"], r"metrics_port must be in 0..65535"),
        (["--port", "9100", "--metrics-port", "9100"], r"metrics_port must differ from --port"),
    ],
)
def test_bad_metrics_port_names_the_setting_flag_and_env(cls, argv, message):
    with pytest.raises(ValueError, match=message + rf".*\(flag --metrics-port, env {ENV[cls]}\)"):
        load_config(cls, [*REQUIRED[cls], *argv], env={})


def test_stack_gives_each_grpc_service_its_metrics_port():
    spec = StackSpec(
        model="m",
        gateway_port=1001,
        scheduler_port=1002,
        prefill_ports=(1003,),
        decode_ports=(1004, 1005),
        http_port=1006,
        metrics_ports=(2001, 2002, 2003, 2004, 2005),
    )
    flags = {
        name: argv[argv.index("--metrics-port") + 1] if "--metrics-port" in argv else None
        for name, _, argv in _commands(spec)
    }
    assert flags == {
        "gateway": "2001",
        "scheduler": "2002",
        "prefill-1003": "2003",
        "decode-1004": "2004",
        "decode-1005": "2005",
        "http": None,  # GET /metrics on its own port
    }
    with pytest.raises(ValueError, match="metrics_ports needs 4 ports"):
        StackSpec(model="m", metrics_ports=(2001, 2002))
    with pytest.raises(ValueError, match="ports must be distinct"):
        StackSpec(model="m", metrics_ports=(50051, 2002, 2003, 2004))
    assert StackSpec(model="m").metrics_port("gateway") is None


def stack_args(base: int, prefill: int = 1, decode: int = 1, schedulers: int = 1):
    return argparse.Namespace(
        metrics_port_base=base, prefill=prefill, decode=decode, both=0, schedulers=schedulers
    )


def test_stack_cli_metrics_port_base():
    assert metrics_ports(stack_args(9100, decode=2)) == (9100, 9101, 9102, 9103, 9104)
    # two schedulers, each with 1 prefill + 1 decode: gateway, 2 schedulers, 4 workers
    assert metrics_ports(stack_args(9100, schedulers=2)) == tuple(range(9100, 9107))
    assert metrics_ports(stack_args(0)) == ()
    with pytest.raises(ValueError, match="--metrics-port-base must leave room"):
        metrics_ports(stack_args(65534))


def test_endpoint_serves_the_text_format_until_closed():
    assert start_metrics_server("127.0.0.1", 0) is None  # 0: off
    registry = CollectorRegistry()
    Counter("tandem:unit_things", "things", registry=registry).inc(3)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = start_metrics_server("127.0.0.1", port, registry)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics") as response:
            text = response.read().decode()
        samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert samples["tandem:unit_things_total"] == 3
        with pytest.raises(StartupError, match=f"could not serve metrics on 127.0.0.1:{port}"):
            start_metrics_server("127.0.0.1", port, registry)  # the port is taken
    finally:
        server.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_loop_collector_computes_on_the_loop_thread():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    seen = []

    def families():
        seen.append(threading.get_ident())
        family = GaugeMetricFamily("tandem:unit_gauge", "g", labels=["worker_id"])
        family.add_metric(["w"], 2.0)
        yield family

    registry = CollectorRegistry()
    registry.register(LoopCollector(loop, families))
    assert registry.get_sample_value("tandem:unit_gauge", {"worker_id": "w"}) == 2.0
    assert seen == [thread.ident]
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()
    assert registry.get_sample_value("tandem:unit_gauge", {"worker_id": "w"}) is None


@pytest.mark.parametrize(
    "path, label",
    [
        ("/v1/completions", "/v1/completions"),
        ("/v1/chat/completions", "/v1/chat/completions"),
        ("/v1/models", "/v1/models"),
        ("/v1/models/tiny-llama", "/v1/models/{model}"),
        ("/v1/models/", "other"),
        ("/metrics", "/metrics"),
        ("/no/such/path/1234", "other"),  # unknown paths do not grow the label set
    ],
)
def test_http_handler_label(path, label):
    assert handler_label(path) == label


def test_request_times_observe_what_a_request_reached():
    times = RequestTimes("unit-model")

    def count(short: str) -> float:
        name = f"tandem:request_{short}_time_seconds_count"
        return REGISTRY.get_sample_value(name, {"model_name": "unit-model"})

    before = {s: count(s) for s in ("queue", "prefill", "decode", "inference")}
    request = Request(request_id="r", prompt_token_ids=[1, 2], max_tokens=4)
    request.arrival_time = 10.0
    times.observe(request, now=11.0)  # aborted while queued: nothing to observe
    assert {s: count(s) for s in before} == before
    request.first_scheduled_time, request.first_token_time = 10.5, 10.75
    times.observe(request, now=12.0)
    assert {s: count(s) - before[s] for s in before} == dict.fromkeys(before, 1)
    total = REGISTRY.get_sample_value(
        "tandem:request_decode_time_seconds_sum", {"model_name": "unit-model"}
    )
    assert total == pytest.approx(1.25)
