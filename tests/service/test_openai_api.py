"""The OpenAI-compatible HTTP front end to end: a real stack (workers, scheduler, gateway,
`python -m services.openai_api`) on free loopback ports, called with the official `openai`
client; greedy output checked against HF `generate`."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from services.stack.launcher import Stack
from tests.hf_reference import hf_greedy, hf_log_softmax, hf_tokenizer
from tests.stack_client import wait_until_idle

MODEL = "tiny-llama"  # the served id: the checkpoint folder's name


@pytest.fixture(scope="module")
def stack(module_stacks):
    return module_stacks(name="openai-stack", http=True)


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(
        base_url=f"http://{stack.spec.http_address}/v1", api_key="unused", max_retries=0,
        timeout=120,
    )  # fmt: skip


def greedy(model_dir: Path, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], str]:
    ids = hf_greedy(model_dir, prompt_ids, max_tokens)
    return ids, hf_tokenizer(str(model_dir)).decode(ids, skip_special_tokens=True)


def finish_of(model_dir: Path, ids: list[int], max_tokens: int) -> str:
    eos = hf_tokenizer(str(model_dir)).eos_token_id
    return "stop" if ids and ids[-1] == eos and len(ids) <= max_tokens else "length"


def chat_prompt_ids(model_dir: Path, messages: list[dict]) -> list[int]:
    rendered = hf_tokenizer(str(model_dir)).apply_chat_template(
        messages, add_generation_prompt=True
    )
    return list(rendered["input_ids"])


def post(stack: Stack, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    """A raw POST of `body` (JSON) with `headers` beside its content type: (status, reply)."""
    request = urllib.request.Request(
        f"http://{stack.spec.http_address}{path}", data=body, method="POST",
        headers={"Content-Type": "application/json", **(headers or {})},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_models_lists_the_served_model(client, stack):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    (card,) = models.data
    assert card.object == "model" and card.owned_by == "tandem"
    assert card.model_extra["max_model_len"] == 512
    assert client.models.retrieve(MODEL).id == MODEL
    with urllib.request.urlopen(f"http://{stack.spec.http_address}/health", timeout=10) as reply:
        assert reply.status == 200


def test_completion_greedy_equals_hf_streamed_or_not(client, tiny_llama_dir):
    prompt, max_tokens = "Once upon a time", 24
    prompt_ids = hf_tokenizer(str(tiny_llama_dir)).encode(prompt)
    want_ids, want_text = greedy(tiny_llama_dir, prompt_ids, max_tokens)
    got = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0
    )
    assert got.id.startswith("cmpl-") and got.object == "text_completion" and got.model == MODEL
    (choice,) = got.choices
    assert choice.text == want_text and choice.index == 0
    assert choice.finish_reason == finish_of(tiny_llama_dir, want_ids, max_tokens)
    assert got.usage.prompt_tokens == len(prompt_ids)
    assert got.usage.completion_tokens == len(want_ids)
    assert got.usage.total_tokens == len(prompt_ids) + len(want_ids)

    chunks = list(client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))  # fmt: skip
    *text_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == want_text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == choice.finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == len(want_ids)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id != got.id


def test_batch_of_token_id_and_text_prompts_runs_each(client, tiny_llama_dir):
    ids_prompt = list(range(3, 40))  # 37 tokens: spans three 16-token blocks
    text_prompt = "The scheduler"
    got = client.completions.create(
        model=MODEL, prompt=[ids_prompt, text_prompt], max_tokens=20, temperature=0
    )
    text_ids = hf_tokenizer(str(tiny_llama_dir)).encode(text_prompt)
    want = [greedy(tiny_llama_dir, p, 20) for p in (ids_prompt, text_ids)]
    assert [c.index for c in got.choices] == [0, 1]
    assert [c.text for c in got.choices] == [text for _, text in want]
    assert got.usage.prompt_tokens == len(ids_prompt) + len(text_ids)
    assert got.usage.completion_tokens == sum(len(ids) for ids, _ in want)


def test_echo_prepends_the_prompt(client):
    got = client.completions.create(
        model=MODEL, prompt="Echo me", max_tokens=5, temperature=0, echo=True
    )
    plain = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=5, temperature=0)
    assert got.choices[0].text == "Echo me" + plain.choices[0].text


def test_chat_greedy_equals_hf_with_the_chat_template(client, tiny_llama_dir):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello there"},
    ]
    want_ids, want_text = greedy(tiny_llama_dir, chat_prompt_ids(tiny_llama_dir, messages), 30)
    got = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=30, temperature=0
    )
    assert got.id.startswith("chatcmpl-") and got.object == "chat.completion"
    (choice,) = got.choices
    assert choice.message.role == "assistant" and choice.message.content == want_text
    assert choice.finish_reason == finish_of(tiny_llama_dir, want_ids, 30)
    assert got.usage.completion_tokens == len(want_ids)

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=30, temperature=0, stream=True
    ))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want_text
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_n_samples_with_a_seed_are_reproducible(client):
    kwargs = dict(model=MODEL, prompt="In the beginning", max_tokens=12, n=2, seed=1234,
                  temperature=1.0, logprobs=0)  # fmt: skip
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.choices[0].text != first.choices[1].text  # sample i uses seed + i
    assert first.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in first.choices)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, n=2, seed=7
    )
    assert [c.index for c in chat.choices] == [0, 1]


def test_logprobs_one_entry_per_generated_token(client):
    got = client.completions.create(
        model=MODEL, prompt="Continuous batching", max_tokens=10, temperature=0, logprobs=3
    )
    (choice,) = got.choices
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert len(lp.tokens) == got.usage.completion_tokens
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and 1 <= len(top) <= 3
        assert logprob >= max(top.values()) - 1e-4  # greedy picks the most likely token

    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0,
        logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert all(t.bytes == list(t.token.encode()) for t in content)


def test_every_generated_step_is_a_chunk_even_when_its_text_is_empty(client, tiny_llama_dir):
    """Tokens whose text is held back (here lone UTF-8 continuation bytes, which never form
    a character) still reach the client as one chunk per step, as vLLM streams them:
    clients measure TTFT and inter-token latency by chunks."""
    tokenizer = hf_tokenizer(str(tiny_llama_dir))
    partial = [i for i in range(len(tokenizer)) if tokenizer.decode([i]) == "\ufffd"]
    assert len(partial) >= 32
    bias = {str(i): 100 for i in partial}
    for stream_kwargs in ({}, {"stream_options": {"include_usage": True}}):
        stream = client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=12, temperature=0, logit_bias=bias,
            logprobs=1, stream=True, **stream_kwargs,
        )  # fmt: skip
        chunks = [c for c in stream if c.choices]
        per_chunk = [len(c.choices[0].logprobs.tokens) for c in chunks]
        assert sum(per_chunk) == 12 and min(per_chunk) >= 1  # every token, none skipped
        empty = [c for c in chunks if c.choices[0].text == ""]
        assert len(empty) >= 8  # most steps had no text and were sent anyway
        assert chunks[-1].choices[0].finish_reason == "length"

    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
        temperature=0, logit_bias=bias, stream=True,
    )  # fmt: skip
    deltas = [c.choices[0].delta for c in chat if c.choices]
    content = [d for d in deltas if d.role is None]  # after the role chunk
    assert len(content) >= 8 and sum(1 for d in content if d.content == "") >= 6


def test_stop_string_cuts_the_text(client):
    prompt = "Greedy decoding must equal transformers token for token."
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0)
    text = full.choices[0].text
    stop = text[6:9]
    assert len(stop.strip()) > 0, text
    got = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=[stop]
    )
    (choice,) = got.choices
    assert choice.text == text[: text.index(stop)]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(temperature="hot"), "temperature: must be a number"),
        (dict(max_tokens=0), "max_tokens must be >= 1"),
        (dict(extra_body={"top_k": "many"}), "top_k: must be an integer"),
        (dict(suffix="end"), "suffix is not supported"),
        (dict(extra_body={"bogus": 1}), "bogus: unknown or unsupported parameter"),
        (dict(max_tokens=100000), "must not exceed the context length"),
    ],
)
def test_bad_completion_requests_are_400s_naming_the_field(client, kwargs, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", **kwargs)
    assert words in info.value.message
    with pytest.raises(openai.BadRequestError):  # also before a stream starts
        client.completions.create(model=MODEL, prompt="hi", stream=True, **kwargs)


def test_bad_chat_requests_and_unknown_models(client):
    user = [{"role": "user", "content": "hi"}]
    # A gateway without --tool-call-parser refuses tool_choice auto (vLLM's 400).
    with pytest.raises(openai.BadRequestError, match='"auto" tool choice requires'):
        client.chat.completions.create(
            model=MODEL, messages=user,
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        )  # fmt: skip
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content\[0\]\.type"):
        client.chat.completions.create(model=MODEL, messages=image)
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="hi")
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=user)


def test_malformed_and_oversized_bodies(stack):
    status, body = post(stack, "/v1/completions", b'{"prompt": "hi",')
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = post(stack, "/v1/completions", b"x" * (8 * 2**20 + 1))
    assert status == 413 and body["error"]["type"] == "invalid_request_error"
    status, body = post(stack, "/v1/nothing", b"{}")
    assert status == 404 and "error" in body


def logged(stack: Stack, service: str, **match) -> dict:
    """The last JSON log line of `service` whose fields include `match` (waits up to 10 s)."""
    path = Path(next(p.log for p in stack.processes if p.name == service))
    deadline = time.monotonic() + 10
    while True:
        events = [json.loads(line) for line in path.read_text().splitlines() if "{" in line]
        found = [e for e in events if all(e.get(k) == v for k, v in match.items())]
        if found:
            return found[-1]
        assert time.monotonic() < deadline, f"no {match} in {path}"
        time.sleep(0.1)


def assert_aborted_early(stack: Stack, request_id: str, max_tokens: int) -> None:
    wait_until_idle(stack)
    finished = logged(stack, "scheduler", event="request_finished", request_id=request_id)
    assert finished["finish_reason"] == "abort" and finished["output_tokens"] < max_tokens


def test_client_disconnect_mid_stream_aborts_the_request(client, stack):
    max_tokens = 500  # ignore_eos: it cannot end before the client leaves
    stream = client.completions.create(
        model=MODEL, prompt="a", max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = iter(stream)
    first = next(chunks)
    next(chunks)
    stream.close()
    assert_aborted_early(stack, first.id.removeprefix("cmpl-"), max_tokens)


def test_a_non_streaming_client_that_gives_up_aborts_its_request(stack):
    impatient = openai.OpenAI(
        base_url=f"http://{stack.spec.http_address}/v1", api_key="unused", max_retries=0,
        timeout=0.3,
    )  # fmt: skip
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(
            model=MODEL, prompt="a", max_tokens=500, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
    gone = logged(stack, "http", event="client_disconnected", path="/v1/completions")
    assert_aborted_early(stack, gone["request_id"], 500)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_scores_the_prompt_as_hf_does(client, tiny_llama_dir, max_tokens):
    """lm-eval's loglikelihood request (`local-completions`): token-id prompts, echo,
    logprobs 1, max_tokens 0 or 1. Each prompt token's logprob equals HF's log-softmax at the
    position before it (fp32, within 1e-4); the first is null; max_tokens 0 adds nothing."""
    tokenizer = hf_tokenizer(str(tiny_llama_dir))
    prompts = [tokenizer.encode(t) for t in ("The capital of France is", "One two three four")]
    got = client.completions.create(
        model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=max_tokens, temperature=0
    )
    for choice, ids in zip(got.choices, prompts, strict=True):
        logprobs = choice.logprobs
        scores = hf_log_softmax(tiny_llama_dir, ids)  # [len(ids), vocab]
        assert len(logprobs.tokens) == len(ids) + max_tokens
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        for i in range(1, len(ids)):
            assert abs(logprobs.token_logprobs[i] - scores[i - 1, ids[i]].item()) < 1e-4, i
            best = scores[i - 1].max().item()
            assert max(logprobs.top_logprobs[i].values()) == pytest.approx(best, abs=1e-4)
        assert logprobs.tokens[: len(ids)] == [tokenizer.decode([t]) for t in ids]
        if max_tokens == 0:
            assert choice.text == tokenizer.decode(ids) and choice.finish_reason == "length"
        else:
            assert logprobs.tokens[-1] == tokenizer.decode([int(scores[-1].argmax())])
    assert got.usage.completion_tokens == max_tokens * len(prompts)


def test_echo_with_logprobs_on_a_text_prompt_starts_at_its_first_token(client, tiny_llama_dir):
    ids = hf_tokenizer(str(tiny_llama_dir)).encode("Scores for a text prompt")
    got = client.completions.create(
        model=MODEL, prompt="Scores for a text prompt", echo=True, logprobs=2, max_tokens=0
    )
    logprobs = got.choices[0].logprobs
    assert len(logprobs.tokens) == len(ids) and logprobs.token_logprobs[0] is None
    assert all(len(top) in (2, 3) for top in logprobs.top_logprobs[1:])  # 2 + the token
    scores = hf_log_softmax(tiny_llama_dir, ids)
    assert abs(logprobs.token_logprobs[-1] - scores[-2, ids[-1]].item()) < 1e-4
