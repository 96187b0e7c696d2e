"""The OpenAI HTTP front's translation, without a network: JSON bodies -> GenerateRequests
(types checked, every field mapped, unsupported ones refused by name), GenerateResponse
messages -> OpenAI objects and SSE chunks, gRPC status -> HTTP status, and its config
(`echo` is in test_openai_api_echo.py)."""

from __future__ import annotations

import asyncio
import json
import math

import grpc
import pytest

from common.config import load_config
from common.pb.tandem.v1 import generate_pb2
from services.openai_api.chat_request import parse_chat
from services.openai_api.chat_response import ChatChunks, chat_body
from services.openai_api.collect import Collector, Meta
from services.openai_api.completion_request import parse_completion
from services.openai_api.completion_response import CompletionChunks, Echo, completion_body
from services.openai_api.config import OpenAIApiConfig
from services.openai_api.errors import ApiError, from_rpc_error
from services.openai_api.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs
from services.openai_api.sse import DONE, encode, events

META = Meta("cmpl-abc", 1700000000, "tiny")
STOP, LENGTH = generate_pb2.FINISH_REASON_STOP, generate_pb2.FINISH_REASON_LENGTH


def message(index=0, text="", ids=(), finish=0, usage=None, logprobs=(), **kwargs):
    response = generate_pb2.GenerateResponse(
        request_id="abc", index=index, text=text, token_ids=list(ids), finish_reason=finish,
        logprobs=list(logprobs), **kwargs,
    )  # fmt: skip
    if usage is not None:
        prompt, completion, cached = usage
        response.usage.CopyFrom(generate_pb2.Usage(
            prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached
        ))  # fmt: skip
    return response


def lp(token_id, token, logprob, tops=()):
    return generate_pb2.TokenLogprob(
        token_id=token_id, token=token, logprob=logprob,
        top_logprobs=[generate_pb2.TopLogprob(token_id=i, token=t, logprob=v) for i, t, v in tops],
    )  # fmt: skip


def rejected(parse, body) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body)
    return info.value


# --- /v1/completions requests ---------------------------------------------------------------


def test_completion_string_prompt_defaults_like_openai():
    parsed = parse_completion({"model": "tiny", "prompt": "Hello"})
    (request,) = parsed.requests
    assert request.text == "Hello" and request.max_tokens == 16
    assert not request.HasField("n") and not request.HasField("logprobs")
    assert not request.sampling.HasField("temperature")  # the gateway's default (1.0)
    assert parsed.options.model == "tiny" and parsed.options.n == 1
    assert not parsed.options.stream and not parsed.echo


def test_completion_null_max_tokens_means_until_the_context_ends():
    (request,) = parse_completion({"prompt": "x", "max_tokens": None}).requests
    assert not request.HasField("max_tokens")


def test_completion_prompt_shapes():
    assert list(parse_completion({"prompt": [1, 2, 3]}).requests[0].token_ids.ids) == [1, 2, 3]
    batch = parse_completion({"prompt": ["a", "b"], "n": 2}).requests
    assert [r.text for r in batch] == ["a", "b"] and all(r.n == 2 for r in batch)
    ids = parse_completion({"prompt": [[1, 2], [3]]}).requests
    assert [list(r.token_ids.ids) for r in ids] == [[1, 2], [3]]


@pytest.mark.parametrize(
    "prompt, param",
    [([], "prompt"), ({"a": 1}, "prompt"), ([1, "a"], "prompt[0]"), ([[1, "x"]], "prompt[0][1]"),
     ([True], "prompt[0]"), (None, "prompt")],
)  # fmt: skip
def test_completion_bad_prompts_name_the_field(prompt, param):
    error = rejected(parse_completion, {"prompt": prompt})
    assert error.status == 400 and error.param == param and param in error.message


def test_every_sampling_and_stopping_field_is_mapped():
    body = {
        "prompt": "x", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 5,
        "min_p": 0.1, "repetition_penalty": 1.2, "presence_penalty": 0.3,
        "frequency_penalty": -0.4, "logit_bias": {"12": 5, "7": -100.0}, "seed": 2**63,
        "stop": ["\n", "END"], "stop_token_ids": [3, 4], "include_stop_str_in_output": True,
        "ignore_eos": True, "min_tokens": 2, "skip_special_tokens": False, "n": 3,
        "best_of": 3, "logprobs": 4, "prompt_logprobs": 1, "cache_salt": "tenant",
        "user": "someone",
    }  # fmt: skip
    (r,) = parse_completion(body).requests
    s, st = r.sampling, r.stopping
    assert (r.max_tokens, r.n, r.logprobs, r.prompt_logprobs) == (7, 3, 4, 1)
    assert (s.temperature, s.top_k, s.seed) == (0.5, 5, 2**63)
    assert math.isclose(s.top_p, 0.9, rel_tol=1e-6) and math.isclose(s.min_p, 0.1, rel_tol=1e-6)
    assert math.isclose(s.repetition_penalty, 1.2, rel_tol=1e-6)
    assert math.isclose(s.presence_penalty, 0.3, rel_tol=1e-6)
    assert math.isclose(s.frequency_penalty, -0.4, rel_tol=1e-6)
    assert dict(s.logit_bias) == {12: 5.0, 7: -100.0}
    assert list(st.stop) == ["\n", "END"] and list(st.stop_token_ids) == [3, 4]
    assert st.include_stop_str_in_output and st.ignore_eos and st.min_tokens == 2
    assert st.HasField("skip_special_tokens") and not st.skip_special_tokens
    assert r.cache_salt == "tenant"


def test_a_single_stop_string_is_a_list_of_one():
    (r,) = parse_completion({"prompt": "x", "stop": "###"}).requests
    assert list(r.stopping.stop) == ["###"]


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("temperature", "hot", "temperature: must be a number, got string"),
        ("top_p", True, "top_p: must be a number, got boolean"),
        ("max_tokens", 1.5, "max_tokens: must be an integer, got number"),
        ("max_tokens", 2**40, "max_tokens: must be in [-2147483648, 2147483647]"),
        ("n", "2", "n: must be an integer, got string"),
        ("stream", "yes", "stream: must be a boolean, got string"),
        ("stop", 5, "stop: must be a string or an array of strings"),
        ("stop", ["a", 1], "stop[1]: must be a string, got integer"),
        ("stop_token_ids", [1, "2"], "stop_token_ids[1]: must be an integer"),
        ("logit_bias", {"abc": 1}, "logit_bias: keys must be token ids"),
        ("logit_bias", {"5": "x"}, "logit_bias[5]: must be a number"),
        ("logit_bias", [1], "logit_bias: must be an object"),
        ("seed", -1, "seed: must be in [0, 18446744073709551615], got -1"),
        ("cache_salt", 5, "cache_salt: must be a string"),
        ("echo", 1, "echo: must be a boolean"),
    ],
)
def test_wrong_types_are_400s_naming_the_field(field, value, words):
    error = rejected(parse_completion, {"prompt": "x", field: value})
    assert error.status == 400 and words in error.message
    assert error.param.split("[")[0] == field


@pytest.mark.parametrize(
    "extra, param, words",
    [
        ({"suffix": "tail"}, "suffix", "suffix is not supported"),
        ({"best_of": 2}, "best_of", "best_of is not supported unless it equals n"),
        ({"length_penalty": 2.0}, "length_penalty", "only applies with use_beam_search"),
        ({"early_stopping": True}, "early_stopping", "only applies with use_beam_search"),
        ({"use_beam_search": True, "early_stopping": "soon"}, "early_stopping", "never"),
        ({"use_beam_search": True, "early_stopping": 1}, "early_stopping", "never"),
        (
            {"echo": True, "logprobs": 1, "stream": True},
            "echo",
            "echo with logprobs is not supported with stream=true",
        ),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream"),
        ({"stream": True, "stream_options": {"continuous_usage_stats": True}},
         "stream_options.continuous_usage_stats", "not supported"),
        ({"stream": True, "stream_options": {"bogus": 1}}, "stream_options.bogus", "unknown"),
        ({"stream": True, "prompt_logprobs": 1}, "prompt_logprobs", "not supported with stream"),
        ({"guided_json": {}}, "guided_json", "unknown or unsupported parameter"),
        ({"tools": []}, "tools", "unknown or unsupported parameter"),
    ],
)  # fmt: skip
def test_unsupported_parameters_are_refused_by_name(extra, param, words):
    error = rejected(parse_completion, {"prompt": "x", **extra})
    assert (error.status, error.param) == (400, param) and words in error.message


@pytest.mark.parametrize("parse", [parse_completion, parse_chat])
def test_use_beam_search_maps_to_beam_search_with_width_n(parse):
    body = {"use_beam_search": True, "n": 3, "length_penalty": 0.5, "early_stopping": "never"}
    if parse is parse_chat:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "x"
    parsed = parse(body)
    request = parsed.requests[0] if parse is parse_completion else parsed.request
    beam = request.beam_search
    assert (beam.beam_width, beam.length_penalty, request.n) == (3, 0.5, 3)
    assert beam.early_stopping == generate_pb2.BEAM_EARLY_STOPPING_NEVER
    plain = parse_completion({"prompt": "x", "use_beam_search": True})
    assert plain.requests[0].beam_search.beam_width == 1
    assert not plain.requests[0].beam_search.HasField("length_penalty")
    off = parse_completion({"prompt": "x", "use_beam_search": False, "length_penalty": 1.0})
    assert not off.requests[0].HasField("beam_search")


def test_best_of_equal_to_n_and_null_fields_are_accepted():
    parsed = parse_completion({"prompt": "x", "n": 2, "best_of": 2, "suffix": None, "seed": None})
    assert parsed.options.n == 2


def test_body_must_be_an_object_and_prompt_is_required():
    assert "must be a JSON object" in rejected(parse_completion, [1]).message
    error = rejected(parse_completion, {"model": "m"})
    assert (error.param, error.code) == ("prompt", "missing_required_parameter")


# --- /v1/chat/completions requests ----------------------------------------------------------


def test_chat_messages_and_text_parts():
    body = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b"}]},
            {"role": "developer", "content": "Newer clients' name for system."},
        ],
        "add_generation_prompt": False,
    }  # fmt: skip
    parsed = parse_chat(body)
    chat = parsed.request.chat
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "Be brief."),
        ("user", "a\nb"),
        ("system", "Newer clients' name for system."),
    ]
    assert chat.HasField("add_generation_prompt") and not chat.add_generation_prompt
    assert not parsed.request.HasField("max_tokens")  # until the context ends
    assert not parsed.request.HasField("logprobs")


def test_chat_max_completion_tokens_wins_and_logprobs_map():
    parsed = parse_chat({
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9,
        "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 3,
        "tool_choice": "none", "response_format": {"type": "text"},
    })  # fmt: skip
    assert parsed.request.max_tokens == 4 and parsed.request.logprobs == 3
    assert parsed.logprobs and parsed.top_logprobs == 3
    plain = parse_chat({"messages": [{"role": "user", "content": "hi"}], "logprobs": True})
    assert plain.request.HasField("logprobs") and plain.request.logprobs == 0


@pytest.mark.parametrize(
    "extra, param, words",
    [
        ({"messages": []}, "messages", "non-empty array"),
        ({"messages": "hi"}, "messages", "non-empty array"),
        ({"messages": [{"content": "x"}]}, "messages[0].role", "is required"),
        ({"messages": [{"role": "user"}]}, "messages[0].content", "is required"),
        ({"messages": [{"role": 1, "content": "x"}]}, "messages[0].role", "must be a string"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content",
         "string or an array of text parts"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "messages[0].content[0].type", "'image_url' are not supported"),
        ({"messages": [{"role": "user", "content": "x", "audio": {}}]}, "messages[0].audio",
         "unknown or unsupported"),
        ({"tools": []}, "tools", "must not be an empty array"),
        ({"tool_choice": "auto"}, "tool_choice", "`tools` must be set"),
        ({"functions": [{}]}, "functions", "not supported"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "not supported"),
        ({"top_logprobs": 2}, "top_logprobs", "requires logprobs=true"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "must be in [0, 20]"),
        ({"logprobs": 2}, "logprobs", "must be a boolean"),
        ({"echo": True}, "echo", "unknown or unsupported"),
    ],
)  # fmt: skip
def test_chat_bad_or_unsupported_fields_are_400s_naming_them(extra, param, words):
    body = {"messages": [{"role": "user", "content": "hi"}], **extra}
    error = rejected(parse_chat, body)
    assert (error.status, error.param) == (400, param) and words in error.message


# --- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "code, status, kind",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
        (grpc.StatusCode.NOT_FOUND, 404, "invalid_request_error"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
        (grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error"),
        (grpc.StatusCode.PERMISSION_DENIED, 403, "permission_error"),
        (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable_error"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error"),
        (grpc.StatusCode.INTERNAL, 500, "server_error"),
        (grpc.StatusCode.UNKNOWN, 500, "server_error"),
    ],
)
def test_grpc_status_maps_to_http_and_the_message_passes_through(code, status, kind):
    error = from_rpc_error(code, "max_tokens must be >= 1, got 0")
    assert error.status == status
    assert error.body() == {
        "error": {
            "message": "max_tokens must be >= 1, got 0",
            "type": kind,
            "param": None,
            "code": code.name.lower(),
        }
    }


# --- responses -------------------------------------------------------------------------------


def test_batch_of_prompts_with_n_samples_indexes_choices_and_sums_usage():
    collector = Collector(n=2)
    stream = [
        (1, message(index=1, text="d", ids=[4])),
        (0, message(index=0, text="a", ids=[1])),
        (0, message(index=1, text="b", ids=[2], finish=LENGTH)),
        (0, message(index=0, text="c", ids=[3], finish=STOP, stop_token_id=2,
                    usage=(3, 3, 1))),
        (1, message(index=0, text="e", ids=[5], finish=STOP, stop_string="##")),
        (1, message(index=1, ids=[], finish=LENGTH, usage=(4, 2, 0))),
    ]  # fmt: skip
    for prompt_index, response in stream:
        collector.add(prompt_index, response)
    body = completion_body(
        META, collector, Echo(["P0", "P1"]), logprobs=False, with_prompt_logprobs=False
    )
    assert body["object"] == "text_completion" and body["id"] == "cmpl-abc"
    got = [(c["index"], c["text"], c["finish_reason"], c["stop_reason"]) for c in body["choices"]]
    assert got == [
        (0, "P0ac", "stop", 2),
        (1, "P0b", "length", None),
        (2, "P1e", "stop", "##"),
        (3, "P1d", "length", None),
    ]
    assert body["usage"] == {
        "prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 1},
    }  # fmt: skip


def test_completion_logprobs_offsets_continue_across_chunks():
    chunks = CompletionChunks(META, n=1, echo_texts=None, logprobs=True, include_usage=True)
    first = chunks.chunk(0, message(text="Hel", ids=[1, 2], logprobs=[
        lp(1, "He", -0.5, [(1, "He", -0.5), (9, "X", -2.0)]), lp(2, "l", -0.25)]))  # fmt: skip
    second = chunks.chunk(0, message(text="lo", ids=[3], finish=LENGTH, usage=(2, 3, 0),
                                     logprobs=[lp(3, "lo", -1.0)]))  # fmt: skip
    assert first["choices"][0]["logprobs"] == {
        "tokens": ["He", "l"], "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{"He": -0.5, "X": -2.0}, {}], "text_offset": [0, 2],
    }  # fmt: skip
    assert second["choices"][0]["logprobs"]["text_offset"] == [3]
    assert first["usage"] is None and second["choices"][0]["finish_reason"] == "length"
    assert chunks.usage_chunk()["usage"]["completion_tokens"] == 3
    assert chunks.usage_chunk()["choices"] == []


def test_streamed_echo_goes_on_each_choice_first_chunk_and_every_step_is_a_chunk():
    chunks = CompletionChunks(META, n=2, echo_texts=["Hi"], logprobs=False, include_usage=False)
    assert chunks.chunk(0, message(index=1, text="a"))["choices"][0]["text"] == "Hia"
    assert chunks.chunk(0, message(index=1, text="b"))["choices"][0]["text"] == "b"
    held = chunks.chunk(0, message(index=1, text="", ids=[7]))  # text held back: a chunk
    assert held["choices"][0]["text"] == "" and held["choices"][0]["finish_reason"] is None
    assert chunks.chunk(0, message(index=1)) is None  # no token, no text: nothing to send
    last = chunks.chunk(0, message(index=0, text="c", finish=STOP))
    assert last["choices"][0] == {
        "index": 0, "text": "Hic", "logprobs": None, "finish_reason": "stop", "stop_reason": None
    }  # fmt: skip
    assert "usage" not in last and chunks.usage_chunk() is None


def test_chat_chunks_role_first_then_content_then_finish_and_usage():
    chunks = ChatChunks(Meta("chatcmpl-x", 1, "tiny"), n=2, logprobs=False, include_usage=True)
    roles = chunks.role_chunks()
    assert [c["choices"][0]["delta"] for c in roles] == [{"role": "assistant", "content": ""}] * 2
    assert all(c["object"] == "chat.completion.chunk" for c in roles)
    content = chunks.chunk(message(index=1, text="Hi"))
    assert content["choices"][0]["delta"] == {"content": "Hi"} and content["usage"] is None
    partial = chunks.chunk(message(index=1, ids=[200]))  # a token whose text is held back
    assert partial["choices"][0]["delta"] == {"content": ""}
    assert chunks.chunk(message(index=1)) is None
    end = chunks.chunk(message(index=1, finish=STOP, stop_string="\n", usage=(5, 1, 0)))
    assert end["choices"][0]["delta"] == {} and end["choices"][0]["finish_reason"] == "stop"
    assert end["choices"][0]["stop_reason"] == "\n"
    assert chunks.usage_chunk()["usage"]["total_tokens"] == 6


def test_chat_body_with_logprobs_and_prompt_logprobs():
    collector = Collector(n=1)
    collector.add(0, message(text="é", ids=[5], logprobs=[lp(5, "é", -0.1, [(6, "e", -3.0)])],
                             prompt_logprobs=[lp(2, "b", -4.0, [(3, "c", -1.0)])]))  # fmt: skip
    collector.add(0, message(finish=LENGTH, usage=(2, 1, 0)))
    body = chat_body(Meta("chatcmpl-x", 1, "tiny"), collector, True, True)
    (choice,) = body["choices"]
    assert choice["message"] == {  # vLLM's message: its OpenAI fields null
        "role": "assistant", "content": "é", "refusal": None, "annotations": None,
        "audio": None, "function_call": None, "reasoning": None,
    }  # fmt: skip
    assert choice["logprobs"]["content"] == [{
        "token": "é", "logprob": pytest.approx(-0.1), "bytes": [195, 169],
        "top_logprobs": [{"token": "e", "logprob": -3.0, "bytes": [101]}],
    }]  # fmt: skip
    assert body["prompt_logprobs"] == [
        None,
        {
            "3": {"logprob": -1.0, "decoded_token": "c"},
            "2": {"logprob": -4.0, "decoded_token": "b"},
        },
    ]


def test_non_finite_logprobs_become_minus_9999():
    entry = lp(1, "a", -math.inf, [(2, "b", math.nan)])
    assert completion_logprobs([entry], 0)[0]["token_logprobs"] == [-9999.0]
    assert chat_logprobs([entry])[0]["top_logprobs"][0]["logprob"] == -9999.0
    assert prompt_logprobs([entry])[1]["1"]["logprob"] == -9999.0
    json.dumps(chat_logprobs([entry]), allow_nan=False)


# --- SSE -------------------------------------------------------------------------------------


def test_an_error_after_the_stream_started_is_a_final_event_then_done():
    async def chunks():
        yield {"a": 1}
        raise ApiError("worker failed", 503)

    outcomes = []

    async def run():
        return [event async for event in events(chunks(), outcomes.append)]

    got = asyncio.run(run())
    assert got[0] == b'data: {"a":1}\n\n' and got[-1] == DONE == b"data: [DONE]\n\n"
    error = json.loads(got[1].removeprefix(b"data: "))
    assert error["error"]["message"] == "worker failed" and error["error"]["code"] is None
    assert outcomes == ["worker failed"]


def test_a_bug_mid_stream_still_ends_with_an_error_event_then_done():
    async def chunks():
        yield {"a": 1}
        raise RuntimeError("boom")

    async def run():
        return [event async for event in events(chunks(), lambda outcome: None)]

    got = asyncio.run(run())
    error = json.loads(got[1].removeprefix(b"data: "))["error"]
    assert (error["type"], error["message"]) == ("server_error", "internal error: RuntimeError")
    assert got[-1] == DONE


def test_sse_encoding_keeps_unicode():
    assert encode({"text": "中"}) == 'data: {"text":"中"}\n\n'.encode()


# --- config ----------------------------------------------------------------------------------


def test_config_defaults_env_and_errors():
    config = load_config(OpenAIApiConfig, [], env={})
    assert (config.host, config.port, config.gateway) == ("127.0.0.1", 8000, "127.0.0.1:50051")
    assert config.max_body_bytes == 8 * 2**20
    assert load_config(OpenAIApiConfig, [], env={"TANDEM_HTTP_PORT": "9001"}).port == 9001
    assert load_config(OpenAIApiConfig, ["--port", "0"], env={"TANDEM_HTTP_PORT": "9"}).port == 0
    with pytest.raises(ValueError, match="gateway must be host:port"):
        load_config(OpenAIApiConfig, ["--gateway", "nowhere"], env={})
    with pytest.raises(ValueError, match="port must be in 0..65535"):
        OpenAIApiConfig(port=70000)
    with pytest.raises(ValueError, match="not a size"):
        OpenAIApiConfig(max_body_size="big")
    with pytest.raises(ValueError, match="max_body_size"):
        OpenAIApiConfig(max_body_size="0")


def test_structured_output_from_response_format_and_vllms_extra():
    """OpenAI's response_format and vLLM's structured_outputs
    become GenerateRequest.structured_output; conflicting or ambiguous ones are 400s."""
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = [
        ({"response_format": {"type": "json_object"}}, "json_object", True),
        (
            {"response_format": {"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": schema, "strict": True}}},
            "json_schema", json.dumps(schema),
        ),
        ({"structured_outputs": {"regex": "[a-z]+"}}, "regex", "[a-z]+"),
        ({"structured_outputs": {"json": schema}}, "json_schema", json.dumps(schema)),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "grammar", 'root ::= "a"'),
    ]  # fmt: skip
    for extra, field, value in cases:
        out = parse_chat(base | extra).request.structured_output
        assert out.WhichOneof("constraint") == field and getattr(out, field) == value, extra
    choice = parse_chat(base | {"structured_outputs": {"choice": ["a", "b"]}})
    assert list(choice.request.structured_output.choice.choices) == ["a", "b"]
    text = parse_chat(base | {"response_format": {"type": "text"}})
    assert not text.request.HasField("structured_output")
    for extra, message in [
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
         "not both"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
        ({"structured_outputs": {"choice": [1]}}, "array of strings"),
    ]:  # fmt: skip
        with pytest.raises(ApiError, match=message):
            parse_chat(base | extra)
    completion = parse_completion(
        {"model": "m", "prompt": "x", "structured_outputs": {"regex": "b"}}
    )
    assert completion.requests[0].structured_output.regex == "b"
