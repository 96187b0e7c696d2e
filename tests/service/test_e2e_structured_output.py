"""Structured output through the real services: on the
random-weight tiny Llama, which alone writes garbage, requests constrained by a regex, a
JSON schema and a choice, greedy and sampled, all at once with free requests, through
the prefill -> decode split: every output is complete (finish reason stop) and matches,
validates or is one of the choices; the free requests are unaffected."""

from __future__ import annotations

import contextlib
import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from common.pb.tandem.v1 import generate_pb2
from tests.hf_reference import hf_greedy, hf_tokenizer
from tests.stack_client import (
    generate,
    generate_together,
    greedy_request,
    pool_stats,
    wait_until_idle,
)

jsonschema = pytest.importorskip("jsonschema")

REGEX = r"[0-9]{3}-[a-z]{2,4}"
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
CHOICES = ["red", "green", "blue sky"]


@contextlib.contextmanager
def grpc_channel(address: str):
    import grpc

    from common.pb.tandem.v1 import generate_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        yield generate_pb2_grpc.GenerateServiceStub(channel)


def constrained(kind: str, temperature: float, seed: int) -> generate_pb2.GenerateRequest:
    request = greedy_request("Once upon a time", 48)
    request.sampling.temperature = temperature
    if temperature:
        request.sampling.seed = seed
    if kind == "regex":
        request.structured_output.regex = REGEX
    elif kind == "schema":
        request.structured_output.json_schema = json.dumps(SCHEMA)
    else:
        request.structured_output.choice.choices.extend(CHOICES)
    return request


def valid(kind: str, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "schema":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    return text in CHOICES


@pytest.fixture(scope="module")
def stack(api_stack):
    return api_stack


def test_constrained_outputs_are_complete_and_valid_beside_free_ones(stack, tiny_llama_dir):
    address = stack.spec.gateway_address
    cases = [(k, t, s) for k in ("regex", "schema", "choice") for t in (0.0, 1.0) for s in (1, 2)]
    prompt = "In the beginning"
    with ThreadPoolExecutor(len(cases) + 2) as pool:
        free = [pool.submit(generate, address, greedy_request(prompt, 12)) for _ in range(2)]
        outs = [pool.submit(generate, address, constrained(*case)) for case in cases]
        results = [f.result() for f in outs]
        free_results = [f.result() for f in free]
    for case, out in zip(cases, results, strict=True):
        assert out.finish_reason == generate_pb2.FINISH_REASON_STOP, (case, out.text)
        assert valid(case[0], out.text), (case, out.text)
    tokenizer = hf_tokenizer(str(tiny_llama_dir))
    expected = hf_greedy(tiny_llama_dir, tokenizer.encode(prompt), 12)
    assert all(r.token_ids == expected for r in free_results)
    stats = wait_until_idle(stack)
    assert all(p.num_free_blocks == p.num_blocks for p in stats.pools)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("json_schema", "{not json", "structured_output.json_schema"),
        ("json_schema", json.dumps({"type": "object", "properties": 5}), "json_schema"),
        ("regex", "[unclosed", "structured_output.regex"),
        ("grammar", "root ::= missing", "structured_output.grammar"),
        ("regex", "a" * 5000, "must be 1..4096 bytes"),
        ("choice", [], "must hold 1..256 strings"),
        (
            "json_schema",
            '{"type":"array","items":' * 70 + '{"type":"string"}' + "}" * 70,
            "must nest at most 64 levels, got 71",
        ),
    ],
)
def test_bad_constraints_are_invalid_argument_and_the_server_serves_on(
    stack, field, value, message
):
    import grpc

    request = greedy_request("Hello", 8)
    if field == "choice":
        request.structured_output.choice.SetInParent()
    else:
        setattr(request.structured_output, field, value)
    with pytest.raises(grpc.RpcError) as refused:
        generate(stack.spec.gateway_address, request)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in refused.value.details(), refused.value.details()
    ok = constrained("regex", 0.0, 1)
    assert valid("regex", generate(stack.spec.gateway_address, ok).text)


def test_openai_response_format_and_vllm_structured_outputs_over_http(stack):
    import urllib.request

    def choice(body: dict) -> dict:
        request = urllib.request.Request(
            f"http://{stack.spec.http_address}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())["choices"][0]

    def post(body: dict) -> str:
        return choice(body)["message"]["content"]

    base = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 48, "temperature": 0}  # fmt: skip
    schema_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    assert valid("schema", post(base | {"response_format": schema_format}))
    assert valid("regex", post(base | {"structured_outputs": {"regex": REGEX}}))
    assert post(base | {"structured_outputs": {"choice": CHOICES}}) in CHOICES
    # Any object is unbounded: on a random model it may be cut by max_tokens (reported so).
    cut_or_done = choice(base | {"response_format": {"type": "json_object"}})
    if cut_or_done["finish_reason"] == "stop":
        assert isinstance(json.loads(cut_or_done["message"]["content"]), dict)
    else:
        assert cut_or_done["finish_reason"] == "length"
        assert cut_or_done["message"]["content"].startswith("{")


def test_n_samples_stop_strings_and_length_cuts(stack):
    address = stack.spec.gateway_address
    # n > 1: one matcher per sample, each sample valid on its own.
    request = constrained("schema", 1.0, 7)
    request.n = 4
    with grpc_channel(address) as stub:
        finals = {}
        texts: dict[int, str] = {}
        for response in stub.Generate(request, timeout=120):
            texts[response.index] = texts.get(response.index, "") + response.text
            if response.finish_reason:
                finals[response.index] = response.finish_reason
    assert sorted(finals) == [0, 1, 2, 3]
    for index, text in texts.items():
        assert finals[index] == generate_pb2.FINISH_REASON_STOP, text
        assert valid("schema", text), text
    # A stop string the grammar forces: the text ends before it, finish reason stop.
    request = greedy_request("Once upon a time", 32)
    request.structured_output.regex = "[a-z]{3}x[a-z]{3}"
    request.stopping.stop.append("x")
    out = generate(address, request)
    assert out.finish_reason == generate_pb2.FINISH_REASON_STOP
    assert re.fullmatch("[a-z]{3}", out.text), out.text
    # Cut by max_tokens before the grammar is complete: reported as length.
    request = greedy_request("Once upon a time", 2)
    request.structured_output.regex = "[0-9]{40}"
    out = generate(address, request)
    assert out.finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert len(out.token_ids) == 2 and re.fullmatch("[0-9]+", out.text), out.text
    # min_tokens past the grammar's end: the output is complete, then only EOS is allowed
    # and min_tokens forbids it. The sample must not crash the worker.
    request = greedy_request("Once upon a time", 8)
    request.structured_output.choice.choices.extend(CHOICES)
    request.stopping.min_tokens = 6
    out = generate(address, request)
    assert out.finish_reason in (generate_pb2.FINISH_REASON_STOP, generate_pb2.FINISH_REASON_LENGTH)
    assert any(out.text.startswith(c) for c in CHOICES), out.text
    wait_until_idle(stack)


def test_preempted_and_recomputed_requests_stay_valid(small_pools_stack):
    """Small pools (the session's shared stack; recompute): the constrained requests are
    preempted and their matchers rebuilt by replaying their tokens; every output still
    full-matches.

    The preemption is certain: no token of this byte-level BPE holds a space after its
    first character, so each " x" of the regex costs a token or two and an output is 37
    to 72 tokens (never cut at 80). The 6 requests (11-12 token prompts: 3 prefill steps
    in all) are queued together (`held_together`; their one grammar compiles once for
    all), then each decodes 37 steps or more, to 3 blocks or more: 18 against 10."""
    stack = small_pools_stack()
    before = sum(p.preemptions for p in pool_stats(stack).pools)
    regex = "[a-z]( [a-z]){35}[.]"
    requests = []
    for i in range(6):
        request = greedy_request(f"Story {i}: once upon a time", 80)
        request.sampling.temperature = 1.0
        request.sampling.seed = 11 + i
        request.structured_output.regex = regex
        requests.append(request)
    results = generate_together(stack, requests)
    for out in results:
        assert out.finish_reason == generate_pb2.FINISH_REASON_STOP, out.text
        assert re.fullmatch(regex, out.text), out.text
    stats = wait_until_idle(stack)
    assert sum(p.preemptions for p in stats.pools) > before, "small pools must preempt"
    assert all(p.num_free_blocks == p.num_blocks for p in stats.pools)
