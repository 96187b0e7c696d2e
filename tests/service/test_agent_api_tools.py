"""Tool calling and reasoning through the Responses API (`/v1/responses`, the official
`openai` client) and Anthropic's Messages API (`/v1/messages`, the official `anthropic`
client) end to end, on the session's `tool_stack` (the tool checkpoint, its gateway with
the hermes tool parser and the deepseek_r1 reasoning parser). Calls are real: a forced
tool choice (named / required, Anthropic's "tool" / "any") constrains the random model's
output to a call whose arguments validate against the schema; the steering logit_bias
(`tests.tool_stack`) closes its reasoning at once. Checked: the output items / content
blocks, whole and streamed (their deltas add up to the whole), a two-step tool loop over
`previous_response_id` + `function_call_output` and over `tool_use` -> `tool_result`,
reasoning items / thinking blocks, and bad tool input as a 400 naming the field."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from tests.service.test_openai_api import post as post_raw
from tests.tool_stack import MODEL, WEATHER_SCHEMA, steering_bias

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather",
           "parameters": WEATHER_SCHEMA}  # fmt: skip
WEATHER_TOOL = {"name": "get_weather", "description": "Weather", "input_schema": WEATHER_SCHEMA}
ASK = "Weather in Paris?"


@pytest.fixture(scope="module")
def steer(tool_checkpoint) -> dict[str, float]:
    return {str(k): v for k, v in steering_bias(tool_checkpoint).items()}


@pytest.fixture(scope="module")
def oai(tool_stack):
    return openai.OpenAI(base_url=f"http://{tool_stack.spec.http_address}/v1",
                         api_key="unused", max_retries=0, timeout=120)  # fmt: skip


@pytest.fixture(scope="module")
def claude(tool_stack):
    return anthropic.Anthropic(base_url=f"http://{tool_stack.spec.http_address}",
                               api_key="unused", max_retries=0, timeout=120)  # fmt: skip


def respond(oai, steer, **kwargs):
    body = {"model": MODEL, "input": ASK, "temperature": 0, "max_output_tokens": 96,
            "tools": [WEATHER], "extra_body": {"logit_bias": steer}, **kwargs}  # fmt: skip
    return oai.responses.create(**body)


def test_responses_named_call_whole_and_streamed(oai, steer):
    named = {"type": "function", "name": "get_weather"}
    whole = respond(oai, steer, tool_choice=named)
    assert whole.status == "completed" and whole.tool_choice.name == "get_weather"
    (call,) = [item for item in whole.output if item.type == "function_call"]
    assert call.id.startswith("fc_") and call.call_id and call.name == "get_weather"
    assert call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    with oai.responses.stream(model=MODEL, input=ASK, temperature=0, max_output_tokens=96,
                              tools=[WEATHER], tool_choice=named,
                              extra_body={"logit_bias": steer}) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    (added,) = [e for e in events if e.type == "response.output_item.added"
                and e.item.type == "function_call"]  # fmt: skip
    assert added.item.arguments == "" and added.item.status == "in_progress"
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(deltas) == done.arguments
    assert json.loads(done.arguments) == json.loads(call.arguments)
    (streamed,) = [item for item in final.output if item.type == "function_call"]
    assert (streamed.id, streamed.call_id) == (added.item.id, added.item.call_id)
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_two_step_tool_loop_over_previous_response_id(oai, steer, tool_stack):
    first = respond(oai, steer, tool_choice="required", parallel_tool_calls=False)
    (call,) = first.output
    assert call.type == "function_call" and not first.parallel_tool_calls
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    second = respond(oai, steer, previous_response_id=first.id, input=[result],
                     tool_choice="none", max_output_tokens=4)  # fmt: skip
    assert [item.type for item in second.output] == ["message"]
    # the call and its result are in the prompt
    assert second.usage.input_tokens > first.usage.input_tokens + 10
    stored = oai.responses.retrieve(first.id)
    assert stored.output[0].call_id == call.call_id
    wrong = {**result, "call_id": "call_nope"}
    status, error = post(
        tool_stack,
        "/v1/responses",
        {"model": MODEL, "input": [wrong], "previous_response_id": first.id},
    )
    assert status == 400 and error["error"]["param"] == "input[0].call_id"


def test_responses_reasoning_item_whole_and_streamed(oai):
    """Unsteered, the random model never closes `<think>`: everything is reasoning."""
    whole = oai.responses.create(model=MODEL, input=ASK, temperature=0, max_output_tokens=12)
    (item,) = whole.output
    assert item.type == "reasoning" and item.id.startswith("rs_") and item.content[0].text
    assert whole.status == "incomplete"
    events = list(oai.responses.create(model=MODEL, input=ASK, temperature=0,
                                       max_output_tokens=12, stream=True))  # fmt: skip
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == item.content[0].text
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output[0].content[0].text == item.content[0].text


def test_messages_tool_use_whole_and_streamed(claude, steer):
    kwargs = {"model": MODEL, "max_tokens": 96, "tools": [WEATHER_TOOL],
              "messages": [{"role": "user", "content": ASK}],
              "tool_choice": {"type": "tool", "name": "get_weather"},
              "extra_body": {"temperature": 0, "logit_bias": steer}}  # fmt: skip
    whole = claude.messages.create(**kwargs)
    assert whole.stop_reason == "tool_use"
    (block,) = [b for b in whole.content if b.type == "tool_use"]
    assert block.id.startswith("toolu_") and block.name == "get_weather"
    jsonschema.validate(block.input, WEATHER_SCHEMA)
    with claude.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    tool_start = [s for s in starts if s.type == "tool_use"][0]
    assert tool_start.name == "get_weather" and tool_start.id.startswith("toolu_")
    partial = [
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert json.loads("".join(partial)) == block.input
    assert final.stop_reason == "tool_use"
    assert [b.input for b in final.content if b.type == "tool_use"] == [block.input]


def test_messages_tool_use_then_tool_result_loop(claude, steer):
    ask = [{"role": "user", "content": ASK}]
    tools = {"model": MODEL, "max_tokens": 96, "tools": [WEATHER_TOOL],
             "extra_body": {"temperature": 0, "logit_bias": steer}}  # fmt: skip
    # one call (parallel calls let a random model go on adding calls)
    any_one = {"type": "any", "disable_parallel_tool_use": True}
    first = claude.messages.create(messages=ask, tool_choice=any_one, **tools)
    (use,) = [b for b in first.content if b.type == "tool_use"]
    turns = [*ask, {"role": "assistant", "content": first.content},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                           "content": "sunny, 21 C"}]}]  # fmt: skip
    second = claude.messages.create(messages=turns, tool_choice={"type": "none"},
                                    **{**tools, "max_tokens": 4})  # fmt: skip
    assert second.stop_reason == "max_tokens" and second.content[0].type == "text"
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens > (
        first.usage.input_tokens + first.usage.cache_read_input_tokens + 10
    )


def test_messages_thinking_block(claude):
    got = claude.messages.create(model=MODEL, max_tokens=12, extra_body={"temperature": 0},
                                 thinking={"type": "enabled", "budget_tokens": 1024},
                                 messages=[{"role": "user", "content": ASK}])  # fmt: skip
    (block,) = got.content
    assert block.type == "thinking" and block.thinking and block.signature
    with claude.messages.stream(
        model=MODEL,
        max_tokens=12,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": ASK}],
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    pieces = [
        e.delta.thinking
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "thinking_delta"
    ]
    assert "".join(pieces) == block.thinking == final.content[0].thinking
    assert any(e.type == "content_block_delta" and e.delta.type == "signature_delta"
               for e in events)  # fmt: skip


def post(stack, path: str, body: dict) -> tuple[int, dict]:
    """A raw POST with the clients' credentials (a stored response is its owner's)."""
    return post_raw(stack, path, json.dumps(body).encode(), {"Authorization": "Bearer unused"})


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/responses", {"tools": [{**WEATHER, "parameters": "x"}]}, "tools[0].parameters"),
        ("/v1/responses", {"tools": [WEATHER], "tool_choice": {"type": "function",
                                                               "name": "nope"}}, "tool_choice"),
        ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "c",
                                      "output": "x"}]}, "input[0].call_id"),
        ("/v1/messages", {"tools": [{"name": "f", "input_schema": 3}]}, "tools[0].input_schema"),
        ("/v1/messages", {"tools": [WEATHER_TOOL], "tool_choice": {"type": "tool",
                                                                    "name": "nope"}},
         "tool_choice.name"),
        ("/v1/messages", {"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_x", "content": "x"}]}]},
         "messages[0].content[0].tool_use_id"),
    ],
)  # fmt: skip
def test_bad_tool_input_is_a_400_naming_the_field(tool_stack, path, body, param):
    base = (
        {"model": MODEL, "input": ASK}
        if path == "/v1/responses"
        else {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": ASK}]}
    )
    status, error = post(tool_stack, path, {**base, **body})
    assert status == 400
    if path == "/v1/responses":
        assert error["error"]["param"] == param
        assert error["error"]["type"] == "invalid_request_error"
    else:
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert error["error"]["message"].startswith(param)


def test_messages_stream_counts_the_tools_in_its_input_tokens(claude):
    """message_start's input_tokens are the rendered prompt's, tools included (as the
    unstreamed answer's usage)."""
    kwargs = {"model": MODEL, "max_tokens": 1, "tools": [WEATHER_TOOL],
              "tool_choice": {"type": "none"}, "extra_body": {"temperature": 0},
              "messages": [{"role": "user", "content": ASK}]}  # fmt: skip
    whole = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        start = next(e for e in stream if e.type == "message_start")
        list(stream)
    prompt = whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert start.message.usage.input_tokens == prompt
