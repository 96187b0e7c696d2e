"""Fuzzed JSON bodies for the OpenAI HTTP front's /v1/completions and /v1/chat/completions:
200 or an OpenAI-shaped 4xx, never a 5xx, and the stack unharmed afterwards."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.service.api_fuzz.checks import (
    Tally,
    assert_stack_unharmed,
    new_log_errors,
    report,
)
from tests.service.api_fuzz.request_strategies import (
    DEADLINE_S,
    FUZZ,
    MAX_LEN,
    ROLES,
    VOCAB,
    any_char,
    any_id,
)
from tests.stack_client import http_front

# ---------------------------------------------------------------------------------------
# 4. The OpenAI HTTP front

HTTP_TALLY = Tally()
MODEL = "tiny-llama"
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def http_address(api_stack, tmp_path_factory):
    """`python -m services.openai_api` in front of the shared stack's gateway."""
    log_path = tmp_path_factory.mktemp("fuzz-http") / "http.log"
    with http_front(api_stack.spec.gateway_address, log_path) as (address, process):
        yield address, process, log_path


json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=8),
)
junk_json = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
json_numbers = st.one_of(
    st.sampled_from([0, 1, -1, 0.5, 2, 100, 1e-300, 1e300, 2**31, -(2**63), 2**64]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.integers(-(2**65), 2**65),
)
json_small_ints = st.one_of(st.integers(1, 4), st.sampled_from([0, -1, 2**31, 2**63, 10**6]))
http_prompts = st.one_of(
    st.text(any_char, max_size=30),
    st.sampled_from(["", "</s>", "\x00", "🚀" * 10]),
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10),
    st.lists(any_id, max_size=5),
    st.lists(st.text(max_size=10), min_size=1, max_size=3),
    st.lists(st.lists(st.integers(-2, VOCAB + 2), max_size=5), min_size=1, max_size=3),
    junk_json,
)
text_parts = st.lists(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)}), max_size=2
)
odd_parts = st.lists(
    st.fixed_dictionaries({"type": st.sampled_from(["image_url", "text", 3])}), max_size=2
)
http_message = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from([*ROLES, "developer", "robot", ""]), junk_json)},
    optional={
        "content": st.one_of(st.text(any_char, max_size=30), text_parts, odd_parts, junk_json),
        "name": st.text(max_size=4),
    },
)
http_messages = st.one_of(st.lists(http_message, max_size=4), junk_json)
COMMON_FIELDS = {
    "model": st.one_of(st.just(MODEL), st.none(), st.text(max_size=8), junk_json),
    "temperature": json_numbers,
    "top_p": json_numbers,
    "top_k": st.one_of(st.sampled_from([-1, 0, 1, 50, -2]), junk_json),
    "min_p": json_numbers,
    "repetition_penalty": json_numbers,
    "presence_penalty": json_numbers,
    "frequency_penalty": json_numbers,
    "seed": st.one_of(st.integers(-1, 2**64), junk_json),
    "logit_bias": st.one_of(
        st.dictionaries(st.integers(-5, VOCAB + 5).map(str), json_numbers, max_size=3),
        st.dictionaries(st.text(max_size=4), junk_json, max_size=2),
        junk_json,
    ),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3), junk_json),
    "stop_token_ids": st.one_of(st.lists(st.integers(-2, VOCAB + 2), max_size=3), junk_json),
    "ignore_eos": st.one_of(st.booleans(), junk_json),
    "include_stop_str_in_output": st.booleans(),
    "min_tokens": st.one_of(st.integers(-1, 6), junk_json),
    "skip_special_tokens": st.one_of(st.booleans(), junk_json),
    "n": st.one_of(st.sampled_from([1, 2, 0, 17, -1]), junk_json),
    "best_of": st.sampled_from([1, 2, 3]),
    "use_beam_search": st.booleans(),
    "cache_salt": st.one_of(st.text(max_size=8), st.just("s" * 300), junk_json),
    "user": st.one_of(st.text(max_size=4), junk_json),
    "prompt_logprobs": st.one_of(st.sampled_from([0, 1, 21, -1]), junk_json),
    "stream": st.one_of(st.booleans(), junk_json),
    "stream_options": st.one_of(
        st.fixed_dictionaries({}, optional={"include_usage": st.booleans(), "x": st.just(1)}),
        junk_json,
    ),
    "unknown_field": junk_json,
}
COMPLETION_FIELDS = {
    **COMMON_FIELDS,
    "max_tokens": st.one_of(json_small_ints, st.none(), junk_json),
    "logprobs": st.one_of(st.sampled_from([0, 2, 5, 21, -1]), junk_json),
    "echo": st.one_of(st.booleans(), junk_json),
    "suffix": st.text(max_size=3),
}
CHAT_FIELDS = {
    **COMMON_FIELDS,
    "max_tokens": st.one_of(json_small_ints, junk_json),
    "max_completion_tokens": st.one_of(json_small_ints, junk_json),
    "logprobs": st.one_of(st.booleans(), junk_json),
    "top_logprobs": st.one_of(st.sampled_from([0, 2, 20, 21, -1]), junk_json),
    "add_generation_prompt": st.booleans(),
    "tools": st.one_of(st.just([]), st.just([{"type": "function"}]), junk_json),
    "tool_choice": st.sampled_from(["none", "auto", None]),
    "response_format": st.one_of(
        st.just({"type": "text"}), st.just({"type": "json_object"}), junk_json
    ),
}


def subset_of(fields: dict) -> st.SearchStrategy:
    """A few of the fields (each body sets about three)."""
    keys = st.lists(st.sampled_from(sorted(fields)), max_size=5, unique=True)
    return keys.flatmap(lambda ks: st.fixed_dictionaries({k: fields[k] for k in ks}))


def keep_short(path: str, body):
    """Cap generation lengths (the point is the parsing, not long generations)."""
    if not isinstance(body, dict):
        return body
    keys = ("max_tokens",) if path == "/v1/completions" else ("max_tokens", "max_completion_tokens")
    for key in keys:
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 4 < value <= MAX_LEN:
            body[key] = 4
    if path == "/v1/completions" and "max_tokens" in body and body["max_tokens"] is None:
        body["max_tokens"] = 4  # null: until the context ends
    if path != "/v1/completions" and all(body.get(k) is None for k in keys):
        body["max_completion_tokens"] = 4  # unset: until the context ends
    return body


@st.composite
def http_bodies(draw) -> tuple[str, bytes]:
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    shape = draw(st.sampled_from(["fields"] * 6 + ["junk", "bytes", "broken", "deep"]))
    if shape == "deep":  # nesting past the 128-level limit, somewhere in the body (issue 19)
        depth = draw(st.integers(129, 200_000))
        opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
        inner = opener * depth + "1" + closer * depth
        where = draw(st.sampled_from(["body", "prompt", "messages", "unknown field"]))
        key = {"body": None, "unknown field": "x"}.get(where, where)
        return path, (inner if key is None else json.dumps({key: 0})[:-2] + inner + "}").encode()
    if shape == "junk":
        return path, json.dumps(keep_short(path, draw(junk_json))).encode()
    if shape == "bytes":
        return path, draw(st.binary(max_size=64))
    if path == "/v1/completions":
        body = {"prompt": draw(http_prompts), **draw(subset_of(COMPLETION_FIELDS))}
    else:
        body = {"messages": draw(http_messages), **draw(subset_of(CHAT_FIELDS))}
    if draw(st.booleans()):  # a well-formed prompt, so the rest gets to the gateway
        body["prompt" if path == "/v1/completions" else "messages"] = (
            "Hello" if path == "/v1/completions" else [{"role": "user", "content": "Hi"}]
        )
    data = json.dumps(keep_short(path, body)).encode()
    if shape == "broken":
        cut = draw(st.integers(0, len(data)))
        data = data[:cut] + draw(st.sampled_from([b"", b"NaN", b"}", b"\xff", b"Infinity"]))
    return path, data


def post(address: str, path: str, body: bytes) -> tuple[int, str, bytes]:
    request = urllib.request.Request(
        f"http://{address}{path}", data=body, method="POST",
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=DEADLINE_S) as reply:
            return reply.status, reply.headers.get("content-type", ""), reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("content-type", ""), exc.read()


def check_http(status: int, content_type: str, data: bytes, tally: Tally) -> None:
    assert status == 200 or 400 <= status < 500, (status, data[:500])
    if status != 200:
        error = json.loads(data)["error"]
        assert set(error) == ERROR_KEYS and isinstance(error["message"], str), error
        assert error["message"] and isinstance(error["type"], str), error
        tally.add(f"http {status}", error.get("param") or error.get("code"))
        return
    if content_type.startswith("text/event-stream"):
        events = [line[6:] for line in data.decode().split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        for event in events[:-1]:
            assert "error" not in json.loads(event), event
    else:
        assert json.loads(data)["choices"], data[:500]
    tally.add("http 200")


@settings(max_examples=160, **FUZZ)
@given(case=http_bodies())
def test_fuzzed_http_bodies_get_200_or_an_openai_shaped_4xx(http_address, case):
    address, process, log_path = http_address
    path, body = case
    status, content_type, data = post(address, path, body)
    check_http(status, content_type, data, HTTP_TALLY)


def test_http_fuzz_left_the_stack_unharmed(
    http_address, api_stack, tiny_llama_dir, log_marks, capsys
):
    address, process, log_path = http_address
    # A body over the 8 MiB limit is refused whole, without reaching the gateway.
    status, _, data = post(address, "/v1/completions", b'{"prompt": "' + b"x" * (9 << 20) + b'"}')
    assert status == 413 and json.loads(data)["error"]["type"] == "invalid_request_error"
    HTTP_TALLY.add(f"http {status}")
    report(capsys, HTTP_TALLY.line("HTTP /v1/completions + /v1/chat/completions"))
    assert process.poll() is None, "the HTTP front exited"
    assert not new_log_errors({log_path: 0}), "\n".join(new_log_errors({log_path: 0})[:20])
    assert_stack_unharmed(api_stack, tiny_llama_dir, log_marks)
