"""The tool-call and reasoning parsers (services/gateway/tool_parsers, reasoning_parsers):
each format's whole-output parse, and its stream fed in pieces of every size: the
streamed pieces put together give the same calls as the whole parse (arguments as
written), a call's first piece carries its id and name, and content never shows a
marker."""

from __future__ import annotations

import json

import pytest

from services.gateway.reasoning_parsers import reasoning_parser
from services.gateway.tool_parsers import TOOL_PARSERS, tool_parser
from services.gateway.tool_parsers.forced import (
    NamedStream,
    RequiredStream,
    extract_named,
    extract_required,
    required_schema,
)
from services.gateway.tool_parsers.json_calls import scan_calls

ARGS_A = '{"city": "Pa}ris", "days": [1, {"x": "]"}]}'
ARGS_B = "{}"


def stream(parser_stream, text: str, step: int):
    """Feed `text` in `step`-character pieces; the content and each call put together."""
    content, calls = "", {}
    for end in range(step, len(text) + step, step):
        delta = parser_stream.feed(text[:end])
        content += delta.content
        for piece in delta.calls:
            call = calls.setdefault(piece.index, {"arguments": ""})
            if piece.id is not None:
                assert "id" not in call, "a call is announced once"
                assert piece.name, "the first piece names the function"
                call["id"], call["name"] = piece.id, piece.name
            else:
                assert "id" in call, "arguments before the call's first piece"
            call["arguments"] += piece.arguments or ""
    return content, [calls[i] for i in sorted(calls)]


CASES = {
    "hermes": (
        f'I will check.<tool_call>\n{{"name": "get_weather", "arguments": {ARGS_A}}}\n</tool_call>'
        f'\n<tool_call>{{"name": "noop", "arguments": {ARGS_B}}}</tool_call>',
        "I will check.",
    ),
    "llama3_json": (
        f'<|python_tag|>{{"name": "get_weather", "arguments": {ARGS_A}}}; '
        f'{{"name": "noop", "parameters": {ARGS_B}}}',
        None,
    ),
    "mistral": (
        f"I will check.[TOOL_CALLS]get_weather[ARGS]{ARGS_A}[TOOL_CALLS]noop{ARGS_B}",
        "I will check.",
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_streamed_calls_add_up_to_the_whole_parse(name, step):
    text, content = CASES[name]
    parser = tool_parser(name)
    whole = parser.extract(text)
    assert whole.content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [
        ("get_weather", json.loads(ARGS_A)),
        ("noop", {}),
    ]
    streamed_content, calls = stream(parser.stream(), text, step)
    assert streamed_content == (content or "")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", ARGS_A),
        ("noop", ARGS_B),
    ]
    assert len({c["id"] for c in calls}) == 2


def test_mistral_array_format_and_ids():
    parser = tool_parser("mistral")
    text = '[TOOL_CALLS] [{"name": "a", "arguments": {"q": 1}}, {"name": "b", "arguments": {}}]'
    assert [(c.name, c.arguments) for c in parser.extract(text).calls] == [
        ("a", '{"q": 1}'),
        ("b", "{}"),
    ]
    _, calls = stream(parser.stream(), text, 3)
    assert [(c["name"], c["arguments"]) for c in calls] == [("a", '{"q": 1}'), ("b", "{}")]
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_text_without_calls_is_content(name):
    parser = tool_parser(name)
    text = "It is sunny < today > {not json"
    whole = parser.extract(text)
    assert whole.content == text and not whole.calls
    content, calls = stream(parser.stream(), text, 3)
    assert not calls
    if name not in ("llama3_json", "llama4_json"):
        assert content == text


def test_hermes_holds_back_a_partial_marker_and_gives_bad_json_back_as_content():
    parser = tool_parser("hermes")
    s = parser.stream()
    assert s.feed("Hi <tool_").content == "Hi "
    assert s.feed("Hi <tool_call>").content == ""
    text = '<tool_call>{"name": "f", "arguments": {broken}}</tool_call>'
    assert parser.extract(text).content == text and not parser.extract(text).calls


def test_scanner_ignores_brackets_in_strings_and_stays_prefix_stable():
    text = '[{"parameters": {"s": "}]\\"{"}, "name": "f\\"x"}, {"name": "g", "parameters": 7}]'
    spans = scan_calls(text, array=True)
    assert [s.name for s in spans] == ['f"x', "g"]
    assert json.loads(text[spans[0].args_start : spans[0].args_end]) == {"s": '}]"{'}
    assert text[spans[1].args_start : spans[1].args_end] == "7"
    for end in range(len(text)):
        for whole, part in zip(spans, scan_calls(text[:end], array=True), strict=False):
            assert part.args_start in (None, whole.args_start)


def test_required_and_named_forced_calls():
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    whole = extract_required(text)
    assert [(c.name, c.arguments) for c in whole.calls] == [("a", '{"x": 1}'), ("b", "{}")]
    assert whole.content is None
    assert extract_required('[{"name": "a", "para').calls == ()
    _, calls = stream(RequiredStream(iter(["i1", "i2"]).__next__), text, 4)
    assert [(c["id"], c["name"], c["arguments"]) for c in calls] == [
        ("i1", "a", '{"x": 1}'),
        ("i2", "b", "{}"),
    ]
    named = extract_named('{"x": 1}', "a")
    assert [(c.name, c.arguments) for c in named.calls] == [("a", '{"x": 1}')]
    assert extract_named("  ", "a").calls == ()
    _, calls = stream(NamedStream("a", lambda: "n1"), '{"x": 1}', 3)
    assert calls == [{"id": "n1", "name": "a", "arguments": '{"x": 1}'}]


def test_required_schema_is_vllms():
    schema = required_schema(
        [("a", {"type": "object", "$defs": {"d": {"type": "string"}}}), ("b", None)], False
    )
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert schema["$defs"] == {"d": {"type": "string"}}
    first, second = schema["items"]["anyOf"]
    assert first["properties"]["name"] == {"type": "string", "enum": ["a"]}
    assert second["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert "maxItems" not in required_schema([("a", None)], True)


@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [
        ("<think>plan</think>answer", "plan", "answer"),
        ("plan</think>answer", "plan", "answer"),  # the prompt opened the block
        ("<think>plan</think>", "plan", None),
        ("still thinking", "still thinking", None),
    ],
)
@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_think_split_whole_and_streamed(name, text, reasoning, content):
    fmt = reasoning_parser(name)
    split = fmt.split(text)
    assert (split.reasoning, split.content) == (reasoning, content)
    for step in (1, 3, 100):
        s, got_reasoning, got_content = fmt.stream(), "", ""
        for end in range(step, len(text) + step, step):
            r, c = s.feed(text[:end])
            got_reasoning += r
            got_content += c
        assert (got_reasoning, got_content) == (reasoning or "", content or "")


def test_qwen3_ends_reasoning_at_a_tool_call_and_a_closed_prompt_starts_in_content():
    qwen3, r1 = reasoning_parser("qwen3"), reasoning_parser("deepseek_r1")
    text = 'hmm<tool_call>{"name": "f"}'
    assert qwen3.split(text).content == '<tool_call>{"name": "f"}'
    assert r1.split(text).content is None
    assert r1.ends_in("<think>\n\n</think>\n\n") and not r1.ends_in("user: hi <think>\n")
    assert r1.stream(ended=True).feed("all content") == ("", "all content")


def test_a_held_back_tail_is_released_when_the_output_ends():
    s = reasoning_parser("deepseek_r1").stream()
    assert s.feed("ends with </th") == ("ends with ", "")
    assert s.feed("ends with </th", final=True) == ("</th", "")
    opening = reasoning_parser("qwen3").stream()
    assert opening.feed("<thi") == ("", "")
    assert opening.feed("<thi", final=True) == ("<thi", "")


def test_unknown_parser_names_list_the_known_ones():
    with pytest.raises(ValueError, match="hermes"):
        tool_parser("nope")
    with pytest.raises(ValueError, match="deepseek_r1"):
        reasoning_parser("nope")
