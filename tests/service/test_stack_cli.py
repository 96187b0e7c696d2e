"""`python -m services.stack up|status|down` — what `make up` / `make down` run — on a
checkpoint folder (`make up MODEL=...`) and on free ports, with and without the HTTP front."""

import contextlib
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

from common.healthcheck import http_health_status
from services.stack.spec import _distinct_free_ports
from tests.hf_reference import hf_greedy, hf_tokenizer
from tests.stack_client import generate, greedy_request

ROOT = Path(__file__).resolve().parents[2]


def stack_cli(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.stack", "--run-dir", str(run_dir), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def up_on_free_ports(run_dir: Path, model: Path, *extra: str):
    """`up` with every port free; returns (result, gateway port, HTTP port)."""
    gateway, scheduler, prefill, decode, http = _distinct_free_ports(5)
    ports = ["--gateway-port", str(gateway), "--scheduler-port", str(scheduler),
             "--prefill-port", str(prefill), "--decode-port", str(decode),
             "--http-port", str(http)]  # fmt: skip
    return stack_cli(run_dir, "up", "--model", str(model), *ports, *extra), gateway, http


def up_with_metrics(run_dir: Path, model: Path):
    """`up_on_free_ports` plus --metrics-port-base on 4 consecutive free ports (gateway,
    scheduler, prefill, decode); returns (result, gateway port, HTTP port, metrics base)."""
    gateway, scheduler, prefill, decode, http = _distinct_free_ports(5)
    metrics = free_port_run(4, avoid={gateway, scheduler, prefill, decode, http})
    ports = ["--gateway-port", str(gateway), "--scheduler-port", str(scheduler),
             "--prefill-port", str(prefill), "--decode-port", str(decode),
             "--http-port", str(http), "--metrics-port-base", str(metrics)]  # fmt: skip
    return stack_cli(run_dir, "up", "--model", str(model), *ports), gateway, http, metrics


def free_port_run(count: int, avoid: set[int]) -> int:
    """The first of `count` consecutive free loopback ports (none of them in `avoid`)."""
    while True:
        base = _distinct_free_ports(1)[0]
        if base + count > 65535 or avoid & set(range(base, base + count)):
            continue
        try:
            with contextlib.ExitStack() as stack:
                for port in range(base, base + count):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        return response.read().decode()


def test_up_prints_how_to_call_then_status_and_down_stop_everything(tiny_llama_dir, tmp_path):
    up, gateway, http, metrics = up_with_metrics(tmp_path, tiny_llama_dir)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "Tandem is serving tiny-llama" in up.stdout
        assert f"127.0.0.1:{gateway}" in up.stdout and "services.client" in up.stdout
        assert f"curl http://127.0.0.1:{http}/v1/completions" in up.stdout
        assert http_health_status(f"127.0.0.1:{http}") == "SERVING"
        status = stack_cli(tmp_path, "status")
        assert status.returncode == 0 and status.stdout.count("SERVING") == 5
        assert f"http           127.0.0.1:{http}" in status.stdout
        again = stack_cli(tmp_path, "up", "--model", str(tiny_llama_dir))
        assert again.returncode == 1 and "already running" in again.stdout
        prompt = hf_tokenizer(str(tiny_llama_dir)).encode("Hello there")
        got = generate(f"127.0.0.1:{gateway}", greedy_request(prompt, 10))
        assert got.token_ids == hf_greedy(tiny_llama_dir, prompt, 10)
        # --metrics-port-base: gateway, scheduler, then the workers; status lists them all.
        for offset, name in enumerate(["gateway", "scheduler", "prefill", "decode"]):
            line = next(x for x in status.stdout.splitlines() if x.split()[0].startswith(name))
            assert f"metrics http://127.0.0.1:{metrics + offset}/metrics" in line
        assert f"http://127.0.0.1:{metrics}/metrics" in up.stdout
        assert "tandem:generation_tokens_total{model_name=" in scrape(f"127.0.0.1:{metrics}")
        assert "tandem:num_requests_running{" in scrape(f"127.0.0.1:{metrics + 1}")
        assert "tandem:http_requests_total{" in scrape(f"127.0.0.1:{http}")
    finally:
        down = stack_cli(tmp_path, "down")
    assert down.returncode == 0 and "stopped" in down.stdout
    assert stack_cli(tmp_path, "status").returncode == 1
    assert "nothing to stop" in stack_cli(tmp_path, "down").stdout
    assert http_health_status(f"127.0.0.1:{http}") == "UNREACHABLE"


def test_bad_model_folder_fails_fast_with_the_log_tail(tmp_path):
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    up, _, _ = up_on_free_ports(tmp_path / "run", empty, "--timeout", "60", "--no-http")
    assert "HTTP front" not in up.stdout
    assert up.returncode == 1
    assert "exited during startup" in up.stderr and "config.json" in up.stderr
