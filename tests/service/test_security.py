"""TLS / mutual TLS on every gRPC hop and bearer-token auth on the public APIs.

A throwaway CA (and an unrelated second one, `tests/throwaway_pki.py`) issue the
certificates; the settings themselves are tested in test_security_settings.py. One real stack
(workers, scheduler, gateway, HTTPS front as processes) runs with mutual TLS and an API key:
greedy output over it equals HF `generate`; plaintext clients, clients trusting another CA
and clients without a certificate are refused by every service; calls without the right
bearer token are UNAUTHENTICATED (HTTP 401) while health stays open.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx2
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from common.grpc_server import open_sync_channel
from common.healthcheck import health_status, http_health_status
from common.pb.tandem.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from common.pb.tandem.v1 import generate_pb2, generate_pb2_grpc
from common.tls import TlsSettings
from services.stack.launcher import Stack
from tests.hf_reference import hf_greedy, hf_tokenizer
from tests.throwaway_pki import Pki, check_health, make_pki

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "tandem-test-key-4f9c"
MODEL = "tiny-llama"
DENIED = "missing or invalid bearer token"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


# --- one stack: mutual TLS on every hop, an API key on the public APIs ---------------------


@pytest.fixture(scope="module")
def stack(pki, module_stacks):
    env = {**pki.env(), "TANDEM_API_KEY": API_KEY}
    # The launcher's readiness probes (common.healthcheck) read this process's environment,
    # as `make up` does: give them the stack's TLS settings while it starts.
    with pytest.MonkeyPatch.context() as patch:
        for name, value in pki.env().items():
            patch.setenv(name, value)
        return module_stacks(name="secure-stack", http=True, env=env)


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def greedy_request(prompt: str, max_tokens: int) -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest(text=prompt, max_tokens=max_tokens)
    request.sampling.temperature = 0.0
    return request


def expected(model_dir: Path, prompt: str, max_tokens: int) -> tuple[list[int], str]:
    tokenizer = hf_tokenizer(str(model_dir))
    ids = hf_greedy(model_dir, tokenizer.encode(prompt), max_tokens)
    return ids, tokenizer.decode(ids, skip_special_tokens=True)


def test_greedy_over_mutual_tls_equals_hf(stack, pki, tiny_llama_dir):
    """Client -> gateway -> scheduler -> workers, every hop mutual TLS: exact tokens."""
    with open_sync_channel(stack.spec.gateway_address, pki.tls(pki.client)) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        for prompt, max_tokens in [("Once upon a time", 24), ("Ελληνικά και русский", 40)]:
            ids, text = [], []
            for message in stub.Generate(
                greedy_request(prompt, max_tokens), timeout=120, metadata=bearer(API_KEY)
            ):
                ids.extend(message.token_ids)
                text.append(message.text)
            assert (ids, "".join(text)) == expected(tiny_llama_dir, prompt, max_tokens), prompt


def test_every_service_refuses_clients_without_a_trusted_certificate(stack, pki):
    """Gateway, scheduler and every worker serve mutual TLS only: plaintext, a client that
    trusts another CA, a client without a certificate and one from another CA all fail."""
    refused = {
        "plaintext": TlsSettings(),
        "trusting another CA": pki.tls(pki.client, ca=pki.other_ca),
        "no client certificate": pki.tls(None),
        "certificate from another CA": pki.tls(pki.rogue),
    }
    grpc_processes = [p for p in stack.processes if p.probe == "grpc"]
    assert {p.name for p in grpc_processes} >= {"gateway", "scheduler"}
    assert len(grpc_processes) == 2 + len(stack.spec.worker_ports)
    for process in grpc_processes:
        for what, tls in refused.items():
            assert check_health(process.address, tls) == "UNAVAILABLE", (process.name, what)
        assert check_health(process.address, pki.tls(pki.client)) == "SERVING", process.name
        assert health_status(process.address, timeout_s=5, tls=pki.tls(pki.client)) == "SERVING"
    # The scheduler's own API also needs a certificate (it sits behind the gateway).
    with open_sync_channel(stack.spec.scheduler_address, TlsSettings()) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            scheduler_pb2_grpc.SchedulerServiceStub(channel).GetPoolStats(
                scheduler_pb2.GetPoolStatsRequest(), timeout=5
            )
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_healthcheck_command_follows_the_tls_environment(stack, pki):
    """`python -m common.healthcheck` (compose, `make up`, `make status`) works under TLS
    with the environment and fails without it."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_TLS_")}

    def probe(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "common.healthcheck", *args],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    secure = {**base, **pki.env()}
    for args in ([stack.spec.gateway_address], ["--http", stack.spec.http_address]):
        ok = probe(secure, *args)
        assert (ok.returncode, ok.stdout.strip()) == (0, "SERVING"), ok.stderr
        refused = probe(base, *args)
        assert (refused.returncode, refused.stdout.strip()) == (1, "UNREACHABLE")


def test_public_api_requires_the_bearer_token(stack, pki, tiny_llama_dir):
    calls = {
        "Generate": lambda stub, md: list(
            stub.Generate(greedy_request("Hello", 4), timeout=30, metadata=md)
        ),
        "Tokenize": lambda stub, md: stub.Tokenize(
            generate_pb2.TokenizeRequest(text="Hello"), timeout=30, metadata=md
        ),
        "GetModelInfo": lambda stub, md: stub.GetModelInfo(
            generate_pb2.GetModelInfoRequest(), timeout=30, metadata=md
        ),
        "ListModels": lambda stub, md: stub.ListModels(
            generate_pb2.ListModelsRequest(), timeout=30, metadata=md
        ),
        "GetServerLoad": lambda stub, md: stub.GetServerLoad(
            generate_pb2.GetServerLoadRequest(), timeout=30, metadata=md
        ),
    }
    wrong = {
        "no token": (),
        "wrong token": bearer(API_KEY + "x"),
        "a prefix of the token": bearer(API_KEY[:-1]),
        "another scheme": (("authorization", f"Basic {API_KEY}"),),
        "empty bearer": (("authorization", "Bearer "),),
    }
    with open_sync_channel(stack.spec.gateway_address, pki.tls(pki.client)) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        for method, call in calls.items():
            for what, metadata in wrong.items():
                with pytest.raises(grpc.RpcError) as caught:
                    call(stub, metadata)
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED, (method, what)
                assert caught.value.details() == DENIED
            call(stub, bearer(API_KEY))
        # The scheme is case-insensitive (RFC 6750); the token is not.
        tokens = stub.Tokenize(
            generate_pb2.TokenizeRequest(text="Hello"),
            timeout=30,
            metadata=(("authorization", f"bearer {API_KEY}"),),
        )
        assert list(tokens.token_ids) == hf_tokenizer(str(tiny_llama_dir)).encode("Hello")
        # A request that does not even parse is refused before it is parsed.
        raw = channel.unary_unary("/tandem.v1.GenerateService/Tokenize")
        with pytest.raises(grpc.RpcError) as caught:
            raw(b"\xff\xff\xff", timeout=30)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as caught:
            raw(b"\xff\xff\xff", timeout=30, metadata=bearer(API_KEY))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # Health and reflection stay open: probes and `grpcurl list` send no headers.
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
        assert "tandem.v1.GenerateService" in services


def test_cli_client_sends_the_api_key_over_tls(stack, pki, tiny_llama_dir):
    env = {
        **os.environ,
        "TANDEM_TLS_CERT": pki.client[0],
        "TANDEM_TLS_KEY": pki.client[1],
        "TANDEM_TLS_CA": str(pki.ca.path),
        "TANDEM_API_KEY": API_KEY,
    }
    argv = [sys.executable, "-m", "services.client", "Once upon a time", "--max-tokens", "12",
            "--address", stack.spec.gateway_address]  # fmt: skip
    ok = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout == expected(tiny_llama_dir, "Once upon a time", 12)[1] + "\n"
    denied = subprocess.run(
        [*argv, "--api-key", "nope"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert denied.returncode == 1 and f"UNAUTHENTICATED: {DENIED}" in denied.stderr


# --- the HTTPS front -----------------------------------------------------------------------


def https_get(stack: Stack, pki: Pki, path: str, headers: dict[str, str], body=None):
    """GET `path`, or POST `body` as JSON when given: (status, headers, JSON answer)."""
    context = pki.tls(pki.client).client_ssl_context()
    host, port = stack.spec.http_address.rsplit(":", 1)
    connection = http.client.HTTPSConnection(host, int(port), timeout=30, context=context)
    try:
        data = None if body is None else json.dumps(body).encode()
        headers = {**headers, "Content-Type": "application/json"}
        connection.request("GET" if body is None else "POST", path, body=data, headers=headers)
        reply = connection.getresponse()
        return reply.status, dict(reply.getheaders()), json.loads(reply.read())
    finally:
        connection.close()


@contextlib.contextmanager
def openai_client(stack: Stack, pki: Pki, api_key: str) -> Iterator[openai.OpenAI]:
    """The official client over HTTPS with the test's client certificate; its keep-alive
    connections are closed on exit."""
    http_client = httpx2.Client(verify=pki.tls(pki.client).client_ssl_context())
    with http_client:
        yield openai.OpenAI(
            base_url=f"https://{stack.spec.http_address}/v1", api_key=api_key, max_retries=0,
            timeout=120, http_client=http_client,
        )  # fmt: skip


def test_http_front_serves_https_and_forwards_the_bearer_token(stack, pki, tiny_llama_dir):
    status, _, body = https_get(stack, pki, "/health", {})
    assert (status, body) == (200, {"status": "ok"})
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer ünï"}):
        status, reply_headers, body = https_get(stack, pki, "/v1/models", headers)
        assert status == 401, headers
        assert reply_headers.get("www-authenticate") == "Bearer"
        assert body["error"]["type"] == "authentication_error"
        assert body["error"]["message"] == DENIED
    # vLLM's extras: /tokenize and /detokenize need the key; /version and /ping do not.
    for path, request in (("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [1]})):
        for key, want in (("", 401), ("wrong", 401), (API_KEY, 200)):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            assert https_get(stack, pki, path, headers, request)[0] == want, (path, key)
    assert [https_get(stack, pki, p, {})[0] for p in ("/version", "/ping")] == [200, 200]

    with openai_client(stack, pki, "wrong") as client:
        with pytest.raises(openai.AuthenticationError) as caught:
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
        assert caught.value.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            client.models.list()

    with openai_client(stack, pki, API_KEY) as client:
        check_authorized_completions(client, tiny_llama_dir)


def check_authorized_completions(client: openai.OpenAI, tiny_llama_dir: Path) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    prompt, max_tokens = "In the beginning", 20
    want_ids, want_text = expected(tiny_llama_dir, prompt, max_tokens)
    got = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0
    )
    assert got.choices[0].text == want_text
    assert got.usage.completion_tokens == len(want_ids)
    streamed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == want_text
    echo = client.completions.create(
        model=MODEL, prompt=[[1, 2, 3]], max_tokens=2, temperature=0, echo=True
    )
    assert echo.choices[0].text  # detokenizing the echoed ids is authorized too


def test_http_front_refuses_plaintext_and_clients_without_a_certificate(stack, pki):
    host, port = stack.spec.http_address.rsplit(":", 1)
    plain = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        with pytest.raises((OSError, http.client.HTTPException)):
            plain.request("GET", "/health")
            plain.getresponse().read()
    finally:
        plain.close()
    assert http_health_status(stack.spec.http_address, 5, TlsSettings()) == "UNREACHABLE"
    for tls in (pki.tls(None), pki.tls(pki.rogue), pki.tls(pki.client, ca=pki.other_ca)):
        assert http_health_status(stack.spec.http_address, 5, tls) == "UNREACHABLE"
    assert http_health_status(stack.spec.http_address, 5, pki.tls(pki.client)) == "SERVING"


def test_oversized_credentials_get_one_answer_right_key_or_not(stack, pki):
    """docs/security.md, "Oversized credentials": up to 64 KiB of metadata / request head
    the key is checked (a credential longer than any key can be is simply wrong:
    UNAUTHENTICATED / 401); past it the call is refused before any key is looked at
    (RESOURCE_EXHAUSTED / 431), the same whether the key was right. Each size is tried
    several times: between gRPC's default soft and hard limits the answer used to be
    chance."""
    sizes = {6 * 1024: "checked", 12 * 1024: "checked", 40 * 1024: "checked",
             100 * 1024: "refused"}  # fmt: skip
    with open_sync_channel(stack.spec.gateway_address, pki.tls(pki.client)) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        for size, outcome in sizes.items():
            wrong = bearer("k" * size)
            right_padded = (*bearer(API_KEY), ("x-pad", "p" * size))
            for _ in range(5):
                codes = []
                for metadata in (wrong, right_padded):
                    try:
                        stub.GetModelInfo(
                            generate_pb2.GetModelInfoRequest(), timeout=30, metadata=metadata
                        )
                        codes.append(grpc.StatusCode.OK)
                    except grpc.RpcError as exc:
                        codes.append(exc.code())
                if outcome == "checked":
                    assert codes == [grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.OK], size
                else:
                    assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2, size
            wrong_http = {"Authorization": "Bearer " + "k" * size}
            right_http = {"Authorization": f"Bearer {API_KEY}", "X-Pad": "p" * size}
            statuses = [https_get(stack, pki, "/v1/models", h)[0] for h in (wrong_http, right_http)]
            assert statuses == ([401, 200] if outcome == "checked" else [431, 431]), size
