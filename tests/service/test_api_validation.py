"""Every limit in docs/api.md's validation table, sent to the real gateway: each bad request
fails with INVALID_ARGUMENT and a message naming the field and the limit, nothing reaches
the scheduler, and the service keeps serving exact outputs. The table and these cases are
checked against each other, so neither can drift."""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format

from common.pb.tandem.v1 import generate_pb2, generate_pb2_grpc
from services.gateway.prompts import PromptTokenizer
from services.gateway.validation import InvalidArgumentError
from tests.hf_reference import hf_greedy, hf_tokenizer
from tests.stack_client import generate, greedy_request, pool_stats, wait_until_idle

ROOT = Path(__file__).resolve().parents[2]
BIG = 4 * 1024 * 1024 + 1

# (request as a dict for json_format, text the error message must contain). The tiny
# checkpoint: vocabulary 1024, max_model_len 512.
GENERATE_CASES = [
    ({}, "prompt is required"),
    ({"text": ""}, "prompt.text must not be empty"),
    ({"text": "x" * BIG}, "prompt.text must be at most 4194304 bytes, got 4194305"),
    ({"token_ids": {"ids": []}}, "prompt.token_ids.ids must not be empty"),
    ({"token_ids": {"ids": [1, -1]}}, "prompt.token_ids.ids[1]=-1 is outside the vocabulary"),
    ({"token_ids": {"ids": [5, 10**6]}}, "[1]=1000000 is outside the vocabulary [0, 1024)"),
    ({"chat": {}}, "prompt.chat.messages must hold 1..1024 messages, got 0"),
    (
        {"chat": {"messages": [{"role": "user", "content": "hi"}] * 1025}},
        "prompt.chat.messages must hold 1..1024 messages, got 1025",
    ),
    (
        {"chat": {"messages": [{"role": "robot", "content": "hi"}]}},
        "prompt.chat.messages[0].role must be one of system, user, assistant, tool, got 'robot'",
    ),
    (
        {"chat": {"messages": [{"role": "user", "content": "x" * BIG}]}},
        "prompt.chat content must be at most 4194304 bytes in all",
    ),
    ({"text": "hi", "max_tokens": 0}, "max_tokens must be >= 1, got 0"),
    ({"text": "hi", "max_tokens": -5}, "max_tokens must be >= 1, got -5"),
    (
        {"token_ids": {"ids": list(range(500))}, "max_tokens": 13},
        "prompt (500 tokens) + max_tokens (13) must not exceed the context length of 512",
    ),
    (
        {"token_ids": {"ids": [7] * 512}},
        "prompt (512 tokens) leaves no room in the context length of 512 tokens",
    ),
    (
        {"text": "hi", "sampling": {"temperature": -1}},
        "sampling.temperature must be a finite number in [0, 100], got -1",
    ),
    ({"text": "hi", "sampling": {"temperature": "NaN"}}, "sampling.temperature must be a finite"),
    (
        {"text": "hi", "sampling": {"top_p": "Infinity"}},
        "sampling.top_p must be in (0, 1], got inf",
    ),
    (
        {"text": "hi", "sampling": {"temperature": 101}},
        "sampling.temperature must be a finite number in [0, 100], got 101",
    ),
    ({"text": "hi", "sampling": {"top_p": 0}}, "sampling.top_p must be in (0, 1], got 0"),
    ({"text": "hi", "sampling": {"top_p": 1.5}}, "sampling.top_p must be in (0, 1], got 1.5"),
    ({"text": "hi", "sampling": {"top_k": -2}}, "sampling.top_k must be >= -1"),
    (
        {"text": "hi", "sampling": {"min_p": 1.5}},
        "sampling.min_p must be a finite number in [0, 1]",
    ),
    (
        {"text": "hi", "sampling": {"repetition_penalty": 11}},
        "sampling.repetition_penalty must be in (0, 10] (1 = off), got 11",
    ),
    (
        {"text": "hi", "sampling": {"repetition_penalty": -1}},
        "sampling.repetition_penalty must be in (0, 10]",
    ),
    (
        {"text": "hi", "sampling": {"presence_penalty": 2.5}},
        "sampling.presence_penalty must be a finite number in [-2, 2], got 2.5",
    ),
    (
        {"text": "hi", "sampling": {"frequency_penalty": -3}},
        "sampling.frequency_penalty must be a finite number in [-2, 2], got -3",
    ),
    (
        {"text": "hi", "sampling": {"logit_bias": {str(i): 1.0 for i in range(301)}}},
        "sampling.logit_bias must have at most 300 entries, got 301",
    ),
    (
        {"text": "hi", "sampling": {"logit_bias": {"1024": 1.0}}},
        "sampling.logit_bias key 1024 is outside the vocabulary [0, 1024)",
    ),
    (
        {"text": "hi", "sampling": {"logit_bias": {"5": 150.0}}},
        "sampling.logit_bias[5] must be a finite number in [-100, 100], got 150",
    ),
    ({"text": "hi", "n": 0}, "n must be in [1, 16], got 0"),
    ({"text": "hi", "n": 17}, "n must be in [1, 16], got 17"),
    ({"text": "hi", "logprobs": 21}, "logprobs must be in [0, 20], got 21"),
    ({"text": "hi", "logprobs": -1}, "logprobs must be in [0, 20], got -1"),
    ({"text": "hi", "prompt_logprobs": 50}, "prompt_logprobs must be in [0, 20], got 50"),
    (
        {"text": "hi", "stopping": {"stop": ["a"] * 17}},
        "stopping.stop must have at most 16 strings, got 17",
    ),
    (
        {"text": "hi", "stopping": {"stop": ["ok", ""]}},
        "stopping.stop[1] must be 1..256 characters, got 0",
    ),
    (
        {"text": "hi", "stopping": {"stop": ["y" * 257]}},
        "stopping.stop[0] must be 1..256 characters, got 257",
    ),
    (
        {"text": "hi", "stopping": {"stop_token_ids": list(range(65))}},
        "stopping.stop_token_ids must have at most 64 ids, got 65",
    ),
    (
        {"text": "hi", "stopping": {"stop_token_ids": [4096]}},
        "stopping.stop_token_ids[0]=4096 is outside the vocabulary [0, 1024)",
    ),
    (
        {"text": "hi", "max_tokens": 4, "stopping": {"min_tokens": 5}},
        "stopping.min_tokens must be in [0, max_tokens=4], got 5",
    ),
    ({"text": "hi", "cache_salt": "s" * 257}, "cache_salt must be at most 256 bytes, got 257"),
]

TOKENIZE_CASES = [
    ({}, "input is required: set text or chat"),
    ({"text": "x" * BIG}, "text must be at most 4194304 bytes"),
    (
        {"chat": {"messages": [{"role": "narrator", "content": "x"}]}},
        "chat.messages[0].role must be one of system, user, assistant, tool",
    ),
]
DETOKENIZE_CASES = [
    ({"token_ids": [2000, 3]}, "token_ids[0]=2000 is outside the vocabulary [0, 1024)"),
    ({"token_ids": [0] * (2**20 + 1)}, "token_ids must hold at most 1048576 ids, got 1048577"),
]
# Raw bytes that are not a GenerateRequest: a text field holding invalid UTF-8, and a
# length prefix that runs past the end of the message.
MALFORMED = [b"\x0a\x03\xff\xfe\x41", b"\x0a\x05ab"]
MALFORMED_MESSAGE = "the request is not a valid protobuf message"
# Rows that need a model without a chat template or with one that raises: unit-tested here.
UNIT_MESSAGES = ["needs a chat template", "the model's chat template rejected the messages"]


def parse(message_type, fields: dict):
    return json_format.ParseDict(fields, message_type())


def call_error(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        fn()
    return caught.value


@pytest.fixture(scope="module")
def stub(api_stack):
    with grpc.insecure_channel(api_stack.spec.gateway_address) as channel:
        yield generate_pb2_grpc.GenerateServiceStub(channel)


@pytest.mark.parametrize("fields, message", GENERATE_CASES, ids=lambda x: str(x)[:60])
def test_bad_generate_field_is_invalid_argument_naming_field_and_limit(stub, fields, message):
    error = call_error(lambda: list(stub.Generate(parse(generate_pb2.GenerateRequest, fields))))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (fields, error)
    assert message in error.details(), (fields, error.details())


def test_bad_tokenize_and_detokenize_fields(stub):
    for fields, message in TOKENIZE_CASES:
        error = call_error(lambda f=fields: stub.Tokenize(parse(generate_pb2.TokenizeRequest, f)))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in error.details(), error.details()
    for fields, message in DETOKENIZE_CASES:
        request = generate_pb2.DetokenizeRequest(token_ids=fields["token_ids"])
        error = call_error(lambda r=request: stub.Detokenize(r))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in error.details(), error.details()


def test_unparseable_messages_are_invalid_argument_not_unknown(api_stack):
    with grpc.insecure_channel(api_stack.spec.gateway_address) as channel:
        raw = channel.unary_stream(
            "/tandem.v1.GenerateService/Generate",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        for payload in MALFORMED:
            error = call_error(lambda p=payload: list(raw(p, timeout=10)))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert MALFORMED_MESSAGE in error.details()
            assert "tandem.v1.GenerateRequest" in error.details()


def test_chat_without_a_template_or_with_one_that_raises(tiny_llama_dir):
    tokenizer = hf_tokenizer(str(tiny_llama_dir))
    messages = [{"role": "user", "content": "hi"}]
    saved = tokenizer.chat_template
    try:
        tokenizer.chat_template = None
        with pytest.raises(InvalidArgumentError, match=UNIT_MESSAGES[0]):
            PromptTokenizer(tokenizer).render_chat(messages, True, "prompt.chat")
        tokenizer.chat_template = "{{ raise_exception('only one user turn, please') }}"
        with pytest.raises(InvalidArgumentError) as caught:
            PromptTokenizer(tokenizer).render_chat(messages, True, "prompt.chat")
        assert UNIT_MESSAGES[1] in str(caught.value)
        assert "only one user turn, please" in str(caught.value)
    finally:
        tokenizer.chat_template = saved


def test_bad_requests_never_reach_the_scheduler_and_service_keeps_serving(
    api_stack, stub, tiny_llama_dir
):
    before = pool_stats(api_stack)
    for fields, _ in GENERATE_CASES[:12]:
        call_error(lambda f=fields: list(stub.Generate(parse(generate_pb2.GenerateRequest, f))))
    after = wait_until_idle(api_stack)
    assert [p.steps for p in after.pools] == [p.steps for p in before.pools]
    got = generate(api_stack.spec.gateway_address, greedy_request("Once upon a time", 8))
    prompt = hf_tokenizer(str(tiny_llama_dir)).encode("Once upon a time")
    assert got.token_ids == hf_greedy(tiny_llama_dir, prompt, 8)


def documented_messages(table_name: str = "validation-table") -> list[str]:
    """The error texts of one of docs/api.md's marked tables (the main one by default)."""
    text = (ROOT / "docs/api.md").read_text()
    table = text.split(f"<!-- {table_name} -->")[1].split(f"<!-- /{table_name} -->")[0]
    rows = [line for line in table.splitlines() if line.startswith("|")][2:]
    messages = []
    for row in rows:
        quoted = re.findall(r"`([^`]+)`", row.rsplit("|", 2)[1])
        assert len(quoted) == 1, row
        messages.append(quoted[0])
    return messages


def test_docs_table_and_tested_cases_agree():
    tested = (
        [m for _, m in GENERATE_CASES]
        + [m for _, m in TOKENIZE_CASES]
        + [m for _, m in DETOKENIZE_CASES]
        + [MALFORMED_MESSAGE]
        + UNIT_MESSAGES
    )
    documented = documented_messages()
    assert len(documented) >= 35
    for row in documented:
        assert any(row in message for message in tested), f"docs row not tested: {row!r}"
    for message in tested:
        assert any(row in message or message in row for row in documented), (
            f"tested but not documented: {message}"
        )
