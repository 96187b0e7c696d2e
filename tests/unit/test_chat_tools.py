"""The gateway's tool checks (services/gateway/chat_tools.py: each bad field named) and its
per-sample split of answers (services/gateway/chat_output.py): content, reasoning and call
pieces streamed on each GenerateResponse, the parse of the whole answer on the last one,
and the finish reasons vLLM gives (streamed: tool_calls when calls were streamed, not for
a named function; whole: when auto found calls, or for required)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from common.pb.tandem.v1 import generate_pb2
from services.gateway.chat_output import ChatParsing
from services.gateway.chat_tools import (
    AUTO,
    FUNCTION,
    NONE,
    REQUIRED,
    template_messages,
    validate_tools,
)
from services.gateway.reasoning_parsers import reasoning_parser
from services.gateway.tool_parsers import tool_parser
from services.gateway.validation import InvalidArgumentError

STOP, LENGTH = generate_pb2.FINISH_REASON_STOP, generate_pb2.FINISH_REASON_LENGTH
TOOL_CALLS = generate_pb2.FINISH_REASON_TOOL_CALLS
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}


def request(*tools, choice=None, **fields) -> generate_pb2.GenerateRequest:
    r = generate_pb2.GenerateRequest(**fields)
    r.chat.messages.add(role="user", content="hi")
    for name in tools:
        r.tools.add(name=name, parameters_json=json.dumps(SCHEMA))
    if isinstance(choice, int):
        r.tool_choice.mode = choice
    elif choice is not None:
        r.tool_choice.function_name = choice
    return r


def test_choices_resolve_as_vllm():
    assert validate_tools(request()) is None
    assert validate_tools(request("a")).choice == AUTO  # tools given: auto by default
    assert validate_tools(request("a", choice=generate_pb2.TOOL_CHOICE_MODE_NONE)).choice == NONE
    forced = validate_tools(request("a", "b", choice="b", parallel_tool_calls=False))
    assert (forced.choice, forced.function, forced.parallel, forced.forced) == (
        FUNCTION,
        "b",
        False,
        True,
    )
    assert json.loads(forced.forced_schema()) == SCHEMA
    required = validate_tools(request("a", choice=generate_pb2.TOOL_CHOICE_MODE_REQUIRED))
    assert required.choice == REQUIRED
    assert json.loads(required.forced_schema())["type"] == "array"
    tool = required.template_tools()[0]
    assert tool == {
        "type": "function",
        "function": {"name": "a", "description": None, "parameters": SCHEMA},
    }


ROOT = Path(__file__).resolve().parents[2]


def documented() -> list[str]:
    """The error texts of docs/api.md's tool table."""
    table = (ROOT / "docs/api.md").read_text().split("<!-- tools-validation-table -->")[1]
    rows = [line for line in table.split("<!-- /")[0].splitlines() if line.startswith("|")]
    return [re.findall(r"`([^`]+)`", row.rsplit("|", 2)[1])[0] for row in rows[2:]]


def check_documented(message: str) -> str:
    assert any(row in message for row in documented()), f"undocumented: {message}"
    return message


def bad(r: generate_pb2.GenerateRequest, parameters: str | None = None):
    if parameters is not None:
        r.tools[0].parameters_json = parameters
    with pytest.raises(InvalidArgumentError) as error:
        validate_tools(r)
    return check_documented(str(error.value))


def test_bad_tools_are_named():
    assert bad(request(choice=generate_pb2.TOOL_CHOICE_MODE_REQUIRED)).startswith(
        "tool_choice 'required' needs tools"
    )
    assert bad(request("a", choice="nope")).startswith("tool_choice.function_name 'nope'")
    assert bad(request("a b")).startswith("tools[0].name must be 1..64")
    assert bad(request("a", "a")).startswith("tools[1].name 'a' is given twice")
    assert bad(request("a"), '"a string"').startswith("tools[0].parameters_json must be a JSON")
    assert bad(request("a"), "{not json").startswith("tools[0].parameters_json must be a JSON")
    assert "tools[0].parameters_json.type must be one of" in bad(request("a"), '{"type": "x"}')
    assert bad(request("a"), '{"properties": {"c": 3}}').startswith(
        "tools[0].parameters_json.properties.c must be a JSON schema object"
    )
    assert bad(request("a"), '{"required": "c"}').startswith(
        "tools[0].parameters_json.required must be an array"
    )
    text = generate_pb2.GenerateRequest(text="hi")
    text.tools.add(name="a")
    assert bad(text).startswith("tools need prompt.chat")
    constrained = request("a", choice="a")
    constrained.structured_output.json_object = True
    assert bad(constrained).startswith("structured_output cannot be combined")


def history(*turns) -> generate_pb2.ChatMessages:
    chat = generate_pb2.ChatMessages()
    for turn in turns:
        chat.messages.add(**turn)
    return chat


def test_history_calls_and_results():
    chat = history(
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "tool_calls": [
                generate_pb2.ToolCall(id="c1", name="w", arguments='{"city": "Oslo"}'),
                generate_pb2.ToolCall(id="c2", name="w", arguments="not json"),
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "c2"},
    )
    plain = [{"role": m.role, "content": m.content} for m in chat.messages]
    out = template_messages(chat, plain, "prompt.chat")
    calls = out[1]["tool_calls"]
    assert calls[0]["function"] == {"name": "w", "arguments": {"city": "Oslo"}}
    assert calls[1]["function"]["arguments"] == {}  # vLLM's coercion of text that is no object
    assert out[2]["tool_call_id"] == "c2"
    orphan = history({"role": "user", "content": "x"}, {"role": "tool", "content": "r"})
    with pytest.raises(InvalidArgumentError, match=r"messages\[1\].tool_call_id '' does not") as e:
        template_messages(orphan, [{}, {}], "prompt.chat")
    check_documented(str(e.value))
    misplaced = history({"role": "user", "content": "x", "tool_call_id": "c"})
    with pytest.raises(InvalidArgumentError, match=r"messages\[0\].tool_call_id is only") as e:
        template_messages(misplaced, [{}], "prompt.chat")
    check_documented(str(e.value))


def run(parsing: ChatParsing, pieces: list[str], reason=STOP):
    """Send `pieces` as a sample's messages; the rewritten messages."""
    sample = parsing.sample()
    out = []
    for i, piece in enumerate(pieces):
        message = generate_pb2.GenerateResponse(text=piece, token_ids=[1])
        if i == len(pieces) - 1:
            message.finish_reason = reason
        sample.rewrite(message)
        out.append(message)
    return out


def joined(messages):
    content = "".join(m.text for m in messages)
    reasoning = "".join(m.reasoning_content for m in messages)
    calls: dict[int, dict] = {}
    for m in messages:
        for piece in m.tool_calls:
            call = calls.setdefault(piece.index, {"arguments": ""})
            if piece.id:
                call["id"], call["name"] = piece.id, piece.name
            call["arguments"] += piece.arguments
    return content, reasoning, [calls[i] for i in sorted(calls)]


def tools_of(*names, **kwargs):
    return validate_tools(request(*names, **kwargs))


CALL = '<tool_call>{"name": "a", "arguments": {"city": "Oslo"}}</tool_call>'


def test_auto_calls_streamed_and_whole():
    parsing = ChatParsing(tools=tools_of("a", "b"), auto_parser=tool_parser("hermes"))
    text = "Checking." + CALL + "\n" + CALL.replace('"a"', '"b"')
    out = run(parsing, [text[i : i + 4] for i in range(0, len(text), 4)])
    content, _, calls = joined(out)
    assert content == "Checking."
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("a", '{"city": "Oslo"}'),
        ("b", '{"city": "Oslo"}'),
    ]
    last = out[-1]
    assert last.finish_reason == TOOL_CALLS
    parsed = last.parsed
    assert parsed.content == "Checking." and parsed.finish_reason == TOOL_CALLS
    assert [c.id for c in parsed.tool_calls] == [c["id"] for c in calls]  # the same ids
    assert not parsed.HasField("reasoning_content")


def test_parallel_tool_calls_false_keeps_the_first_call():
    tools = tools_of("a", "b", parallel_tool_calls=False)
    parsing = ChatParsing(tools=tools, auto_parser=tool_parser("hermes"))
    out = run(parsing, [CALL, CALL.replace('"a"', '"b"')])
    assert [c["name"] for c in joined(out)[2]] == ["a"]
    assert [c.name for c in out[-1].parsed.tool_calls] == ["a"]


def test_auto_without_calls_and_without_the_auto_flag():
    parsing = ChatParsing(tools=tools_of("a"), auto_parser=tool_parser("hermes"))
    out = run(parsing, ["just ", "text"])
    assert joined(out)[0] == "just text" and out[-1].finish_reason == STOP
    assert out[-1].parsed.content == "just text" and not out[-1].parsed.tool_calls
    assert ChatParsing(tools=tools_of("a")).tool_mode is None  # no --enable-auto-tool-choice


def test_required_and_named():
    required = ChatParsing(tools=tools_of("a", choice=generate_pb2.TOOL_CHOICE_MODE_REQUIRED))
    out = run(required, ['[{"name": "a", ', '"parameters": {"city": "Oslo"}}]'])
    assert [(c["name"], c["arguments"]) for c in joined(out)[2]] == [("a", '{"city": "Oslo"}')]
    assert out[-1].finish_reason == TOOL_CALLS
    assert out[-1].parsed.content == "" and out[-1].parsed.finish_reason == TOOL_CALLS
    named = ChatParsing(tools=tools_of("a", choice="a"))
    out = run(named, ['{"city": ', '"Oslo"}'])
    assert joined(out)[2][0]["arguments"] == '{"city": "Oslo"}'
    assert out[-1].finish_reason == STOP  # a named call ends with stop, as in vLLM
    assert out[-1].parsed.tool_calls[0].arguments == '{"city": "Oslo"}'
    truncated = run(required, ['[{"name": "a", "param'], LENGTH)[-1]
    assert truncated.finish_reason == LENGTH and not truncated.parsed.tool_calls


def test_reasoning_then_calls_from_the_content():
    parsing = ChatParsing(
        reasoning=reasoning_parser("deepseek_r1"),
        tools=tools_of("a"),
        auto_parser=tool_parser("hermes"),
    )
    text = "<think>I should call a.</think>" + CALL
    out = run(parsing, [text[i : i + 3] for i in range(0, len(text), 3)])
    content, reasoning, calls = joined(out)
    assert (content, reasoning) == ("", "I should call a.")
    assert [c["name"] for c in calls] == ["a"]
    parsed = out[-1].parsed
    assert parsed.reasoning_content == "I should call a." and not parsed.HasField("content")
    only_thinking = run(ChatParsing(reasoning=reasoning_parser("qwen3")), ["hmm ", "..."])
    assert joined(only_thinking)[:2] == ("", "hmm ...")
    assert only_thinking[-1].parsed.reasoning_content == "hmm ..."


def test_gateway_flags_are_checked(tmp_path):
    from services.gateway.config import GatewayConfig

    def config(**kwargs):
        return GatewayConfig(model="m", **kwargs)

    with pytest.raises(ValueError, match="enable_auto_tool_choice requires tool_call_parser"):
        config(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="tool_call_parser.*hermes"):
        config(tool_call_parser="nope")
    with pytest.raises(ValueError, match="reasoning_parser.*deepseek_r1"):
        config(reasoning_parser="r2")
    with pytest.raises(ValueError, match="neither a file nor a template"):
        config(chat_template="missing.jinja")
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0].content }}")
    assert config(chat_template=str(template)).resolved_chat_template == template.read_text()
    assert config(chat_template="{{ 'x' }}").resolved_chat_template == "{{ 'x' }}"
    flags = config(enable_auto_tool_choice=True, tool_call_parser="qwen3_json")
    assert flags.reasoning_parser == "" and flags.resolved_chat_template is None


@pytest.mark.parametrize(
    ("constraint", "answer"),
    [
        (generate_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA)), '{"city": "Oslo"}'),
        (generate_pb2.StructuredOutput(json_object=True), "{}"),
        (generate_pb2.StructuredOutput(regex="(yes|no)"), "no"),
        (generate_pb2.StructuredOutput(grammar='root ::= "a" "b"'), "ab"),
        (generate_pb2.StructuredOutput(choice=generate_pb2.Choices(choices=["x", "y"])), "y"),
    ],
)
def test_a_constraint_starts_after_the_reasoning(tiny_llama_dir, constraint, answer):
    """vLLM applies a grammar once the reasoning ended: free text up to `</think>`, then
    the constraint (an xgrammar structural tag, compiled and run by xgrammar here)."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from common.grammar_cache import GrammarCache
    from common.structured_output import constraint_from_pb
    from services.gateway.reasoning_parsers.grammar import after_reasoning

    wrapped = after_reasoning(constraint, "</think>")
    assert wrapped.WhichOneof("constraint") == "structural_tag"
    assert after_reasoning(wrapped, "</think>") is wrapped  # a structural tag stays as it is
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    cache = GrammarCache(tokenizer, len(tokenizer))

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(cache.compile(constraint_from_pb(wrapped)))
        ids = tokenizer.encode(text, add_special_tokens=False)
        return all(matcher.accept_token(i) for i in ids) and matcher.is_completed()

    assert accepts("I think {so} </think>" + answer)
    assert not accepts("no end tag " + answer)
