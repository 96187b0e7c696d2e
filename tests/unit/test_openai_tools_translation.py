"""The HTTP front's tool calling (services/openai_api/tools_request.py, chat_message.py):
OpenAI's tools, tool_choice, parallel_tool_calls and tool turns into the GenerateRequest,
shape errors as 400s naming the field, and the gateway's parsed answers out in vLLM's
shape (whole message, streamed deltas, finish reasons, reasoning tokens, no stop_reason
for an end-of-sequence token)."""

from __future__ import annotations

import json

import pytest

from common.pb.tandem.v1 import generate_pb2
from services.openai_api.chat_request import parse_chat
from services.openai_api.chat_response import ChatChunks, chat_body
from services.openai_api.collect import Collector, Meta
from services.openai_api.errors import ApiError

WEATHER = {"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}
ASK = [{"role": "user", "content": "hi"}]


def test_tools_choice_and_history_reach_the_request():
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    body = {
        "messages": history,
        "tools": [WEATHER, {"type": "function", "function": {"name": "t", "strict": True}}],
        "tool_choice": {"type": "function", "function": {"name": "t"}},
        "parallel_tool_calls": False,
    }
    request = parse_chat(body).request
    assert [t.name for t in request.tools] == ["w", "t"]
    assert json.loads(request.tools[0].parameters_json) == {"type": "object"}
    assert not request.tools[1].HasField("parameters_json") and request.tools[1].strict
    assert request.tool_choice.function_name == "t" and not request.parallel_tool_calls
    assistant, tool = request.chat.messages[1], request.chat.messages[2]
    assert assistant.content == "" and [(c.id, c.name) for c in assistant.tool_calls] == [
        ("c1", "w")
    ]
    assert tool.tool_call_id == "c1" and tool.content == "sunny"
    required = parse_chat({"messages": ASK, "tools": [WEATHER], "tool_choice": "required"})
    assert required.request.tool_choice.mode == generate_pb2.TOOL_CHOICE_MODE_REQUIRED


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
         "tools[0].function.parameters"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.function"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"messages": [*ASK, {"role": "tool", "tool_call_id": "c9", "content": "x"}]},
         "messages[1].tool_call_id"),
        ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)  # fmt: skip
def test_bad_tool_fields_are_400s_naming_them(extra, param):
    with pytest.raises(ApiError) as error:
        parse_chat({"messages": ASK, **extra})
    assert (error.value.status, error.value.param) == (400, param)


def last_message(**parsed) -> generate_pb2.GenerateResponse:
    message = generate_pb2.GenerateResponse(
        index=0, token_ids=[7], finish_reason=generate_pb2.FINISH_REASON_TOOL_CALLS
    )
    message.parsed.CopyFrom(generate_pb2.ParsedMessage(**parsed))
    message.usage.CopyFrom(generate_pb2.Usage(prompt_tokens=3, completion_tokens=1))
    return message


def test_whole_answer_from_the_parse():
    collector = Collector(n=1)
    call = generate_pb2.ToolCall(id="chatcmpl-tool-1", name="w", arguments='{"a": 1}')
    collector.add(
        0,
        last_message(
            reasoning_content="hmm",
            tool_calls=[call],
            finish_reason=generate_pb2.FINISH_REASON_TOOL_CALLS,
            reasoning_tokens=2,
        ),
    )
    body = chat_body(Meta("chatcmpl-x", 1, "m"), collector, False, False)
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None and choice["message"]["reasoning"] == "hmm"
    assert choice["message"]["tool_calls"] == [
        {
            "id": "chatcmpl-tool-1",
            "type": "function",
            "function": {"name": "w", "arguments": '{"a": 1}'},
        }
    ]
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2}


def test_streamed_deltas_carry_reasoning_and_call_pieces():
    chunks = ChatChunks(Meta("chatcmpl-x", 1, "m"), 1, False, False)
    message = generate_pb2.GenerateResponse(index=0, token_ids=[1], reasoning_content="r")
    message.tool_calls.add(index=0, id="chatcmpl-tool-1", name="w", arguments="")
    message.tool_calls.add(index=0, arguments='{"a"')
    delta = chunks.chunk(message)["choices"][0]["delta"]
    assert delta == {
        "reasoning": "r",
        "tool_calls": [
            {"index": 0, "id": "chatcmpl-tool-1", "type": "function",
             "function": {"name": "w", "arguments": ""}},
            {"index": 0, "function": {"arguments": '{"a"'}},
        ],
    }  # fmt: skip
    end = chunks.chunk(last_message())["choices"][0]
    assert end["finish_reason"] == "tool_calls" and end["delta"] == {"content": ""}


def test_an_end_of_sequence_stop_has_no_stop_reason():
    stop = generate_pb2.GenerateResponse(
        index=0, finish_reason=generate_pb2.FINISH_REASON_STOP, stop_token_id=2
    )
    eos = Collector(n=1, eos_ids=frozenset({2}))
    eos.add(0, stop)
    asked = Collector(n=1)
    asked.add(0, stop)
    assert eos.choices[0].stop_reason is None and asked.choices[0].stop_reason == 2
    chunks = ChatChunks(Meta("x", 1, "m", frozenset({2})), 1, False, False)
    assert chunks.chunk(stop)["choices"][0]["stop_reason"] is None


def test_vllms_structural_tag_extra_reaches_the_request():
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}
    for value in (tag, json.dumps(tag)):
        request = parse_chat({"messages": ASK, "structured_outputs": {"structural_tag": value}})
        assert json.loads(request.request.structured_output.structural_tag) == tag
