"""The beam search policy against transformers' `generate(num_beams=k, do_sample=False)`:
the policy is driven with the real fp32 model's logprobs (each live beam's full sequence, no
KV cache) and must return HF's hypotheses and `sequences_scores`; plus its config checks and
the fork/free bookkeeping a caller maps onto KV block tables."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from services.scheduler.beam_search import MASKED, BeamParams, BeamSearch, Hypothesis
from tests.hf_reference import hf_model

PROMPTS = ([5, 17, 300, 42], [9, 250, 3, 77, 101, 64])
MAX_NEW = 10


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    folder = request.getfixturevalue(f"tiny_{request.param}_dir")
    return hf_model(str(folder))


def check_step(before, result, search: BeamSearch) -> None:
    """Each new beam is its parent plus the token; freed ids are exactly the unreferenced ones;
    the first child of a parent keeps its id, the others get ids never seen before."""
    after = search.live_beams
    old_ids = [b.beam_id for b in before]
    parents = {f.parent_id for f in result.forks}
    assert result.freed == tuple(i for i in old_ids if i not in parents)
    if result.done:
        assert result.forks == () and after == () and result.freed == tuple(old_ids)
        return
    assert len(after) == len(result.forks) == search.params.beam_width
    assert len({b.beam_id for b in after}) == len(after)
    kept = set()
    for fork, beam in zip(result.forks, after, strict=True):
        parent = before[fork.parent_index]
        assert parent.beam_id == fork.parent_id and beam.beam_id == fork.beam_id
        assert beam.tokens == parent.tokens + (fork.token,)
        if fork.token in search.params.eos_token_ids:  # EOS continues only pushed down by
            assert beam.score <= MASKED  # 1e9, as in HF when fewer than K real candidates
        if fork.parent_id in kept:
            assert fork.beam_id not in old_ids and fork.beam_id != fork.parent_id
        else:
            assert fork.beam_id == fork.parent_id
            kept.add(fork.parent_id)
    assert kept == parents


@dataclass
class Trace:
    early_finished: int = 0  # hypotheses that finished before max_new_tokens
    masked_beams: int = 0  # live beams scored at or below -1e9 (HF's absent rows)
    steps: int = 0


@torch.inference_mode()
def drive(model, prompt: list[int], params: BeamParams, processor=None):
    """Run the policy on the model's logprobs; returns its results and a Trace."""
    search = BeamSearch(params)
    need = min(search.candidates_needed(), model.config.vocab_size)
    trace = Trace()
    for _ in range(params.max_new_tokens):
        before = search.live_beams
        ids = torch.tensor([prompt + list(b.tokens) for b in before])
        logprobs = torch.log_softmax(model(ids).logits[:, -1, :].float(), dim=-1)
        if processor is not None:
            logprobs = processor(ids, logprobs)
        values, tokens = torch.topk(logprobs, need, dim=-1)
        per_beam = [
            list(zip(t.tolist(), v.tolist(), strict=True))
            for t, v in zip(tokens, values, strict=True)
        ]
        result = search.step(per_beam)
        check_step(before, result, search)
        if search.num_steps < params.max_new_tokens:
            trace.early_finished += result.finished
        trace.masked_beams += sum(b.score <= MASKED for b in search.live_beams)
        if result.done:
            break
    assert search.is_done()
    trace.steps = search.num_steps
    return search.results(), trace


@torch.inference_mode()
def hf_beams(model, prompt: list[int], params: BeamParams, processor=None):
    """HF's returned hypotheses (generated tokens, trailing pad cut by `beam_indices`) and
    its number of steps (one `scores` entry each: when its stopping rules ended the search)."""
    input_ids = torch.tensor([prompt])
    eos = list(params.eos_token_ids)
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        num_beams=params.beam_width,
        do_sample=False,
        max_new_tokens=params.max_new_tokens,
        num_return_sequences=params.num_return_sequences,
        early_stopping=params.early_stopping,
        length_penalty=params.length_penalty,
        eos_token_id=eos,
        pad_token_id=eos[0],
        return_dict_in_generate=True,
        output_scores=True,
        logits_processor=LogitsProcessorList([processor] if processor else []),
    )
    lengths = (out.beam_indices != -1).sum(dim=1).tolist()
    seqs = out.sequences[:, len(prompt) :]
    for row, n in zip(seqs, lengths, strict=True):
        assert (row[n:] == eos[0]).all()  # padding after a shorter hypothesis
    hypotheses = [
        Hypothesis(tuple(row[:n].tolist()), score)
        for row, n, score in zip(seqs, lengths, out.sequences_scores.tolist(), strict=True)
    ]
    return hypotheses, len(out.scores)


def assert_parity(model, prompt, params, processor=None) -> Trace:
    ours, trace = drive(model, prompt, params, processor)
    theirs, steps = hf_beams(model, prompt, params, processor)
    assert trace.steps == steps
    assert [h.tokens for h in ours] == [h.tokens for h in theirs]
    for mine, ref in zip(ours, theirs, strict=True):
        assert mine.score == pytest.approx(ref.score, abs=1e-4)
    return trace


def liked_token(model, prompt: list[int], position: int) -> int:
    """The greedy token at `position` of the prompt's continuation: used as EOS, the beams
    reach it often."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(position + 1):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-1]


# (beam_width, length_penalty, early_stopping, num_return_sequences)
CASES = [
    (2, 1.0, False, 1),
    (4, 0.0, True, 2),
    (8, 2.0, "never", 3),
    (4, -0.5, False, 4),
    (8, 1.0, True, 8),
    (2, 0.0, "never", 2),
    (4, 2.0, False, 1),
    (8, -0.5, "never", 2),
    (2, 2.0, True, 2),  # with frequent EOS, True stops earlier than False
    (2, 1.0, "never", 1),  # with frequent EOS, "never" runs longer than False
]


def params_for(case, prompt, eos) -> BeamParams:
    k, lp, es, r = case
    return BeamParams(
        beam_width=k,
        length_penalty=lp,
        early_stopping=es,
        eos_token_ids=tuple(eos),
        max_new_tokens=MAX_NEW,
        num_return_sequences=r,
        prompt_len=len(prompt),
    )


@pytest.mark.parametrize("case", CASES, ids=str)
def test_parity_checkpoint_eos(model, case):
    for prompt in PROMPTS:
        eos = [model.generation_config.eos_token_id]
        assert_parity(model, prompt, params_for(case, prompt, eos))


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("eos_at", [0, 1])
def test_parity_frequent_eos(model, case, eos_at):
    """EOS is a token the model picks greedily (first or second step), so hypotheses finish
    early; at least one must enter the finished list before max_new_tokens."""
    early = 0
    for prompt in PROMPTS:
        eos = [liked_token(model, prompt, eos_at)]
        early += assert_parity(model, prompt, params_for(case, prompt, eos)).early_finished
    assert early > 0


@pytest.mark.parametrize("k", [2, 4, 8])
def test_parity_two_eos_tokens(model, k):
    """Two EOS ids: K = 3 * k candidates per step."""
    for prompt in PROMPTS:
        eos = [liked_token(model, prompt, 1), model.generation_config.eos_token_id]
        params = params_for((k, 1.0, False, min(k, 3)), prompt, eos)
        assert BeamSearch(params).candidates_needed() == 3 * k
        assert_parity(model, prompt, params)


def test_returns_hypotheses_ended_by_eos(model):
    """A returned hypothesis shorter than max_new_tokens ends with its EOS (which HF pads)."""
    prompt = PROMPTS[0]
    eos = [liked_token(model, prompt, 0)]
    params = params_for((4, 0.0, False, 4), prompt, eos)
    ours, _ = drive(model, prompt, params)
    short = [h for h in ours if len(h.tokens) < MAX_NEW]
    assert short and all(h.tokens[-1] == eos[0] for h in short)
    assert all(eos[0] not in h.tokens[:-1] for h in ours)
    assert [h.score for h in ours] == sorted((h.score for h in ours), reverse=True)
    assert_parity(model, prompt, params)


class OnlyTokens(LogitsProcessor):
    """Masks every token but a few to -inf: fewer real candidates than K."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed = allowed

    def __call__(self, input_ids, scores):
        masked = torch.full_like(scores, float("-inf"))
        masked[:, self.allowed] = scores[:, self.allowed]
        return masked


@pytest.mark.parametrize("with_eos", [False, True])
def test_parity_fewer_real_candidates_than_k(model, with_eos):
    """With 3 allowed tokens and 4 beams (K = 8) HF's first step also takes continuations of
    its -1e9 rows 1..3 (copies of beam 0): the policy emulates them."""
    eos = model.generation_config.eos_token_id
    allowed = [eos, 300, 600] if with_eos else [299, 300, 600]
    for prompt in PROMPTS:
        params = params_for((4, 1.0, False, 2), prompt, [eos])
        assert assert_parity(model, prompt, params, OnlyTokens(allowed)).masked_beams > 0


def test_first_step_rows_beyond_beam_zero():
    """Vocabulary of 2, no EOS, width 3 (K = 6): beam 0's two tokens, then rows 1 and 2 at
    -1e9; the third live beam continues beam 0 with a masked score."""
    search = BeamSearch(BeamParams(beam_width=3, max_new_tokens=3, prompt_len=1))
    assert search.candidates_needed() == 6
    result = search.step([[(0, -0.5), (1, -1.0)]])
    assert [f.token for f in result.forks] == [0, 1, 0]
    assert all(f.parent_index == 0 and f.parent_id == 0 for f in result.forks)
    assert [f.beam_id for f in result.forks] == [0, 1, 2]
    assert [b.score for b in search.live_beams] == [-0.5, -1.0, MASKED]
    assert result.freed == ()


def test_eos_ranked_beyond_width_is_dropped():
    """Only EOS candidates among the first beam_width ranks finish; later ones vanish."""
    search = BeamSearch(
        BeamParams(beam_width=2, eos_token_ids=(9,), max_new_tokens=5, prompt_len=1)
    )
    assert search.candidates_needed() == 4
    search.step([[(1, -0.1), (2, -0.2), (3, -3.0), (9, -4.0)]])  # EOS ranked 4th of 4
    result = search.step([[(4, -0.1), (9, -0.2), (5, -0.3), (6, -0.4)], [(9, -5.0), (7, -6.0)]])
    assert result.finished == 1 and not result.done  # beam 0's EOS ranked 2nd: finished
    assert [b.tokens for b in search.live_beams] == [(1, 4), (1, 5)]
    assert [b.beam_id for b in search.live_beams] == [0, 2]  # both children of beam 0
    assert result.freed == (1,)


def test_last_step_finalises_the_best_width_candidates():
    """At max_new_tokens every candidate stops: the first beam_width ranks become hypotheses
    scored sum / len ** length_penalty, merged with earlier ones; then no step is allowed."""
    params = BeamParams(
        beam_width=2,
        length_penalty=2.0,
        eos_token_ids=(9,),
        max_new_tokens=2,
        num_return_sequences=2,
        prompt_len=3,
    )
    search = BeamSearch(params)
    search.step([[(9, -0.5), (1, -1.0), (2, -1.5), (3, -4.0)]])  # [9] finishes: -0.5 / 1
    result = search.step([[(4, -0.25), (5, -1.0), (6, -2.0), (9, -3.0)], [(7, -0.5), (8, -1.0)]])
    assert result.done and result.forks == () and result.freed == (0, 1)
    assert search.is_done() and search.live_beams == ()
    # (1, 5) scores -2.0 / 4 = -0.5 too: the earlier hypothesis wins the tie
    assert search.results() == [((1, 4), -1.25 / 4), ((9,), -0.5)]
    with pytest.raises(RuntimeError, match="done"):
        search.step([[(1, -1.0)]])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"beam_width": 0}, "beam_width"),
        ({"beam_width": True}, "beam_width"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"prompt_len": 0}, "prompt_len"),
        ({"num_return_sequences": 5}, "num_return_sequences"),
        ({"num_return_sequences": 0}, "num_return_sequences"),
        ({"early_stopping": "always"}, "early_stopping"),
        ({"early_stopping": 1}, "early_stopping"),
        ({"length_penalty": float("nan")}, "length_penalty"),
        ({"eos_token_ids": (-1,)}, "eos_token_ids"),
        ({"eos_token_ids": (3, 3)}, "duplicates"),
    ],
)
def test_params_validation(kwargs, match):
    base = {"beam_width": 4, "max_new_tokens": 8, "prompt_len": 3}
    with pytest.raises(ValueError, match=match):
        BeamParams(**{**base, **kwargs})


def test_step_input_checks():
    search = BeamSearch(BeamParams(beam_width=2, max_new_tokens=4, prompt_len=2))
    with pytest.raises(ValueError, match="expected candidates for 1 beams"):
        search.step([[(1, -1.0)], [(2, -1.0)]])
    with pytest.raises(ValueError, match="duplicate"):
        search.step([[(1, -1.0), (1, -2.0)]])
    with pytest.raises(ValueError, match="need 4 candidates"):
        search.step([[(1, -1.0)]])
    with pytest.raises(RuntimeError, match="not done"):
        search.results()
