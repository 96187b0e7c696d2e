"""Wire-level and oversize fuzzing of the public gRPC API: random and mutated bytes, messages
around the receive limit, and large prompts that must not stall the gateway."""

from __future__ import annotations

import threading
import time

import grpc
from hypothesis import given, settings
from hypothesis import strategies as st

from common.config import parse_size
from common.pb.tandem.v1 import generate_pb2
from services.gateway.config import GatewayConfig
from tests.service.api_fuzz.checks import (
    Tally,
    assert_stack_unharmed,
    call_stream,
    call_unary,
    check_documented,
    check_generate_outcome,
    report,
)
from tests.service.api_fuzz.request_strategies import (
    DEADLINE_S,
    FUZZ,
    MALFORMED,
    ROLES,
    UINT64,
    VOCAB,
    any_char,
    error_field,
)

# ---------------------------------------------------------------------------------------
# 2. Wire-level fuzzing

WIRE_TALLY = Tally()
# max_tokens = 2 (field 4, varint): appended to a payload that parses, it keeps the
# generation short whatever the rest holds (the last value of a scalar field wins).
SHORT_GENERATION = b"\x20\x02"


@st.composite
def wire_payloads(draw, base_requests: st.SearchStrategy) -> bytes:
    kind = draw(st.sampled_from(["random", "truncate", "flip", "insert", "delete", "concat"]))
    if kind == "random":
        return draw(st.binary(max_size=200))
    base = draw(base_requests).SerializeToString()
    at = draw(st.integers(0, len(base)))
    if kind == "truncate":
        return base[:at]
    if kind == "flip":
        if not base:
            return base
        at = min(at, len(base) - 1)
        return base[:at] + bytes([draw(st.integers(0, 255))]) + base[at + 1 :]
    if kind == "insert":
        return base[:at] + draw(st.binary(min_size=1, max_size=12)) + base[at:]
    if kind == "delete":
        return base[:at] + base[at + draw(st.integers(1, 8)) :]
    return base + draw(base_requests).SerializeToString()  # concatenation = merge


def parses(message_type, data: bytes):
    try:
        return message_type.FromString(data)
    except Exception:
        return None


# Small valid requests with every field set, to mutate.
@st.composite
def small_generate_requests(draw) -> generate_pb2.GenerateRequest:
    r = generate_pb2.GenerateRequest(max_tokens=draw(st.integers(1, 3)))
    kind = draw(st.sampled_from(["text", "token_ids", "chat"]))
    if kind == "text":
        r.text = draw(st.text(any_char, min_size=1, max_size=12))
    elif kind == "token_ids":
        r.token_ids.ids.extend(draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)))
    else:
        r.chat.messages.add(role=draw(st.sampled_from(ROLES)), content=draw(st.text(max_size=8)))
        r.chat.add_generation_prompt = draw(st.booleans())
    r.sampling.CopyFrom(
        generate_pb2.SamplingParams(
            temperature=0.7, top_p=0.9, top_k=20, min_p=0.01, repetition_penalty=1.1,
            presence_penalty=0.1, frequency_penalty=0.1, logit_bias={5: 1.5, 9: -2.0},
            seed=draw(st.integers(*UINT64)),
        )
    )  # fmt: skip
    r.stopping.CopyFrom(
        generate_pb2.StoppingParams(
            stop=["xyz"], include_stop_str_in_output=True, stop_token_ids=[3, 4],
            ignore_eos=True, min_tokens=1, skip_special_tokens=False,
        )
    )  # fmt: skip
    r.n, r.logprobs, r.prompt_logprobs = draw(st.integers(1, 2)), 2, 1
    r.cache_salt = "tenant-ä"
    return r


@settings(max_examples=200, **FUZZ)
@given(payload=wire_payloads(small_generate_requests()))
def test_mutated_generate_bytes_end_ok_or_invalid_argument(channel, documented, payload):
    request = parses(generate_pb2.GenerateRequest, payload)
    if request is not None and (not request.HasField("max_tokens") or request.max_tokens > 8):
        payload += SHORT_GENERATION
        request = generate_pb2.GenerateRequest.FromString(payload)
    raw = channel.unary_stream(
        "/tandem.v1.GenerateService/Generate",
        request_serializer=lambda b: b,
        response_deserializer=generate_pb2.GenerateResponse.FromString,
    )
    code, details, messages, _ = call_stream(raw, payload)
    if request is None:  # does not parse here, so must not parse on the server either
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details, payload)
        assert MALFORMED in details and "tandem.v1.GenerateRequest" in details, details
        WIRE_TALLY.add("malformed")
        return
    assert MALFORMED not in details, (details, payload)
    check_generate_outcome(request, code, details, messages, documented, WIRE_TALLY)


UNARY_METHODS = {
    "Tokenize": (generate_pb2.TokenizeRequest, generate_pb2.TokenizeResponse),
    "Detokenize": (generate_pb2.DetokenizeRequest, generate_pb2.DetokenizeResponse),
}
small_unary_requests = st.one_of(
    st.builds(
        generate_pb2.TokenizeRequest, text=st.text(max_size=10), add_special_tokens=st.booleans()
    ),
    st.builds(
        generate_pb2.DetokenizeRequest,
        token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=6),
        skip_special_tokens=st.booleans(),
    ),
)


@settings(max_examples=100, **FUZZ)
@given(method=st.sampled_from(sorted(UNARY_METHODS)), payload=wire_payloads(small_unary_requests))
def test_mutated_tokenize_and_detokenize_bytes_end_ok_or_invalid_argument(
    channel, documented, method, payload
):
    request_type, response_type = UNARY_METHODS[method]
    raw = channel.unary_unary(
        f"/tandem.v1.GenerateService/{method}",
        request_serializer=lambda b: b,
        response_deserializer=response_type.FromString,
    )
    code, details, _ = call_unary(raw, payload)
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), (code, details)
    parsed = parses(request_type, payload)
    if parsed is None:
        assert code == grpc.StatusCode.INVALID_ARGUMENT and MALFORMED in details, details
        assert f"tandem.v1.{method}Request" in details, details
        WIRE_TALLY.add("malformed")
    elif code == grpc.StatusCode.INVALID_ARGUMENT:
        check_documented(details, documented)
        WIRE_TALLY.add("invalid", error_field(details))
    else:
        WIRE_TALLY.add("ok")


def test_wire_fuzz_left_the_stack_unharmed(api_stack, tiny_llama_dir, log_marks, capsys):
    report(capsys, WIRE_TALLY.line("wire bytes (Generate, Tokenize, Detokenize)"))
    assert_stack_unharmed(api_stack, tiny_llama_dir, log_marks)


# ---------------------------------------------------------------------------------------
# 3. Oversize messages


# The public gateway's request cap (--max-request-bytes; internal hops allow more).
MAX_MESSAGE_BYTES = parse_size(GatewayConfig.__dataclass_fields__["max_request_bytes"].default)


def text_payload(size: int) -> bytes:
    """A GenerateRequest / TokenizeRequest (field 1: text) of exactly `size` bytes of text."""
    length, varint = size, bytearray()
    while True:
        byte, length = length & 0x7F, length >> 7
        varint.append(byte | (0x80 if length else 0))
        if not length:
            break
    return b"\x0a" + bytes(varint) + b"x" * size


def test_messages_over_the_receive_limit_are_resource_exhausted(
    api_stack, channel, tiny_llama_dir, log_marks, capsys
):
    generate_raw = channel.unary_stream(
        "/tandem.v1.GenerateService/Generate",
        request_serializer=lambda b: b,
        response_deserializer=generate_pb2.GenerateResponse.FromString,
    )
    tokenize_raw = channel.unary_unary(
        "/tandem.v1.GenerateService/Tokenize",
        request_serializer=lambda b: b,
        response_deserializer=generate_pb2.TokenizeResponse.FromString,
    )
    # Just under the limit: it arrives, and fails validation (the text is over 4 MiB).
    under = text_payload(MAX_MESSAGE_BYTES - 16)
    assert len(under) < MAX_MESSAGE_BYTES
    code, details, _, _ = call_stream(generate_raw, under)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert "prompt.text must be at most 4194304 bytes" in details
    # Over it: refused by grpc on receipt (the server's message, not the client's).
    over = text_payload(MAX_MESSAGE_BYTES + 1024)
    code, details, _, elapsed = call_stream(generate_raw, over)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
    assert "Received message larger than max" in details, details
    code, details, _ = call_unary(tokenize_raw, over)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details, details
    report(capsys, f"fuzz oversize: 3 requests of ~16 MiB (1 invalid, 2 exhausted, {elapsed:.1f}s)")
    assert_stack_unharmed(api_stack, tiny_llama_dir, log_marks)


# A prompt of this many bytes takes the tokenizer a second or more.
LARGE_PROMPT = "hello world " * 120_000


def worst_latency_during(stub, request) -> tuple[float, grpc.StatusCode]:
    """The slowest GetModelInfo answer while `request` (a large prompt) is being handled."""
    outcome = []
    worker = threading.Thread(target=lambda: outcome.append(call_stream(stub.Generate, request)))
    worker.start()
    worst = 0.0
    while worker.is_alive():
        start = time.monotonic()
        stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=DEADLINE_S)
        worst = max(worst, time.monotonic() - start)
        time.sleep(0.02)
    worker.join()
    return worst, outcome[0][0]


def test_a_large_text_prompt_does_not_stall_the_gateway(stub):
    request = generate_pb2.GenerateRequest(text=LARGE_PROMPT, max_tokens=1)
    worst, code = worst_latency_during(stub, request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT  # far past the context length
    assert worst < 0.75, f"GetModelInfo took {worst:.2f}s while a large prompt was tokenized"


def test_a_large_chat_prompt_does_not_stall_the_gateway(stub):
    request = generate_pb2.GenerateRequest(max_tokens=1)
    request.chat.messages.add(role="user", content=LARGE_PROMPT)
    worst, code = worst_latency_during(stub, request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT  # far past the context length
    assert worst < 0.75, f"GetModelInfo took {worst:.2f}s while a large chat was tokenized"
