"""Structured negative fuzzing of `Generate`, `Tokenize` and `Detokenize` on the real stack
(the package docstring, `__init__.py`, states the whole fuzz and its contract)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.pb.tandem.v1 import generate_pb2
from tests.hf_reference import hf_generate, hf_tokenizer
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
    FUZZ,
    MAX_LEN,
    MAX_TEXT_BYTES,
    ROLES,
    VOCAB,
    any_id,
    chats,
    error_field,
    generate_requests,
    texts,
    utf8_len,
    weighted,
)
from tests.stack_client import greedy_request

# ---------------------------------------------------------------------------------------
# 1. Structured fuzzing

GENERATE_TALLY = Tally()


@settings(max_examples=300, **FUZZ)
@given(request=generate_requests())
def test_fuzzed_generate_requests_end_ok_or_invalid_argument(stub, documented, log_marks, request):
    code, details, messages, _ = call_stream(stub.Generate, request)
    check_generate_outcome(request, code, details, messages, documented, GENERATE_TALLY)


BATCH_TALLY = Tally()
NEIGHBOUR_PROMPT = "The scheduler batches every request"


def neighbours() -> list[generate_pb2.GenerateRequest]:
    """A greedy and a seeded request whose outputs must not depend on their batch."""
    greedy = greedy_request(NEIGHBOUR_PROMPT, 8)
    seeded = generate_pb2.GenerateRequest(text=NEIGHBOUR_PROMPT, max_tokens=8)
    seeded.sampling.temperature, seeded.sampling.top_p, seeded.sampling.seed = 0.9, 0.95, 11
    return [greedy, seeded]


@pytest.fixture(scope="module")
def neighbour_outputs(stub, tiny_llama_dir) -> list[list[int]]:
    """Each neighbour's tokens when it runs alone (greedy: also checked against HF)."""
    outputs = []
    for request in neighbours():
        code, details, messages, _ = call_stream(stub.Generate, request)
        assert code == grpc.StatusCode.OK, details
        outputs.append([t for m in messages for t in m.token_ids])
    prompt_ids = hf_tokenizer(str(tiny_llama_dir)).encode(NEIGHBOUR_PROMPT)
    assert outputs[0] == hf_generate(tiny_llama_dir, prompt_ids, max_new_tokens=8)
    return outputs


@settings(max_examples=25, **FUZZ)
@given(batch=st.lists(generate_requests(), min_size=3, max_size=6))
def test_fuzzed_requests_in_one_batch_leave_their_neighbours_exact(
    stub, documented, neighbour_outputs, batch
):
    """Fuzzed requests sent together (so they share worker steps) with a greedy and a
    seeded neighbour: each ends as it would alone, and the neighbours' tokens are exactly
    their solo tokens, whatever extreme values share their batch."""
    requests = [*neighbours(), *batch]
    barrier = threading.Barrier(len(requests))

    def one(request):
        barrier.wait()
        return call_stream(stub.Generate, request)

    with ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(one, requests))
    for want, (code, details, messages, _) in zip(neighbour_outputs, results, strict=False):
        assert code == grpc.StatusCode.OK, (code, details)
        assert [t for m in messages for t in m.token_ids] == want, [str(r)[:300] for r in batch]
        BATCH_TALLY.add("neighbour ok")
    for request, (code, details, messages, _) in zip(batch, results[2:], strict=True):
        check_generate_outcome(request, code, details, messages, documented, BATCH_TALLY)


def test_structured_generate_fuzz_left_the_stack_unharmed(
    api_stack, tiny_llama_dir, log_marks, capsys
):
    report(capsys, GENERATE_TALLY.line("Generate (structured)"))
    report(capsys, BATCH_TALLY.line("Generate (structured, concurrent batches)"))
    assert_stack_unharmed(api_stack, tiny_llama_dir, log_marks)


TOKENIZE_TALLY = Tally()


@st.composite
def tokenize_requests(draw) -> generate_pb2.TokenizeRequest:
    r = generate_pb2.TokenizeRequest()
    kind = draw(st.sampled_from(["text", "text", "chat", "none"]))
    if kind == "text":
        r.text = draw(texts)
    elif kind == "chat":
        r.chat.SetInParent()
        r.chat.messages.extend(draw(chats))
        add = draw(st.one_of(st.none(), st.booleans()))
        if add is not None:
            r.chat.add_generation_prompt = add
    add_special = draw(st.one_of(st.none(), st.booleans()))
    if add_special is not None:
        r.add_special_tokens = add_special
    return r


detokenize_requests = st.builds(
    lambda ids, skip: generate_pb2.DetokenizeRequest(token_ids=ids, skip_special_tokens=skip),
    weighted(
        (3, st.lists(st.integers(0, VOCAB - 1), max_size=40)),
        (1, st.lists(any_id, max_size=8)),
        (1, st.sampled_from([2**20, 2**20 + 1]).map(lambda k: [5] * k)),
    ),
    st.one_of(st.none(), st.booleans()),
)


@settings(max_examples=120, **FUZZ)
@given(request=tokenize_requests())
def test_fuzzed_tokenize_matches_the_tokenizer_or_is_invalid_argument(
    stub, documented, tiny_llama_dir, request
):
    code, details, reply = call_unary(stub.Tokenize, request)
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), (code, details)
    which = request.WhichOneof("input")
    if which == "text":
        violation = "text" if utf8_len(request.text) > MAX_TEXT_BYTES else None
    elif which == "chat":
        messages = request.chat.messages
        bad_chat = (
            not 1 <= len(messages) <= 1024
            or any(m.role not in ROLES for m in messages)
            or sum(utf8_len(m.content) for m in messages) > MAX_TEXT_BYTES
        )
        violation = "chat" if bad_chat else None
    else:
        violation = "input"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        check_documented(details, documented)
        field = error_field(details)
        assert field.split(".")[0] == violation, (details, violation)
        TOKENIZE_TALLY.add("invalid", field)
        return
    assert violation is None, f"accepted although {violation} breaks a documented limit"
    assert len(reply.tokens) == len(reply.token_ids) and reply.max_model_len == MAX_LEN
    if which == "text":
        add = request.add_special_tokens if request.HasField("add_special_tokens") else True
        tok = hf_tokenizer(str(tiny_llama_dir))
        assert list(reply.token_ids) == tok.encode(request.text, add_special_tokens=add)
    else:
        assert all(0 <= t < VOCAB for t in reply.token_ids)
    TOKENIZE_TALLY.add("ok")


@settings(max_examples=100, **FUZZ)
@given(request=detokenize_requests)
def test_fuzzed_detokenize_matches_the_tokenizer_or_is_invalid_argument(
    stub, documented, tiny_llama_dir, request
):
    code, details, reply = call_unary(stub.Detokenize, request)
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), (code, details)
    ids = list(request.token_ids)
    valid = len(ids) <= 2**20 and all(0 <= t < VOCAB for t in ids)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert not valid, details
        check_documented(details, documented)
        TOKENIZE_TALLY.add("invalid", error_field(details))
        return
    assert valid
    skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
    if len(ids) < 1000:
        want = hf_tokenizer(str(tiny_llama_dir)).decode(ids, skip_special_tokens=skip)
        assert reply.text == want
    TOKENIZE_TALLY.add("ok")


def test_tokenize_fuzz_left_the_stack_unharmed(api_stack, tiny_llama_dir, log_marks, capsys):
    report(capsys, TOKENIZE_TALLY.line("Tokenize/Detokenize (structured)"))
    assert_stack_unharmed(api_stack, tiny_llama_dir, log_marks)
