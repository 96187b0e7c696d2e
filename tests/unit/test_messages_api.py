"""Anthropic's Messages API's pure parts: a request's conversion to the chat-completions
request (`parse_chat` of its chat body), stop reasons, usage, errors in Anthropic's shape and
the stream events, each checked against the official `anthropic` client's types."""

from __future__ import annotations

import pydantic
import pytest
from anthropic.types import Message, RawMessageStreamEvent

from services.openai_api.chat_request import parse_chat
from services.openai_api.collect import UsageSum
from services.openai_api.errors import ApiError
from services.openai_api.messages_events import MessageEvents
from services.openai_api.messages_request import parse_messages
from services.openai_api.messages_response import (
    MessageHead,
    error_body,
    message_body,
    stop_of,
    text_block,
    usage_body,
)

HEAD = MessageHead("msg_abc", "m")
STREAM_EVENT = pydantic.TypeAdapter(RawMessageStreamEvent)
USER = [{"role": "user", "content": "Hi"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOL = {"name": "get_weather", "description": "Weather", "input_schema": SCHEMA}


def chat_of(body: dict):
    return parse_chat(parse_messages({"model": "m", "max_tokens": 8, **body}).chat)


def rejected(body: dict) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_messages(body)
    return info.value


def test_system_blocks_stops_and_sampling_are_the_chat_request():
    chat = chat_of({
        "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b",
                                                   "cache_control": {"type": "ephemeral"}}]}],
        "stop_sequences": ["END", "\n\n"], "temperature": 0.5, "top_p": 0.5, "top_k": 4,
        "metadata": {"user_id": "u"}, "stream": True,
    })  # fmt: skip
    messages = [(m.role, m.content) for m in chat.request.chat.messages]
    assert messages == [("system", "Be brief."), ("user", "a\nb")]
    assert list(chat.request.stopping.stop) == ["END", "\n\n"] and chat.request.max_tokens == 8
    sampling = chat.request.sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.5, 0.5, 4)
    assert not chat.request.chat.continue_final_message


def test_a_last_assistant_turn_is_a_prefill():
    chat = chat_of({"messages": [*USER, {"role": "assistant", "content": "Well,"}]})
    assert chat.request.chat.continue_final_message
    assert not chat.request.chat.add_generation_prompt
    assert parse_messages({"model": "m", "max_tokens": 1, "messages": USER}).stream is False


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "messages": USER}, "max_tokens"),
        ({"model": "m", "max_tokens": 0, "messages": USER}, "max_tokens"),
        ({"max_tokens": 8, "messages": USER}, "model"),
        ({"model": "m", "max_tokens": 8, "messages": []}, "messages"),
        ({"model": "m", "max_tokens": 8, "messages": [{"role": "system", "content": "x"}]},
         "messages[0].role"),
        ({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
         "messages[0].content[0].type"),
        ({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
        ({"model": "m", "max_tokens": 8, "messages": USER,
          "tools": [{"name": "f", "input_schema": "x"}]}, "tools[0].input_schema"),
        ({"model": "m", "max_tokens": 8, "messages": USER,
          "tools": [{"name": "f", "input_schema": {"type": "array"}}]},
         "tools[0].input_schema.type"),
        ({"model": "m", "max_tokens": 8, "messages": USER, "tools": [{"name": "f"}]},
         "tools[0].input_schema"),
        ({"model": "m", "max_tokens": 8, "messages": USER,
          "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        ({"model": "m", "max_tokens": 8, "messages": USER, "tool_choice": {"type": "any"}},
         "tool_choice.type"),
        ({"model": "m", "max_tokens": 8, "messages": USER, "tools": [TOOL],
          "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
        ({"model": "m", "max_tokens": 8, "messages": USER, "tools": [TOOL],
          "tool_choice": {"type": "maybe"}}, "tool_choice.type"),
        ({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_x", "content": "x"}]}]},
         "messages[0].content[0].tool_use_id"),
        ({"model": "m", "max_tokens": 8, "messages": [{"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": []}]}]},
         "messages[0].content[0].input"),
        ({"model": "m", "max_tokens": 8, "messages": USER,
          "thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
        ({"model": "m", "max_tokens": 8, "messages": USER,
          "thinking": {"type": "sometimes"}}, "thinking.type"),
        ({"model": "m", "max_tokens": 8, "messages": USER, "stop_sequences": [1]},
         "stop_sequences[0]"),
        ({"model": "m", "max_tokens": 8, "messages": USER, "temperature": "x"}, "temperature"),
        ({"model": "m", "max_tokens": 8, "messages": USER, "n": 2}, "n"),
    ],
)  # fmt: skip
def test_bad_requests_name_the_field(body, param):
    error = rejected(body)
    assert error.status == 400 and error.param == param, error.message
    assert param in error.message
    assert error_body(error) == {
        "type": "error", "error": {"type": "invalid_request_error", "message": error.message}
    }  # fmt: skip


@pytest.mark.parametrize(
    ("status", "kind"),
    [(401, "authentication_error"), (404, "not_found_error"), (413, "request_too_large"),
     (429, "rate_limit_error"), (500, "api_error"), (503, "overloaded_error")],
)  # fmt: skip
def test_error_types_by_status(status, kind):
    assert error_body(ApiError("x", status))["error"]["type"] == kind


def test_stop_reasons():
    assert stop_of("length", None) == ("max_tokens", None)
    assert stop_of("stop", "END") == ("stop_sequence", "END")
    assert stop_of("stop", 2) == ("end_turn", None)  # EOS or a stop token id
    assert stop_of("stop", None) == ("end_turn", None)
    assert stop_of("abort", None) == (None, None)


def usage(prompt: int, completion: int, cached: int = 0) -> UsageSum:
    return UsageSum(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached)


def test_message_body_validates():
    body = message_body(HEAD, [text_block("Hi")], ("end_turn", None), usage_body(usage(10, 2, 4)))
    message = Message.model_validate(body)
    assert message.content[0].text == "Hi" and message.stop_reason == "end_turn"
    assert message.usage.input_tokens == 6 and message.usage.cache_read_input_tokens == 4
    assert message.usage.output_tokens == 2


def test_stream_events_validate_against_the_client_types():
    events = MessageEvents(HEAD)
    out = events.start(10) + events.text("Hel") + events.text("") + events.text("lo")
    out += events.finish(("stop_sequence", "END"), usage(10, 3))
    assert [name for name, _ in out] == [
        "message_start", "content_block_start", "ping", "content_block_delta",
        "content_block_delta", "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    for name, data in out:
        assert data["type"] == name
        if name != "ping":  # the client drops pings before parsing
            STREAM_EVENT.validate_python(data)
    assert out[0][1]["message"]["usage"] == {"input_tokens": 10, "output_tokens": 0}
    assert [d["delta"]["text"] for n, d in out if n == "content_block_delta"] == ["Hel", "lo"]
    assert out[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert out[-2][1]["usage"]["output_tokens"] == 3


def test_an_empty_answer_is_one_empty_text_block():
    events = MessageEvents(HEAD)
    out = events.start(3) + events.text("") + events.finish(("end_turn", None), usage(3, 1))
    names = [name for name, _ in out]
    assert names == ["message_start", "content_block_start", "ping", "content_block_stop",
                     "message_delta", "message_stop"]  # fmt: skip
    assert out[1][1]["content_block"] == {"type": "text", "text": ""}
    name, data = events.error(ApiError("gone", 503))
    assert name == "error"
    assert data == {"type": "error", "error": {"type": "overloaded_error", "message": "gone"}}


def test_tools_and_tool_choice_become_the_chat_fields():
    chat = parse_messages({"model": "m", "max_tokens": 8, "messages": USER, "tools": [TOOL],
                           "tool_choice": {"type": "tool", "name": "get_weather",
                                           "disable_parallel_tool_use": True},
                           "thinking": {"type": "enabled", "budget_tokens": 1024}}).chat
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "parameters": SCHEMA, "description": "Weather"}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["parallel_tool_calls"] is False
    request = parse_chat(chat).request
    assert request.tool_choice.function_name == "get_weather" and not request.parallel_tool_calls
    any_tool = chat_of({"messages": USER, "tools": [TOOL], "tool_choice": {"type": "any"}})
    assert any_tool.request.tool_choice.mode == 3  # REQUIRED
    assert "tool_choice" not in parse_messages({"model": "m", "max_tokens": 8, "messages": USER,
                                                "tool_choice": {"type": "none"}}).chat


def test_tool_use_and_tool_result_blocks_become_calls_and_tool_turns():
    messages = [
        *USER,
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "s"},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Oslo"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "sunny"}], "is_error": False},
            {"type": "text", "text": "And tomorrow?"},
        ]},
    ]  # fmt: skip
    chat = chat_of({"messages": messages, "tools": [TOOL]})
    turns = chat.request.chat.messages
    assert [m.role for m in turns] == ["user", "assistant", "tool", "user"]
    assert turns[1].content == "Let me look."
    (call,) = turns[1].tool_calls
    assert (call.id, call.name, call.arguments) == ("toolu_1", "get_weather", '{"city": "Oslo"}')
    assert (turns[2].tool_call_id, turns[2].content) == ("toolu_1", "sunny")
    assert turns[3].content == "And tomorrow?" and not chat.request.chat.continue_final_message


def test_parsed_content_blocks_and_tool_use_stop():
    from common.pb.tandem.v1 import generate_pb2
    from services.openai_api.messages_response import content_blocks

    parsed = generate_pb2.ParsedMessage(content="Sure.", reasoning_content="think")
    parsed.tool_calls.add(id="chatcmpl-tool-ab12", name="get_weather",
                          arguments='{"city": "Oslo"}')  # fmt: skip
    blocks = content_blocks("raw", parsed)
    body = message_body(HEAD, blocks, stop_of("stop", None, True), usage_body(usage(9, 5)))
    message = Message.model_validate(body)
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[0].thinking == "think" and message.content[0].signature
    assert message.content[2].id == "toolu_ab12" and message.content[2].input == {"city": "Oslo"}
    assert message.stop_reason == "tool_use"
    assert stop_of("tool_calls", None) == ("tool_use", None)
    assert content_blocks("", generate_pb2.ParsedMessage()) == [text_block("")]


def test_stream_of_thinking_text_and_tool_use_validates():
    from common.pb.tandem.v1 import generate_pb2

    def message(text="", reasoning="", calls=()):
        response = generate_pb2.GenerateResponse(text=text, reasoning_content=reasoning)
        for call in calls:
            response.tool_calls.add(**call)
        return response

    events = MessageEvents(HEAD)
    out = events.start(10) + events.message(message(reasoning="hm"))
    out += events.message(message(reasoning="m", text="Sure."))
    out += events.message(message(calls=[{"index": 0, "id": "chatcmpl-tool-1",
                                          "name": "get_weather", "arguments": '{"city"'}]))
    out += events.message(message(calls=[{"index": 0, "arguments": ': "Oslo"}'}]))
    out += events.finish(stop_of("stop", None, events.tool_used), usage(10, 7))
    assert [name for name, _ in out] == [
        "message_start", "content_block_start", "ping", "content_block_delta",
        "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    for name, data in out:
        if name != "ping":
            STREAM_EVENT.validate_python(data)
    deltas = [d["delta"] for n, d in out if n == "content_block_delta"]
    assert [d["type"] for d in deltas] == [
        "thinking_delta", "thinking_delta", "signature_delta", "text_delta",
        "input_json_delta", "input_json_delta"]  # fmt: skip
    starts = [d["content_block"] for n, d in out if n == "content_block_start"]
    assert starts[0] == {"type": "thinking", "thinking": "", "signature": ""}
    assert starts[2] == {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
    assert "".join(d["partial_json"] for d in deltas[4:]) == '{"city": "Oslo"}'
    assert [d["index"] for n, d in out if n == "content_block_stop"] == [0, 1, 2]
    assert out[-2][1]["delta"]["stop_reason"] == "tool_use"
