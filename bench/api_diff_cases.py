"""The requests `bench.api_diff` sends to both servers, and how their answers are compared.

Cases are OpenAI chat requests on the tool checkpoint (`devtools.tool_checkpoint`), greedy,
with the model's choices driven so that the calls are real: in `auto`, a regex
(`structured_outputs`) makes the model write Hermes calls; for `required` and a named
function the servers' own grammars do, with a `logit_bias` that keeps whitespace out
(a random model fills any-whitespace JSON with it) and closed enum schemas (a random
model's free strings never end). With a reasoning parser both servers start a grammar
after `</think>`; a logit_bias on it closes the reasoning at once. Each runs streamed and
not.

A streamed answer is assembled (content, reasoning and each call's arguments
concatenated; which pieces carried id, type and name) before comparing. Answers are
flattened to `path -> value` and compared path by path, ids, timestamps and
`system_fingerprint` aside. Pure.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]
CALL_WEATHER = (
    r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome|Oslo)"\}\}'
    r"</tool_call>"
)
CALL_TIME = r'<tool_call>\{"name": "get_time", "arguments": \{"tz": "(UTC|CET)"\}\}</tool_call>'
HISTORY = [
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
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny", "c": 21}'},
]


@dataclass(frozen=True)
class Case:
    name: str
    body: dict
    reasoning: bool = False  # needs the servers started with a reasoning parser
    tags: tuple[str, ...] = field(default_factory=tuple)


def cases(no_whitespace: dict[str, float], think_end: int) -> list[Case]:
    """`no_whitespace`: a logit_bias keeping whitespace-only tokens out; `think_end`: the
    id of `</think>` (a bias on it makes the random model close its reasoning)."""
    forced = {"logit_bias": no_whitespace, "max_tokens": 96}
    long = {"max_tokens": 160}
    return [
        Case("auto_no_call", {"messages": ASK, "tools": TOOLS, "max_tokens": 16}),
        Case(
            "auto_one_call",
            {
                "messages": ASK,
                "tools": TOOLS,
                "structured_outputs": {"regex": CALL_WEATHER},
                **long,
            },
        ),
        Case(
            "auto_parallel_calls",
            {
                "messages": ASK,
                "tools": TOOLS,
                "structured_outputs": {"regex": CALL_WEATHER + "\n" + CALL_TIME},
                **long,
            },
        ),
        Case(
            "auto_parallel_false",
            {
                "messages": ASK,
                "tools": TOOLS,
                "parallel_tool_calls": False,
                "structured_outputs": {"regex": CALL_WEATHER + "\n" + CALL_TIME},
                **long,
            },
        ),
        Case(
            "auto_text_then_call",
            {
                "messages": ASK,
                "tools": TOOLS,
                "structured_outputs": {"regex": "Let me check\\. " + CALL_WEATHER},
                **long,
            },
        ),
        Case("required", {"messages": ASK, "tools": TOOLS, "tool_choice": "required", **forced}),
        Case(
            "required_parallel_false",
            {
                "messages": ASK,
                "tools": TOOLS,
                "tool_choice": "required",
                "parallel_tool_calls": False,
                **forced,
            },
        ),
        Case(
            "named",
            {
                "messages": ASK,
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                **forced,
            },
        ),
        Case("none", {"messages": ASK, "tools": TOOLS, "tool_choice": "none", "max_tokens": 16}),
        Case(
            "multi_turn_tool_result",
            {
                "messages": HISTORY,
                "tools": TOOLS,
                "structured_outputs": {"regex": "It is (sunny|rainy) in Paris\\."},
            },
        ),
        Case("reasoning", {"messages": ASK, "max_tokens": 16}, reasoning=True),
        Case(
            "reasoning_then_content",
            {"messages": ASK, "max_tokens": 24, "logit_bias": {str(think_end): 7.0}},
            reasoning=True,
        ),
        Case(
            "reasoning_then_named_call",
            {
                "messages": ASK,
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                **forced,
                "logit_bias": {**no_whitespace, str(think_end): 100.0},
            },
            reasoning=True,
        ),
        Case(
            "reasoning_then_auto_call",
            {
                "messages": ASK,
                "tools": TOOLS,
                "structured_outputs": {"regex": CALL_WEATHER},
                "logit_bias": {str(think_end): 100.0},
                **long,
            },
            reasoning=True,
        ),
        Case(
            "reasoning_with_tools",
            {"messages": ASK, "tools": TOOLS, "max_tokens": 16},
            reasoning=True,
        ),
    ]


# Paths never compared: per-request ids and times, and the vLLM build.
IGNORED = re.compile(
    r"^(id|created|system_fingerprint)$|tool_calls\[\d+\]\.id$|^choices\[\d+\]\.first_piece_id$"
)
# Fields vLLM always sends as null and Tandem leaves out (OpenAI-optional, or vLLM
# extensions Tandem does not have); listed, not counted.
VLLM_ONLY_NULLS = re.compile(
    r"^(service_tier|prompt_logprobs|prompt_token_ids|prompt_text|kv_transfer_params|"
    r"ec_transfer_params|metrics|usage\.prompt_tokens_details|usage\.completion_tokens_details)$"
    r"|^choices\[\d+\]\.(token_ids|routed_experts)$"
)


# Fields Tandem sends that this vLLM leaves null (`--enable-prompt-tokens-details` off):
# listed, not counted.
TANDEM_EXTRAS = re.compile(r"^usage\.prompt_tokens_details\.")


def flatten(value, path: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    if isinstance(value, dict):
        for key, item in value.items():
            out.update(flatten(item, f"{path}.{key}" if path else key))
    elif isinstance(value, list) and value:
        for index, item in enumerate(value):
            out.update(flatten(item, f"{path}[{index}]"))
    else:
        out[path] = value
    return out


def assemble_stream(chunks: list[dict]) -> dict:
    """One object from a stream's chunks: per choice the role, content, reasoning and
    calls concatenated, the finish and stop reasons, and the shape of each call's first
    piece (id, type and name together, as OpenAI and vLLM send them)."""
    choices: dict[int, dict] = {}
    usage = None
    for chunk in chunks:
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices", []):
            out = choices.setdefault(choice["index"], {"index": choice["index"]})
            delta = choice.get("delta") or {}
            if delta.get("role"):
                out["role"] = delta["role"]
            for key in ("content", "reasoning"):
                if delta.get(key):
                    out[key] = out.get(key, "") + delta[key]
            for piece in delta.get("tool_calls") or []:
                calls = out.setdefault("tool_calls", {})
                call = calls.setdefault(piece["index"], {"arguments": ""})
                function = piece.get("function") or {}
                if piece.get("id"):
                    call["first_piece"] = sorted(k for k in ("id", "type") if piece.get(k)) + (
                        ["name"] if function.get("name") else []
                    )
                    call["type"] = piece.get("type")
                if function.get("name"):
                    call["name"] = function["name"]
                call["arguments"] += function.get("arguments") or ""
            if choice.get("finish_reason"):
                out["finish_reason"] = choice["finish_reason"]
                out["stop_reason"] = choice.get("stop_reason")
    for out in choices.values():
        if "tool_calls" in out:
            out["tool_calls"] = [out["tool_calls"][i] for i in sorted(out["tool_calls"])]
    return {"choices": [choices[i] for i in sorted(choices)], "usage": usage}


def parse_sse(text: str) -> list[dict]:
    chunks = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunks.append(json.loads(line[len("data: ") :]))
    return chunks


def compare(vllm: dict, tandem: dict) -> dict:
    """Path by path: how many compared, which differ, which only one side has."""
    a, b = flatten(vllm), flatten(tandem)
    compared, differ, only_vllm, only_tandem, vllm_nulls, extras = 0, [], [], [], [], []
    for path in sorted(set(a) | set(b)):
        if IGNORED.search(path):
            continue
        if path not in b:
            if VLLM_ONLY_NULLS.search(path) and a[path] is None:
                vllm_nulls.append(path)
            else:
                only_vllm.append(path)
            continue
        if path not in a:
            (extras if TANDEM_EXTRAS.search(path) else only_tandem).append(path)
            continue
        compared += 1
        if a[path] != b[path]:
            differ.append({"path": path, "vllm": a[path], "tandem": b[path]})
    return {
        "fields": compared,
        "matching": compared - len(differ),
        "differ": differ,
        "only_vllm": only_vllm,
        "only_tandem": only_tandem,
        "vllm_only_nulls": vllm_nulls,
        "tandem_extras": extras,
        "match": not differ and not only_vllm and not only_tandem,
    }
