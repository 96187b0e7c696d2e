"""Batched sampling: greedy rows are argmax, random rows stay inside top-k / top-p, logprobs
come from the raw logits, and odd parameter values never crash the worker."""

import torch

from common.sampling import MAX_LOGPROBS, SamplingParams
from services.worker.sampler import SamplingRow, sample


def rows(*params: SamplingParams) -> list[SamplingRow]:
    return [SamplingRow(p) for p in params]


def test_greedy_rows_take_the_argmax_next_to_random_rows():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = rows(
        SamplingParams(),
        SamplingParams(temperature=1.0),
        SamplingParams(),
        SamplingParams(temperature=0.7),
    )
    tokens = sample(logits, params, torch.Generator().manual_seed(1)).token_ids
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())


def test_greedy_equals_temperature_zero_equals_raw_argmax():
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(2))
    expected = logits.argmax(dim=-1).tolist()
    assert sample(logits, rows(*[SamplingParams()] * 16)).token_ids == expected
    # Greedy whatever the truncation settings, and with a seed: the draw is never used.
    odd = SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.2, seed=5)
    assert sample(logits, rows(*[odd] * 16)).token_ids == expected
    # Logprobs do not change the greedy choice.
    assert sample(logits, rows(*[SamplingParams(logprobs=2)] * 16)).token_ids == expected


def test_plain_greedy_step_leaves_the_logits_alone():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(3))
    before = logits.clone()
    params = rows(
        SamplingParams(),
        SamplingParams(logit_bias=((1, 5.0),)),
        SamplingParams(repetition_penalty=2.0),
    )
    sample(logits, params)
    assert torch.equal(logits, before)  # processors work on a copy


def test_top_k_restricts_support_to_the_k_best():
    logits = torch.linspace(0, 1, 20).repeat(200, 1)
    params = rows(*[SamplingParams(temperature=5.0, top_k=3)] * 200)
    tokens = sample(logits, params, torch.Generator().manual_seed(0)).token_ids
    assert set(tokens) == {17, 18, 19}


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(400, 1)
    params = rows(*[SamplingParams(temperature=1.0, top_p=0.8)] * 400)
    tokens = sample(logits, params, torch.Generator().manual_seed(0)).token_ids
    assert set(tokens) == {0, 1}  # 0.5 + 0.3 reaches 0.8; 2 and 3 are cut


def test_tiny_top_p_and_top_k_one_are_greedy():
    logits = torch.randn(8, 30)
    expected = logits.argmax(dim=-1).tolist()
    assert (
        sample(logits, rows(*[SamplingParams(temperature=1.0, top_p=1e-6)] * 8)).token_ids
        == expected
    )
    assert (
        sample(logits, rows(*[SamplingParams(temperature=3.0, top_k=1)] * 8)).token_ids == expected
    )


def test_edge_values_do_not_crash():
    logits = torch.randn(5, 10)
    params = rows(
        # k and logprobs above the vocab (values out of their limits never get this far:
        # SamplingParams refuses them, see tests/unit/test_sampling_params.py)
        SamplingParams(temperature=1.0, top_k=1000, logprobs=MAX_LOGPROBS),
        SamplingParams(temperature=1.0, min_p=1.0, top_p=1.0),  # only the top token survives min-p
        SamplingParams(logit_bias=((99, 1.0),)),  # ids outside the vocab are ignored
        SamplingParams(min_tokens=4, stop_token_ids=(3, 1000)),
        SamplingParams(temperature=1.0, seed=2**64 - 1, logprobs=0),
    )
    result = sample(logits, params, torch.Generator().manual_seed(0))
    assert all(0 <= t < 10 for t in result.token_ids)
    assert result.token_ids[1] == int(logits[1].argmax())
    assert result.token_ids[3] == int(logits[3].argmax()) and result.token_ids[3] != 3
    assert len(result.logprobs[0].top) == 10 and result.logprobs[4].top == ()
    assert result.logprobs[1:4] == [None, None, None]


def test_logprobs_are_raw_log_softmax_sorted_descending():
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    params = rows(
        SamplingParams(temperature=0.5, top_k=5, repetition_penalty=1.5, logprobs=4),
        SamplingParams(),
        SamplingParams(logit_bias=((7, 50.0),), logprobs=2),
    )
    result = sample(logits, params, torch.Generator().manual_seed(0))
    reference = torch.log_softmax(logits, dim=-1)
    assert result.logprobs[1] is None
    assert result.token_ids[2] == 7  # the bias decides the token, not the reported logprob
    for row in (0, 2):
        entry = result.logprobs[row]
        assert entry.token_id == result.token_ids[row]
        assert abs(entry.logprob - float(reference[row, entry.token_id])) < 1e-6
        values, ids = reference[row].topk(len(entry.top))
        assert [t for t, _ in entry.top] == ids.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in entry.top]), values)
