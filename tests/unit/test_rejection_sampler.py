"""The speculative verification rule: greedy rows emit exactly what sequential greedy decoding
would; sampled rows emit the target's distribution (chi-square over many seeded rows on a tiny
vocabulary, for sampled and one-hot drafts) with the theoretical acceptance rate; one-hot
drafts reproduce the plain sampler token for token; seeded rows ignore their neighbours."""

import math

import pytest
import torch

from common.sampling import SamplingParams
from services.worker.sampler import SamplingRow, sample
from services.worker.seeded_noise import split_key
from services.worker.spec_decode.rejection_sampler import (
    PAD,
    rejection_sample,
    verify_streams,
)
from tests.unit.test_sampler_stats import ALPHA, fits

DRAWS = 20000


def seeded_streams(seeds, first_positions, num_positions):
    keys = torch.tensor([split_key(s) for s in seeds], dtype=torch.int64)
    return verify_streams(keys, torch.as_tensor(first_positions), num_positions)


def rate_fits(successes: int, trials: int, rate: float) -> bool:
    """Two-sided binomial z-test at the chi-square tests' ALPHA."""
    z = (successes - trials * rate) / math.sqrt(trials * rate * (1 - rate))
    return math.erfc(abs(z) / math.sqrt(2)) > ALPHA


def sequential_greedy(drafts, num_draft, logits):
    """The reference: accept while the draft is the argmax, then emit the argmax."""
    out = []
    for j in range(num_draft + 1):
        best = int(logits[j].argmax())
        out.append(best)
        if j == num_draft or drafts[j] != best:
            break
    return out


def test_greedy_rows_equal_sequential_greedy_decoding():
    gen = torch.Generator().manual_seed(0)
    rows, k, vocab = 300, 4, 7
    logits = torch.randn(rows, k + 1, vocab, generator=gen)
    drafts = logits[:, :k].argmax(-1)
    wrong = torch.rand(rows, k, generator=gen) < 0.25  # corrupt a quarter of the drafts
    drafts = torch.where(wrong, (drafts + 1) % vocab, drafts)
    num_draft = torch.randint(0, k + 1, (rows,), generator=gen)
    greedy = torch.ones(rows, dtype=torch.bool)
    for draft_probs in (None, torch.softmax(torch.randn(rows, k, vocab, generator=gen), -1)):
        for streams in (None, seeded_streams(range(rows), [0] * rows, k + 1)):
            result = rejection_sample(drafts, num_draft, logits, draft_probs, greedy, streams)
            for i in range(rows):
                n = int(num_draft[i])
                expected = sequential_greedy(drafts[i].tolist(), n, logits[i])
                row = result.output_token_ids[i].tolist()
                assert row == expected + [PAD] * (k + 1 - len(expected))
                assert int(result.num_accepted[i]) == len(expected) - 1


def target_and_draft(vocab: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(k + 1, vocab, generator=gen) * 1.2
    q = torch.softmax(torch.randn(k, vocab, generator=gen) * 1.2, -1)
    return scores, torch.softmax(scores, -1), q


def run_batch(scores, q, one_hot: bool, seed: int):
    """DRAWS rows with the same target and draft distributions, drafts drawn from q with their
    own generator (independent of the verification noise), each row its own seed."""
    k, vocab = q.shape
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.stack([torch.multinomial(q[j], DRAWS, True, generator=gen) for j in range(k)], 1)
    streams = seeded_streams(range(seed * DRAWS, (seed + 1) * DRAWS), [5] * DRAWS, k + 1)
    result = rejection_sample(
        drafts,
        torch.full((DRAWS,), k),
        scores.expand(DRAWS, -1, -1),
        None if one_hot else q.expand(DRAWS, -1, -1),
        torch.zeros(DRAWS, dtype=torch.bool),
        streams,
    )
    return drafts, result


@pytest.mark.parametrize("vocab, k", [(5, 2), (8, 3)])
@pytest.mark.parametrize("one_hot", [False, True])
def test_emitted_tokens_follow_the_target_distribution(vocab, k, one_hot):
    scores, p, q = target_and_draft(vocab, k, seed=vocab + k)
    drafts, result = run_batch(scores, q, one_hot, seed=vocab * 10 + k + one_hot)
    out, accepted = result.output_token_ids, result.num_accepted
    assert bool((out[:, 0] >= 0).all())
    assert fits(torch.bincount(out[:, 0], minlength=vocab), p[0])
    first_kept = accepted >= 1
    assert fits(torch.bincount(out[first_kept, 1], minlength=vocab), p[1])
    all_kept = accepted == k  # the bonus token
    assert fits(torch.bincount(out[all_kept, k], minlength=vocab), p[k])
    # Acceptance of the first draft: sum_x min(p, q); for one-hot drafts drawn from q that is
    # E_x[p(x)] = sum_x q(x) p(x).
    rates = (p[:k] * q).sum(-1) if one_hot else torch.minimum(p[:k], q).sum(-1)
    rate = float(rates[0])
    assert rate_fits(int(first_kept.sum()), DRAWS, rate)
    # ... and of the second draft once the first is in (positions are independent here).
    assert rate_fits(int((accepted >= 2).sum()), int(first_kept.sum()), float(rates[1]))
    # Accepted tokens are the drafts; the rest is PAD.
    columns = torch.arange(k + 1)
    kept = columns < accepted.unsqueeze(1)
    assert torch.equal(out[:, :k][kept[:, :k]], drafts[kept[:, :k]])
    assert bool((out[columns > accepted.unsqueeze(1)] == PAD).all())
    # The tests have power: a wrong rule, accepting every draft, emits q (rejected), and so
    # does a rule that recovers from p instead of the residual (first token p + min(p,q) mass).
    assert not fits(torch.bincount(drafts[:, 0], minlength=vocab), p[0])
    if not one_hot:
        wrong = torch.minimum(p[0], q[0]) + (1 - rate) * p[0]
        assert not fits(torch.bincount(out[:, 0], minlength=vocab), wrong)


def test_one_hot_drafts_reproduce_the_plain_sampler_token_for_token():
    """With one-hot drafts every emitted token is the plain seeded sampler's token at that
    output position, whatever the drafts: seeded output does not change with speculation."""
    gen = torch.Generator().manual_seed(3)
    rows, k, vocab, temperature = 64, 3, 11, 0.8
    logits = torch.randn(rows, k + 1, vocab, generator=gen) * 2
    seeds = [1000 + i for i in range(rows)]
    first = torch.randint(0, 50, (rows,), generator=gen)
    plain = torch.stack(
        [
            torch.tensor(
                sample(
                    logits[:, j],
                    [
                        SamplingRow(SamplingParams(temperature=temperature, seed=s), [1] * (n + j))
                        for s, n in zip(seeds, first.tolist(), strict=True)
                    ],
                ).token_ids
            )
            for j in range(k + 1)
        ],
        1,
    )
    drafts = torch.where(torch.rand(rows, k, generator=gen) < 0.5, plain[:, :k], 0)
    result = rejection_sample(
        drafts,
        torch.randint(0, k + 1, (rows,), generator=gen),
        logits / temperature,
        None,
        torch.zeros(rows, dtype=torch.bool),
        seeded_streams(seeds, first, k + 1),
    )
    emitted = result.output_token_ids
    mask = emitted != PAD
    assert torch.equal(emitted[mask], plain[mask])


@pytest.mark.parametrize("one_hot", [False, True])
def test_rows_without_drafts_are_plain_sampling(one_hot):
    gen = torch.Generator().manual_seed(4)
    rows, k, vocab = 32, 2, 9
    logits = torch.randn(rows, k + 1, vocab, generator=gen)
    seeds = list(range(rows))
    draft_probs = None if one_hot else torch.softmax(torch.randn(rows, k, vocab), -1)
    result = rejection_sample(
        torch.randint(0, vocab, (rows, k), generator=gen),
        torch.zeros(rows, dtype=torch.int64),
        logits,
        draft_probs,
        torch.zeros(rows, dtype=torch.bool),
        seeded_streams(seeds, [7] * rows, k + 1),
    )
    params = [SamplingRow(SamplingParams(temperature=1.0, seed=s), [1] * 7) for s in seeds]
    assert result.output_token_ids[:, 0].tolist() == sample(logits[:, 0], params).token_ids
    assert bool((result.output_token_ids[:, 1:] == PAD).all())
    assert bool((result.num_accepted == 0).all())


@pytest.mark.parametrize("one_hot", [False, True])
def test_seeded_rows_are_deterministic_whatever_their_neighbours(one_hot):
    gen = torch.Generator().manual_seed(5)
    rows, k, vocab = 40, 3, 6
    logits = torch.randn(rows, k + 1, vocab, generator=gen)
    q = torch.softmax(torch.randn(rows, k, vocab, generator=gen), -1)
    drafts = torch.randint(0, vocab, (rows, k), generator=gen)
    num_draft = torch.randint(0, k + 1, (rows,), generator=gen)
    greedy = torch.rand(rows, generator=gen) < 0.3
    seeds = [77 * i for i in range(rows)]
    first = torch.randint(0, 100, (rows,), generator=gen)

    def run(index):
        return rejection_sample(
            drafts[index],
            num_draft[index],
            logits[index],
            None if one_hot else q[index],
            greedy[index],
            seeded_streams([seeds[i] for i in index.tolist()], first[index], k + 1),
        )

    full = run(torch.arange(rows))
    again = run(torch.arange(rows))
    assert torch.equal(full.output_token_ids, again.output_token_ids)
    subset = torch.randperm(rows, generator=gen)[: rows // 3]  # other neighbours, other order
    alone = run(subset)
    assert torch.equal(alone.output_token_ids, full.output_token_ids[subset])
    assert torch.equal(alone.num_accepted, full.num_accepted[subset])


def test_no_draft_positions_at_all_and_shape_checks():
    logits = torch.randn(3, 1, 4)
    result = rejection_sample(
        torch.empty(3, 0, dtype=torch.int64),
        torch.zeros(3, dtype=torch.int64),
        logits,
        None,
        torch.ones(3, dtype=torch.bool),
        None,
    )
    assert result.output_token_ids[:, 0].tolist() == logits[:, 0].argmax(-1).tolist()
    with pytest.raises(ValueError, match="target_logits"):
        rejection_sample(
            torch.zeros(3, 2, dtype=torch.int64),
            torch.zeros(3, dtype=torch.int64),
            logits,
            None,
            torch.ones(3, dtype=torch.bool),
            None,
        )
