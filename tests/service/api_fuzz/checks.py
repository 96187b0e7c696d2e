"""The API fuzz's calls and checks: outcomes tallied per category, a Generate stream's
invariants, an outcome against the oracle, and the after-run check that the stack is unharmed
(pools at baseline, every service alive, no error in any log, greedy output still HF-exact)."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import grpc

from common.pb.tandem.v1 import generate_pb2
from tests.hf_reference import hf_generate, hf_tokenizer
from tests.service.api_fuzz.request_strategies import (
    ALLOWED,
    DEADLINE_S,
    FINISHED,
    MAX_LEN,
    VOCAB,
    documented_violations,
    error_field,
)
from tests.stack_client import generate, greedy_request, wait_until_idle

# ---------------------------------------------------------------------------------------
# Calls and their checks


class Tally:
    """Outcomes per category, for the summary line."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.fields: Counter[str] = Counter()

    def add(self, outcome: str, field: str | None = None) -> None:
        self.counts[outcome] += 1
        if field:
            self.fields[field] += 1

    def line(self, name: str) -> str:
        total = sum(self.counts.values())
        parts = ", ".join(f"{k} {v}" for k, v in sorted(self.counts.items()))
        fields = len(self.fields)
        return f"fuzz {name}: {total} requests ({parts}); errors named {fields} distinct fields"


def call_stream(method, payload) -> tuple[grpc.StatusCode, str, list, float]:
    start = time.monotonic()
    messages = []
    try:
        for message in method(payload, timeout=DEADLINE_S):
            messages.append(message)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", messages, time.monotonic() - start
    return grpc.StatusCode.OK, "", messages, time.monotonic() - start


def call_unary(method, payload) -> tuple[grpc.StatusCode, str, object]:
    try:
        return grpc.StatusCode.OK, "", method(payload, timeout=DEADLINE_S)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", None


def check_documented(details: str, documented: list[str]) -> None:
    assert any(row in details for row in documented), f"undocumented error text: {details!r}"


def check_stream(r: generate_pb2.GenerateRequest, messages: list) -> None:
    """An OK Generate stream: every sample finished once, tokens within the limits."""
    assert messages, "an OK stream without a message"
    n = r.n if r.HasField("n") else 1
    finals: dict[int, int] = {}
    tokens: Counter[int] = Counter()
    prompt_logprobs = []
    for m in messages:
        assert 0 <= m.index < n, m
        assert m.index not in finals, f"sample {m.index} sent a message after its finish"
        tokens[m.index] += len(m.token_ids)
        assert all(0 <= t < VOCAB for t in m.token_ids), m.token_ids
        if r.HasField("logprobs"):
            assert len(m.logprobs) == len(m.token_ids)
            assert all(len(lp.top_logprobs) == r.logprobs for lp in m.logprobs)
            assert all(lp.logprob <= 0 for lp in m.logprobs), m.logprobs  # not nan either
            assert all(top.logprob <= 0 for lp in m.logprobs for top in lp.top_logprobs)
        else:
            assert not m.logprobs
        prompt_logprobs.extend(m.prompt_logprobs)
        if m.finish_reason:
            finals[m.index] = m.finish_reason
    assert sorted(finals) == list(range(n)), f"samples without a finish: {finals}"
    assert set(finals.values()) <= FINISHED, finals
    last = messages[-1]
    assert last.HasField("usage") and last.usage.prompt_tokens >= 1, last
    assert last.usage.completion_tokens == sum(tokens.values())
    assert last.usage.prompt_tokens + max(tokens.values(), default=0) <= MAX_LEN
    if r.HasField("max_tokens"):
        assert max(tokens.values(), default=0) <= r.max_tokens
    if r.HasField("prompt_logprobs"):
        assert len(prompt_logprobs) == last.usage.prompt_tokens - 1
        assert all(lp.logprob <= 0 for lp in prompt_logprobs), prompt_logprobs
        assert all(len(lp.top_logprobs) == r.prompt_logprobs for lp in prompt_logprobs)
    else:
        assert not prompt_logprobs


def check_generate_outcome(
    r: generate_pb2.GenerateRequest, code, details: str, messages: list, documented, tally
) -> None:
    certain, possible = documented_violations(r)
    assert code in ALLOWED, f"{code.name}: {details!r} for {summarize(r)}"
    if code == grpc.StatusCode.OK:
        assert not certain, f"accepted although {certain} break documented limits: {summarize(r)}"
        check_stream(r, messages)
        tally.add("ok")
    elif code == grpc.StatusCode.INVALID_ARGUMENT:
        assert not messages, "INVALID_ARGUMENT after the stream started"
        check_documented(details, documented)
        field = error_field(details)
        assert field in certain | possible, (
            f"error names {field!r} ({details!r}); documented violations: {certain}"
        )
        tally.add("invalid", field)
    else:
        assert details, "RESOURCE_EXHAUSTED without a message"
        tally.add("exhausted")


def summarize(r: generate_pb2.GenerateRequest) -> str:
    """A request, readable even when it holds a 4 MiB prompt."""
    text = str(r)
    return text if len(text) < 2000 else text[:1000] + f"... ({len(text)} chars)"


LOG_ERROR_MARKERS = (
    "Traceback",
    '"level": "error"',
    "Exception calling application",
    "Exception in callback",
)


def new_log_errors(marks: dict[Path, int]) -> list[str]:
    bad = []
    for path, offset in marks.items():
        with open(path, "rb") as log:
            log.seek(offset)
            for line in log.read().decode(errors="replace").splitlines():
                if any(marker in line for marker in LOG_ERROR_MARKERS):
                    bad.append(f"{path.name}: {line[:400]}")
    return bad


def assert_stack_unharmed(api_stack, tiny_llama_dir, marks) -> None:
    wait_until_idle(api_stack)  # pools all-free, no worker holding a request, integrity clean
    dead = [p.name for p in api_stack.processes if not api_stack.alive(p)]
    assert not dead, f"services died: {dead}"
    assert not new_log_errors(marks), "\n".join(new_log_errors(marks)[:20])
    prompt = "Once upon a time, the fuzzer"
    got = generate(api_stack.spec.gateway_address, greedy_request(prompt, 12), timeout=60)
    ids = hf_tokenizer(str(tiny_llama_dir)).encode(prompt)
    assert got.token_ids == hf_generate(tiny_llama_dir, ids, max_new_tokens=12)


def report(capsys, line: str) -> None:
    with capsys.disabled():
        print(f"\n{line}")
