"""vLLM's extras on the HTTP front, end to end on the shared `api_stack`: `/tokenize` and
`/detokenize` against the `transformers` tokenizer and chat template, `/version`, `/ping`,
and `return_token_ids` / `return_tokens_as_token_ids` on both generation endpoints
(through the official `openai` client's `extra_body`; raw `httpx2` for the rest), checked
against the gateway's own `Generate` ids and HF greedy."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx2
import openai
import pytest

from services.stack.ports import free_port
from tests.hf_reference import hf_greedy, hf_tokenizer
from tests.stack_client import generate, greedy_request

MODEL = "tiny-llama"
ROOT = Path(__file__).resolve().parents[2]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "naïve café 🚀, hello"},
]


@pytest.fixture(scope="module")
def http(api_stack):
    with httpx2.Client(base_url=f"http://{api_stack.spec.http_address}", timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def client(api_stack):
    return openai.OpenAI(
        base_url=f"http://{api_stack.spec.http_address}/v1", api_key="unused", max_retries=0,
        timeout=120,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return hf_tokenizer(str(tiny_llama_dir))


def template_ids(tokenizer, add_generation_prompt: bool = True) -> list[int]:
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt)
    return list(rendered["input_ids"])


def error_of(reply, status: int) -> dict:
    assert reply.status_code == status, reply.text
    return reply.json()["error"]


def test_tokenize_completion_and_chat_forms_equal_the_hf_tokenizer(http, tokenizer):
    prompt = "naïve café 中文 🚀 Hello"
    got = http.post("/tokenize", json={"model": MODEL, "prompt": prompt}).json()
    want = tokenizer.encode(prompt)
    assert got == {"count": len(want), "max_model_len": 512, "tokens": want, "token_strs": None}

    got = http.post(
        "/tokenize", json={"prompt": prompt, "add_special_tokens": False, "return_token_strs": True}
    ).json()
    want = tokenizer.encode(prompt, add_special_tokens=False)
    assert got["tokens"] == want and got["count"] == len(want)
    assert got["token_strs"] == tokenizer.convert_ids_to_tokens(want)

    for add_generation_prompt in (True, False):
        body = {
            "model": MODEL,
            "messages": MESSAGES,
            "add_generation_prompt": add_generation_prompt,
        }
        got = http.post("/tokenize", json=body).json()
        want = template_ids(tokenizer, add_generation_prompt)
        assert got["tokens"] == want and got["count"] == len(want)
    assert http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"] == template_ids(
        tokenizer
    )


def test_detokenize_round_trips_and_refuses_ids_outside_the_vocabulary(
    http, tokenizer, tiny_llama_dir
):
    prompt = "Ελληνικά και русский 🚀"
    ids = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    got = http.post("/detokenize", json={"model": MODEL, "tokens": ids}).json()
    assert got == {"prompt": tokenizer.decode(ids)}  # special tokens kept, as vLLM
    plain = tokenizer.encode(prompt, add_special_tokens=False)
    assert http.post("/detokenize", json={"tokens": plain}).json()["prompt"] == prompt
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}

    vocab = json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"]
    for tokens, param in (([5, vocab], "tokens[1]"), ([-1], "tokens[0]")):
        error = error_of(http.post("/detokenize", json={"tokens": tokens}), 400)
        assert error["param"] == param and f"[0, {vocab})" in error["message"]
    error = error_of(http.post("/detokenize", json={"tokens": [1, "2"]}), 400)
    assert error["message"] == "tokens[1]: must be an integer, got string"
    assert error_of(http.post("/detokenize", json={}), 400)["param"] == "tokens"


def test_tokenize_and_detokenize_refusals_name_the_field(http):
    cases = [
        ({"prompt": 5}, "prompt", "prompt: must be a string, got integer"),
        ({"prompt": "x", "return_token_strs": "yes"}, "return_token_strs", "must be a boolean"),
        ({"prompt": "x", "add_special_tokens": 1}, "add_special_tokens", "must be a boolean"),
        ({"prompt": "x", "messages": MESSAGES}, "messages", "either prompt or messages"),
        ({"prompt": "x", "add_generation_prompt": True}, "add_generation_prompt", "unknown"),
        ({"messages": []}, "messages", "non-empty array"),
        (
            {"messages": MESSAGES, "continue_final_message": True, "add_generation_prompt": True},
            "continue_final_message",
            "cannot be true with add_generation_prompt=true",
        ),
        ({"messages": MESSAGES, "add_special_tokens": True}, "add_special_tokens", "chat"),
        ({"messages": MESSAGES, "chat_template_kwargs": {"x": 1}}, "chat_template_kwargs", ""),
        ({"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools[0].function", "required"),
        ({}, "prompt", "prompt is required"),
    ]
    for body, param, words in cases:
        error = error_of(http.post("/tokenize", json=body), 400)
        assert error["param"] == param and words in error["message"], (body, error)
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        error = error_of(http.post(path, json={**body, "model": "nope"}), 404)
        assert error["code"] == "model_not_found"


def test_version_and_ping(http):
    assert http.get("/version").json() == {"version": importlib.metadata.version("tandem")}
    for method in ("GET", "POST"):
        assert http.request(method, "/ping").status_code == 200


def test_ping_is_503_while_the_gateway_is_not_serving(tmp_path):
    """A front whose gateway is not there: /ping and /health are 503, /version still 200."""
    port = free_port()
    argv = [
        sys.executable, "-m", "services.openai_api", "--port", str(port),
        "--gateway", f"127.0.0.1:{free_port()}",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TANDEM_EXIT_WITH_PARENT": "1"}
    with open(tmp_path / "http.log", "wb") as log:
        process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        with httpx2.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            deadline = time.monotonic() + 60
            while True:
                try:
                    version = http.get("/version")
                    break
                except httpx2.TransportError:
                    assert process.poll() is None, (tmp_path / "http.log").read_text()
                    assert time.monotonic() < deadline, "the HTTP front did not start"
                    time.sleep(0.1)
            assert version.status_code == 200
            for method, path in (("GET", "/ping"), ("POST", "/ping"), ("GET", "/health")):
                reply = http.request(method, path)
                assert reply.status_code == 503, (method, path)
                assert reply.json()["error"]["type"] == "service_unavailable_error"
    finally:
        process.terminate()
        process.wait(10)


def test_completion_return_token_ids_are_the_gateway_and_hf_ids(
    client, api_stack, tiny_llama_dir, tokenizer
):
    prompt, max_tokens = "Once upon a time", 16
    prompt_ids = tokenizer.encode(prompt)
    want = hf_greedy(tiny_llama_dir, prompt_ids, max_tokens)
    direct = generate(api_stack.spec.gateway_address, greedy_request(prompt, max_tokens))
    assert direct.token_ids == want
    kwargs = dict(model=MODEL, max_tokens=max_tokens, temperature=0)
    extra = {"return_token_ids": True}

    got = client.completions.create(prompt=[prompt, [3, 4, 5]], extra_body=extra, **kwargs)
    first, second = got.choices
    assert first.prompt_token_ids == prompt_ids and first.token_ids == want
    assert second.prompt_token_ids == [3, 4, 5]
    assert second.token_ids == hf_greedy(tiny_llama_dir, [3, 4, 5], max_tokens)
    assert got.usage.completion_tokens == len(first.token_ids) + len(second.token_ids)
    plain = client.completions.create(prompt=prompt, **kwargs).choices[0]
    assert "token_ids" not in plain.model_extra and "prompt_token_ids" not in plain.model_extra

    chunks = list(client.completions.create(prompt=prompt, stream=True, extra_body=extra, **kwargs))
    assert chunks[0].choices[0].prompt_token_ids == prompt_ids
    assert all("prompt_token_ids" not in c.choices[0].model_extra for c in chunks[1:])
    assert [i for c in chunks for i in c.choices[0].token_ids] == want
    assert all(c.choices[0].token_ids for c in chunks[:-1])  # each chunk: the ids it covers


def test_chat_return_token_ids_are_the_template_and_hf_ids(client, http, tiny_llama_dir, tokenizer):
    prompt_ids = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    want = hf_greedy(tiny_llama_dir, prompt_ids, 20)
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0)
    extra = {"return_token_ids": True}

    got = client.chat.completions.create(extra_body=extra, **kwargs)
    assert got.prompt_token_ids == prompt_ids  # what /tokenize of the messages gives
    assert got.choices[0].token_ids == want
    assert got.usage.prompt_tokens == len(prompt_ids)

    # continue_final_message: the assistant's partial answer is continued, not closed.
    partial = [*MESSAGES, {"role": "assistant", "content": "Sure, the"}]
    open_ids = list(
        tokenizer.apply_chat_template(partial, continue_final_message=True)["input_ids"]
    )
    body = {"messages": partial, "continue_final_message": True, "add_generation_prompt": False}
    assert http.post("/tokenize", json=body).json()["tokens"] == open_ids
    continued = client.chat.completions.create(
        model=MODEL, messages=partial, max_tokens=8, temperature=0,
        extra_body={"return_token_ids": True, "continue_final_message": True},
    )  # fmt: skip
    assert continued.prompt_token_ids == open_ids
    assert continued.choices[0].token_ids == hf_greedy(tiny_llama_dir, open_ids, 8)

    chunks = list(client.chat.completions.create(stream=True, extra_body=extra, **kwargs))
    assert chunks[0].prompt_token_ids == prompt_ids
    assert all("prompt_token_ids" not in c.model_extra for c in chunks[1:])
    assert [i for c in chunks[1:] for i in c.choices[0].token_ids] == want


def test_return_tokens_as_token_ids_renders_every_logprob_token_as_its_id(client):
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": True}
    kwargs = dict(model=MODEL, prompt="Continuous batching", max_tokens=8, temperature=0)
    got = client.completions.create(logprobs=3, extra_body=extra, **kwargs).choices[0]
    assert got.logprobs.tokens == [f"token_id:{i}" for i in got.token_ids]
    for chosen, top in zip(got.token_ids, got.logprobs.top_logprobs, strict=True):
        assert all(key.startswith("token_id:") for key in top)
        assert f"token_id:{chosen}" in top  # greedy: the chosen token is among the top
    streamed = list(client.completions.create(logprobs=1, stream=True, extra_body=extra, **kwargs))
    tokens = [t for c in streamed for t in c.choices[0].logprobs.tokens]
    assert tokens == [f"token_id:{i}" for c in streamed for i in c.choices[0].token_ids]
    assert tokens == got.logprobs.tokens

    chat_kwargs = dict(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=2, extra_body=extra,
    )  # fmt: skip
    chat = client.chat.completions.create(**chat_kwargs).choices[0]
    content = chat.logprobs.content
    assert [t.token for t in content] == [f"token_id:{i}" for i in chat.token_ids]
    assert all(t.bytes == list(t.token.encode()) for t in content)
    assert all(top.token.startswith("token_id:") for t in content for top in t.top_logprobs)
    chunks = list(client.chat.completions.create(stream=True, **chat_kwargs))
    streamed = [
        t.token for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content
    ]
    assert streamed == [t.token for t in content]


@pytest.mark.parametrize("key", ["return_token_ids", "return_tokens_as_token_ids"])
def test_bad_types_for_the_token_id_extras_are_400s_naming_them(client, key):
    with pytest.raises(openai.BadRequestError, match=f"{key}: must be a boolean, got string"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={key: "yes"})
    with pytest.raises(openai.BadRequestError, match=f"{key}: must be a boolean, got integer"):
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=1, extra_body={key: 1}
        )
