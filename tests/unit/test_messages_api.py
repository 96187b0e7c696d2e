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
          "tools": [{"name": "f", "input_schema": {}}]}, "tools"),
        ({"model": "m", "max_tokens": 8, "messages": USER, "tool_choice": {"type": "any"}},
         "tool_choice.type"),
        ({"model": "m", "max_tokens": 8, "messages": USER,
          "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
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
