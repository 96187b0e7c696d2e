"""The Responses API (`/v1/responses`) end to end on the shared `api_stack`, called with the
official `openai` client: greedy output equal to HF `generate` on the chat template's
rendering of `instructions` + `input` (and a `previous_response_id`'s stored conversation),
the typed stream events, the store's GET and DELETE, and errors naming the field."""

from __future__ import annotations

import openai
import pytest

from tests.hf_reference import hf_tokenizer
from tests.service.test_openai_api import chat_prompt_ids, greedy
from tests.stack_client import http_front

MODEL = "tiny-llama"
TEXT_EVENTS = [
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
]
CLOSING_EVENTS = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


@pytest.fixture(scope="module")
def client(api_stack):
    return openai.OpenAI(
        base_url=f"http://{api_stack.spec.http_address}/v1", api_key="unused", max_retries=0,
        timeout=120,
    )  # fmt: skip


def expected(model_dir, messages: list[dict], max_tokens: int) -> tuple[list[int], list, str]:
    """(prompt ids, HF's greedy ids, their text) for a chat conversation."""
    prompt = chat_prompt_ids(model_dir, messages)
    ids, text = greedy(model_dir, prompt, max_tokens)
    return prompt, ids, text


def test_create_equals_hf_then_get_and_delete(client, tiny_llama_dir):
    instructions, question = "You are terse.", "Name a color."
    messages = [{"role": "system", "content": instructions}, {"role": "user", "content": question}]
    prompt, ids, text = expected(tiny_llama_dir, messages, 16)
    got = client.responses.create(
        model=MODEL, instructions=instructions, input=question, max_output_tokens=16,
        temperature=0,
    )  # fmt: skip
    assert got.id.startswith("resp_") and got.object == "response" and got.model == MODEL
    assert got.output_text == text
    (item,) = got.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    eos = hf_tokenizer(str(tiny_llama_dir)).eos_token_id
    finished = ids[-1] == eos
    assert got.status == ("completed" if finished else "incomplete")
    if not finished:
        assert got.incomplete_details.reason == "max_output_tokens"
    assert got.usage.input_tokens == len(prompt) and got.usage.output_tokens == len(ids)
    assert got.usage.total_tokens == len(prompt) + len(ids)
    assert got.instructions == instructions and got.max_output_tokens == 16
    assert got.temperature == 0 and got.previous_response_id is None

    assert client.responses.retrieve(got.id).model_dump() == got.model_dump()
    client.responses.delete(got.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(got.id)
    assert info.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(got.id)


def test_previous_response_id_continues_without_its_instructions(client, tiny_llama_dir):
    first = client.responses.create(
        model=MODEL, instructions="Be brief.", input=[{"role": "user", "content": "Hi there"}],
        max_output_tokens=8, temperature=0,
    )  # fmt: skip
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, max_output_tokens=12, temperature=0,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "And then?"}]}],
    )  # fmt: skip
    messages = [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]
    prompt, ids, text = expected(tiny_llama_dir, messages, 12)
    assert second.output_text == text and second.previous_response_id == first.id
    assert second.usage.input_tokens == len(prompt)
    # The output items passed back as input (as agent loops do) mean the same conversation.
    again = client.responses.create(
        model=MODEL, max_output_tokens=12, temperature=0,
        input=[messages[0], *[o.model_dump() for o in first.output], messages[2]],
    )  # fmt: skip
    assert again.output_text == text


def test_store_false_is_not_retrievable(client):
    got = client.responses.create(model=MODEL, input="Hello", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(got.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=MODEL, input="More", previous_response_id=got.id)
    assert info.value.body["param"] == "previous_response_id"
    assert info.value.body["code"] == "previous_response_not_found"


def test_a_stored_response_belongs_to_the_credentials_that_stored_it(client, api_stack):
    """The gateway here checks no key; a front that passes each user's key still keeps
    their stored responses apart."""
    alice, bob = (client.with_options(api_key=key) for key in ("alice-key", "bob-key"))
    got = alice.responses.create(model=MODEL, input="Hello", max_output_tokens=2)
    assert alice.responses.retrieve(got.id).id == got.id
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(got.id)
    with pytest.raises(openai.NotFoundError):
        bob.responses.create(model=MODEL, input="More", previous_response_id=got.id)
    with pytest.raises(openai.NotFoundError):
        bob.responses.delete(got.id)
    alice.responses.delete(got.id)


def test_a_front_with_no_store_size_keeps_nothing(api_stack, tmp_path):
    """`--response-store-size 0`: answers as usual, but nothing to GET or continue."""
    with http_front(api_stack.spec.gateway_address, tmp_path / "front.log",
                    "--response-store-size", "0") as (address, _):  # fmt: skip
        front = openai.OpenAI(base_url=f"http://{address}/v1", api_key="k", max_retries=0)
        got = front.responses.create(model=MODEL, input="Hello", max_output_tokens=2)
        assert got.id.startswith("resp_") and 1 <= got.usage.output_tokens <= 2
        with pytest.raises(openai.NotFoundError):
            front.responses.retrieve(got.id)


def test_stream_events_in_order_with_sequence_numbers(client):
    kwargs = dict(model=MODEL, input="Tell me a story", max_output_tokens=12, temperature=0)
    plain = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    types = [e.type for e in events]
    deltas = types.count("response.output_text.delta")
    assert deltas >= 1
    assert types == [
        "response.created", "response.in_progress", *TEXT_EVENTS,
        *["response.output_text.delta"] * (deltas - 1), *CLOSING_EVENTS, "response.incomplete",
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text == events[-4].text
    created, final = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.output == [] and created.id == final.id
    assert final.status == "incomplete" and final.output_text == text
    assert final.output[0].id == events[2].item.id == events[-2].item.id
    assert final.usage.output_tokens == plain.usage.output_tokens == 12
    assert client.responses.retrieve(final.id).output_text == text  # stored at the end


def test_stream_helper_final_response(client, tiny_llama_dir):
    """`client.responses.stream`: an answer that ends on EOS (forced by logit_bias) is
    `response.completed`; its empty message still comes as one output item."""
    eos = hf_tokenizer(str(tiny_llama_dir)).eos_token_id
    with client.responses.stream(
        model=MODEL, input="Hi", max_output_tokens=8, extra_body={"logit_bias": {str(eos): 100}}
    ) as stream:
        types = [event.type for event in stream]
        final = stream.get_final_response()
    assert types == ["response.created", "response.in_progress", *TEXT_EVENTS[:2],
                     *CLOSING_EVENTS, "response.completed"]  # fmt: skip
    assert final.status == "completed" and final.output_text == ""
    assert final.usage.output_tokens == 1


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": 5}, "input"),
        ({}, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]},
         "input[0].call_id"),
        ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": 1}]},
         "tools[0].parameters"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "temperature": "hot"}, "temperature"),
        ({"input": "x", "frobnicate": 1}, "frobnicate"),
    ],
)  # fmt: skip
def test_bad_input_is_a_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.post("/responses", body={"model": MODEL, **body}, cast_to=object)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param and info.value.body["type"] == "invalid_request_error"
