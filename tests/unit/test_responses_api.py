"""The Responses API's pure parts: a request's conversion to the chat-completions request
(`parse_chat` of its chat body), the response store's size limit and expiry, and the stream
events, each checked against the official `openai` client's types."""

from __future__ import annotations

import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from services.openai_api.chat_request import parse_chat
from services.openai_api.collect import UsageSum
from services.openai_api.errors import ApiError
from services.openai_api.response_store import ResponseStore
from services.openai_api.responses_events import ResponseEvents
from services.openai_api.responses_request import parse_responses
from services.openai_api.responses_response import (
    ResponseHead,
    message_item,
    response_body,
    response_id,
)

HEAD = ResponseHead("resp_abc", 1700000000, "m")
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather",
        "parameters": SCHEMA, "strict": True}  # fmt: skip
STREAM_EVENT = pydantic.TypeAdapter(ResponseStreamEvent)


def chat_of(body: dict, history=()):
    return parse_chat(parse_responses(body).chat_body(history))


def roles(chat) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in chat.request.chat.messages]


def rejected(body: dict) -> ApiError:
    with pytest.raises(ApiError) as info:
        chat_of(body)
    return info.value


def test_string_input_with_instructions_is_the_chat_request():
    chat = chat_of({"input": "Hi", "instructions": "Be brief.", "max_output_tokens": 9,
                    "temperature": 0.5, "top_p": 0.5, "top_k": 3})  # fmt: skip
    assert roles(chat) == [("system", "Be brief."), ("user", "Hi")]
    assert chat.request.max_tokens == 9 and chat.request.sampling.top_k == 3
    assert chat.request.sampling.temperature == 0.5 and chat.request.sampling.top_p == 0.5
    same = parse_chat({"messages": [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Hi"}],
                       "max_completion_tokens": 9, "temperature": 0.5, "top_p": 0.5,
                       "top_k": 3})  # fmt: skip
    assert chat.request == same.request


def test_items_passed_back_and_history_order():
    output = message_item("msg_1", "Blue.", "completed")
    body = {
        "input": [
            {"role": "developer", "content": "Rules"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                             {"type": "input_text", "text": "b"}]},
            output,
        ],
        "instructions": "Sys",
    }  # fmt: skip
    history = ({"role": "user", "content": "earlier"}, {"role": "assistant", "content": "ok"})
    assert roles(chat_of(body, history)) == [
        ("system", "Sys"), ("user", "earlier"), ("assistant", "ok"), ("system", "Rules"),
        ("user", "a\nb"), ("assistant", "Blue."),
    ]  # fmt: skip


def test_text_format_becomes_structured_output():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    form = {"type": "json_schema", "name": "n", "schema": schema, "strict": True}
    chat = chat_of({"input": "x", "text": {"format": form}})
    assert chat.request.structured_output.json_schema
    chat = chat_of({"input": "x", "text": {"format": {"type": "json_object"}}})
    assert chat.request.structured_output.json_object


def test_defaults_echoed():
    parsed = parse_responses({"input": "x"})
    assert parsed.store and not parsed.stream and parsed.previous_response_id is None
    assert parsed.echo["tool_choice"] == "auto" and parsed.echo["tools"] == []
    assert parsed.echo["temperature"] == 1.0 and parsed.echo["max_output_tokens"] is None
    assert not parse_responses({"input": "x", "store": False}).store


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"input": []}, "input"),
        ({"input": [{"role": "user", "content": 3}]}, "input[0].content"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
         "input[0].content[0].type"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id"),
        ({"input": [{"type": "custom_tool_call", "name": "f"}]}, "input[0].type"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]},
         "input[0].call_id"),
        ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "z"}]},
         "input[0].encrypted_content"),
        ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": "x"}]},
         "tools[0].parameters"),
        ({"input": "x", "tools": [TOOL, TOOL]}, "tools[1].name"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "g"}},
         "tool_choice"),
        ({"input": "x", "tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
        ({"input": "x", "reasoning": {"effort": "low", "x": 1}}, "reasoning.x"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "previous_response_id": 7}, "previous_response_id"),
        ({"input": "x", "metadata": {"k": 1}}, "metadata"),
        ({"input": "x", "stream_options": {}}, "stream_options"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": "x", "stop": "y"}, "stop"),
    ],
)  # fmt: skip
def test_bad_requests_name_the_field(body, param):
    error = rejected(body)
    assert error.status == 400 and error.param == param, error.message
    assert error.body()["error"]["type"] == "invalid_request_error"


def test_store_expires_and_deletes():
    now = [0.0]
    store = ResponseStore(10_000, ttl_s=60, clock=lambda: now[0])
    store.put("a", {"id": "a"}, (), [{"role": "user", "content": "hi"}])
    assert store.get("a").conversation == ({"role": "user", "content": "hi"},)
    now[0] = 59.9
    assert store.get("a") is not None
    now[0] = 60.0
    assert store.get("a") is None and len(store) == 0 and store.bytes_held == 0
    store.put("b", {"id": "b"}, (), [])
    assert store.delete("b") and not store.delete("b") and store.get("b") is None


def test_store_evicts_least_recently_used_past_its_size():
    store = ResponseStore(3 * 300, ttl_s=60)
    for key in "abc":
        store.put(key, {"id": key}, (), [])
    assert len(store) == 3
    store.get("a")  # now the most recently used
    store.put("d", {"id": "d"}, (), [])
    assert store.get("b") is None and all(store.get(k) for k in "acd")
    assert store.bytes_held <= store.max_bytes
    store.put("huge", {"text": "x" * 10_000}, (), [])  # larger than the store: not kept
    assert store.get("huge") is None and len(store) == 3
    nothing = ResponseStore(0, ttl_s=60)
    nothing.put("a", {}, (), [])
    assert nothing.get("a") is None


def test_store_conversation_shares_its_history():
    store = ResponseStore(1 << 20, ttl_s=60)
    turn = [{"role": "user", "content": "x" * 1000}, {"role": "assistant", "content": "y"}]
    store.put("a", {}, (), turn)
    history = store.get("a").conversation
    store.put("b", {}, history, [{"role": "user", "content": "z"}])
    entry = store.get("b")
    assert entry.conversation[:2] == history and entry.conversation[0] is turn[0]
    assert entry.size < store.get("a").size  # the shared messages count as pointers


def usage(prompt: int, completion: int) -> UsageSum:
    return UsageSum(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=2)


def test_stream_events_validate_against_the_client_types():
    parsed = parse_responses({"input": "x", "stream": True, "max_output_tokens": 3})
    events = ResponseEvents(HEAD, parsed)
    out = events.start() + events.delta("Hel") + events.delta("") + events.delta("lo")
    closing, final = events.finish("incomplete", usage(5, 3))
    out += closing
    assert [e["type"] for e in out] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.incomplete",
    ]  # fmt: skip
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    for event in out:
        STREAM_EVENT.validate_python(event)
    response = Response.model_validate(final)
    assert response.output_text == "Hello" and response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == 5 and response.usage.output_tokens == 3
    assert response.usage.input_tokens_details.cached_tokens == 2
    assert out[-1]["response"] is final and final["output"][0]["id"] == out[2]["item"]["id"]
    assert out[6]["text"] == "Hello" and out[8]["item"]["status"] == "incomplete"


def test_an_empty_answer_still_has_its_message_and_completes():
    events = ResponseEvents(HEAD, parse_responses({"input": "x"}))
    out = events.start() + events.delta("")
    closing, final = events.finish("completed", usage(4, 1))
    types = [e["type"] for e in out + closing]
    assert types[2:] == [
        "response.output_item.added", "response.content_part.added",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert Response.model_validate(final).output_text == ""
    error = events.error(ApiError("boom", 503))
    assert STREAM_EVENT.validate_python(error).message == "boom"
    assert error["sequence_number"] == len(out) + len(closing)


def test_response_body_validates_and_ids():
    parsed = parse_responses({"input": "x", "metadata": {"k": "v"}, "user": "u"})
    body = response_body(HEAD, parsed, [message_item("msg_1", "t", "completed")], "completed",
                         usage(3, 1))  # fmt: skip
    response = Response.model_validate(body)
    assert response.metadata == {"k": "v"} and response.user == "u"
    assert response.tool_choice == "auto" and response.parallel_tool_calls
    assert response_id("1b4e28ba-2fa1-41d2-883f-0016d3cca427") == (
        "resp_1b4e28ba2fa141d2883f0016d3cca427"
    )


def test_tools_and_tool_choice_become_the_chat_fields():
    named = {"type": "function", "name": "get_weather"}
    parsed = parse_responses({"input": "x", "tools": [TOOL], "tool_choice": named,
                              "parallel_tool_calls": False})  # fmt: skip
    body = parsed.chat_body()
    assert body["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather", "parameters": SCHEMA, "strict": True}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert body["parallel_tool_calls"] is False
    request = parse_chat(body).request
    assert request.tools[0].name == "get_weather" and not request.parallel_tool_calls
    assert request.tool_choice.function_name == "get_weather"
    response = Response.model_validate(response_body(HEAD, parsed, [], "completed", usage(1, 1)))
    assert response.tools[0].name == "get_weather" and response.tool_choice.name == "get_weather"
    assert not response.parallel_tool_calls
    required = parse_responses({"input": "x", "tools": [TOOL], "tool_choice": "required"})
    assert parse_chat(required.chat_body()).request.tool_choice.mode == 3  # REQUIRED
    assert "tools" not in parse_responses({"input": "x", "tools": []}).chat_body()


def test_tool_items_become_assistant_calls_and_tool_turns():
    call = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
            "arguments": '{"city": "Paris"}', "status": "completed"}  # fmt: skip
    second = {**call, "call_id": "call_2"}
    body = {"input": [
        {"role": "user", "content": "Weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "hmm"}]},
        message_item("msg_1", "Let me see.", "completed"), call, second,
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "rain"}]},
    ], "tools": [TOOL]}  # fmt: skip
    messages = parse_chat(parse_responses(body).chat_body()).request.chat.messages
    assert [m.role for m in messages] == ["user", "assistant", "tool", "tool"]
    assert messages[1].content == "Let me see."
    assert [(c.id, c.name) for c in messages[1].tool_calls] == [
        ("call_1", "get_weather"), ("call_2", "get_weather")]
    assert [(m.tool_call_id, m.content) for m in messages[2:]] == [
        ("call_1", "sunny"), ("call_2", "rain")]


def test_an_output_answers_a_call_of_the_stored_conversation():
    output = {"type": "function_call_output", "call_id": "call_9", "output": "ok"}
    parsed = parse_responses({"input": [output]})
    call = {"id": "call_9", "type": "function",
            "function": {"name": "f", "arguments": "{}"}}  # fmt: skip
    history = ({"role": "user", "content": "go"},
               {"role": "assistant", "content": None, "tool_calls": [call]})  # fmt: skip
    messages = parse_chat(parsed.chat_body(history)).request.chat.messages
    assert [m.role for m in messages] == ["user", "assistant", "tool"]
    with pytest.raises(ApiError) as info:
        parsed.chat_body(history[:1])
    assert info.value.param == "input[0].call_id"


def test_parsed_output_items_and_the_stored_turn():
    from common.pb.tandem.v1 import generate_pb2
    from services.openai_api.responses_response import output_items, stored_turn

    parsed = generate_pb2.ParsedMessage(content="Sure. ", reasoning_content="think")
    parsed.tool_calls.add(id="chatcmpl-tool-1", name="get_weather", arguments='{"city": "Oslo"}')
    items = output_items("raw", parsed, "completed")
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call"]
    assert items[0]["id"].startswith("rs_") and items[2]["id"].startswith("fc_")
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "think"}]
    assert items[2]["call_id"] == "chatcmpl-tool-1" and items[2]["status"] == "completed"
    request = parse_responses({"input": "x", "reasoning": {"effort": "low"}})
    body = response_body(HEAD, request, items, "completed", usage(3, 4))
    response = Response.model_validate(body)
    assert response.output_text == "Sure. " and response.reasoning.effort == "low"
    assert response.output[2].arguments == '{"city": "Oslo"}'
    turn = stored_turn(request, items)[-1]
    assert turn == {"role": "assistant", "content": "Sure. ", "tool_calls": [
        {"id": "chatcmpl-tool-1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}  # fmt: skip
    only_calls = generate_pb2.ParsedMessage()
    only_calls.tool_calls.add(id="c", name="f", arguments="{}")
    assert [i["type"] for i in output_items("", only_calls, "completed")] == ["function_call"]
    assert stored_turn(request, output_items("", only_calls, "completed"))[-1]["content"] is None
    assert [i["type"] for i in output_items("", generate_pb2.ParsedMessage(), "completed")] == [
        "message"]


def test_stream_of_reasoning_text_and_calls_validates():
    from common.pb.tandem.v1 import generate_pb2

    def message(text="", reasoning="", calls=()):
        response = generate_pb2.GenerateResponse(text=text, reasoning_content=reasoning)
        for call in calls:
            response.tool_calls.add(**call)
        return response

    events = ResponseEvents(HEAD, parse_responses({"input": "x", "tools": [TOOL]}))
    out = events.start()
    out += events.message(message(reasoning="hm"))
    out += events.message(message(reasoning="m", text="Sure."))
    out += events.message(message(calls=[{"index": 0, "id": "call_a", "name": "get_weather",
                                          "arguments": '{"city"'}]))  # fmt: skip
    out += events.message(message(calls=[{"index": 0, "arguments": ': "Oslo"}'},
                                         {"index": 1, "id": "call_b", "name": "get_weather"}]))
    out += events.message(message(calls=[{"index": 1, "arguments": "{}"}]))
    closing, final = events.finish("completed", usage(5, 9))
    out += closing
    assert [e["type"] for e in out] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    for event in out:
        STREAM_EVENT.validate_python(event)
    response = Response.model_validate(final)
    assert [item.type for item in response.output] == [
        "reasoning", "message", "function_call", "function_call"]
    assert response.output[0].content[0].text == "hmm" and response.output_text == "Sure."
    assert [(i.call_id, i.arguments) for i in response.output[2:]] == [
        ("call_a", '{"city": "Oslo"}'), ("call_b", "{}")]
    indexes = [e["output_index"] for e in out if e["type"] == "response.output_item.done"]
    assert indexes == [0, 1, 2, 3]
    done = [e for e in out if e["type"] == "response.function_call_arguments.done"]
    assert done[0]["name"] == "get_weather" and done[0]["arguments"] == '{"city": "Oslo"}'
