"""vLLM's `--served-model-name` (one or more names): a second gateway over the shared
stack's scheduler serves the model under two names, and an HTTP front over it lists and
accepts them (greedy output still HF's); an HTTP front with names of its own serves under
those. The folder's name is then not served, as in vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from common.config import load_config
from common.healthcheck import health_status
from common.pb.tandem.v1 import generate_pb2, generate_pb2_grpc
from services.gateway.config import GatewayConfig
from services.openai_api.config import OpenAIApiConfig
from services.stack.ports import free_port
from tests.hf_reference import hf_greedy, hf_tokenizer
from tests.stack_client import http_front, stop_process

ROOT = Path(__file__).resolve().parents[2]
NAMES = ("tandem-tiny", "acme/Tiny-Llama-Chat")


def spawn(argv: list[str], log_path: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TANDEM_EXIT_WITH_PARENT": "1"}
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", *argv], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )


def wait(check, process: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + 90
    while check() != "SERVING":
        assert process.poll() is None, log_path.read_text()
        assert time.monotonic() < deadline, log_path.read_text()[-2000:]
        time.sleep(0.2)


@pytest.fixture(scope="module")
def fronts(api_stack, tiny_llama_dir, tmp_path_factory):
    """(gateway address, HTTP address over it, HTTP address with its own names)."""
    logs = tmp_path_factory.mktemp("served-names")
    gateway_port = free_port()
    gateway = spawn(
        ["services.gateway", "--model", str(tiny_llama_dir), "--port", str(gateway_port),
         "--scheduler", api_stack.spec.scheduler_address, "--served-model-name", *NAMES],
        logs / "gateway.log",
    )  # fmt: skip
    try:
        gateway_address = f"127.0.0.1:{gateway_port}"
        wait(lambda: health_status(gateway_address), gateway, logs / "gateway.log")
        with (
            http_front(gateway_address, logs / "http.log") as (address, _),
            http_front(gateway_address, logs / "alias.log", "--served-model-name", "my-model") as (
                alias_address,
                _,
            ),
        ):
            yield gateway_address, address, alias_address
    finally:
        stop_process(gateway)


def http(address: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://{address}{path}", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_flag_takes_one_or_more_names_as_vllm_does():
    base = ["--model", "m"]
    assert load_config(GatewayConfig, base + ["--served-model-name", "a", "b/c"], env={}) \
        .served_model_name == ("a", "b/c")  # fmt: skip
    assert load_config(GatewayConfig, base + ["--served-model-name", "a,b"], env={}) \
        .served_model_name == ("a", "b")  # fmt: skip
    from_env = load_config(GatewayConfig, base, env={"TANDEM_SERVED_MODEL_NAME": "x,y"})
    assert from_env.served_model_name == ("x", "y")
    assert load_config(OpenAIApiConfig, [], env={"TANDEM_SERVED_MODEL_NAME": "x"}) \
        .served_model_name == ("x",)  # fmt: skip
    with pytest.raises(ValueError, match="served_model_name must not repeat a name"):
        load_config(GatewayConfig, base + ["--served-model-name", "a", "a"], env={})
    with pytest.raises(ValueError, match="served_model_name names must be 1..128 printable"):
        load_config(GatewayConfig, base + ["--served-model-name", "x" * 129], env={})


def test_the_gateway_lists_every_served_name(fronts):
    gateway_address, _, _ = fronts
    with grpc.insecure_channel(gateway_address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        listed = stub.ListModels(generate_pb2.ListModelsRequest(), timeout=10)
        info = stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=10)
    assert [m.model_name for m in listed.models] == list(NAMES)
    assert info.model_name == NAMES[0]
    assert {m.vocab_size for m in listed.models} == {info.vocab_size}


def test_the_http_front_accepts_any_served_name_and_not_the_folder_name(fronts, tiny_llama_dir):
    _, address, _ = fronts
    status, models = http(address, "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == list(NAMES)
    prompt = "The served name is"
    want = hf_tokenizer(str(tiny_llama_dir)).decode(
        hf_greedy(tiny_llama_dir, hf_tokenizer(str(tiny_llama_dir)).encode(prompt), 8),
        skip_special_tokens=True,
    )
    for name in NAMES:
        body = {"model": name, "prompt": prompt, "max_tokens": 8, "temperature": 0}
        status, reply = http(address, "/v1/completions", body)
        assert status == 200, reply
        assert reply["model"] == name and reply["choices"][0]["text"] == want
    status, reply = http(address, "/v1/completions", {"model": "tiny-llama", "prompt": "x"})
    assert status == 404 and reply["error"]["code"] == "model_not_found"
    assert all(name in reply["error"]["message"] for name in NAMES)


def test_an_http_front_with_names_of_its_own_serves_under_them(fronts):
    _, _, address = fronts
    status, models = http(address, "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == ["my-model"]
    body = {"model": "my-model", "prompt": "Hi", "max_tokens": 2, "temperature": 0}
    assert http(address, "/v1/completions", body)[0] == 200
    assert http(address, "/v1/completions", body | {"model": NAMES[0]})[0] == 404
