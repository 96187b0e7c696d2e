"""The runner's logprobs on the real (tiny) model: sampled-token logprobs with their top
alternatives, and prompt logprobs across chunked prefill, equal `log_softmax` of HF's fp32
logits for the same tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.sampling import Logprob, SamplingParams
from common.step_plan import CachedRequestData, NewRequestData
from common.step_result import StepResult
from services.worker.batch import PersistentBatch
from services.worker.kv_cache import KvCache
from services.worker.logprobs import prompt_entry_span
from services.worker.models.weight_loader import load_model
from services.worker.runner import ModelRunner

ATOL = 1e-4
BLOCK = 4


@pytest.fixture(scope="module")
def models(tiny_llama_dir):
    ours, config = load_model(tiny_llama_dir, dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(
        tiny_llama_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return ours, config, hf


class Driver:
    """A ModelRunner over a fresh KV cache, fed through the worker's persistent batch."""

    def __init__(self, ours, config) -> None:
        cache = KvCache(
            64,
            BLOCK,
            config.num_hidden_layers,
            config.num_key_value_heads,
            config.head_dim,
            torch.float32,
        )
        self.runner = ModelRunner(ours, cache, torch.device("cpu"))
        self.batch = PersistentBatch(BLOCK, cache.num_blocks, config.vocab_size)
        self.next_block = 0

    def blocks(self, num_tokens: int) -> list[int]:
        count = -(-num_tokens // BLOCK)
        self.next_block += count
        return list(range(self.next_block - count, self.next_block))

    def new(self, rid, tokens, scheduled, sampling, num_prompt_tokens=0) -> NewRequestData:
        blocks = self.blocks(len(tokens) + 8)
        return NewRequestData(rid, tokens, blocks, 0, scheduled, sampling, num_prompt_tokens)

    def step(self, new=(), cached=()) -> StepResult:
        work = self.batch.apply([], list(new), list(cached))
        output = self.runner.execute(work)
        self.batch.complete(work, output.sampled)
        return output


def hf_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V]: row p = log-probabilities of the token at position p + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), dim=-1)


def assert_entry(entry: Logprob, reference_row: torch.Tensor, token: int, k: int) -> None:
    assert entry.token_id == token
    assert abs(entry.logprob - float(reference_row[token])) < ATOL
    assert len(entry.top) == k
    values = [v for _, v in entry.top]
    assert values == sorted(values, reverse=True)
    for top_id, value in entry.top:  # each listed alternative carries its own logprob
        assert abs(value - float(reference_row[top_id])) < ATOL
    expected = reference_row.topk(k).values  # and they are the k most likely
    torch.testing.assert_close(torch.tensor(values), expected, atol=ATOL, rtol=0)


def test_prompt_entry_span():
    assert prompt_entry_span(0, 13, 30) == (1, 13)  # first chunk: positions 1..13
    assert prompt_entry_span(13, 17, 30) == (14, 16)  # last chunk: 14..29
    assert prompt_entry_span(0, 30, 30) == (1, 29)
    assert prompt_entry_span(29, 1, 30) == (30, 0)  # the last prompt token only samples
    assert prompt_entry_span(10, 5, 12) == (11, 1)  # a recompute: prompt positions only
    assert prompt_entry_span(12, 3, 12) == (13, 0)


def test_chunked_prompt_and_sampled_logprobs_match_hf(models):
    ours, config, hf = models
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, config.vocab_size, (30,), generator=gen).tolist()
    other = torch.randint(3, config.vocab_size, (9,), generator=gen).tolist()
    asking = SamplingParams(prompt_logprobs=3, logprobs=4)
    driver = Driver(ours, config)

    first = driver.step(
        new=[driver.new("a", prompt, 13, asking), driver.new("b", other, 9, SamplingParams())]
    )
    assert "a" not in first.sampled and "b" in first.sampled
    assert first.logprobs == {} and set(first.prompt_logprobs) == {"a"}
    second = driver.step(cached=[CachedRequestData("a", [], 17), CachedRequestData("b", [], 1)])
    third = driver.step(cached=[CachedRequestData("a", [], 1), CachedRequestData("b", [], 1)])
    assert set(second.logprobs) == set(third.logprobs) == {"a"}
    assert "a" not in third.prompt_logprobs and "b" not in second.prompt_logprobs

    chunk1, chunk2 = first.prompt_logprobs["a"], second.prompt_logprobs["a"]
    assert (chunk1.start, len(chunk1.entries)) == (1, 13)
    assert (chunk2.start, len(chunk2.entries)) == (14, 16)
    tokens = prompt + [second.sampled["a"], third.sampled["a"]]
    reference = hf_logprobs(hf, tokens)
    for position, entry in enumerate(chunk1.entries + chunk2.entries, start=1):
        assert_entry(entry, reference[position - 1], prompt[position], k=3)
    for position, output in ((30, second), (31, third)):
        token = output.sampled["a"]
        assert token == int(reference[position - 1].argmax())  # greedy
        assert_entry(output.logprobs["a"], reference[position - 1], token, k=4)


def test_sampled_logprobs_are_raw_under_processors_and_seeded_draws(models):
    """Bias, penalty, temperature and top-k shape the draw, not the logprobs reported."""
    ours, config, hf = models
    prompt = torch.randint(3, config.vocab_size, (11,), generator=torch.Generator().manual_seed(1))
    prompt = prompt.tolist()
    params = SamplingParams(
        temperature=1.3,
        top_k=20,
        seed=7,
        repetition_penalty=1.5,
        logit_bias=((5, 2.0),),
        logprobs=2,
    )
    driver = Driver(ours, config)
    tokens = list(prompt)
    for step in range(4):
        if step == 0:
            output = driver.step(new=[driver.new("s", prompt, len(prompt), params)])
        else:
            output = driver.step(cached=[CachedRequestData("s", [], 1)])
        tokens.append(output.sampled["s"])
        assert output.prompt_logprobs == {}
        reference = hf_logprobs(hf, tokens)
        assert_entry(output.logprobs["s"], reference[len(tokens) - 2], tokens[-1], k=2)


def test_recompute_after_preemption_scores_prompt_positions_only(models):
    ours, config, hf = models
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, config.vocab_size, (12,), generator=gen).tolist()
    outputs = torch.randint(3, config.vocab_size, (3,), generator=gen).tolist()
    driver = Driver(ours, config)
    params = SamplingParams(prompt_logprobs=0)
    output = driver.step(new=[driver.new("r", prompt + outputs, 15, params, len(prompt))])
    scored = output.prompt_logprobs["r"]
    assert (scored.start, len(scored.entries)) == (1, 11)
    reference = hf_logprobs(hf, prompt + outputs)
    for position, entry in enumerate(scored.entries, start=1):
        assert_entry(entry, reference[position - 1], prompt[position], k=0)
    assert output.sampled["r"] == int(reference[-1].argmax()) and output.logprobs == {}
