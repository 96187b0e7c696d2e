"""A GGUF file served as vLLM serves one (`--model path/file.gguf`) by the real services:
every service is given the file itself and reads it through the one converted folder (built
once, under a lock, by whichever starts first). Greedy output equals HF `generate` on the
same file as transformers loads it (its own GGUF reading), token for token, for text and
chat prompts; the model's name is the file's stem. A bad file stops a service at start
with one line, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from functools import lru_cache

import grpc
import pytest
import torch

from common.pb.tandem.v1 import generate_pb2, generate_pb2_grpc
from services.stack.launcher import ROOT
from tests.stack_client import generate, greedy_request, wait_until_idle
from tests.tiny_gguf import gguf_checkpoint, write_gguf

PROMPTS = ["Once upon a time", "KV blocks move between workers", "naïve café 中文字符 🚀"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return gguf_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="module")
def gguf_file(tiny, tmp_path_factory):
    return write_gguf(tiny, tmp_path_factory.mktemp("gguf") / "tiny-q8.gguf", "Q8_0")


@lru_cache(maxsize=2)
def hf_from_gguf(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model.eval(), tokenizer


@torch.inference_mode()
def hf_greedy_ids(path, prompt_ids: list[int], max_new: int) -> list[int]:
    model, _ = hf_from_gguf(path)
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                         do_sample=False, pad_token_id=model.config.eos_token_id)  # fmt: skip
    new = out[0, len(prompt_ids) :].tolist()
    eos = model.config.eos_token_id
    return new[: new.index(eos) + 1] if eos in new else new


@pytest.fixture(scope="module")
def stack(gguf_file, module_stacks, tmp_path_factory):
    cache = tmp_path_factory.mktemp("gguf-cache")
    return module_stacks(gguf_file, name="gguf", env={"TANDEM_GGUF_CACHE": str(cache)})


def test_a_gguf_file_serves_hf_exact_tokens(stack, gguf_file):
    _, tokenizer = hf_from_gguf(gguf_file)
    address = stack.spec.gateway_address
    for prompt in PROMPTS:
        got = generate(address, greedy_request(prompt, MAX_TOKENS))
        assert got.token_ids == hf_greedy_ids(gguf_file, tokenizer.encode(prompt), MAX_TOKENS)
    chat = generate_pb2.GenerateRequest(max_tokens=MAX_TOKENS)
    chat.chat.messages.add(role="user", content="Hello there")
    chat.sampling.temperature = 0.0
    messages = [{"role": "user", "content": "Hello there"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert generate(address, chat).token_ids == hf_greedy_ids(gguf_file, rendered, MAX_TOKENS)
    with grpc.insecure_channel(address) as channel:
        info = generate_pb2_grpc.GenerateServiceStub(channel).GetModelInfo(
            generate_pb2.GetModelInfoRequest(), timeout=10
        )
    assert info.model_name == "tiny-q8"  # the file's stem
    wait_until_idle(stack)


def test_a_bad_gguf_stops_a_service_with_one_line(tiny, gguf_file, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_file.read_bytes()[:100_000])
    gpt2 = write_gguf(tiny, tmp_path / "gpt2.gguf", "F32", architecture="gpt2")
    env = {"TANDEM_GGUF_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    for path, message in ((cut, "truncated"), (gpt2, "architecture 'gpt2' is not served")):
        for argv in (
            ["services.worker", "--model", str(path), "--port", "0"],
            ["services.stack", "--run-dir", str(tmp_path / "run"), "up", "--model", str(path)],
        ):
            done = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True,
                                  env=env, cwd=ROOT, timeout=120)  # fmt: skip
            assert done.returncode == 2, (argv, done.stdout, done.stderr)
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            assert len(lines) == 1 and message in lines[0], (argv, done.stderr)
            assert "Traceback" not in done.stderr + done.stdout
