"""Tool calling and reasoning output end to end (issue 46): a real stack on the tool
checkpoint (`devtools.tool_checkpoint`: a tiny Qwen2 with a Hermes/Qwen tool template),
its gateway started with `--chat-template`, `--enable-auto-tool-choice --tool-call-parser
hermes --reasoning-parser deepseek_r1`. Called with the official `openai` client (tools,
streamed and not), over gRPC, and by an OpenAI Agents SDK agent running a two-step tool
loop. Calls are real: the worker's xgrammar grammar forces them (tool_choice required or
named, or a regex in auto), and their arguments must validate against the function's
schema. With the reasoning parser the grammar starts after `</think>` (as in vLLM): a
logit_bias on `</think>` makes the random model close its reasoning at once (and one
against whitespace-only tokens keeps it from filling the JSON with them: a structural tag's
JSON allows any whitespace). Bad input is a 400 naming the field (INVALID_ARGUMENT over
gRPC)."""

from __future__ import annotations

import json
from typing import Literal

import grpc
import jsonschema
import openai
import pytest

from common.pb.tandem.v1 import generate_pb2, generate_pb2_grpc
from tests.tool_stack import MODEL, WEATHER_SCHEMA, steering_bias

WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER_SCHEMA},
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"enum": ["UTC", "CET"]}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL_REGEX = (
    r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}</tool_call>'
)


@pytest.fixture(scope="module")
def model(tool_checkpoint):
    return tool_checkpoint


@pytest.fixture(scope="module")
def steer(model) -> dict[int, float]:
    return steering_bias(model)


@pytest.fixture(scope="module")
def stack(tool_stack):
    return tool_stack


@pytest.fixture(scope="module")
def client(stack, steer):
    client = openai.OpenAI(
        base_url=f"http://{stack.spec.http_address}/v1", api_key="unused", max_retries=0,
        timeout=120,
    )  # fmt: skip
    client.steer = {str(k): v for k, v in steer.items()}
    return client


def chat(client, stream=False, **kwargs):
    """A greedy chat answer, steered (reasoning closed at once, no whitespace) unless
    `logit_bias` is given."""
    body = {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 96, **kwargs}
    body.setdefault("logit_bias", client.steer)
    return client.chat.completions.create(stream=stream, **body)


def check_weather_args(arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), WEATHER_SCHEMA)


def assembled(chunks) -> tuple[dict, dict[int, dict]]:
    """A stream's content/finish and its calls put together; checks each call's first
    piece carries id, type and name, and later ones only arguments."""
    out, calls = {"content": "", "finish_reason": None}, {}
    for chunk in chunks:
        for choice in chunk.choices:
            out["content"] += choice.delta.content or ""
            out["finish_reason"] = choice.finish_reason or out["finish_reason"]
            for piece in choice.delta.tool_calls or []:
                if piece.index not in calls:
                    assert piece.id and piece.type == "function" and piece.function.name
                    calls[piece.index] = {"name": piece.function.name, "arguments": ""}
                else:
                    assert piece.id is None and piece.function.name is None
                calls[piece.index]["arguments"] += piece.function.arguments or ""
    return out, calls


def test_named_function_whole_and_streamed(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    whole = chat(client, tools=[WEATHER, TIME], tool_choice=choice).choices[0]
    assert whole.finish_reason == "stop" and whole.message.content == ""  # as vLLM
    (call,) = whole.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    check_weather_args(call.function.arguments)
    out, calls = assembled(chat(client, True, tools=[WEATHER, TIME], tool_choice=choice))
    assert out == {"content": "", "finish_reason": "stop"}
    assert calls == {0: {"name": "get_weather", "arguments": call.function.arguments}}


def test_required_whole_and_streamed(client):
    """parallel_tool_calls=false: the grammar allows one call (maxItems 1), so the answer
    ends (with parallel calls allowed a random model goes on adding calls)."""
    asked = {"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False}
    whole = chat(client, **asked).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == ""
    (call,) = whole.message.tool_calls
    assert call.function.name in ("get_weather", "get_time")
    if call.function.name == "get_weather":
        check_weather_args(call.function.arguments)
    out, calls = assembled(chat(client, True, **asked))
    assert out == {"content": "", "finish_reason": "tool_calls"}
    assert list(calls) == [0] and calls[0]["name"] == call.function.name
    # streamed as written, whole re-serialized (both as vLLM)
    assert json.loads(calls[0]["arguments"]) == json.loads(call.function.arguments)


def test_auto_parses_hermes_calls(client):
    extra = {"structured_outputs": {"regex": "Sure\\. " + CALL_REGEX}}
    whole = chat(client, tools=[WEATHER], extra_body=extra).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Sure. "
    (call,) = whole.message.tool_calls
    assert call.id.startswith("chatcmpl-tool-") and call.function.name == "get_weather"
    check_weather_args(call.function.arguments)
    out, calls = assembled(chat(client, True, tools=[WEATHER], extra_body=extra))
    assert out == {"content": "Sure. ", "finish_reason": "tool_calls"}
    assert json.loads(calls[0]["arguments"]) == json.loads(call.function.arguments)


def test_history_with_a_tool_result_renders_through_the_template(client):
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    extra = {"structured_outputs": {"regex": "It is sunny\\."}}
    reply = chat(client, messages=history, tools=[WEATHER], extra_body=extra)
    choice = reply.choices[0]
    assert choice.message.content == "It is sunny." and not choice.message.tool_calls
    first = chat(client, tools=[WEATHER], extra_body=extra)
    assert reply.usage.prompt_tokens > first.usage.prompt_tokens + 10  # the call and its result


def test_reasoning_is_split_off_whole_and_streamed(client, stack):
    whole = chat(client, messages=ASK, max_tokens=12, logit_bias={}).choices[0]
    reasoning = whole.message.model_extra["reasoning"]
    assert reasoning and whole.message.content is None  # no </think>: all reasoning
    stream = chat(client, True, messages=ASK, max_tokens=12, logit_bias={})
    pieces = [c.choices[0].delta.model_extra.get("reasoning") or "" for c in stream if c.choices]
    assert "".join(pieces) == reasoning
    with grpc.insecure_channel(stack.spec.gateway_address) as channel:
        request = generate_pb2.GenerateRequest(max_tokens=12)
        request.chat.messages.add(role="user", content=ASK[0]["content"])
        request.sampling.temperature = 0
        messages = list(generate_pb2_grpc.GenerateServiceStub(channel).Generate(request))
    assert "".join(m.reasoning_content for m in messages) == reasoning
    assert all(not m.text for m in messages)
    assert messages[-1].parsed.reasoning_content == reasoning


def test_grpc_generate_carries_the_calls(stack, steer):
    request = generate_pb2.GenerateRequest(max_tokens=96)
    request.chat.messages.add(role="user", content="Weather?")
    request.sampling.temperature = 0
    request.sampling.logit_bias.update(steer)
    request.tools.add(name="get_weather", parameters_json=json.dumps(WEATHER_SCHEMA))
    request.tool_choice.function_name = "get_weather"
    with grpc.insecure_channel(stack.spec.gateway_address) as channel:
        messages = list(generate_pb2_grpc.GenerateServiceStub(channel).Generate(request))
    pieces = [p for m in messages for p in m.tool_calls]
    assert pieces[0].id and pieces[0].name == "get_weather"
    arguments = "".join(p.arguments for p in pieces)
    check_weather_args(arguments)
    (call,) = messages[-1].parsed.tool_calls
    assert (call.id, call.name, call.arguments) == (pieces[0].id, "get_weather", arguments)


def status_of(stack, body: dict) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        f"http://{stack.spec.http_address}/v1/chat/completions",
        data=json.dumps({"messages": ASK, "max_tokens": 4, **body}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())["error"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
         "tools[0].function.parameters"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": []}, "tools"),
        ({"messages": [*ASK, {"role": "tool", "tool_call_id": "nope", "content": "x"}]},
         "messages[1].tool_call_id"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400_naming_the_field(stack, body, param):
    status, error = status_of(stack, body)
    assert status == 400 and error["param"] == param and error["type"] == "invalid_request_error"


def test_bad_schemas_are_named_by_the_gateway(stack):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "banana"}}}
    status, error = status_of(stack, {"tools": [bad], "tool_choice": "required"})
    assert status == 400 and "tools[0].parameters_json.type must be one of" in error["message"]
    request = generate_pb2.GenerateRequest()
    request.chat.messages.add(role="user", content="x")
    request.tools.add(name="f", parameters_json='{"properties": []}')
    with grpc.insecure_channel(stack.spec.gateway_address) as channel:
        with pytest.raises(grpc.RpcError) as failure:
            list(generate_pb2_grpc.GenerateServiceStub(channel).Generate(request))
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert failure.value.details().startswith("tools[0].parameters_json.properties must be")


def test_auto_needs_the_gateway_flag(api_stack):
    """A gateway without --tool-call-parser refuses tool_choice auto, as vLLM does."""
    status, error = status_of(api_stack, {"tools": [WEATHER]})
    assert status == 400
    assert '"auto" tool choice requires --enable-auto-tool-choice' in error["message"]
    assert error["message"].startswith("tool_choice")


def test_an_agent_runs_a_two_step_tool_loop(stack, steer):
    """OpenAI Agents SDK on chat completions: the first turn must call the tool (required);
    the SDK runs it, sends the result back and resets tool_choice to auto; the second turn
    answers in text (a regex makes the random model's text short) and the run ends."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    seen: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"sunny in {city}"

    client = openai.AsyncOpenAI(
        base_url=f"http://{stack.spec.http_address}/v1", api_key="unused", max_retries=0
    )
    agent = Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        tools=[get_weather],
        model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
        model_settings=ModelSettings(
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=96,
            extra_body={
                "structured_outputs": {"regex": "It is sunny\\."},
                "logit_bias": {str(k): v for k, v in steer.items()},
            },
        ),
    )
    result = Runner.run_sync(agent, "Weather in Paris?", max_turns=3)
    assert len(seen) == 1 and seen[0] in ("Paris", "Rome")
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]
    assert kinds[-1] == "message_output_item" and result.final_output == "It is sunny."


def test_tokenize_and_return_token_ids_render_the_tools(client, stack):
    """/tokenize with tools and a chat answer's prompt_token_ids are the prompt Generate
    ran: its usage counts them."""
    import urllib.request

    body = {"messages": ASK, "tools": [WEATHER]}
    request = urllib.request.Request(
        f"http://{stack.spec.http_address}/tokenize",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        tokens = json.loads(reply.read())["tokens"]
    reply = chat(client, tools=[WEATHER], max_tokens=4, extra_body={"return_token_ids": True})
    assert reply.model_extra["prompt_token_ids"] == tokens
    assert reply.usage.prompt_tokens == len(tokens)
    plain = chat(client, max_tokens=4, extra_body={"return_token_ids": True})
    assert len(plain.model_extra["prompt_token_ids"]) < len(tokens)
