"""Speculative decoding in the worker on the real (tiny) model: proposals verified in the
step's own forward pass give exactly plain decoding's tokens — greedy, and seeded sampled
requests with penalties — whatever the proposer proposes (n-gram lookup, the right
continuation, wrong tokens), several per step when they are right; and the sampled rule's
output distribution is the target's (chi-square on the first and second emitted token)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.sampling import SamplingParams
from common.step_plan import CachedRequestData, NewRequestData
from services.worker.batch import PersistentBatch
from services.worker.kv_cache import KvCache
from services.worker.models.weight_loader import load_model
from services.worker.runner import ModelRunner
from services.worker.spec_decode.draft_model_proposer import DraftModelProposer
from services.worker.spec_decode.ngram_proposer import NgramProposer
from services.worker.spec_decode.verify import verify
from tests.unit.test_sampler_stats import fits

BLOCK = 4


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return load_model(tiny_llama_dir, dtype=torch.float32)


class Driver:
    """A runner and persistent batch, each request with blocks for its whole life."""

    def __init__(self, model, proposer=None, num_blocks=256) -> None:
        ours, config = model
        self.cache = KvCache(
            num_blocks,
            BLOCK,
            config.num_hidden_layers,
            config.num_key_value_heads,
            config.head_dim,
            torch.float32,
        )
        self.runner = ModelRunner(ours, self.cache, torch.device("cpu"), proposer=proposer)
        self.batch = PersistentBatch(BLOCK, num_blocks, config.vocab_size)
        self.next_block = 0
        self.num_steps = 0
        self.proposing: list[tuple[int, float, float]] = []  # passes, their s, the step's s

    def blocks(self, num_tokens: int) -> list[int]:
        count = -(-num_tokens // BLOCK)
        self.next_block += count
        assert self.next_block <= self.cache.num_blocks
        return list(range(self.next_block - count, self.next_block))

    def step(self, new=(), cached=()):
        work = self.batch.apply([], list(new), list(cached))
        output = self.runner.execute(work)
        self.batch.complete(work, output.sampled, output.accepted_tokens)
        self.num_steps += 1
        self.proposing.append(
            (output.propose_passes, output.propose_seconds, output.execute_seconds)
        )
        return output

    def generate(self, prompts, max_tokens, sampling, k=0) -> tuple[list[list[int]], int]:
        """Every prompt's output (prompts step together; k lookahead slots per decode
        step, fewer near max_tokens), and the proposals accepted."""
        out: dict[str, list[int]] = {}
        new = []
        for i, p in enumerate(prompts):
            rid = f"r{i}"
            blocks = self.blocks(len(p) + max_tokens + k + 1)
            new.append(NewRequestData(rid, p, blocks, 0, len(p), sampling))
        first = self.step(new=new)
        out = {rid: [token] for rid, token in first.sampled.items()}
        accepted = 0
        while any(len(t) < max_tokens for t in out.values()):
            cached = [
                CachedRequestData(rid, [], 1, (), min(k, max_tokens - len(t) - 1))
                for rid, t in out.items()
                if len(t) < max_tokens
            ]
            output = self.step(cached=cached)
            for rid, token in output.sampled.items():
                extra = output.accepted_tokens.get(rid, [])
                accepted += len(extra)
                out[rid].extend([*extra, token])
        return [out[f"r{i}"][:max_tokens] for i in range(len(prompts))], accepted


class Oracle:
    """Proposes the right continuation (from a plain run), so every proposal is accepted."""

    def __init__(self, sequences: list[list[int]]) -> None:
        self.sequences = sequences

    def propose(self, token_ids, max_tokens):
        for seq in self.sequences:
            if seq[: len(token_ids)] == list(token_ids):
                return seq[len(token_ids) : len(token_ids) + max_tokens]
        return []


class Wrong:
    """Proposes tokens the model never picks first: every proposal is rejected."""

    def __init__(self, sequences: list[list[int]], vocab: int) -> None:
        self.oracle, self.vocab = Oracle(sequences), vocab

    def propose(self, token_ids, max_tokens):
        right = self.oracle.propose(token_ids, max_tokens)
        return [(t + 1) % self.vocab for t in right]


def prompts_for(config) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    looped = torch.randint(3, config.vocab_size, (6,), generator=gen).tolist() * 4
    return [
        looped,  # repeats itself: n-gram lookup finds it
        torch.randint(3, config.vocab_size, (11,), generator=gen).tolist(),
        torch.randint(3, config.vocab_size, (3,), generator=gen).tolist(),
    ]


SAMPLINGS = {
    "greedy": SamplingParams(),
    "seeded": SamplingParams(temperature=0.8, top_k=20, seed=1234, repetition_penalty=1.2),
    # Three tokens pushed up: the output repeats itself, so n-gram lookup gets accepted
    # (the random-weight model alone never repeats).
    "biased": SamplingParams(logit_bias=((7, 30.0), (8, 30.0), (9, 30.0))),
}


def draft_model(folder, layers: int | None, num_blocks: int = 256) -> DraftModelProposer:
    """A draft model proposer over its own pool of the Driver's blocks."""
    ours, config = load_model(folder, dtype=torch.float32, num_layers=layers)
    cache = KvCache(
        num_blocks, BLOCK, config.num_hidden_layers, config.num_key_value_heads,
        config.head_dim, torch.float32,
    )  # fmt: skip
    return DraftModelProposer(ours, cache, torch.device("cpu"))


@pytest.mark.parametrize("sampling", list(SAMPLINGS), ids=list(SAMPLINGS))
def test_verified_proposals_give_plain_decodings_tokens(model, sampling, tiny_llama_dir):
    config = model[1]
    params = SAMPLINGS[sampling]
    prompts = prompts_for(config)
    plain, _ = Driver(model).generate(prompts, 24, params)
    sequences = [p + o for p, o in zip(prompts, plain, strict=True)]
    self_draft = draft_model(tiny_llama_dir, None)  # the target as its own draft
    for proposer, k in (
        (NgramProposer(1, 3), 4),
        (Oracle(sequences), 5),
        (Wrong(sequences, config.vocab_size), 3),
        (draft_model(tiny_llama_dir, 1), 3),  # its first layer: some proposals rejected
        (self_draft, 4),
    ):
        driver = Driver(model, proposer)
        got, accepted = driver.generate(prompts, 24, params, k)
        assert got == plain, type(proposer).__name__
        if isinstance(proposer, Oracle) or (proposer is self_draft and sampling != "seeded"):
            # all accepted (the draft applies the request's logit_bias too): k + 1 a step
            assert accepted > 0 and driver.num_steps <= 1 + -(-23 // (k + 1))
        if isinstance(proposer, Wrong):
            assert accepted == 0
        if isinstance(proposer, NgramProposer) and sampling == "biased":
            assert accepted > 0  # the repeating output's continuation is found
        # A draft model's cost is reported for the scheduler: its steady passes, k a step,
        # but in the first decode step, whose first pass caught the prompts up (unpriced).
        passes = [p for p, _, _ in driver.proposing]
        if isinstance(proposer, DraftModelProposer):
            assert passes[0] == 0 and passes[1] == k - 1 and max(passes) == k
            assert all(0 < s < step for p, s, step in driver.proposing if p)
        else:
            assert passes == [0] * len(passes)
            assert all(s == 0.0 for _, s, _ in driver.proposing)


def target_probs(hf, tokens: list[int], top_k: int) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([tokens])).logits[0, -1].float()
    kept = logits.topk(top_k)
    probs = torch.zeros_like(logits)
    probs[kept.indices] = torch.softmax(kept.values, dim=-1)
    return probs


def test_the_sampled_rule_keeps_the_targets_distribution(model, tiny_llama_dir):
    """Unseeded draws, one proposal d (the second most likely token) per request: the first
    emitted token follows p(. | prompt), and, when it was d (accepted), the second follows
    p(. | prompt + d). The test has power: p of the wrong context is rejected."""
    _, config = model
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    top_k, params = 4, SamplingParams(temperature=1.0, top_k=4)
    prompt = prompts_for(config)[1]
    p1 = target_probs(hf, prompt, top_k)
    draft = int(p1.topk(2).indices[1])
    p2 = target_probs(hf, prompt + [draft], top_k)

    class Fixed:
        def propose(self, token_ids, max_tokens):
            return [draft]

    first, second = torch.zeros_like(p1), torch.zeros_like(p2)
    for batch in range(8):
        driver = Driver(model, Fixed(), num_blocks=4 * 160)
        new = [
            NewRequestData(f"b{batch}-{i}", prompt, driver.blocks(len(prompt) + 2), 0, 10, params)
            for i in range(150)
        ]
        driver.step(new=new)  # the prompt but its last token: nothing sampled
        output = driver.step(cached=[CachedRequestData(r.request_id, [], 1, (), 1) for r in new])
        for rid, token in output.sampled.items():
            accepted = output.accepted_tokens.get(rid, [])
            if accepted:
                first[accepted[0]] += 1
                second[token] += 1
            else:
                first[token] += 1
    assert first.sum() == 1200 and second.sum() > 100
    assert fits(first, p1)
    assert fits(second, p2)
    assert not fits(second, p1)


def test_verify_accepts_the_agreeing_prefix():
    assert verify([5, 6, 7], [5, 6, 9, 1]).accepted == [5, 6]
    assert verify([5, 6, 7], [5, 6, 9, 1]).token == 9
    assert verify([5], [5, 8]).token == 8
    assert verify([], [3]).accepted == [] and verify([], [3]).token == 3
    with pytest.raises(ValueError):
        verify([1, 2], [1])


def test_accepted_tokens_carry_the_logprobs_plain_decoding_gives(model, tiny_llama_dir):
    """Logprobs (the token's and the top 3) of every emitted token with the target as its
    own draft (several accepted per step) equal HF's log_softmax at that position."""
    from tests.hf_reference import hf_log_softmax

    config = model[1]
    prompt = prompts_for(config)[1]
    params = SamplingParams(logprobs=3)
    driver = Driver(model, draft_model(tiny_llama_dir, None))
    blocks = driver.blocks(len(prompt) + 20)
    first = driver.step(new=[NewRequestData("r", prompt, blocks, 0, len(prompt), params)])
    tokens, entries = [first.sampled["r"]], [first.logprobs["r"]]
    while len(tokens) < 12:
        out = driver.step(cached=[CachedRequestData("r", [], 1, (), 3)])
        assert len(out.spec["r"].logprobs) == len(out.accepted_tokens.get("r", []))
        tokens += [*out.accepted_tokens.get("r", []), out.sampled["r"]]
        entries += [*out.spec["r"].logprobs, out.logprobs["r"]]
    assert driver.num_steps < len(tokens)  # several tokens landed in one step
    reference = hf_log_softmax(tiny_llama_dir, prompt + tokens)
    for i, (token, entry) in enumerate(zip(tokens, entries, strict=True)):
        row = reference[len(prompt) + i - 1]
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(float(row[token]), abs=1e-4)
        top = row.topk(3)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)
