"""`echo` on /v1/completions: the request it makes (prompt logprobs for `logprobs`, one
dropped token for `max_tokens: 0`) and the body it builds (the prompt's text and logprobs
ahead of the generated ones, the first prompt token's null, tokens named by id)."""

from __future__ import annotations

from services.openai_api.collect import Collector
from services.openai_api.completion_request import parse_completion
from services.openai_api.completion_response import Echo, completion_body
from tests.unit.test_openai_api_translation import LENGTH, META, lp, message


def test_echo_with_logprobs_asks_for_prompt_logprobs_and_max_tokens_0_for_one_dropped():
    parsed = parse_completion({"prompt": [5, 6, 7], "echo": True, "logprobs": 2, "max_tokens": 0})
    assert parsed.echo_logprobs and parsed.echo_only
    (request,) = parsed.requests
    assert request.prompt_logprobs == 2 and request.logprobs == 2 and request.max_tokens == 1
    plain = parse_completion({"prompt": "x", "echo": True, "max_tokens": 3})
    assert not plain.echo_logprobs and not plain.echo_only and plain.requests[0].max_tokens == 3
    assert not plain.requests[0].HasField("prompt_logprobs")
    assert not parse_completion({"prompt": "x", "max_tokens": 0}).echo_only  # gateway's 400


def echo_collector(generated_ids):
    collector = Collector(n=1)
    first = message(
        text="!" if generated_ids else "", ids=generated_ids, finish=LENGTH, usage=(3, 1, 0),
        logprobs=[lp(9, "!", -0.75, [(8, "?", -0.5)])] if generated_ids else [],
        prompt_logprobs=[lp(6, " b", -1.5, [(4, " a", -0.25), (3, "z", -3.0)]),
                         lp(7, " c", float("-inf"), [(6, " b", -0.125)])],
    )  # fmt: skip
    collector.add(0, first)
    return collector


def test_echoed_logprobs_lead_with_the_prompt_first_token_null():
    body = completion_body(
        META, echo_collector([9]), Echo(["a b c"], [(5, "a")], k=1), logprobs=True,
        with_prompt_logprobs=False,
    )  # fmt: skip
    (choice,) = body["choices"]
    assert choice["text"] == "a b c!"
    assert choice["logprobs"] == {
        "tokens": ["a", " b", " c", "!"],
        "token_logprobs": [None, -1.5, -9999.0, -0.75],
        "top_logprobs": [None, {" a": -0.25, " b": -1.5}, {" b": -0.125, " c": -9999.0},
                         {"?": -0.5}],
        "text_offset": [0, 1, 3, 5],
    }  # fmt: skip
    assert body["usage"]["completion_tokens"] == 1 and "prompt_logprobs" not in choice


def test_echo_with_max_tokens_0_returns_only_the_prompt():
    body = completion_body(
        META, echo_collector([9]), Echo(["a b c"], [(5, "a")], k=2, only=True), logprobs=True,
        with_prompt_logprobs=False,
    )  # fmt: skip
    (choice,) = body["choices"]
    assert choice["text"] == "a b c" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == ["a", " b", " c"]
    assert choice["logprobs"]["top_logprobs"][1] == {" a": -0.25, "z": -3.0, " b": -1.5}
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["total_tokens"] == 3


def test_echoed_logprobs_name_tokens_by_id_under_return_tokens_as_token_ids():
    body = completion_body(
        META, echo_collector([9]), Echo(["a b c"], [(5, "a")], k=1), logprobs=True,
        with_prompt_logprobs=False, tokens_as_ids=True,
    )  # fmt: skip
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["token_id:5", "token_id:6", "token_id:7", "token_id:9"]
    assert logprobs["top_logprobs"][1] == {"token_id:4": -0.25, "token_id:6": -1.5}
    assert logprobs["text_offset"] == [0, 1, 3, 5]  # the text's offsets, as without ids
