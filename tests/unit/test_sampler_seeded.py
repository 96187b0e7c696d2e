"""Seeded sampling: the same (seed, output position) gives the same token whatever the other
rows, their order, the batch size and the worker's generator; a generation resumed from its
tokens so far (another worker, or a recompute after preemption) continues identically. And
the counter-based noise behind it is uniform and uncorrelated."""

import random

import pytest
import torch

from common.sampling import SamplingParams
from services.worker.sampler import SamplingRow, sample
from services.worker.seeded_noise import (
    U_MAX,
    U_MIN,
    exponential,
    mix32,
    random_keys,
    row_streams,
    split_key,
    uniform,
)
from tests.unit.test_sampler_stats import fits

VOCAB = 1000
TARGETS = [  # seeded rows under test, drawn at output position 7
    SamplingParams(temperature=1.0, seed=1234),  # dense race
    SamplingParams(temperature=0.9, top_k=40, seed=99),  # top-k candidates
    SamplingParams(temperature=1.1, top_p=0.9, seed=2**63 + 5),  # full sort, 64-bit seed
    SamplingParams(
        temperature=0.8, top_k=200, top_p=0.95, min_p=0.01, seed=0, repetition_penalty=1.2
    ),
]


def target_row(params: SamplingParams, position: int = 7) -> SamplingRow:
    prompt = list(range(10, 20))
    return SamplingRow(params, prompt + list(range(30, 30 + position)), len(prompt))


def neighbours(count: int, rng: random.Random) -> list[SamplingRow]:
    choices = [
        SamplingParams(),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5, top_k=3),
        SamplingParams(temperature=1.0, top_k=900, seed=7),
        SamplingParams(temperature=2.0, top_p=0.5, seed=8, presence_penalty=1.0),
        SamplingParams(temperature=1.0, min_p=0.2, logprobs=3),
    ]
    return [SamplingRow(rng.choice(choices), [1, 2, 3, 4], 2) for _ in range(count)]


@pytest.mark.parametrize("target", TARGETS, ids=range(len(TARGETS)))
def test_same_seed_and_position_give_the_same_token_in_any_batch(target):
    logits_row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1))
    alone = sample(logits_row[None], [target_row(target)]).token_ids[0]
    rng = random.Random(0)
    for size in (2, 9, 64):
        others = neighbours(size - 1, rng)
        rows = [*others, target_row(target)]
        rng.shuffle(rows)
        at = next(i for i, r in enumerate(rows) if r.sampling is target)
        logits = torch.randn(size, VOCAB, generator=torch.Generator().manual_seed(size))
        logits[at] = logits_row
        generator = torch.Generator().manual_seed(size)  # the worker's generator differs too
        assert sample(logits, rows, generator).token_ids[at] == alone


@pytest.mark.parametrize("target", TARGETS, ids=range(len(TARGETS)))
def test_different_seeds_and_positions_give_different_tokens(target):
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(2))
    batch = logits.expand(64, -1).contiguous()
    by_seed = [
        SamplingRow(
            SamplingParams(**{**target.__dict__, "seed": 1000 + i}),
            target_row(target).token_ids,
            10,
        )
        for i in range(64)
    ]
    by_position = [target_row(target, position=p) for p in range(64)]
    assert len(set(sample(batch, by_seed).token_ids)) > 8
    assert len(set(sample(batch, by_position).token_ids)) > 8


def toy_logits(tokens: list[int]) -> torch.Tensor:
    """A deterministic 'model': next-token logits from the tokens so far."""
    seed = hash(tuple(tokens)) % 2**31
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def generate(params: SamplingParams, prompt: list[int], tokens: list[int], steps: int, seed: int):
    """Continue a seeded generation for `steps` tokens, each step in a batch of unseeded
    strangers whose count and order change."""
    tokens = list(tokens)
    first_new = len(tokens)
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        rows = [*neighbours(rng.randrange(0, 6), rng), SamplingRow(params, tokens, len(prompt))]
        rng.shuffle(rows)
        at = next(i for i, r in enumerate(rows) if r.sampling is params)
        logits = torch.randn(len(rows), VOCAB, generator=generator)
        logits[at] = toy_logits(tokens)
        tokens.append(sample(logits, rows, generator).token_ids[at])
    return tokens[first_new:]


def test_a_resumed_generation_continues_identically():
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=42, frequency_penalty=0.3)
    prompt = [5, 6, 7, 8]
    straight = generate(params, prompt, prompt, steps=24, seed=0)
    # The first token on a "prefill worker", the rest on a "decode worker"; then a recompute
    # after preemption at token 11 that replays prompt + output.
    first = generate(params, prompt, prompt, steps=1, seed=1)
    decoded = generate(params, prompt, prompt + first, steps=10, seed=2)
    resumed = generate(params, prompt, prompt + first + decoded, steps=13, seed=3)
    assert first + decoded + resumed == straight
    assert len(set(straight)) > 10  # really sampled, not a fixed point
    other_seed = SamplingParams(**{**params.__dict__, "seed": 43})
    assert generate(other_seed, prompt, prompt, steps=24, seed=0) != straight


def test_unseeded_rows_depend_on_the_worker_generator():
    logits = torch.randn(256, VOCAB, generator=torch.Generator().manual_seed(3))
    rows = [SamplingRow(SamplingParams(temperature=1.0))] * 256
    a = sample(logits, rows, torch.Generator().manual_seed(0)).token_ids
    b = sample(logits, rows, torch.Generator().manual_seed(0)).token_ids
    c = sample(logits, rows, torch.Generator().manual_seed(1)).token_ids
    assert a == b and a != c


def streams_grid(num_keys: int, num_positions: int) -> torch.Tensor:
    keys = torch.tensor([split_key(k * 0x9E3779B97F4A7C15) for k in range(num_keys)])
    keys = keys.repeat_interleave(num_positions, dim=0)
    positions = torch.arange(num_positions).repeat(num_keys)
    return row_streams(keys, positions)


def test_noise_is_uniform_in_range_and_every_bit_is_fair():
    streams = streams_grid(num_keys=32, num_positions=16)  # 512 rows
    u = uniform(streams, torch.arange(4096).unsqueeze(0))  # 2M values
    assert u.min() >= U_MIN and u.max() <= U_MAX
    counts = torch.histc(u, bins=256, min=0.0, max=1.0)
    assert fits(counts, torch.ones(256))
    bits = (u.double() * 2**24).long() >> 1  # the 23 random bits
    n = bits.numel()
    for bit in range(23):
        ones = int(((bits >> bit) & 1).sum())
        assert abs(ones - n / 2) < 5 * (n / 4) ** 0.5, f"bit {bit}"
    q = exponential(streams, torch.arange(4096).unsqueeze(0)).double()
    assert torch.isfinite(q).all() and (q > 0).all()
    assert abs(float(q.mean()) - 1.0) < 0.005 and abs(float(q.var()) - 1.0) < 0.01


def pairs_fit(a: torch.Tensor, b: torch.Tensor, bins: int = 16) -> bool:
    """Joint uniformity of (a, b) on a bins x bins grid: pairwise independence."""
    cells = (a * bins).long().flatten() * bins + (b * bins).long().flatten()
    return fits(torch.bincount(cells, minlength=bins * bins), torch.ones(bins * bins))


def test_noise_of_neighbouring_tokens_positions_and_seeds_is_independent():
    grid = uniform(streams_grid(num_keys=64, num_positions=64), torch.arange(512).unsqueeze(0))
    grid = grid.reshape(64, 64, 512)  # key, position, token
    assert pairs_fit(grid[:, :, 1:], grid[:, :, :-1])  # adjacent tokens
    assert pairs_fit(grid[:, 1:], grid[:, :-1])  # adjacent positions
    assert pairs_fit(grid[1:], grid[:-1])  # adjacent keys
    # Consecutive seeds (n samples use seed + i) are as unrelated as any others.
    consecutive = torch.tensor([split_key(s) for s in range(256)])
    positions = torch.zeros(256, dtype=torch.long)
    near = uniform(row_streams(consecutive, positions), torch.arange(512).unsqueeze(0))
    assert pairs_fit(near[1:], near[:-1])
    assert not pairs_fit(near[1:], near[1:].sqrt())  # the check has power


def test_hash_is_a_bijection_and_streams_differ():
    x = torch.randperm(1 << 20, generator=torch.Generator().manual_seed(0)) * 4093
    assert mix32(x).unique().numel() == x.numel()
    streams = row_streams(random_keys(4096, torch.device("cpu")), torch.zeros(4096).long())
    assert streams.unique(dim=0).shape[0] == 4096
    assert bool((streams[:, 1] % 2 == 1).all())  # odd multipliers: a full-period sequence


def test_cpu_kernel_uniforms_equal_the_torch_reference_bit_for_bit():
    """The C++ pass (kernels/cpu/seeded_uniform.cpp) computes the same integers and floats
    as the torch ops, so seeded draws do not depend on which one a worker runs."""
    from kernels import cpu_ops
    from services.worker.seeded_noise import uniform_reference

    if not cpu_ops.available():
        pytest.fail("the C++ CPU kernels did not build")
    gen = torch.Generator().manual_seed(5)
    keys = torch.randint(0, 1 << 32, (37, 2), generator=gen)
    streams = row_streams(keys, torch.randint(0, 1 << 31, (37,), generator=gen))
    cases = [
        torch.arange(3000).unsqueeze(0),  # the whole vocabulary, shared by every row
        torch.randint(0, (1 << 32) - 1, (37, 64), generator=gen),  # per-row candidate ids
        torch.randint(0, 200_000, (1, 5), generator=gen),
    ]
    for ids in cases:
        fast = torch.ops.tandem_cpu.seeded_uniform(streams, ids)
        assert torch.equal(fast, uniform_reference(streams, ids))
        assert torch.equal(uniform(streams, ids), fast)


@pytest.mark.parametrize("vocab", [5, 45, 8192])
def test_one_pass_race_picks_the_torch_race_winner(vocab):
    """The dense race in one C++ pass (kernels/cpu/gumbel_race.cpp) against the torch ops it
    replaces on CPU (`logits / t + gumbel`, argmax): the same token in every row whose two
    best torch scores are further apart than its logs' rounding (its log is a polynomial,
    not torch's, so the noise may differ in the last bit). Vocabularies below, above and at
    a multiple of the 8-lane vector."""
    from kernels import cpu_ops
    from services.worker.seeded_noise import gumbel

    if not cpu_ops.available():
        pytest.fail("the C++ CPU kernels did not build")
    gen = torch.Generator().manual_seed(vocab)
    rows = 200
    logits = torch.randn(rows, vocab, generator=gen) * 3.0
    logits[0] = 0.0  # every score is noise alone
    temperature = torch.rand(rows, generator=gen) * 1.9 + 0.1
    streams = row_streams(random_keys(rows, torch.device("cpu"), gen), torch.arange(rows))
    picks = torch.ops.tandem_cpu.gumbel_race(logits, temperature, streams)
    scores = gumbel(streams, torch.arange(vocab).unsqueeze(0)) + logits / temperature[:, None]
    top2 = scores.topk(min(2, vocab), dim=-1).values
    clear = (top2[:, 0] - top2[:, -1]) > 1e-4 * top2[:, 0].abs().clamp(min=1.0)
    assert clear.sum() >= rows - 2  # near-ties are rare: the comparison has power
    assert torch.equal(picks[clear], scores.argmax(dim=-1)[clear])
    # Elsewhere the pick is one of the tied best.
    best = scores.gather(1, picks.unsqueeze(1)).squeeze(1)
    assert torch.all(top2[:, 0] - best <= 1e-4 * top2[:, 0].abs().clamp(min=1.0))


def test_sampler_takes_the_one_pass_race_for_plain_temperature_rows():
    """A plain temperature row on CPU goes through the C++ race: the sampler's token equals
    the kernel's for the same seed and position."""
    from kernels import cpu_ops

    if not cpu_ops.available():
        pytest.fail("the C++ CPU kernels did not build")
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(11))
    rows = [
        target_row(SamplingParams(temperature=t, seed=s)) for t, s in ((1.0, 1), (0.7, 2), (1.3, 3))
    ]
    got = sample(logits, rows).token_ids
    keys = torch.tensor([list(split_key(s)) for s in (1, 2, 3)])
    streams = row_streams(keys, torch.full((3,), 7))
    want = torch.ops.tandem_cpu.gumbel_race(logits, torch.tensor([1.0, 0.7, 1.3]), streams)
    assert got == want.tolist()
