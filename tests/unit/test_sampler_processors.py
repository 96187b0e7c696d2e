"""Each logits processor against transformers' own (or a plain per-row Python loop where HF
has none), on random logits, in mixed batches where rows without a setting stay untouched."""

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from common.sampling import SamplingParams
from services.worker.logits_processors import truncate
from services.worker.sampler import SamplingRow, process_logits

VOCAB = 512


def random_logits(rows: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def history(length: int, seed: int, high: int = 60) -> list[int]:
    """Token ids drawn from a small range, so tokens repeat."""
    return torch.randint(0, high, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_row(processor, tokens: list[int], row: torch.Tensor) -> torch.Tensor:
    ids = torch.tensor([tokens], dtype=torch.long).reshape(1, -1)
    return processor(ids, row.unsqueeze(0).clone())[0]


def test_repetition_penalty_matches_hf_over_prompt_and_output():
    logits = random_logits(6, seed=0)
    penalties = [1.3, 1.0, 0.7, 2.5, 1.0, 1.1]
    seqs = [history(20 + 7 * i, seed=i) for i in range(6)]
    rows = [
        SamplingRow(SamplingParams(repetition_penalty=p), tokens, num_prompt_tokens=12)
        for p, tokens in zip(penalties, seqs, strict=True)
    ]
    got = process_logits(logits, rows)
    for i, (p, tokens) in enumerate(zip(penalties, seqs, strict=True)):
        if p == 1.0:
            assert torch.equal(got[i], logits[i])  # untouched
            continue
        expected = hf_row(RepetitionPenaltyLogitsProcessor(penalty=p), tokens, logits[i])
        torch.testing.assert_close(got[i], expected, rtol=0, atol=0)  # the same float ops
        assert not torch.equal(got[i], logits[i])


def test_min_tokens_suppresses_stop_tokens_like_hf_until_enough_outputs():
    logits = random_logits(4, seed=1)
    stops = (3, 17, 200)
    prompt = history(9, seed=5)
    rows, expected = [], []
    for i, outputs in enumerate((0, 2, 3, 5)):  # output tokens so far; min_tokens = 3
        tokens = prompt + history(outputs, seed=10 + i)
        rows.append(
            SamplingRow(SamplingParams(min_tokens=3, stop_token_ids=stops), tokens, len(prompt))
        )
        hf = MinNewTokensLengthLogitsProcessor(len(prompt), 3, list(stops))
        expected.append(hf_row(hf, tokens, logits[i]))
    got = process_logits(logits, rows)
    torch.testing.assert_close(got, torch.stack(expected), rtol=0, atol=0)
    assert torch.isinf(got[:2, list(stops)]).all() and torch.isfinite(got[2:, list(stops)]).all()


def test_logit_bias_matches_hf_sequence_bias():
    logits = random_logits(3, seed=2)
    biases = [((5, 2.5), (40, -100.0), (511, 7.0)), (), ((0, -3.25),)]
    rows = [SamplingRow(SamplingParams(logit_bias=b)) for b in biases]
    got = process_logits(logits, rows)
    for i, bias in enumerate(biases):
        if not bias:
            assert torch.equal(got[i], logits[i])
            continue
        hf = SequenceBiasLogitsProcessor(sequence_bias=[[[t], v] for t, v in bias])
        torch.testing.assert_close(got[i], hf_row(hf, [1, 2], logits[i]), rtol=0, atol=0)


def reference_presence_frequency(
    logits: torch.Tensor, outputs: list[list[int]], presence: list[float], frequency: list[float]
) -> torch.Tensor:
    """OpenAI/vLLM semantics, one row and one distinct token at a time."""
    out = logits.clone()
    for row, tokens in enumerate(outputs):
        for token in set(tokens):
            count = tokens.count(token)
            out[row, token] -= frequency[row] * count + presence[row]
    return out


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = random_logits(5, seed=3)
    presence = [0.5, 0.0, -1.0, 2.0, 0.0]
    frequency = [0.0, 0.3, 0.7, -0.4, 0.0]
    prompts = [history(10, seed=20 + i) for i in range(5)]
    outputs = [history(5 + 9 * i, seed=30 + i) for i in range(5)]
    rows = [
        SamplingRow(
            SamplingParams(presence_penalty=p, frequency_penalty=f), prompt + output, len(prompt)
        )
        for p, f, prompt, output in zip(presence, frequency, prompts, outputs, strict=True)
    ]
    got = process_logits(logits, rows)
    expected = reference_presence_frequency(logits, outputs, presence, frequency)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert torch.equal(got[4], logits[4])
    prompt_only = set(prompts[0]) - set(outputs[0])
    assert torch.equal(got[0, list(prompt_only)], logits[0, list(prompt_only)])


def test_processors_apply_in_order_on_one_row():
    """bias, then min_tokens, then repetition, then presence/frequency (vLLM and HF order)."""
    logits = random_logits(2, seed=4)
    prompt, output = [4, 5, 6, 4], [6, 7, 7]
    params = SamplingParams(
        logit_bias=((4, 3.0), (7, -2.0), (9, 1.0)),
        min_tokens=5,
        stop_token_ids=(9,),
        repetition_penalty=1.4,
        presence_penalty=0.25,
        frequency_penalty=0.5,
    )
    got = process_logits(
        logits, [SamplingRow(params, prompt + output, 4), SamplingRow(SamplingParams())]
    )
    ids = torch.tensor([prompt + output])
    expected = logits[:1].clone()
    expected = SequenceBiasLogitsProcessor([[[t], v] for t, v in params.logit_bias])(ids, expected)
    expected = MinNewTokensLengthLogitsProcessor(4, 5, [9])(ids, expected)
    expected = RepetitionPenaltyLogitsProcessor(1.4)(ids, expected)
    expected = reference_presence_frequency(expected, [output], [0.25], [0.5])
    torch.testing.assert_close(got[:1], expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[1], logits[1])


def hf_truncation(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> torch.Tensor:
    """HF's warper chain in generate's order; 0 / 1 / 0 mean off."""
    ids = torch.zeros(1, 1, dtype=torch.long)
    out = TemperatureLogitsWarper(temperature)(ids, logits.unsqueeze(0).clone())
    if top_k > 0:
        out = TopKLogitsWarper(top_k)(ids, out)
    if top_p < 1.0:
        out = TopPLogitsWarper(top_p)(ids, out)
    if min_p > 0.0:
        out = MinPLogitsWarper(min_p)(ids, out)
    return out[0]


SETTINGS = [  # (temperature, top_k, top_p, min_p)
    (1.0, 0, 1.0, 0.0),
    (0.7, 10, 1.0, 0.0),
    (1.3, 0, 0.9, 0.0),
    (1.0, 0, 1.0, 0.05),
    (0.8, 50, 0.8, 0.0),
    (2.0, 100, 0.95, 0.02),
    (0.5, 3, 0.5, 0.3),
    (1.0, 1000, 0.6, 0.0),  # top_k above the vocabulary
]


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", SETTINGS)
def test_truncation_matches_hf_warpers(temperature, top_k, top_p, min_p):
    logits = random_logits(64, seed=top_k + int(100 * top_p), scale=2.0)
    k = min(top_k, VOCAB) if top_k > 0 else VOCAB
    scaled = logits / temperature
    got = truncate(
        scaled,
        torch.full((64,), k),
        torch.full((64,), top_p),
        torch.full((64,), min_p),
    )
    for row in range(64):
        expected = hf_truncation(logits[row], temperature, top_k, top_p, min_p)
        kept = torch.isfinite(expected)
        assert torch.equal(torch.isfinite(got[row]), kept), f"row {row}: different support"
        torch.testing.assert_close(got[row][kept], expected[kept], rtol=1e-6, atol=0)


def test_truncation_with_different_settings_per_row():
    logits = random_logits(len(SETTINGS), seed=9, scale=2.0)
    temps = torch.tensor([s[0] for s in SETTINGS]).unsqueeze(1)
    got = truncate(
        logits / temps,
        torch.tensor([min(s[1], VOCAB) if s[1] > 0 else VOCAB for s in SETTINGS]),
        torch.tensor([s[2] for s in SETTINGS]),
        torch.tensor([s[3] for s in SETTINGS]),
    )
    for row, setting in enumerate(SETTINGS):
        expected = hf_truncation(logits[row], *setting)
        assert torch.equal(torch.isfinite(got[row]), torch.isfinite(expected)), setting
    assert torch.isfinite(got[0]).all()  # no truncation at all: every token stays
