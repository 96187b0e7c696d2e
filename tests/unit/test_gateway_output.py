"""The gateway's per-sample output with the real tokenizer: stop strings across token
boundaries, stop tokens' text, min_tokens, logprob text, usage and timings."""

from __future__ import annotations

import pytest

from common.hf_checkpoint_reader import load_tokenizer
from common.pb.tandem.internal.v1 import scheduler_pb2
from common.pb.tandem.v1 import generate_pb2
from services.gateway.output import RequestOutput, SampleOutput
from services.gateway.prompts import PromptTokenizer
from services.gateway.validation import Stopping

TEXT = "Once upon a time, the scheduler said: the end. And then it went on and on."
EOS = 1


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return load_tokenizer(tiny_llama_dir)


def sample(tokenizer, stopping: Stopping, index: int = 0) -> SampleOutput:
    prompts = PromptTokenizer(tokenizer)
    return SampleOutput(index, tokenizer, [], stopping, frozenset({EOS}), prompts.token_text)


def updates(ids, finish_last=generate_pb2.FINISH_REASON_UNSPECIFIED, index=0):
    out = [scheduler_pb2.SubmitResponse(token_ids=[t], index=index) for t in ids]
    out[-1].finish_reason = finish_last
    return out


def drive(output: SampleOutput, messages):
    got = [m for m in (output.consume(u, now=float(i)) for i, u in enumerate(messages)) if m]
    return got, "".join(m.text for m in got), [t for m in got for t in m.token_ids]


def token_boundary_stop(tokenizer, ids):
    """A stop string that starts inside one token and ends inside a later one."""
    pieces = [tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]
    for i in range(4, len(ids) - 3):
        before, after = pieces[i - 1], pieces[i + 1]
        if len(after) - len(before) >= 3 and len(pieces[i]) - len(before) >= 2:
            start = len(before) + len(pieces[i]) - len(before) - 1  # last char of token i
            return after[start : len(after) - 1], i  # runs into token i + 1
    raise AssertionError("no multi-character tokens in the text")


def test_stop_string_across_tokens_cuts_text_and_ends_at_the_completing_token(tokenizer):
    ids = tokenizer.encode(TEXT)
    stop, i = token_boundary_stop(tokenizer, ids)
    full = tokenizer.decode(ids)
    out = sample(tokenizer, Stopping(stop=(stop,)))
    got, text, emitted = drive(out, updates(ids))
    assert text == full[: full.index(stop)]
    assert emitted == ids[: i + 2]  # through the token that completed the stop string
    assert got[-1].finish_reason == generate_pb2.FINISH_REASON_STOP
    assert got[-1].stop_string == stop
    assert out.finished and out.num_tokens == i + 2
    # Nothing after the match is ever reported.
    assert out.consume(updates([ids[-1]])[0], now=99.0) is None


def test_include_stop_str_in_output_keeps_the_stop_string(tokenizer):
    ids = tokenizer.encode(TEXT)
    stop, _ = token_boundary_stop(tokenizer, ids)
    full = tokenizer.decode(ids)
    _, text, _ = drive(
        sample(tokenizer, Stopping(stop=(stop,), include_stop_str_in_output=True)), updates(ids)
    )
    assert text == full[: full.index(stop) + len(stop)]


def test_stop_token_text_is_left_out_unless_asked(tokenizer):
    ids = tokenizer.encode(TEXT)[:8]
    stop_id = ids[-1]
    for include, want in ((False, ids[:-1]), (True, ids)):
        out = SampleOutput(
            0,
            tokenizer,
            [],
            Stopping(stop_token_ids=(stop_id,), include_stop_str_in_output=include),
            frozenset({EOS, stop_id}),
            PromptTokenizer(tokenizer).token_text,
        )
        got, text, emitted = drive(out, updates(ids, generate_pb2.FINISH_REASON_STOP))
        assert text == tokenizer.decode(want) and emitted == ids
        assert got[-1].stop_token_id == stop_id
        assert got[-1].finish_reason == generate_pb2.FINISH_REASON_STOP


def test_length_finish_flushes_held_back_text(tokenizer):
    ids = tokenizer.encode(TEXT)[:6]
    full = tokenizer.decode(ids)
    stop = full[-2:] + "\u2603"  # the text ends with the start of a stop string
    got, text, _ = drive(
        sample(tokenizer, Stopping(stop=(stop,))), updates(ids, generate_pb2.FINISH_REASON_LENGTH)
    )
    assert text == full
    assert got[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert not got[-1].HasField("stop_reason")


def test_stop_strings_wait_for_min_tokens(tokenizer):
    ids = tokenizer.encode(TEXT)
    stop = tokenizer.decode(ids[:2])  # completed by the 2nd token, nowhere later
    assert TEXT.count(stop) == 1
    length = generate_pb2.FINISH_REASON_LENGTH
    got, text, _ = drive(sample(tokenizer, Stopping(stop=(stop,))), updates(ids, length))
    assert (text, got[-1].stop_string) == ("", stop)
    got, text, emitted = drive(
        sample(tokenizer, Stopping(stop=(stop,), min_tokens=3)), updates(ids, length)
    )
    assert (text, emitted) == (tokenizer.decode(ids), ids)
    assert got[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH


def test_request_output_usage_timings_and_prompt_logprobs(tokenizer):
    ids = tokenizer.encode(TEXT)[:4]
    prompts = PromptTokenizer(tokenizer)
    samples = [sample(tokenizer, Stopping(), index=i) for i in range(2)]
    request = RequestOutput("rid", samples, num_prompt_tokens=9, arrival=0.0)
    entry = generate_pb2.TokenLogprob(
        token_id=ids[0],
        logprob=-0.5,
        top_logprobs=[generate_pb2.TopLogprob(token_id=5, logprob=-1)],
    )
    first = scheduler_pb2.SubmitResponse(
        token_ids=ids[:2],
        index=0,
        cached_tokens=8,
        logprobs=[entry, entry],
        prompt_logprobs=[entry],
    )
    m = request.consume(first, prompts.token_text, now=1.0)
    assert m.request_id == "rid" and m.index == 0 and list(m.token_ids) == ids[:2]
    assert m.logprobs[0].token == tokenizer.decode([ids[0]])
    assert m.logprobs[0].top_logprobs[0].token == tokenizer.decode([5])
    assert len(m.prompt_logprobs) == 1 and not m.HasField("usage")
    length = generate_pb2.FINISH_REASON_LENGTH
    m = request.consume(
        scheduler_pb2.SubmitResponse(token_ids=ids[2:], index=0, finish_reason=length),
        prompts.token_text,
        now=3.0,
    )
    assert m.finish_reason == generate_pb2.FINISH_REASON_LENGTH and not m.HasField("usage")
    m = request.consume(
        scheduler_pb2.SubmitResponse(
            token_ids=ids, index=1, cached_tokens=16, finish_reason=length
        ),
        prompts.token_text,
        now=4.0,
    )
    assert request.done and m.index == 1
    assert (m.usage.prompt_tokens, m.usage.completion_tokens, m.usage.cached_tokens) == (9, 8, 8)
    assert m.timings.ttft_ms == pytest.approx(1000.0)
    assert m.timings.e2e_ms == pytest.approx(4000.0)
    # Sample 0: 4 tokens from t=1 to t=3; sample 1: 4 tokens in one message (0 apart).
    assert m.timings.mean_itl_ms == pytest.approx((2000.0 / 3 + 0.0) / 2)
