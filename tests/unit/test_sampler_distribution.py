"""The sampler's draws, statistically: thousands of draws of one row (repeated as a batch)
never leave the support that top-k / top-p / min-p allow, and their frequencies match the
renormalised probabilities (chi-square, fixed seeds). Expected probabilities come from
transformers' own processors and warpers."""

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from common.sampling import SamplingParams
from services.worker.sampler import SamplingRow, sample
from tests.unit.test_sampler_processors import hf_truncation
from tests.unit.test_sampler_stats import fits

VOCAB = 48
DRAWS = 4000


def one_row(seed: int) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 1.5


def draw_counts(rows: list[SamplingRow], logits: torch.Tensor, seed: int = 0) -> torch.Tensor:
    batch = logits.unsqueeze(0).expand(len(rows), -1).contiguous()
    tokens = sample(batch, rows, torch.Generator().manual_seed(seed)).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=VOCAB)


CASES = [  # (temperature, top_k, top_p, min_p)
    (1.0, 0, 1.0, 0.0),
    (0.6, 5, 1.0, 0.0),
    (1.0, 0, 0.7, 0.0),
    (1.5, 0, 1.0, 0.1),
    (0.9, 12, 0.85, 0.05),
]


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", CASES)
def test_draws_stay_in_the_support_and_follow_the_renormalised_probabilities(
    temperature, top_k, top_p, min_p
):
    logits = one_row(seed=top_k + 7)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    counts = draw_counts([SamplingRow(params)] * DRAWS, logits)
    expected = torch.softmax(hf_truncation(logits, temperature, top_k, top_p, min_p), dim=-1)
    assert counts[expected == 0].sum() == 0, "a draw outside the allowed set"
    assert fits(counts, expected)
    # The test has power: the untruncated or untempered distribution is rejected.
    if (top_k, top_p, min_p) != (0, 1.0, 0.0):
        assert not fits(counts, torch.softmax(logits / temperature, dim=-1))
    if temperature != 1.0:
        wrong = torch.softmax(hf_truncation(logits, 1.0, top_k, top_p, min_p), dim=-1)
        assert not fits(counts, wrong)


def test_seeded_draws_follow_the_distribution_across_seeds_and_positions():
    logits = one_row(seed=3)
    expected = torch.softmax(hf_truncation(logits, 0.8, 20, 0.95, 0.0), dim=-1)
    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.95, seed=s) for s in range(DRAWS)]
    across_seeds = draw_counts([SamplingRow(p) for p in params], logits)
    assert counts_ok(across_seeds, expected)
    fixed = SamplingParams(temperature=0.8, top_k=20, top_p=0.95, seed=12345)
    across_positions = draw_counts(
        [SamplingRow(fixed, [1] * n, num_prompt_tokens=1) for n in range(1, DRAWS + 1)], logits
    )
    assert counts_ok(across_positions, expected)


def counts_ok(counts: torch.Tensor, expected: torch.Tensor) -> bool:
    return bool(counts[expected == 0].sum() == 0) and fits(counts, expected)


def test_dense_seeded_draws_follow_the_distribution():
    logits = one_row(seed=4)
    rows = [SamplingRow(SamplingParams(temperature=1.2, seed=1000 + s)) for s in range(DRAWS)]
    assert counts_ok(draw_counts(rows, logits), torch.softmax(logits / 1.2, dim=-1))


def test_processors_then_truncation_then_draw_follow_hf():
    """The whole chain on one row: bias and repetition penalty, then temperature and top-p."""
    logits = one_row(seed=5)
    history = [0, 1, 2, 3, 1, 2]
    params = SamplingParams(
        temperature=0.7, top_p=0.9, repetition_penalty=1.8, logit_bias=((10, 1.5), (11, -3.0))
    )
    counts = draw_counts([SamplingRow(params, history, 4)] * DRAWS, logits, seed=1)
    ids = torch.tensor([history])
    processed = SequenceBiasLogitsProcessor([[[10], 1.5], [[11], -3.0]])(ids, logits[None].clone())
    processed = RepetitionPenaltyLogitsProcessor(1.8)(ids, processed)[0]
    expected = torch.softmax(hf_truncation(processed, 0.7, 0, 0.9, 0.0), dim=-1)
    assert counts_ok(counts, expected)
    unprocessed = torch.softmax(hf_truncation(logits, 0.7, 0, 0.9, 0.0), dim=-1)
    assert not counts_ok(counts, unprocessed)


def test_mixed_batch_rows_keep_their_own_distributions():
    """Half the rows top-k, half dense: each half follows its own distribution."""
    logits = one_row(seed=6)
    top_k = SamplingRow(SamplingParams(temperature=1.0, top_k=4))
    dense = SamplingRow(SamplingParams(temperature=1.0))
    rows = [top_k, dense] * (DRAWS // 2)
    batch = logits.unsqueeze(0).expand(len(rows), -1).contiguous()
    tokens = torch.tensor(sample(batch, rows, torch.Generator().manual_seed(2)).token_ids)
    for half, expected in (
        (tokens[0::2], torch.softmax(hf_truncation(logits, 1.0, 4, 1.0, 0.0), -1)),
        (tokens[1::2], torch.softmax(logits, -1)),
    ):
        assert counts_ok(torch.bincount(half, minlength=VOCAB), expected)
