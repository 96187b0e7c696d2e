"""Anthropic's Messages API (`/v1/messages`) end to end on the shared `api_stack`, called
with the official `anthropic` client: greedy output equal to HF `generate` on the chat
template's rendering of `system` + `messages`, `stop_sequences`, a prefilled assistant turn,
the stream's events, and errors in Anthropic's shape."""

from __future__ import annotations

import json

import anthropic
import httpx2
import pytest

from tests.hf_reference import hf_tokenizer
from tests.service.test_openai_api import chat_prompt_ids, greedy

MODEL = "tiny-llama"
SYSTEM, QUESTION = "You are terse.", "Name a color."
# The client (2.x) no longer has `temperature`; the API still takes it.
GREEDY = {"temperature": 0}
CONVERSATION = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def client(api_stack):
    return anthropic.Anthropic(
        base_url=f"http://{api_stack.spec.http_address}", api_key="unused", max_retries=0,
        timeout=120,
    )  # fmt: skip


def test_create_equals_hf_with_system_blocks(client, tiny_llama_dir):
    prompt = chat_prompt_ids(tiny_llama_dir, CONVERSATION)
    ids, text = greedy(tiny_llama_dir, prompt, 16)
    got = client.messages.create(
        model=MODEL, max_tokens=16, extra_body=GREEDY,
        system=[{"type": "text", "text": "You are "}, {"type": "text", "text": "terse."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
    )  # fmt: skip
    assert got.id.startswith("msg_") and got.type == "message" and got.role == "assistant"
    assert got.model == MODEL and [b.type for b in got.content] == ["text"]
    assert got.content[0].text == text
    eos = hf_tokenizer(str(tiny_llama_dir)).eos_token_id
    assert got.stop_reason == ("end_turn" if ids[-1] == eos else "max_tokens")
    assert got.stop_sequence is None
    assert got.usage.input_tokens + got.usage.cache_read_input_tokens == len(prompt)
    assert got.usage.output_tokens == len(ids)


def test_stop_sequence_cuts_and_is_named(client, tiny_llama_dir):
    _, text = greedy(tiny_llama_dir, chat_prompt_ids(tiny_llama_dir, CONVERSATION), 24)
    stop = text[len(text) // 2 :][:3]
    assert stop.strip(), text
    got = client.messages.create(
        model=MODEL, max_tokens=24, extra_body=GREEDY, system=SYSTEM, stop_sequences=[stop],
        messages=[{"role": "user", "content": QUESTION}],
    )  # fmt: skip
    assert got.content[0].text == text[: text.index(stop)]
    assert got.stop_reason == "stop_sequence" and got.stop_sequence == stop


def test_prefilled_assistant_turn_is_continued(client, tiny_llama_dir):
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "Blue"}]
    rendered = hf_tokenizer(str(tiny_llama_dir)).apply_chat_template(
        messages, continue_final_message=True
    )
    _, text = greedy(tiny_llama_dir, list(rendered["input_ids"]), 8)
    got = client.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, messages=messages)
    assert got.content[0].text == text


def sse_events(address: str, body: dict) -> list[tuple[str, dict]]:
    """The (event name, data) pairs of a raw SSE answer (the client drops `ping`)."""
    with httpx2.Client(timeout=60) as http:
        reply = http.post(f"http://{address}/v1/messages", json=body)
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in reply.text.strip().split("\n\n"):
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


def test_stream_events_and_helper(client, api_stack):
    kwargs = dict(model=MODEL, max_tokens=12, system=SYSTEM,
                  messages=[{"role": "user", "content": QUESTION}])  # fmt: skip
    plain = client.messages.create(**kwargs, extra_body=GREEDY)
    events = sse_events(api_stack.spec.http_address, {**kwargs, **GREEDY, "stream": True})
    names = [name for name, _ in events]
    deltas = names.count("content_block_delta")
    assert names == [
        "message_start", "content_block_start", "ping",
        *["content_block_delta"] * deltas, "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    assert all(data["type"] == name for name, data in events)
    text = "".join(data["delta"]["text"] for name, data in events if name == "content_block_delta")
    assert text == plain.content[0].text
    prompt_tokens = plain.usage.input_tokens + plain.usage.cache_read_input_tokens
    assert events[0][1]["message"]["usage"] == {"input_tokens": prompt_tokens, "output_tokens": 0}
    assert events[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}

    with client.messages.stream(**kwargs, extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == final.content[0].text == text
    assert final.id.startswith("msg_") and final.id != plain.id
    assert final.stop_reason == plain.stop_reason == "max_tokens"
    assert final.usage.output_tokens == plain.usage.output_tokens == 12
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == prompt_tokens


@pytest.mark.parametrize(
    ("body", "status", "kind", "names"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error",
         "max_tokens"),
        ({"max_tokens": 4, "messages": []}, 400, "invalid_request_error", "messages"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": "1"}]}]},
         400, "invalid_request_error", "messages[0].content[0].tool_use_id"),
        # tools on a gateway without --tool-call-parser: "auto" is refused, as in vLLM
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
          "tools": [{"name": "f", "input_schema": {"type": "object"}}]},
         400, "invalid_request_error", "tool_choice"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "model": "nope"},
         404, "not_found_error", "nope"),
    ],
)  # fmt: skip
def test_errors_in_anthropic_shape(client, body, status, kind, names):
    with pytest.raises(anthropic.APIStatusError) as info:
        client.post("/v1/messages", body={"model": MODEL, **body}, cast_to=object)
    assert info.value.status_code == status
    error = info.value.response.json()
    assert error["type"] == "error" and error["error"]["type"] == kind
    assert names in error["error"]["message"]
