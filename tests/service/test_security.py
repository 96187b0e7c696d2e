"""TLS / mutual TLS on every gRPC hop and bearer-token auth on the public APIs.

A throwaway CA (and an unrelated second one) issue certificates here. One real stack
(workers, scheduler, gateway, HTTPS front as processes) runs with mutual TLS and an API key:
greedy output over it equals HF `generate`; plaintext clients, clients trusting another CA
and clients without a certificate are refused by every service; calls without the right
bearer token are UNAUTHENTICATED (HTTP 401) while health stays open.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import http.client
import ipaddress
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx2
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from common.config import load_config
from common.grpc_server import ServiceHost, open_sync_channel
from common.healthcheck import health_status, http_health_status
from common.pb.tandem.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from common.pb.tandem.v1 import generate_pb2, generate_pb2_grpc
from common.tls import TlsSettings
from services.gateway.config import GatewayConfig
from services.stack.launcher import Stack
from tests.hf_reference import hf_greedy, hf_tokenizer

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "tandem-test-key-4f9c"
MODEL = "tiny-llama"
DENIED = "missing or invalid bearer token"


# --- a throwaway PKI -----------------------------------------------------------------------


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _save(path: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
    path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.with_suffix(".key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def _builder(subject: str, issuer: x509.Name, key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


@dataclass(frozen=True)
class Authority:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate
    path: Path  # the CA certificate's PEM file

    @classmethod
    def create(cls, folder: Path, name: str) -> Authority:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            _builder(name, _name(name), key)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256())
        )
        _save(folder / name, key, cert)
        return cls(key, cert, folder / f"{name}.pem")

    def issue(
        self, folder: Path, name: str, sans: list[x509.GeneralName] | None = None
    ) -> tuple[str, str]:
        """A leaf for servers and clients alike; returns (cert file, key file)."""
        key = ec.generate_private_key(ec.SECP256R1())
        if sans is None:
            sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        cert = (
            _builder(name, self.cert.subject, key)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        _save(folder / name, key, cert)
        return str(folder / f"{name}.pem"), str(folder / f"{name}.key")


@dataclass(frozen=True)
class Pki:
    ca: Authority
    other_ca: Authority
    service: tuple[str, str]  # every Tandem process
    client: tuple[str, str]  # the test's clients
    rogue: tuple[str, str]  # issued by the other CA

    def tls(self, identity: tuple[str, str] | None, ca: Authority | None = None) -> TlsSettings:
        cert, key = identity or (None, None)
        return TlsSettings(cert_file=cert, key_file=key, ca_file=str((ca or self.ca).path))

    def env(self) -> dict[str, str]:
        return {
            "TANDEM_TLS_CERT": self.service[0],
            "TANDEM_TLS_KEY": self.service[1],
            "TANDEM_TLS_CA": str(self.ca.path),
            "TANDEM_TLS_CLIENT_AUTH": "1",
        }


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    folder = tmp_path_factory.mktemp("pki")
    ca = Authority.create(folder, "ca")
    other = Authority.create(folder, "other-ca")
    return Pki(
        ca=ca,
        other_ca=other,
        service=ca.issue(folder, "service"),
        client=ca.issue(folder, "client"),
        rogue=other.issue(folder, "rogue"),
    )


# --- TlsSettings ---------------------------------------------------------------------------


def test_nothing_set_means_plaintext():
    tls = TlsSettings.from_env({})
    assert not tls.enabled and not tls.client_auth
    assert TlsSettings.from_env({"TANDEM_TLS_CLIENT_AUTH": "false"}) == tls


def test_a_full_mutual_tls_environment_is_accepted(pki):
    tls = TlsSettings.from_env(pki.env())
    assert tls.enabled and tls.can_serve and tls.client_auth
    assert tls.server_credentials() is not None and tls.channel_credentials() is not None
    client_only = TlsSettings.from_env({"TANDEM_TLS_CA": str(pki.ca.path)})
    assert client_only.enabled and not client_only.can_serve
    with pytest.raises(ValueError, match="a server needs its own certificate"):
        client_only.server_credentials()


@pytest.mark.parametrize(
    "env, message",
    [
        ({"TANDEM_TLS_CERT": "{cert}"}, "TANDEM_TLS_CERT is set but TANDEM_TLS_KEY is not"),
        ({"TANDEM_TLS_KEY": "{key}"}, "TANDEM_TLS_KEY is set but TANDEM_TLS_CERT is not"),
        (
            {"TANDEM_TLS_CERT": "{cert}", "TANDEM_TLS_KEY": "{key}", "TANDEM_TLS_CLIENT_AUTH": "1"},
            "TANDEM_TLS_CLIENT_AUTH needs TANDEM_TLS_CA",
        ),
        (
            {"TANDEM_TLS_CA": "{ca}", "TANDEM_TLS_CLIENT_AUTH": "true"},
            "TANDEM_TLS_CLIENT_AUTH needs TANDEM_TLS_CERT and TANDEM_TLS_KEY",
        ),
        ({"TANDEM_TLS_CA": "{ca}", "TANDEM_TLS_CLIENT_AUTH": "maybe"}, "must be true or false"),
        ({"TANDEM_TLS_CA": "/nonexistent/ca.pem"}, "TANDEM_TLS_CA: cannot read"),
        (
            {"TANDEM_TLS_CERT": "{cert}", "TANDEM_TLS_KEY": "/nonexistent/key.pem"},
            "TANDEM_TLS_KEY: cannot read",
        ),
        ({"TANDEM_TLS_CA": "{garbage}"}, "TANDEM_TLS_CA: .* is not a PEM file"),
        (
            {"TANDEM_TLS_CERT": "{cert}", "TANDEM_TLS_KEY": "{other_key}"},
            "are not a PEM certificate and its unencrypted private key",
        ),
        ({"TANDEM_TLS_CA": "{key}"}, "TANDEM_TLS_CA: .* holds no usable PEM CA certificate"),
        ({"TANDEM_TLS_SERVER_NAME": "localhost"}, "TANDEM_TLS_SERVER_NAME is set but TLS is off"),
    ],
)
def test_inconsistent_settings_raise_naming_the_variable(pki, tmp_path, env, message):
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    paths = {
        "cert": pki.service[0],
        "key": pki.service[1],
        "other_key": pki.rogue[1],
        "ca": str(pki.ca.path),
        "garbage": str(garbage),
    }
    env = {name: value.format(**paths) for name, value in env.items()}
    with pytest.raises(ValueError, match=message):
        TlsSettings.from_env(env)


def test_server_name_override_checks_the_certificate_against_that_name(pki, tmp_path):
    """A certificate issued only for `tandem.internal` fails against 127.0.0.1 unless the
    client checks it against TANDEM_TLS_SERVER_NAME."""
    named = pki.ca.issue(tmp_path, "named", sans=[x509.DNSName("tandem.internal")])
    ca = str(pki.ca.path)
    server = TlsSettings(cert_file=named[0], key_file=named[1], ca_file=ca)

    def check(address: str, tls: TlsSettings) -> str:
        try:
            with open_sync_channel(address, tls) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
            return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.RpcError as exc:
            return exc.code().name

    async def scenario() -> tuple[str, str]:
        host = ServiceHost(["tandem.test.Nothing"], tls=server)
        port = host.bind("127.0.0.1", 0)
        await host.start()
        await host.set_serving(True)
        try:
            address = f"127.0.0.1:{port}"
            plain_name = await asyncio.to_thread(check, address, TlsSettings(ca_file=ca))
            overridden = TlsSettings(ca_file=ca, server_name="tandem.internal")
            return plain_name, await asyncio.to_thread(check, address, overridden)
        finally:
            await host.stop(0)

    assert asyncio.run(scenario()) == ("UNAVAILABLE", "SERVING")


# --- the gateway's API key setting -----------------------------------------------------------


def test_api_key_comes_from_flag_env_or_file_and_stays_out_of_repr(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text(f"  {API_KEY}\n")
    from_env = load_config(GatewayConfig, ["--model", "m"], env={"TANDEM_API_KEY": API_KEY})
    from_flag = load_config(GatewayConfig, ["--model", "m", "--api-key", API_KEY], env={})
    from_file = load_config(
        GatewayConfig, ["--model", "m"], env={"TANDEM_API_KEY_FILE": str(key_file)}
    )
    for config in (from_env, from_flag, from_file):
        assert config.resolved_api_key == API_KEY
        assert API_KEY not in repr(config)
    assert load_config(GatewayConfig, ["--model", "m"], env={}).resolved_api_key == ""


@pytest.mark.parametrize(
    "argv, file_text, message",
    [
        (["--api-key", "k", "--api-key-file", "{file}"], "k", "api_key or api_key_file, not both"),
        (["--api-key-file", "/nonexistent/key"], None, "api_key_file: cannot read"),
        (["--api-key-file", "{file}"], "  \n", "api_key_file: .* is empty"),
        (["--api-key", "two words"], None, "api_key must be printable ASCII without spaces"),
        (["--api-key", "clé"], None, "api_key must be printable ASCII"),
        (["--api-key", "k" * 4097], None, "api_key must be at most 4096 characters"),
    ],
)
def test_bad_api_key_settings_raise_naming_the_setting(tmp_path, argv, file_text, message):
    key_file = tmp_path / "key"
    if file_text is not None:
        key_file.write_text(file_text)
    argv = ["--model", "m", *(a.format(file=key_file) for a in argv)]
    with pytest.raises(ValueError, match=message):
        load_config(GatewayConfig, argv, env={})


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


def check_health(address: str, tls: TlsSettings) -> str:
    """The Health status over `tls`, or the gRPC status code's name when the call fails."""
    try:
        with open_sync_channel(address, tls) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError as exc:
        return exc.code().name


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
