"""The HTTP front's bounds on hostile clients (docs/openai_api.md, "Limits"), against a real
front in front of the shared stack's gateway, started with short timeouts:

- JSON nested deeper than 128 levels is a 400 naming the limit (never a RecursionError 500),
  on every route that reads a body;
- a client that disconnects in the middle of its body is logged at info, without a trace;
- a connection that does not finish its headers in time gets 408 and is closed, and so does
  a request whose body does not arrive in time; connections past `--max-connections` are
  closed on accept; ordinary requests are served all along;
- a request head over 64 KiB gets 431 (the gRPC API's metadata limit)."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.service.api_fuzz.checks import new_log_errors
from tests.stack_client import http_front

ROOT = Path(__file__).resolve().parents[2]
HEADER_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 24
LORA_BODY_LIMIT = 64 * 1024
DEPTH_ERROR = "request body nests deeper than 128 levels of arrays/objects"


@pytest.fixture(scope="module")
def front(api_stack, tmp_path_factory):
    """`python -m services.openai_api` with short limits, in front of the shared stack."""
    log_path = tmp_path_factory.mktemp("http-limits") / "http.log"
    limits = ["--header-timeout-s", str(HEADER_TIMEOUT_S), "--body-timeout-s",
              str(BODY_TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS)]  # fmt: skip
    with http_front(api_stack.spec.gateway_address, log_path, *limits) as (address, _):
        host, port = address.rsplit(":", 1)
        yield (host, int(port)), log_path


def request(address, method: str, path: str, body: bytes | None = None, headers=None):
    """(status, parsed JSON body or None); (0, None) when the connection fails."""
    url = f"http://{address[0]}:{address[1]}{path}"
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as reply:
            return reply.status, json.loads(reply.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")
    except OSError:
        return 0, None


def models_ok(address) -> bool:
    status, body = request(address, "GET", "/v1/models")
    return status == 200 and body["data"][0]["id"] == "tiny-llama"


def open_socket(address) -> socket.socket:
    sock = socket.create_connection(address, timeout=30)
    sock.settimeout(30)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:  # closed with a reset (an abort): nothing more comes
        pass
    return data


DEEP_BODIES = {
    "one million levels": b"[" * 10**6 + b"]" * 10**6,
    "100k levels inside a field": b'{"model": "tiny-llama", "prompt": '
    + b"[" * 10**5
    + b"1"
    + b"]" * 10**5
    + b"}",
    "10k levels inside a field": b'{"lora_name": "a", "lora_path": '
    + b"[" * 10**4
    + b"]" * 10**4
    + b"}",
    "129 levels": b'{"model": "tiny-llama", "x": ' + b"[" * 128 + b"]" * 128 + b"}",
}


BODY_ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/load_lora_adapter"]


@pytest.mark.parametrize("path", BODY_ROUTES)
@pytest.mark.parametrize("what", list(DEEP_BODIES))
def test_deeply_nested_json_is_a_400_naming_the_limit(front, path, what):
    address, log_path = front
    data = DEEP_BODIES[what]
    status, body = request(address, "POST", path, data)
    if path == "/v1/load_lora_adapter" and len(data) > LORA_BODY_LIMIT:
        assert status == 413, body  # that route's size limit comes first
        return
    assert status == 400, body
    assert body["error"]["message"] == DEPTH_ERROR
    assert body["error"]["type"] == "invalid_request_error"


def test_json_at_the_depth_limit_is_parsed(front):
    """128 levels pass the guard: the request then fails on its fields, not its depth."""
    address, _ = front
    body = b'{"model": "tiny-llama", "prompt": ' + b"[" * 127 + b"]" * 127 + b"}"
    status, reply = request(address, "POST", "/v1/completions", body)
    assert status == 400 and "nests deeper" not in reply["error"]["message"], reply


def test_a_client_gone_mid_body_is_logged_at_info_without_a_trace(front):
    address, log_path = front
    marks = {log_path: log_path.stat().st_size}
    sock = open_socket(address)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 1000\r\n\r\n" + b'{"model": "tiny-llama", '
    )
    time.sleep(0.3)
    sock.close()
    deadline = time.monotonic() + 10
    while "client_disconnected" not in log_path.read_text(errors="replace")[marks[log_path] :]:
        assert time.monotonic() < deadline, "the disconnect was not logged"
        time.sleep(0.1)
    new_lines = log_path.read_text(errors="replace")[marks[log_path] :]
    assert '"level": "info"' in next(
        line for line in new_lines.splitlines() if "client_disconnected" in line
    )
    assert not new_log_errors(marks), new_log_errors(marks)
    assert models_ok(address)


def test_headers_and_bodies_that_do_not_arrive_in_time_are_cut_off(front):
    address, log_path = front
    marks = {log_path: log_path.stat().st_size}
    half_headers = [open_socket(address) for _ in range(10)]
    for sock in half_headers:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-slow: ")
    silent = open_socket(address)  # connects, sends nothing
    half_body = open_socket(address)
    half_body.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{")
    began = time.monotonic()
    assert models_ok(address)  # ordinary requests are served meanwhile
    for sock in [*half_headers, silent]:
        reply = read_all(sock)
        assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
        assert b"request headers not received in time" in reply
    body_reply = read_all(half_body)
    assert body_reply.startswith(b"HTTP/1.1 408 "), body_reply[:200]
    assert b"request body not received within 2 s" in body_reply
    waited = time.monotonic() - began
    assert HEADER_TIMEOUT_S - 0.5 < waited < HEADER_TIMEOUT_S + 20, waited
    for sock in [*half_headers, silent, half_body]:
        sock.close()
    assert not new_log_errors(marks), new_log_errors(marks)
    assert models_ok(address)


def test_connections_past_the_limit_are_closed_on_accept(front):
    address, _ = front
    held = [open_socket(address) for _ in range(MAX_CONNECTIONS)]
    try:
        extra = open_socket(address)
        assert read_all(extra) == b"", "a connection past the limit was kept"
        extra.close()
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    while not models_ok(address):  # the closed ones free their places
        assert time.monotonic() < deadline
        time.sleep(0.1)


@pytest.mark.parametrize("size", [20 * 1024, 100 * 1024])
def test_a_request_head_over_64_kib_gets_431(front, size):
    address, _ = front
    status, body = request(
        address, "GET", "/v1/models", headers={"Authorization": "Bearer " + "k" * size}
    )
    if size < 64 * 1024:
        assert status == 200, body  # no API key on this stack: credentials are not checked
    else:
        assert status == 431, body
        assert body["error"]["message"] == "request headers are larger than 65536 bytes"
